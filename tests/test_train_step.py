"""The train step's correctness, in-process (a world-size-1 gloo group; Megatron GPTModel on CPU).

Each test compares parameter updates of plain SGD (lr 1, no clipping: update = -gradient) in
float32 from the same deterministic init. The multi-rank versions of these checks go through
the real Ray placement group in test_train_group.py; the collective-recording test spawns
two gloo ranks here.
"""

from __future__ import annotations

import multiprocessing
import dataclasses

import pytest

from tests.train_support import (assert_same_update, inprocess_trainer, make_samples, record_collectives_worker,
                           reference_update, relative_difference, sgd_config, update_between)
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.lr_schedule import LRScheduleConfig, lr_at
from vgbs_ray.sample import make_rollout
from vgbs_ray.schedule import build_dp_schedule
from vgbs_ray.shard import build_legacy_shards, build_step_shards


def _schedule(samples, *, dp_size=1, gbs=None, max_tokens=4096, balance="tokens", leftover="partial"):
    gbs = gbs or len({s.rollout_id for s in samples})
    return build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                             ParallelConfig(dp_size=dp_size),
                             BatchConfig(global_batch_size=gbs, max_tokens_per_gpu=max_tokens, balance=balance,
                                         leftover=leftover))


def _train_one_step(config, samples, **schedule_kwargs):
    trainer = inprocess_trainer(config)
    before = trainer.full_parameters()
    shard = build_step_shards(samples, _schedule(samples, **schedule_kwargs).steps[0], 0)[0]
    result = trainer.train_shard(shard)
    return update_between(before, trainer.full_parameters()), result


def test_one_micro_batch_and_many_give_the_same_update():
    samples = make_samples(10, 10)
    one, r1 = _train_one_step(sgd_config(), samples, max_tokens=4096)
    many, r2 = _train_one_step(sgd_config(), samples, max_tokens=100)
    assert r1.num_microbatches == 1 and r2.num_microbatches > 4
    assert_same_update(one, many)
    assert r1.metrics["loss"][0] == pytest.approx(r2.metrics["loss"][0], rel=1e-5)


def test_update_is_mean_over_rollouts_of_token_means():
    samples = make_samples(11, 8)
    update, result = _train_one_step(sgd_config(), samples, max_tokens=120)
    expected = reference_update(sgd_config().model, None, samples, lr=1.0)
    assert_same_update(expected, update)
    assert result.metrics["loss"][1] == pytest.approx(8)  # one unit per rollout
    assert 0 < result.metrics["clip_fraction"][0]  # the test exercises the clipped branch


def test_no_op_with_one_sample_per_rollout():
    samples = make_samples(12, 9, max_siblings=1)
    update, _ = _train_one_step(sgd_config(), samples, max_tokens=150)
    classic = reference_update(sgd_config().model, None, samples, lr=1.0, per_rollout=False)
    assert_same_update(classic, update)


def test_rollout_with_four_samples_weighs_as_much_as_one_with_one():
    base = make_samples(13, 3, max_siblings=1, id_prefix="other")
    single = make_samples(14, 1, max_siblings=1, id_prefix="x")[0]
    row = dict(tokens=single.tokens, response_length=single.response_length, loss_mask=single.loss_mask,
               rollout_log_probs=single.rollout_log_probs)
    one = make_rollout("x", [row], reward=single.reward, advantage=single.advantage)
    four = make_rollout("x", [row] * 4, reward=single.reward, advantage=single.advantage)
    update_one, _ = _train_one_step(sgd_config(), base + one, max_tokens=100)
    update_four, _ = _train_one_step(sgd_config(), base + four, max_tokens=100)
    assert_same_update(update_one, update_four)
    # The per-sample accounting this replaces would weigh "x" four times:
    per_sample = reference_update(sgd_config().model, None, base + four, lr=1.0, per_rollout=False)
    assert relative_difference(update_one, per_sample) > 0.05


def test_legacy_path_trains_the_same_update():
    samples = make_samples(15, 8)
    layout_update, layout_result = _train_one_step(sgd_config(), samples, max_tokens=120)
    trainer = inprocess_trainer(sgd_config())
    before = trainer.full_parameters()
    result = trainer.train_shard(build_legacy_shards(samples, 0, 1)[0])
    assert result.path == "legacy" and layout_result.path == "layout"
    assert_same_update(layout_update, update_between(before, trainer.full_parameters()))


