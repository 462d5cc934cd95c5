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
    lengths = np.fromiter((len(m) for m in loss_masks), dtype=np.int64, count=len(loss_masks))
    per_sample = np.zeros(len(lengths), dtype=np.int64)
    nonempty = lengths > 0
    if nonempty.any():
        # One pass over the step's masks (a reduction per sample costs ~2 us of call overhead each);
        # reduceat needs the empty masks left out (it would read the next sample's first value).
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[nonempty]
        masks = np.concatenate([np.asarray(m) for m in loss_masks])
        per_sample[nonempty] = np.add.reduceat(masks, starts, dtype=np.int64)
    totals: dict[Hashable, int] = {}
    for rollout_id, count in zip(rollout_ids, per_sample.tolist()):
        totals[rollout_id] = totals.get(rollout_id, 0) + count
    return np.array([totals[r] for r in rollout_ids], dtype=np.int64)
