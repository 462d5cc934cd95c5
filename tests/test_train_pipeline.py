"""Pipeline parallelism through Megatron's own schedule, on a real in-process Ray over gloo.

Every test compares plain-SGD updates (lr 1, no clipping, float32) of a pipelined group with
the PP=1 update of an in-process rank from the same initial weights (`load_full_parameters`)
on the same fixed rollouts: 1F1B at PP=2, interleaved at PP=2 x VPP=2 (with a padding
micro-batch), old log-probs recomputed with `forward_only`, TP=2 x PP=2 on four ranks and
PP=4 x VPP=2.
"""

from __future__ import annotations

import dataclasses

import pytest
import ray

from trainer.config import ModelConfig
from actors.train_group import TrainGroup
from tests.train_support import (assert_same_update, inprocess_trainer, layout_shards, make_samples, sgd_config,
                                 update_between)
from vgbs_ray.config import BatchConfig, ParallelConfig

FOUR_LAYERS = ModelConfig(num_layers=4)
EIGHT_LAYERS = ModelConfig(num_layers=8)


def _shards(samples, parallel: ParallelConfig, *, max_tokens: int):
    return layout_shards(samples, parallel=parallel, max_tokens=max_tokens)


def _pp1_update(model: ModelConfig, shard):
    """The reference: one in-process rank (dp=tp=pp=1), the same shard; returns (initial weights, update, result)."""
    trainer = inprocess_trainer(sgd_config(model=model))
    before = trainer.full_parameters()
    result = trainer.train_shard(shard)
    return before, update_between(before, trainer.full_parameters()), result


def _group_update(group: TrainGroup, initial: dict, shards):
    group.load_full_parameters(initial)
    result = group.train_shards(shards)
    return update_between(initial, group.full_parameters()), result


def _assert_same_metrics(expected: dict, actual: dict) -> None:
    assert set(actual) == set(expected)
    for name, pair in expected.items():
        assert actual[name] == pytest.approx(pair, rel=1e-5, abs=1e-6), name


@pytest.fixture(scope="module")
def pp2_group(ray_session):
    group = TrainGroup(sgd_config(pp_size=2))
    yield group
    group.shutdown()


def test_pp2_ranks_and_lead(pp2_group):
    assert [(i.dp_rank, i.pp_rank) for i in pp2_group.rank_infos] == [(0, 0), (0, 1)]
    assert [i.is_lead for i in pp2_group.rank_infos] == [False, True]  # metrics come from the last stage
    assert pp2_group.parallel_config == ParallelConfig(dp_size=1)


def test_pp2_1f1b_matches_pp1(pp2_group):
    samples = make_samples(30, 10)
    shards = _shards(samples, ParallelConfig(dp_size=1), max_tokens=120)
    initial, expected, expected_result = _pp1_update(ModelConfig(), shards[0])
    update, result = _group_update(pp2_group, initial, shards)
    assert result.num_microbatches == shards[0].num_microbatches >= 3
    assert_same_update(expected, update)
    _assert_same_metrics(expected_result.metrics, result.metric_pairs)


def test_pp2_recomputes_old_log_probs_with_forward_only(pp2_group):
    samples = make_samples(31, 8, with_log_probs=False)  # old log-probs must come from a forward pass
    shards = _shards(samples, ParallelConfig(dp_size=1), max_tokens=120)
    initial, expected, expected_result = _pp1_update(ModelConfig(), shards[0])
    update, result = _group_update(pp2_group, initial, shards)
    assert_same_update(expected, update)
    assert result.metrics["ratio"] == pytest.approx(1.0, rel=1e-5)  # new == old before the update
    _assert_same_metrics(expected_result.metrics, result.metric_pairs)


