"""The per-rollout loss normaliser, computed once on the rollout side (numpy only, no torch).

`rollout_mask_sums[i]` is the number of loss-mask tokens over every sample of sample i's
rollout, wherever its siblings land (other micro-batches, DP or CP ranks). A sample's
contribution to the loss is divided by it (`vgbs_ray.loss`), so a rollout of N samples
weighs as much as a rollout of one. The scheduler builds shards with it and must not import
torch, hence this module.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np


def rollout_mask_sums(rollout_ids: Sequence[Hashable], loss_masks: Sequence[Sequence[int]]) -> np.ndarray:
    """For each sample, the number of loss-mask tokens over every sample of its rollout (int64)."""
    # ndarray.sum skips np.sum's dispatch wrapper (~40% of this loop for a step's 512 masks).
    per_sample = np.array([int(m.sum() if isinstance(m, np.ndarray) else np.sum(m)) for m in loss_masks], dtype=np.int64)
    totals: dict[Hashable, int] = {}
    for rollout_id, count in zip(rollout_ids, per_sample.tolist()):
        totals[rollout_id] = totals.get(rollout_id, 0) + count
    return np.array([totals[r] for r in rollout_ids], dtype=np.int64)
