"""Step shards carry their normalisers; eligibility picks the layout path with a reason."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np

from vgbs_ray.config import ParallelConfig
from vgbs_ray.eligibility import decide_scheduling
from vgbs_ray.sample import make_rollout
from vgbs_ray.schedule import BatchConfig, build_dp_schedule
from vgbs_ray.shard import build_legacy_shards, build_step_shards


def window(num_rollouts=8, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for r in range(num_rollouts):
        rows = []
        for _ in range(int(rng.integers(1, 4))):
            response = int(rng.integers(1, 6))
            rows.append(dict(tokens=rng.integers(0, 100, response + 3), response_length=response,
                             loss_mask=rng.integers(0, 2, response), rollout_log_probs=rng.normal(size=response)))
        samples += make_rollout(f"r{r}", rows, reward=float(r), advantage=float(r) - 3.5)
    order = rng.permutation(len(samples))
    return [samples[i] for i in order]


def test_shards_hold_their_rank_partition_with_whole_rollout_normalisers():
    samples = window()
    parallel = ParallelConfig(dp_size=2)
    schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples], parallel,
                                 BatchConfig(global_batch_size=8, max_tokens_per_gpu=16))
    step = schedule.steps[0]
    shards = build_step_shards(samples, step, step=0)
    assert [s.rank for s in shards] == [0, 1]
    for rank, shard in enumerate(shards):
        partition = step.partition(rank)
        assert shard.num_rollouts == 8 and shard.num_microbatches == step.num_microbatches
        assert shard.micro_batch_indices == step.micro_batch_indices(rank)
        assert shard.rollout_ids == [samples[i].rollout_id for i in partition]
        assert np.array_equal(shard.token_ids, np.concatenate([samples[i].tokens for i in partition]))
        assert shard.loss_mask.size == shard.response_lengths.sum() == shard.rollout_log_probs.size
        for pos, i in enumerate(partition):
            siblings = [s for s in samples if s.rollout_id == samples[i].rollout_id]
            assert shard.rollout_mask_sums[pos] == sum(int(s.loss_mask.sum()) for s in siblings)
    assert sum(s.num_samples for s in shards) == len(samples)


def test_legacy_shards_split_evenly_without_a_layout():
    samples = window()
    shards = build_legacy_shards(samples, step=3, dp_size=2)
    assert all(not s.has_layout and s.num_microbatches is None for s in shards)
    assert abs(shards[0].num_samples - shards[1].num_samples) <= 1
    assert shards[0].num_rollouts == 8


def test_eligibility_decisions_carry_their_reason():
    parallel = ParallelConfig(dp_size=4)
    assert decide_scheduling(parallel).rollout_side
    cases = [
        (decide_scheduling(None), "parallel config"),
        (decide_scheduling(parallel, features=["multimodal"]), "multimodal"),
    ]
    for decision, reason in cases:
        assert not decision.rollout_side and reason in decision.reason


def test_each_shard_pickles_only_its_own_range_of_the_step_arrays():
    rng = np.random.default_rng(1)
    samples = [s for r in range(8) for s in make_rollout(
        f"r{r}", [dict(tokens=rng.integers(0, 100, 2000), response_length=1000, loss_mask=np.ones(1000, dtype=np.int8))],
        reward=0.0, advantage=1.0)]
    shards = build_legacy_shards(samples, step=0, dp_size=4)
    whole = sum(s.tokens.nbytes for s in samples)
    for shard, rank_samples in zip(shards, [samples[r::4] for r in range(4)]):
        assert np.array_equal(shard.token_ids, np.concatenate([s.tokens for s in rank_samples]))
        assert np.array_equal(shard.loss_mask, np.concatenate([s.loss_mask for s in rank_samples]))
        # The arrays are views of one step-wide array: a pickled shard carries its quarter, not the step.
        assert len(pickle.dumps(shard, protocol=5)) < whole / 2


def test_a_step_carries_behaviour_log_probs_on_every_rank_or_on_none():
    samples = window(num_rollouts=8, seed=2)
    assert all(s.rollout_log_probs is not None for s in build_legacy_shards(samples, step=0, dp_size=2))
    # One sample without log-probs: no rank may train this step as if it had them.
    samples[0] = replace(samples[0], rollout_log_probs=None)
    assert all(s.rollout_log_probs is None for s in build_legacy_shards(samples, step=0, dp_size=2))
    # A rank the step gives no sample agrees with the others: an empty array, not None.
    lone = build_legacy_shards(window(num_rollouts=1, seed=3)[:1], step=0, dp_size=2)
    assert lone[1].num_samples == 0 and lone[1].rollout_log_probs is not None and lone[1].rollout_log_probs.size == 0
