"""GRPO-style group advantages: one normalised reward per rollout, shared by its samples.

Rollouts answering the same prompt form a *group* (`group_id`, `group_size` rollouts).
Once every rollout of the group is complete, each rollout's single reward is normalised
within the group

    advantage_i = (r_i - mean(r)) / (std(r) + eps)       (population std, ddof=0)

and every sample of rollout i gets advantage_i. The reward is counted once per rollout,
never once per sample, so a rollout with many samples does not pull the group mean.

Invariants (tests/test_advantages.py): the advantages of a group sum to 0 (up to float
error); their order follows the rewards'; a group of equal rewards gets all zeros (and is
"uniform", which a policy may drop: it carries no learning signal); the result does not
depend on how many samples each rollout has.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

import numpy as np

DEFAULT_EPS = 1e-6


def normalize_group_rewards(rewards: Sequence[float], eps: float = DEFAULT_EPS) -> np.ndarray:
    """(r - mean) / (std + eps) over one group's per-rollout rewards (float64, same order).

    Raises ValueError for an empty group, a non-finite reward or a negative eps.
    """
    values = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError("a group needs at least one rollout reward")
    if not np.isfinite(values).all():
        raise ValueError(f"group rewards must be finite, got {values.tolist()}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if np.all(values == values[0]):
        return np.zeros_like(values)  # uniform group: no signal (mean may carry rounding; no 0/0 at eps=0)
    return (values - values.mean()) / (values.std() + eps)


def is_uniform_group(rewards: Sequence[float]) -> bool:
    """True when every rollout of the group has the same reward (advantages all zero)."""
    values = np.asarray(rewards, dtype=np.float64).reshape(-1)
    return bool(values.size > 0 and np.all(values == values[0]))


def group_advantages(rewards_by_rollout: Mapping[Hashable, float], eps: float = DEFAULT_EPS) -> dict[Hashable, float]:
    """Advantage per rollout id of one group, from one reward per rollout."""
    ids = list(rewards_by_rollout)
    normalised = normalize_group_rewards([rewards_by_rollout[r] for r in ids], eps)
    return {rollout_id: float(a) for rollout_id, a in zip(ids, normalised)}
