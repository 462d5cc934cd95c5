"""Targeted cases of the DP schedule (SPEC "The schedule")."""

from __future__ import annotations

import numpy as np
import pytest

from tests.schedule_invariants import assert_schedule_invariants
from vgbs_ray.errors import ConfigError
from vgbs_ray.models.flops import TransformerFlopsModel
from vgbs_ray.layout.schedule import BatchConfig, ParallelConfig, build_dp_schedule


def one_sample_rollouts(lengths):
    return list(lengths), [f"r{i}" for i in range(len(lengths))]


def test_oversize_sample_sits_alone():
    lengths, rids = one_sample_rollouts([5000, 100, 200, 300])
    parallel = ParallelConfig(dp_size=2)
    batch = BatchConfig(global_batch_size=4, max_tokens_per_gpu=1000)
    schedule = build_dp_schedule(lengths, rids, parallel, batch)
    micro_batches = [mb for rank in schedule.steps[0].rank_micro_batches for mb in rank]
    assert (0,) in micro_batches  # the 5000-token sample alone
    assert_schedule_invariants(schedule, lengths, rids, parallel, batch)


def test_micro_batch_count_rounds_up_to_vpp_alignment():
    # 6 small samples fit one micro-batch; dp=2 with vpp and group 2 needs a multiple of 4.
    lengths, rids = one_sample_rollouts([10] * 6)
    parallel = ParallelConfig(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    batch = BatchConfig(global_batch_size=6, max_tokens_per_gpu=1000)
    schedule = build_dp_schedule(lengths, rids, parallel, batch)
    assert schedule.num_microbatches == [2]
    assert_schedule_invariants(schedule, lengths, rids, parallel, batch)
    # Without vpp, the group does not matter.
    flat = build_dp_schedule(lengths, rids, ParallelConfig(dp_size=2, microbatch_group_size_per_vp_stage=2), batch)
    assert flat.num_microbatches == [1]


def test_compact_rollouts_stay_in_one_step_whatever_their_arrival():
    # Rollout "a" has 4 samples arriving early and late; gbs=2 rollouts per step.
    rids = ["a", "b", "a", "c", "d", "a", "c", "a"]
    lengths = [100] * len(rids)
    parallel = ParallelConfig(dp_size=2)
    batch = BatchConfig(global_batch_size=2, max_tokens_per_gpu=250, leftover="drop")
    schedule = build_dp_schedule(lengths, rids, parallel, batch)
    assert [s.rollout_ids for s in schedule.steps] == [("a", "b"), ("c", "d")]
    assert sorted(schedule.steps[0].sample_indices) == [0, 1, 2, 5, 7]
    assert_schedule_invariants(schedule, lengths, rids, parallel, batch)


def test_trailing_rollouts_are_left_over_in_arrival_order():
    lengths, rids = one_sample_rollouts([50] * 30)
    parallel = ParallelConfig(dp_size=2)
    for policy in ("drop", "carry"):
        batch = BatchConfig(global_batch_size=8, max_tokens_per_gpu=100, leftover=policy)
        schedule = build_dp_schedule(lengths, rids, parallel, batch)
        assert schedule.num_rollouts == [8, 8, 8]
        assert list(schedule.leftover_rollout_ids) == rids[24:]


def test_variable_size_run_gives_full_then_partial_step():
    rng = np.random.default_rng(3)
    rids = [f"r{r}" for r in range(32) for _ in range(int(rng.integers(1, 4)))]
    rng.shuffle(rids)
    lengths = rng.integers(50, 400, len(rids))
    parallel = ParallelConfig(dp_size=4)
    partial = build_dp_schedule(lengths, rids, parallel,
                                BatchConfig(global_batch_size=24, max_tokens_per_gpu=512, leftover="partial"))
    assert partial.num_rollouts == [24, 8] and partial.leftover_rollout_ids == ()
    dropped = build_dp_schedule(lengths, rids, parallel,
                                BatchConfig(global_batch_size=24, max_tokens_per_gpu=512, leftover="drop"))
    assert dropped.num_rollouts == [24] and len(dropped.leftover_rollout_ids) == 8


def test_partial_step_with_fewer_samples_than_ranks_is_padded():
    # 10 full rollouts + 3 one-sample leftovers: 3 samples on 4 ranks -> one empty micro-batch.
    lengths, rids = one_sample_rollouts([100] * 13)
    parallel = ParallelConfig(dp_size=4)
    batch = BatchConfig(global_batch_size=10, max_tokens_per_gpu=1000, leftover="partial")
    schedule = build_dp_schedule(lengths, rids, parallel, batch)
    assert schedule.num_rollouts == [10, 3] and schedule.leftover_rollout_ids == ()
    assert schedule.steps[1].num_padding_microbatches == 1 and schedule.steps[0].num_padding_microbatches == 0
    assert sorted(len(p) for p in schedule.steps[1].rank_micro_batches) == [1, 1, 1, 1]
    assert_schedule_invariants(schedule, lengths, rids, parallel, batch)


def test_unalignable_full_step_is_padded_not_stalled():
    """Issue 8's wedge: gbs=3, dp=2, cap 100, three 60-token one-sample rollouts."""
    lengths, rids = one_sample_rollouts([60] * 3)
    parallel = ParallelConfig(dp_size=2)
    batch = BatchConfig(global_batch_size=3, max_tokens_per_gpu=100)
    schedule = build_dp_schedule(lengths, rids, parallel, batch)
    assert schedule.num_rollouts == [3] and schedule.num_microbatches == [2]
    assert schedule.steps[0].num_padding_microbatches == 1
    assert_schedule_invariants(schedule, lengths, rids, parallel, batch)


def test_fewer_rollouts_than_a_step():
    lengths, rids = one_sample_rollouts([100] * 5)
    parallel = ParallelConfig(dp_size=2)
    empty = build_dp_schedule(lengths, rids, parallel, BatchConfig(global_batch_size=8, max_tokens_per_gpu=500, leftover="drop"))
    assert empty.steps == () and list(empty.leftover_rollout_ids) == rids
    assert empty.partitions == [[], []]
    partial = build_dp_schedule(lengths, rids, parallel, BatchConfig(global_batch_size=8, max_tokens_per_gpu=500))
    assert partial.num_rollouts == [5]


def test_static_misalignment_fails_with_the_rule_and_fix():
    lengths, rids = one_sample_rollouts([10] * 12)
    with pytest.raises(ConfigError, match=r"step_size % \(dp_size \* micro_batch_size \* mb_group\) == 0"):
        build_dp_schedule(lengths, rids, ParallelConfig(dp_size=4),
                          BatchConfig(global_batch_size=10, micro_batch_size=2))


def test_flops_mode_keeps_the_token_cap_while_balancing_flops():
    # Three long sequences dominate FLOPs (attention is quadratic); two ranks.
    rng = np.random.default_rng(0)
    lengths = np.concatenate([[4000, 3900, 3800], rng.integers(100, 800, 60)])
    rids = [f"r{i}" for i in range(lengths.size)]
    model = TransformerFlopsModel(num_layers=8, hidden_size=256, num_attention_heads=8)
    flops = model.sequence_flops(lengths)
    parallel = ParallelConfig(dp_size=2)

    def rank_flops_ratio(balance):
        batch = BatchConfig(global_batch_size=lengths.size, max_tokens_per_gpu=4096, balance=balance, flops_model=model)
        schedule = build_dp_schedule(lengths, rids, parallel, batch)
        assert_schedule_invariants(schedule, lengths, rids, parallel, batch)  # includes the token cap
        loads = [flops[p].sum() for p in schedule.partitions]
        return max(loads) / np.mean(loads)

    by_flops, by_tokens = rank_flops_ratio("flops"), rank_flops_ratio("tokens")
    assert by_flops < 1.01
    assert by_flops < by_tokens


def test_token_balance_beats_whole_bin_assignment():
    rng = np.random.default_rng(1)
    rids = [f"r{r}" for r in range(256) for _ in range(int(rng.integers(1, 5)))]
    lengths = np.clip(rng.lognormal(np.log(2000), 0.7, len(rids)), 32, 16000).astype(int)
    parallel = ParallelConfig(dp_size=8)
    strided = build_dp_schedule(lengths, rids, parallel, BatchConfig(global_batch_size=256, max_tokens_per_gpu=16384, balance="none"))
    balanced = build_dp_schedule(lengths, rids, parallel, BatchConfig(global_batch_size=256, max_tokens_per_gpu=16384, balance="tokens"))
    assert strided.num_microbatches == balanced.num_microbatches

    def ratio(s):
        loads = [lengths[p].sum() for p in s.partitions]
        return max(loads) / np.mean(loads)

    assert ratio(balanced) <= 1.01 < ratio(strided)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(global_batch_size=0, max_tokens_per_gpu=10), "global_batch_size"),
        (dict(global_batch_size=4), "exactly one of max_tokens_per_gpu"),
        (dict(global_batch_size=4, max_tokens_per_gpu=10, micro_batch_size=1), "exactly one of max_tokens_per_gpu"),
        (dict(global_batch_size=4, max_tokens_per_gpu=-1), "max_tokens_per_gpu"),
        (dict(global_batch_size=4, max_tokens_per_gpu=10, balance="round-robin"), "balance"),
        (dict(global_batch_size=4, max_tokens_per_gpu=10, leftover="keep"), "leftover"),
        (dict(global_batch_size=4, max_tokens_per_gpu=10, balance="flops"), "flops_model"),
    ],
)
def test_bad_batch_configs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BatchConfig(**kwargs)


def test_bad_parallel_configs_name_the_field():
    with pytest.raises(ValueError, match="dp_size"):
        ParallelConfig(dp_size=0)
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage"):
        ParallelConfig(dp_size=2, microbatch_group_size_per_vp_stage=0)


def test_step_smaller_than_alignment_is_a_config_error():
    with pytest.raises(ConfigError, match="global_batch_size"):
        build_dp_schedule([10], ["a"], ParallelConfig(dp_size=4), BatchConfig(global_batch_size=2, max_tokens_per_gpu=10))


def test_mismatched_inputs_are_rejected():
    with pytest.raises(ValueError, match="rollout_ids"):
        build_dp_schedule([10, 20], ["a"], ParallelConfig(dp_size=1), BatchConfig(global_batch_size=1, max_tokens_per_gpu=10))