def test_pp2_vpp2_interleaved_with_a_padding_micro_batch_matches_pp1(ray_session):
    samples = make_samples(33, 10)
    parallel = ParallelConfig(dp_size=1, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    shards = _shards(samples, parallel, max_tokens=120)
    assert shards[0].num_microbatches % 2 == 0
    # the scheduler may pad a rank with empty micro-batches to reach the alignment: two more
    padded = dataclasses.replace(shards[0], micro_batch_indices=[*shards[0].micro_batch_indices, [], []],
                                 num_microbatches=shards[0].num_microbatches + 2)
    initial, expected, expected_result = _pp1_update(FOUR_LAYERS, shards[0])
    group = TrainGroup(sgd_config(model=FOUR_LAYERS, pp_size=2, vpp_size=2))
    try:
        assert group.parallel_config == parallel
        for step_shards in (shards, [padded]):
            update, result = _group_update(group, initial, step_shards)
            assert result.num_microbatches == step_shards[0].num_microbatches
            assert_same_update(expected, update)
            _assert_same_metrics(expected_result.metrics, result.metric_pairs)
        misaligned = dataclasses.replace(shards[0], micro_batch_indices=shards[0].micro_batch_indices[:-1],
                                         num_microbatches=shards[0].num_microbatches - 1)
        if misaligned.num_microbatches % 2:
            with pytest.raises(Exception, match="microbatch_group_size_per_vp_stage=2"):
                group.train_shards([misaligned])
    finally:
        group.shutdown()


@pytest.mark.slow
def test_tp2_pp2_on_four_ranks_matches_pp1(ray_session):
    samples = make_samples(34, 8)
    shards = _shards(samples, ParallelConfig(dp_size=1), max_tokens=120)
    initial, expected, expected_result = _pp1_update(ModelConfig(), shards[0])
    group = TrainGroup(sgd_config(tp_size=2, pp_size=2))
    try:
        assert [(i.tp_rank, i.pp_rank) for i in group.rank_infos] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        update, result = _group_update(group, initial, shards)
        assert_same_update(expected, update)
        _assert_same_metrics(expected_result.metrics, result.metric_pairs)
    finally:
        group.shutdown()


@pytest.mark.slow
def test_pp4_vpp2_matches_pp1(ray_session):
    samples = make_samples(35, 12)
    parallel = ParallelConfig(dp_size=1, vpp_size=2, microbatch_group_size_per_vp_stage=4)
    shards = _shards(samples, parallel, max_tokens=100)
    assert shards[0].num_microbatches % 4 == 0
    initial, expected, expected_result = _pp1_update(EIGHT_LAYERS, shards[0])
    group = TrainGroup(sgd_config(model=EIGHT_LAYERS, pp_size=4, vpp_size=2))
    try:
        update, result = _group_update(group, initial, shards)
        assert_same_update(expected, update)
        _assert_same_metrics(expected_result.metrics, result.metric_pairs)
    finally:
        group.shutdown()


@pytest.mark.slow
def test_interleaved_steps_from_the_scheduler_actor_with_its_padding(ray_session):
    """The SchedulerActor lays out for the group's (vpp, group) and pads a 1-sample partial step to 2 micro-batches."""
    from vgbs_ray.scheduler.types import SchedulerConfig
    from actors.scheduler_actor import create_scheduler
    from tests.train_support import reference_update

    config = sgd_config(model=FOUR_LAYERS, pp_size=2, vpp_size=2)
    group = TrainGroup(config)
    scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(global_batch_size=4, max_tokens_per_gpu=120)),
                                 name="pipeline-test-scheduler")
    try:
        group.register_with(scheduler)
        samples = make_samples(36, 5, max_siblings=1, id_prefix="piped")
        assert ray.get(scheduler.submit.remote(samples), timeout=60).accepted == len(samples)
        ray.get(scheduler.end_of_input.remote(), timeout=120)  # 5 rollouts: a full step of 4, a partial of 1
        first = group.train_step(0, scheduler, shard_timeout_s=60)
        assert first.num_rollouts == 4 and first.num_microbatches % 2 == 0
        before = group.full_parameters()
        second = group.train_step(1, scheduler, shard_timeout_s=60)
        assert second.num_rollouts == 1 and second.num_microbatches == 2  # one real, one padding
        assert second.metric_pairs["loss"][1] == pytest.approx(1)
        record = ray.get(scheduler.step_record.remote(1), timeout=60)
        assert record.padding_microbatches == 1
        trained = [s for s in samples if s.rollout_id in set(record.rollout_ids)]
        assert len(trained) == 1
        expected = reference_update(config.model, before, trained, lr=second.lr)
        assert_same_update(expected, update_between(before, group.full_parameters()))
    finally:
        ray.kill(scheduler)
        group.shutdown()
