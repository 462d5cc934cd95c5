"""The loss normalisers, computed once on the rollout side (numpy only, no torch).

`rollout_mask_sums[i]` is the number of loss-mask tokens over every sample of sample i's
rollout, wherever its siblings land (other micro-batches, DP or CP ranks). A sample's
contribution to the loss is divided by it (`vgbs_ray.losses.accounting`), so a rollout of N samples
weighs as much as a rollout of one. `step_normalisers` adds what the other aggregations
divide by (a prompt group's mask tokens, the step's totals) and a step-wide rollout index.
The scheduler builds shards with them and must not import torch, hence this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np


def rollout_mask_sums(rollout_ids: Sequence[Hashable], loss_masks: Sequence[Sequence[int]]) -> np.ndarray:
    """For each sample, the number of loss-mask tokens over every sample of its rollout (int64).

    Masks hold 0/1 (the data contract): a mask's sum is its count of non-zeros, which numpy counts
    without a reduction (~0.5 us for a thousand-token mask, a few times less than `sum`)."""
    totals: dict[Hashable, int] = {}
    per_sample = [int(np.count_nonzero(mask)) for mask in loss_masks]
    for rollout_id, count in zip(rollout_ids, per_sample):
        totals[rollout_id] = totals.get(rollout_id, 0) + count
    return np.array([totals[r] for r in rollout_ids], dtype=np.int64)


@dataclass(frozen=True)
class StepTotals:
    """Counts over a whole step (every rank), the divisors of the loss aggregations
    (`vgbs_ray.losses.aggregation`): computed once on the rollout side, like the mask sums."""

    num_rollouts: int
    num_samples: int
    num_groups: int
    """Prompt groups (`Sample.group_id`); a rollout without a group is a group of its own."""
    mask_tokens: int
    """Loss-mask tokens of every sample of the step."""


@dataclass(frozen=True)
class StepNormalisers:
    """Per-sample normalisers of one step's samples (in the order given), and the step's totals."""

    rollout_indices: np.ndarray
    """int64: the index of each sample's rollout in the step (order of first appearance), the same on
    every rank: per-rollout reductions across ranks (GSPO's rollout ratio) key on it."""
    rollout_mask_sums: np.ndarray
    """int64: loss-mask tokens over each sample's whole rollout (`rollout_mask_sums`)."""
    group_mask_sums: np.ndarray
    """int64: loss-mask tokens over each sample's whole prompt group."""
    totals: StepTotals


def step_normalisers(rollout_ids: Sequence[Hashable], group_ids: Sequence[Hashable | None],
                     loss_masks: Sequence[Sequence[int]], num_rollouts: int | None = None) -> StepNormalisers:
    """`StepNormalisers` of every sample of a step (all ranks' samples, any order)."""
    per_sample = [int(np.count_nonzero(mask)) for mask in loss_masks]
    rollout_index: dict[Hashable, int] = {}
    rollout_totals: dict[Hashable, int] = {}
    group_totals: dict[Hashable, int] = {}
    groups = [("rollout", r) if g is None else ("group", g) for r, g in zip(rollout_ids, group_ids)]
    for rollout_id, group, count in zip(rollout_ids, groups, per_sample):
        rollout_index.setdefault(rollout_id, len(rollout_index))
        rollout_totals[rollout_id] = rollout_totals.get(rollout_id, 0) + count
        group_totals[group] = group_totals.get(group, 0) + count
    totals = StepTotals(num_rollouts=len(rollout_index) if num_rollouts is None else num_rollouts,
                        num_samples=len(per_sample), num_groups=len(group_totals), mask_tokens=sum(per_sample))
    return StepNormalisers(
        rollout_indices=np.array([rollout_index[r] for r in rollout_ids], dtype=np.int64),
        rollout_mask_sums=np.array([rollout_totals[r] for r in rollout_ids], dtype=np.int64),
        group_mask_sums=np.array([group_totals[g] for g in groups], dtype=np.int64),
        totals=totals)
