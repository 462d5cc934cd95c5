"""The DP schedule: pack first, distribute second.

    build_dp_schedule(total_lengths, rollout_ids, parallel, batch) -> DPSchedule

1. Group samples by rollout id; rollouts keep first-arrival order. Siblings are never
   split across steps.
2. Plan steps by rollouts: floor(R / gbs) full steps of the oldest rollouts; the rest are
   leftover, or (leftover="partial") one smaller final step.
3. Pack each step: dynamic -> first-fit-decreasing under max_tokens_per_gpu * cp_size,
   then split the heaviest micro-batches until the count is a multiple of
   dp_size * mb_group (vpp > 1) or dp_size; static -> chunks of micro_batch_size. A step
   with fewer samples than that count gets empty padding micro-batches (zero weight), so
   any step with a sample can be laid out (`packing.split_to_alignment`).
4. Distribute micro-batches over ranks, equal counts: strided, or balanced on tokens or
   FLOPs with sample-level refinement, always under the token cap (`balancing`).

Invariants (tests/test_schedule_properties.py checks each on random inputs):
coverage of exactly the scheduled rollouts' samples; no sample on two ranks; each rank's
micro_batch_indices tile range(len(partition)); every rank runs num_microbatches[k]
micro-batches in step k, a multiple of mb_group under vpp; a micro-batch is empty only as
padding of a step with fewer samples than micro-batches; every micro-batch within the
cap unless it is one oversize sample; a rollout's samples all in one step; steps take
rollouts in arrival order; num_rollouts[k] == gbs except a partial last step; the same
input gives the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from vgbs_ray.layout.balancing import distribute
from vgbs_ray.config import BatchConfig, ParallelConfig, check_schedule_configs
from vgbs_ray.layout.packing import first_fit_decreasing, split_to_alignment, static_chunks

__all__ = [
    "BatchConfig",
    "DPSchedule",
    "ParallelConfig",
    "StepLayout",
    "build_dp_schedule",
    "group_by_rollout",
    "layout_step",
]


@dataclass(frozen=True)
class StepLayout:
    """One optimizer step: its rollouts and, per rank, its micro-batches of global sample indices."""

    rollout_ids: tuple
    """The step's rollouts, in first-arrival order."""
    rank_micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    """[rank][micro-batch] -> global sample indices, in execution order."""

    @property
    def num_rollouts(self) -> int:
        return len(self.rollout_ids)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.rank_micro_batches[0])

    @property
    def num_padding_microbatches(self) -> int:
        """Empty micro-batches over all ranks (zero samples, zero weight)."""
        return sum(1 for rank in self.rank_micro_batches for mb in rank if not mb)

    @property
    def sample_indices(self) -> list[int]:
        """Every sample of the step, ascending."""
        return sorted(i for rank in self.rank_micro_batches for mb in rank for i in mb)

    def partition(self, rank: int) -> list[int]:
        """The rank's global sample indices in execution order."""
        return [i for mb in self.rank_micro_batches[rank] for i in mb]

    def micro_batch_indices(self, rank: int) -> list[list[int]]:
        """Per micro-batch, positions into `partition(rank)`."""
        positions, start = [], 0
        for mb in self.rank_micro_batches[rank]:
            positions.append(list(range(start, start + len(mb))))
            start += len(mb)
        return positions


@dataclass(frozen=True)
class DPSchedule:
    """The layout of every scheduled step, flattened per rank (the public contract).

    partitions[rank]: global sample indices in execution order, all steps concatenated.
    micro_batch_indices[rank]: per micro-batch (all steps), positions into partitions[rank].
    num_microbatches[k]: micro-batches per rank in step k; the first num_microbatches[0]
        entries of micro_batch_indices[rank] belong to step 0, and so on.
    num_rollouts[k]: rollouts in step k.
    leftover_rollout_ids: rollouts not scheduled (the latest-arriving), for the caller.
    """

    steps: tuple[StepLayout, ...]
    leftover_rollout_ids: tuple
    partitions: list[list[int]]
    micro_batch_indices: list[list[list[int]]]
    num_microbatches: list[int]
    num_rollouts: list[int]

    @classmethod
    def from_steps(cls, steps: Sequence[StepLayout], leftover_rollout_ids, dp_size: int) -> "DPSchedule":
        partitions: list[list[int]] = [[] for _ in range(dp_size)]
        micro_batch_indices: list[list[list[int]]] = [[] for _ in range(dp_size)]
        for step in steps:
            for rank, rank_bins in enumerate(step.rank_micro_batches):
                partition, positions = partitions[rank], micro_batch_indices[rank]
                for mb in rank_bins:
                    start = len(partition)
                    positions.append(list(range(start, start + len(mb))))
                    partition.extend(mb)
        return cls(
            steps=tuple(steps),
            leftover_rollout_ids=tuple(leftover_rollout_ids),
            partitions=partitions,
            micro_batch_indices=micro_batch_indices,
            num_microbatches=[s.num_microbatches for s in steps],
            num_rollouts=[s.num_rollouts for s in steps],
        )


