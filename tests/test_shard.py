"""Step shards carry their rank's partition, micro-batches and whole-rollout normalisers."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np

from vgbs_ray.config import ParallelConfig
from vgbs_ray.sample import make_rollout
from vgbs_ray.layout.schedule import BatchConfig, build_dp_schedule
from vgbs_ray.layout.shard import build_step_shards


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


def laid_out(samples, dp_size, max_tokens=16):
    """The step's layout over dp_size ranks (all the samples' rollouts) and its shards."""
    schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                 ParallelConfig(dp_size=dp_size),
                                 BatchConfig(global_batch_size=max(len({s.rollout_id for s in samples}), dp_size),
                                             max_tokens_per_gpu=max_tokens))  # fewer rollouts: a partial step
    return schedule.steps[0], build_step_shards(samples, schedule.steps[0], step=0)


def test_shards_hold_their_rank_partition_with_whole_rollout_normalisers():
    samples = window()
    step, shards = laid_out(samples, 2)
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


def test_each_shard_pickles_only_its_own_range_of_the_step_arrays():
    rng = np.random.default_rng(1)
    samples = [s for r in range(8) for s in make_rollout(
        f"r{r}", [dict(tokens=rng.integers(0, 100, 2000), response_length=1000, loss_mask=np.ones(1000, dtype=np.int8))],
        reward=0.0, advantage=1.0)]
    step, shards = laid_out(samples, 4, max_tokens=2000)
    whole = sum(s.tokens.nbytes for s in samples)
    for shard, rank_samples in zip(shards, [[samples[i] for i in step.partition(r)] for r in range(4)]):
        assert len(rank_samples) == 2
        assert np.array_equal(shard.token_ids, np.concatenate([s.tokens for s in rank_samples]))
        assert np.array_equal(shard.loss_mask, np.concatenate([s.loss_mask for s in rank_samples]))
        # The arrays are views of one step-wide array: a pickled shard carries its quarter, not the step.
        assert len(pickle.dumps(shard, protocol=5)) < whole / 2


def test_a_step_carries_behaviour_log_probs_on_every_rank_or_on_none():
    samples = window(num_rollouts=8, seed=2)
    assert all(s.rollout_log_probs is not None for s in laid_out(samples, 2)[1])
    # One sample without log-probs: no rank may train this step as if it had them.
    samples[0] = replace(samples[0], rollout_log_probs=None)
    assert all(s.rollout_log_probs is None for s in laid_out(samples, 2)[1])
    # A rank the step gives no sample agrees with the others: an empty array, not None.
    _, lone = laid_out(window(num_rollouts=1, seed=3)[:1], 2)
    empty = min(lone, key=lambda s: s.num_samples)
    assert empty.num_samples == 0 and empty.rollout_log_probs is not None and empty.rollout_log_probs.size == 0
