"""Sample rows for scheduler tests: rollouts of 1..N samples with known lengths and rewards."""

from __future__ import annotations

import numpy as np


def sample_row(rollout_id, index: int, *, size: int | None, reward: float = 1.0, length: int = 12,
               response: int = 6, advantage: float | None = 0.5, group: tuple | None = None, **extra) -> dict:
    """One sample dict (Sample.from_dict keys); `size=None` leaves rollout_size out (whole-call rollout)."""
    row = {
        "rollout_id": rollout_id,
        "tokens": np.arange(length, dtype=np.int64) + index,
        "response_length": response,
        "loss_mask": np.ones(response, dtype=np.int8),
        "reward": reward,
        "sample_index": index,
        "rollout_size": size,
        "advantage": advantage,
        "group_id": None if group is None else group[0],
        "group_size": None if group is None else group[1],
    }
    row.update(extra)
    return row


def rollout_rows(rollout_id, num_samples: int, *, with_size: bool = True, **kw) -> list[dict]:
    """Every sample of one rollout; lengths vary with the index so layouts are not trivial."""
    return [
        sample_row(rollout_id, i, size=num_samples if with_size else None, length=10 + 3 * i, **kw)
        for i in range(num_samples)
    ]


def many_rollouts(num_rollouts: int, *, seed: int = 0, max_samples: int = 3, prefix: str = "r", **kw) -> list[list[dict]]:
    """`num_rollouts` rollouts of 1..max_samples samples each, ids f"{prefix}{i}"."""
    rng = np.random.default_rng(seed)
    return [rollout_rows(f"{prefix}{i}", int(rng.integers(1, max_samples + 1)), **kw) for i in range(num_rollouts)]