def test_variable_size_steps_24_then_8_rollouts():
    samples = make_samples(16, 32, max_siblings=3, max_len=40)
    schedule = _schedule(samples, gbs=24, max_tokens=400)
    assert schedule.num_rollouts == [24, 8]
    lr_config = LRScheduleConfig(lr=2.0, warmup_rollouts=48)  # the LR moves by rollouts, not steps
    config = dataclasses.replace(sgd_config(), optimizer=dataclasses.replace(sgd_config().optimizer,
                                                                           lr_schedule=lr_config))
    trainer = inprocess_trainer(config)
    results = []
    for k, step in enumerate(schedule.steps):
        before = trainer.full_parameters()
        results.append(trainer.train_shard(build_step_shards(samples, step, k)[0]))
        step_samples = [samples[i] for i in step.sample_indices]
        expected = reference_update(config.model, before, step_samples, lr=results[-1].lr)
        assert_same_update(expected, update_between(before, trainer.full_parameters()))
    assert [r.num_rollouts for r in results] == [24, 8]
    assert [r.metrics["loss"][1] for r in results] == pytest.approx([24, 8])
    assert [r.lr for r in results] == pytest.approx([lr_at(lr_config, 24), lr_at(lr_config, 32)])
    assert [r.consumed_rollouts for r in results] == [24, 32]


def _record_collectives(shards_by_phase: dict, pp_size: int = 1) -> list:
    """Run each phase's shards on two spawned gloo ranks; per rank: (rank, {phase: (calls, count)}, params, error)."""
    from actors.distributed import find_free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    procs = [context.Process(target=record_collectives_worker, args=(rank, port, shards_by_phase, results, pp_size))
             for rank in range(2)]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=180) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, _, _, error in reports:
        assert error is None, f"rank {rank}: {error}"
    return sorted(reports, key=lambda report: report[0])


def test_a_step_issues_only_the_gradient_and_grad_norm_sums():
    """Two spawned gloo ranks (dp=2) record every torch.distributed collective of a step."""
    samples = make_samples(17, 8)
    layout = build_step_shards(samples, _schedule(samples, dp_size=2, max_tokens=100).steps[0], 0)
    legacy = build_legacy_shards(samples, 1, 2)
    # the scheduler may give a rank an empty legacy shard: it still joins every collective
    lone = build_legacy_shards(make_samples(20, 1, max_siblings=1), 2, 2)
    assert lone[1].num_samples == 0
    phases = {"layout": layout, "legacy": legacy, "empty_legacy": lone}
    for rank, by_phase, num_params, _ in _record_collectives(phases):
        calls, num_microbatches = by_phase["layout"]
        assert num_microbatches == layout[rank].num_microbatches > 1
        # exactly: Megatron DDP's gradient SUM (one flat buffer), then its optimizer's SUM of the squared
        # grad norm over the model-parallel group. Metrics travel in the result, not in a collective.
        assert calls == [("all_reduce", "SUM", num_params), ("all_reduce", "SUM", 1)]
        legacy_calls, _ = by_phase["legacy"]
        assert legacy_calls[0][:2] == ("all_reduce", "MAX")  # the legacy path must agree on a count
        assert legacy_calls[1:] == calls
        assert by_phase["empty_legacy"][0] == legacy_calls


def test_a_pipelined_step_agrees_on_no_count():
    """PP=2 on two spawned gloo ranks: stages exchange activations point to point, never an all-reduce(MAX)."""
    samples = make_samples(19, 8)
    layout = build_step_shards(samples, _schedule(samples, max_tokens=100).steps[0], 0)
    legacy = build_legacy_shards(samples, 1, 1)
    for rank, by_phase, _, _ in _record_collectives({"layout": layout, "legacy": legacy}, pp_size=2):
        calls, num_microbatches = by_phase["layout"]
        assert num_microbatches == layout[0].num_microbatches > 1
        assert not [c for c in calls if c[:2] == ("all_reduce", "MAX")], calls
        point_to_point = [c for c in calls if c[0] in ("send", "recv", "isend", "irecv")]
        assert len(point_to_point) >= 2 * num_microbatches  # activations forward, gradients back (and shapes)
        legacy_calls, _ = by_phase["legacy"]
        assert legacy_calls[0][:2] == ("all_reduce", "MAX")


def test_padding_micro_batches_run_as_zero_contributions():
    """Empty entries in a shard's layout (the scheduler's padding) change neither update nor metrics."""
    samples = make_samples(18, 8)
    plain, plain_result = _train_one_step(sgd_config(), samples, max_tokens=120)
    shard = build_step_shards(samples, _schedule(samples, max_tokens=120).steps[0], 0)[0]
    padded = dataclasses.replace(shard, micro_batch_indices=[[], *shard.micro_batch_indices, []],
                                 num_microbatches=shard.num_microbatches + 2)
    trainer = inprocess_trainer(sgd_config())
    before = trainer.full_parameters()
    result = trainer.train_shard(padded)
    assert result.num_microbatches == plain_result.num_microbatches + 2
    assert_same_update(plain, update_between(before, trainer.full_parameters()))
    assert set(result.metrics) == set(plain_result.metrics)
    for name, pair in plain_result.metrics.items():
        assert result.metrics[name] == pytest.approx(pair, rel=1e-6), name
