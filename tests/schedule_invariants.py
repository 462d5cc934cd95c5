"""The SPEC's layout invariants as one checker, shared by the property and case tests."""

from __future__ import annotations

import numpy as np

from vgbs_ray.layout.schedule import BatchConfig, DPSchedule, ParallelConfig, group_by_rollout


def assert_schedule_invariants(schedule: DPSchedule, lengths, rollout_ids, parallel: ParallelConfig, batch: BatchConfig):
    lengths = np.asarray(lengths)
    dp = parallel.dp_size
    groups = group_by_rollout(rollout_ids)
    arrival = list(groups)
    gbs = batch.global_batch_size

    # Public flattened fields agree with the per-step layouts.
    assert len(schedule.partitions) == dp and len(schedule.micro_batch_indices) == dp
    assert schedule.num_rollouts == [s.num_rollouts for s in schedule.steps]
    assert schedule.num_microbatches == [s.num_microbatches for s in schedule.steps]
    for rank in range(dp):
        # Each rank's micro-batches tile range(len(partition)), in order.
        flat = [p for mb in schedule.micro_batch_indices[rank] for p in mb]
        assert flat == list(range(len(schedule.partitions[rank])))
        # Lockstep: every rank runs the same count in every step.
        assert len(schedule.micro_batch_indices[rank]) == sum(schedule.num_microbatches)

    # Coverage and disjointness: exactly the scheduled rollouts' samples, each once.
    scheduled = [rid for s in schedule.steps for rid in s.rollout_ids]
    all_samples = [i for part in schedule.partitions for i in part]
    assert len(all_samples) == len(set(all_samples))
    assert sorted(all_samples) == sorted(i for rid in scheduled for i in groups[rid])
    # Steps take rollouts in arrival order; leftover are the latest-arriving.
    assert scheduled + list(schedule.leftover_rollout_ids) == arrival

    align = parallel.microbatch_alignment
    capacity = batch.max_tokens_per_gpu * parallel.cp_size if batch.is_dynamic else None
    for k, step in enumerate(schedule.steps):
        # Siblings in one step: the step holds whole rollouts.
        step_samples = set(step.sample_indices)
        for rid in step.rollout_ids:
            assert set(groups[rid]) <= step_samples
        assert len(step_samples) == sum(len(groups[rid]) for rid in step.rollout_ids)
        # Steps hold gbs rollouts, except one partial last step.
        if k < len(schedule.steps) - 1:
            assert step.num_rollouts == gbs
        else:
            assert step.num_rollouts == gbs or (batch.leftover == "partial" and 0 < step.num_rollouts < gbs)
        # Padding (empty micro-batches) only when the step has fewer samples than micro-batches.
        if step.num_padding_microbatches:
            assert len(step_samples) < step.num_microbatches * dp
        # VPP alignment of the total count; lockstep per rank.
        assert (step.num_microbatches * dp) % align == 0
        assert all(len(mbs) == step.num_microbatches for mbs in step.rank_micro_batches)
        for rank_mbs in step.rank_micro_batches:
            for mb in rank_mbs:
                if capacity is not None:
                    # The token cap, except a lone oversize sample.
                    assert lengths[list(mb)].sum() <= capacity or len(mb) == 1
                else:
                    assert len(mb) <= batch.micro_batch_size
