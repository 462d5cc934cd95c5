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

import math
from typing import Hashable, Mapping, Sequence


DEFAULT_EPS = 1e-6


def is_uniform_group(rewards: Sequence[float]) -> bool:
    """True when every rollout of the group has the same reward (advantages all zero)."""
    values = list(rewards)
    return bool(values) and all(v == values[0] for v in values)


def group_advantages(rewards_by_rollout: Mapping[Hashable, float], eps: float = DEFAULT_EPS,
                     scale_by_std: bool = True) -> dict[Hashable, float]:
    """Advantage per rollout id of one group, from one reward per rollout; `scale_by_std=False` only centres
    them (r_i - mean(r): Dr. GRPO, which finds the std division biases toward easy and hard prompts)."""
    ids = list(rewards_by_rollout)
    return dict(zip(ids, _normalised([float(rewards_by_rollout[r]) for r in ids], eps, scale_by_std)))


def _normalised(values: list[float], eps: float, scale_by_std: bool = True) -> list[float]:
    # Plain floats, not numpy: a group is a handful of rewards, and this runs once per group
    # on the scheduler's push path, where numpy's per-call overhead is ~5x the arithmetic.
    if not values:
        raise ValueError("a group needs at least one rollout reward")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"group rewards must be finite, got {values}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if all(v == values[0] for v in values):
        return [0.0] * len(values)  # uniform group: no signal (mean may carry rounding; no 0/0 at eps=0)
    mean = math.fsum(values) / len(values)
    if not scale_by_std:
        return [v - mean for v in values]
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    return [(v - mean) / (std + eps) for v in values]