def group_by_rollout(rollout_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Sample indices per rollout id; dict order is the rollouts' first-arrival order."""
    groups: dict[Hashable, list[int]] = {}
    for index, rollout_id in enumerate(rollout_ids):
        indices = groups.get(rollout_id)
        if indices is None:  # not setdefault: that builds a list for every sample
            groups[rollout_id] = [index]
        else:
            indices.append(index)
    return groups


def layout_step(
    rollout_ids: Sequence[Hashable],
    sample_indices: Sequence[int],
    total_lengths: np.ndarray,
    parallel: ParallelConfig,
    batch: BatchConfig,
) -> StepLayout:
    """Pack and distribute one step's samples (global indices) over the DP ranks.

    Never fails for a valid config pair: a step with fewer samples than the aligned
    micro-batch count gets empty padding micro-batches.
    """
    sample_indices = np.asarray(sorted(sample_indices), dtype=np.int64)
    lengths = np.asarray(total_lengths, dtype=np.int64)[sample_indices]
    align = parallel.microbatch_alignment
    if batch.is_dynamic:
        capacity = batch.max_tokens_per_gpu * parallel.cp_size
        bins = split_to_alignment(first_fit_decreasing(lengths, capacity), lengths, align, capacity)
    else:
        capacity = None
        bins = static_chunks(len(sample_indices), batch.micro_batch_size, align)
    if batch.balance == "flops":
        weights = batch.flops_model.sequence_flops(lengths)
    else:
        weights = lengths.astype(np.float64)
    ranks = distribute(
        bins, lengths, weights, parallel.dp_size,
        mode=batch.balance, capacity=capacity, allow_moves=batch.is_dynamic,
    )
    to_global = sample_indices.tolist().__getitem__
    rank_micro_batches = tuple(tuple(tuple(map(to_global, mb)) for mb in rank_bins) for rank_bins in ranks)
    return StepLayout(rollout_ids=tuple(rollout_ids), rank_micro_batches=rank_micro_batches)


def build_dp_schedule(
    total_lengths: Sequence[int],
    rollout_ids: Sequence[Hashable],
    parallel: ParallelConfig,
    batch: BatchConfig,
) -> DPSchedule:
    """Lay out every step of a window of samples (see module docstring).

    Args:
        total_lengths: tokens per sample (prompt + response), in arrival order.
        rollout_ids: the rollout of each sample; any hashable; siblings may interleave.
        parallel: the backend's advertised parallel layout.
        batch: gbs in rollouts, token cap or micro-batch size, balance and leftover policy.
    Returns:
        DPSchedule. Rollouts past the last full step are leftover unless leftover="partial"
        (then they are one smaller step, padded if it holds fewer samples than micro-batches).
    Raises:
        ConfigError for a config pair that can never be laid out (e.g. static misalignment);
        ValueError if the two sequences differ in length.
    Complexity: O(n log n) packing plus refinement bounded by O(dp_size) pair moves per step.
    """
    check_schedule_configs(parallel, batch)
    lengths = np.asarray(total_lengths, dtype=np.int64)
    if lengths.size != len(rollout_ids):
        raise ValueError(f"total_lengths has {lengths.size} entries but rollout_ids has {len(rollout_ids)}")
    if lengths.size and lengths.min() <= 0:
        raise ValueError(f"sample {int(np.argmin(lengths))} has total length {int(lengths.min())}; lengths must be > 0")
    groups = group_by_rollout(rollout_ids)
    ordered = list(groups)
    gbs = batch.global_batch_size
    num_full = len(ordered) // gbs

    def step_of(ids):
        return layout_step(ids, [i for rid in ids for i in groups[rid]], lengths, parallel, batch)

    steps = [step_of(ordered[k * gbs:(k + 1) * gbs]) for k in range(num_full)]
    leftover = ordered[num_full * gbs:]
    if leftover and batch.leftover == "partial":
        steps.append(step_of(leftover))
        leftover = []
    return DPSchedule.from_steps(steps, leftover, parallel.dp_size)
