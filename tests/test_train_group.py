"""The train group on a real in-process Ray: placement group, TrainActors, gloo, Megatron.

DP=2 packing invariance (every balance mode) against a dp=1 single-micro-batch run in this
process; checkpoints; TP=2 against TP=1; a dead rank; the placement-group timeout; and a
step pulled from the real SchedulerActor.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from trainer.config import TrainGroupConfig
from actors.train_group import PlacementGroupTimeoutError, TrainGroup, TrainStepError
from tests.train_support import (assert_same_update, inprocess_trainer, layout_shards, make_samples, sgd_config,
                                 update_between)
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.models.flops import TransformerFlopsModel

FLOPS = TransformerFlopsModel(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)


def _shards(samples, *, dp_size, max_tokens, balance="tokens", step=0):
    return layout_shards(samples, dp_size=dp_size, max_tokens=max_tokens, step=step, balance=balance,
                         flops_model=FLOPS if balance == "flops" else None)


def _dp1_one_micro_batch_update(samples, start: dict | None = None, **config):
    """The update one rank makes of the whole step in one micro-batch (from `start`'s parameters if given)."""
    trainer = inprocess_trainer(sgd_config(**config))
    if start is not None:
        trainer.load_full_parameters(start)
    before = trainer.full_parameters()
    result = trainer.train_shard(_shards(samples, dp_size=1, max_tokens=1 << 16)[0])
    assert result.num_microbatches == 1
    return update_between(before, trainer.full_parameters()), result


@pytest.fixture(scope="module")
def dp2_group(ray_session):
    group = TrainGroup(sgd_config(dp_size=2))
    yield group
    group.shutdown()


def test_group_advertises_its_parallel_config(dp2_group):
    assert dp2_group.parallel_config == ParallelConfig(dp_size=2, cp_size=1, vpp_size=1,
                                                       microbatch_group_size_per_vp_stage=1)
    assert [(i.rank, i.dp_rank, i.tp_rank) for i in dp2_group.rank_infos] == [(0, 0, 0), (1, 1, 0)]


def test_dp2_many_micro_batches_match_dp1_one_micro_batch_in_every_balance_mode(dp2_group):
    samples = make_samples(20, 12, max_len=100)
    expected, expected_result = _dp1_one_micro_batch_update(samples)
    initial = dp2_group.state_dict()
    before = dp2_group.full_parameters()
    for balance in ("none", "tokens", "flops"):
        dp2_group.load_state_dict(initial)
        shards = _shards(samples, dp_size=2, max_tokens=110, balance=balance)
        result = dp2_group.train_shards(shards)
        assert result.num_microbatches == shards[0].num_microbatches >= 3
        assert_same_update(expected, update_between(before, dp2_group.full_parameters()))
        for name, (total, count) in expected_result.metrics.items():  # count-weighted, not mean of means
            assert result.metric_pairs[name] == pytest.approx((total, count), rel=1e-5, abs=1e-6), (balance, name)


def test_checkpoint_round_trip(dp2_group, tmp_path):
    samples = make_samples(21, 6)
    dp2_group.train_shards(_shards(samples, dp_size=2, max_tokens=100))
    written = dp2_group.save_checkpoint(str(tmp_path))
    assert len(written) == 1  # one model-parallel shard, written by DP rank 0 only
    saved = dp2_group.full_parameters()
    consumed = dp2_group.state_dict()[0]["consumed_rollouts"]
    dp2_group.train_shards(_shards(samples, dp_size=2, max_tokens=100, step=1))
    assert not all(np.array_equal(saved[k], v) for k, v in dp2_group.full_parameters().items())
    dp2_group.load_checkpoint(str(tmp_path))
    restored = dp2_group.full_parameters()
    assert all(np.array_equal(saved[k], restored[k]) for k in saved)
    assert [s["consumed_rollouts"] for s in dp2_group.state_dict()] == [consumed, consumed]


def test_placement_group_that_cannot_fit_fails_with_a_clear_error(ray_session):
    config = TrainGroupConfig(dp_size=2, num_cpus_per_actor=1000, placement_timeout_s=2)
    start = time.monotonic()
    with pytest.raises(PlacementGroupTimeoutError, match="not ready after 2 s.*CPU="):
        TrainGroup(config)
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_tp2_matches_tp1(ray_session):
    samples = make_samples(22, 6)
    expected, _ = _dp1_one_micro_batch_update(samples)
    group = TrainGroup(sgd_config(tp_size=2))
    try:
        assert [(i.dp_rank, i.tp_rank) for i in group.rank_infos] == [(0, 0), (0, 1)]
        assert group.parallel_config.dp_size == 1
        before = group.full_parameters()
        result = group.train_shards(_shards(samples, dp_size=1, max_tokens=120))
        assert result.num_microbatches > 1
        assert_same_update(expected, update_between(before, group.full_parameters()))
    finally:
        group.shutdown()


def test_ep2_matches_one_rank_holding_every_expert(ray_session, tmp_path):
    """Expert parallelism: two DP ranks, each with half the experts and its own micro-batches, make the update one
    rank with every expert makes of the whole step; the experts are gathered for export and checkpointed per EP rank."""
    from trainer.config import ModelConfig

    moe = ModelConfig(family="qwen3_moe", kv_channels=16, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
    samples = make_samples(23, 8)
    group = TrainGroup(sgd_config(dp_size=2, ep_size=2, model=moe))
    try:
        assert [(i.dp_rank, i.ep_rank, i.in_first_replica) for i in group.rank_infos] == [(0, 0, True), (1, 1, True)]
        before = group.full_parameters()
        assert sum(".local_experts." in name for name in before) == 2 * 2 * 4  # 2 layers x fc1, fc2 x 4 experts
        # Each EP rank initialises its own experts: the reference starts from the group's whole model.
        expected, _ = _dp1_one_micro_batch_update(samples, start=before, model=moe)
        result = group.train_shards(_shards(samples, dp_size=2, max_tokens=120))
        assert result.num_microbatches > 1
        assert_same_update(expected, update_between(before, group.full_parameters()))
        written = sorted(path.rsplit("/", 1)[-1] for path in group.save_checkpoint(tmp_path))
        assert written == ["model_tp00_pp000_ep000.pt", "model_tp00_pp000_ep001.pt"]
    finally:
        group.shutdown()


@pytest.mark.slow
def test_dead_train_actor_fails_the_step_within_the_collective_timeout(ray_session):
    group = TrainGroup(sgd_config(dp_size=2, collective_timeout_s=15))
    try:
        shards = _shards(make_samples(23, 6), dp_size=2, max_tokens=100)
        ray.kill(group.actors[1], no_restart=True)
        start = time.monotonic()
        with pytest.raises(TrainStepError, match="rank 1 died"):
            group.train_shards(shards)
        assert time.monotonic() - start < 15
    finally:
        group.shutdown()


@pytest.mark.slow
def test_steps_pulled_from_the_scheduler_actor(dp2_group):
    from vgbs_ray.scheduler.types import SchedulerConfig
    from actors.scheduler_actor import create_scheduler

    scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(global_batch_size=8, max_tokens_per_gpu=120)),
                                 name="train-group-test-scheduler")
    try:
        dp2_group.register_with(scheduler)
        samples = make_samples(24, 12, id_prefix="pulled")
        assert ray.get(scheduler.submit.remote(samples), timeout=60).accepted == len(samples)
        ray.get(scheduler.end_of_input.remote(), timeout=120)  # 12 rollouts: one full step, one partial of 4
        results, walls = [], []
        for k in range(3):
            start = time.perf_counter()
            results.append(dp2_group.train_step(k, scheduler, shard_timeout_s=30))
            walls.append(time.perf_counter() - start)
        assert results[2] is None  # the stream ended: no step 2
        assert all(0 < r.shard_wait_s < wall for r, wall in zip(results[:2], walls))  # trainer idle: part of the call
        assert [r.num_rollouts for r in results[:2]] == [8, 4]
        assert results[1].consumed_rollouts - results[0].consumed_rollouts == 4
        stats = ray.get(scheduler.stats.remote(), timeout=60)
        assert stats.steps_trained == 2
        for record, result in zip(stats.recent_steps, results):  # the acks carried the ranks' (sum, count) pairs
            assert record.trained and record.microbatches_per_rank == (result.num_microbatches,) * 2
            assert record.metrics["loss"] == pytest.approx(result.metric_pairs["loss"], rel=1e-6)
    finally:
        ray.kill(scheduler)
