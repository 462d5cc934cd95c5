"""The named bad-input corpus (tests/bad_inputs.py) through a live SchedulerActor: by push and by
Ray Data stream. Each case is rejected by its rule, names its rollout, and disturbs nothing
already accepted; the scheduler keeps training afterwards."""

from __future__ import annotations

import time

import pytest
import ray

from vgbs_ray.scheduler.types import SchedulerConfig
from actors.scheduler_actor import create_scheduler
from tests.bad_inputs import BAD_INPUTS, CORPUS_LIMITS
from tests.rollout_factory import rollout_rows, sample_row
from tests.scheduler_harness import call
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.scheduler.intake import IntakeConfig

NAME = "sched-corpus"


def corpus_scheduler(name: str):
    """A scheduler where rollout "trained" was trained, "dropped" dropped, and "open" is half pushed."""
    scheduler = create_scheduler(SchedulerConfig(
        batch=BatchConfig(global_batch_size=1, max_tokens_per_gpu=128),
        intake=IntakeConfig(drop_uniform_groups=True, **CORPUS_LIMITS)), name=name)
    call(scheduler.register_train_group, ParallelConfig(dp_size=1))
    call(scheduler.submit, [sample_row("trained", 0, size=2), sample_row("trained", 1, size=2)])
    call(scheduler.get_shard, 0, 0, timeout_s=30)
    assert call(scheduler.ack_ranks, 0, {0: None})
    dropped = [sample_row("dropped", i, size=2, advantage=None, group=("dropped-group", 1)) for i in range(2)]
    call(scheduler.submit, dropped)
    call(scheduler.submit, [sample_row("open", 0, size=2)])
    return scheduler


@pytest.fixture(scope="module")
def pushed(ray_session):
    scheduler = corpus_scheduler(NAME)
    yield scheduler
    ray.kill(scheduler)


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_each_bad_push_is_rejected_by_rule_and_disturbs_nothing(pushed, name):
    case = BAD_INPUTS[name]
    before = call(pushed.stats)
    rows = case.rows()
    result = call(pushed.submit, rows)
    assert result.accepted == case.accepted and not result.deferred
    assert [r.rule for r in result.rejected] == [case.rule] * (len(rows) - case.accepted)
    if isinstance(rows[-1], dict):
        assert repr(rows[-1]["rollout_id"]) in str(result.rejected[-1].error())
    after = call(pushed.stats)
    assert after.failure is None
    assert after.ledger.rollouts_by_state["trained"] == before.ledger.rollouts_by_state["trained"] == 1
    assert after.ledger.rollouts_by_state["dropped"] == before.ledger.rollouts_by_state["dropped"] == 1
    assert after.buffered_rollouts == before.buffered_rollouts + case.accepted  # "open" and friends untouched


def test_after_the_corpus_the_open_rollout_completes_and_trains(pushed):
    step = call(pushed.stats).steps_emitted
    assert call(pushed.submit, [sample_row("open", 1, size=2)]).completed_rollouts == ("open",)
    ref = call(pushed.get_shard, step, 0, timeout_s=30)
    shard = ray.get(ref.ref, timeout=30)
    assert shard.rollout_ids == ["open", "open"]
    call(pushed.ack_ranks, step, {0: None})
    stats = call(pushed.stats, include_rollouts=True, check_ledger=True)
    assert stats.rollout_states["open"] == ("trained", step, None)


def test_the_corpus_through_a_ray_data_stream(ray_session):
    scheduler = corpus_scheduler("sched-corpus-stream")
    try:
        cases = [case for case in BAD_INPUTS.values() if case.in_dataset]
        blocks = [case.rows() for case in cases] + [rollout_rows("good-row", 1)]
        # One dataset per block: a stream's blocks may not share a schema (a string reward, float tokens).
        for rows in blocks:
            call(scheduler.consume_dataset, ray.data.from_items(rows))
        expected: dict[str, int] = {}
        for case, rows in zip(cases, blocks):
            expected[case.rule] = expected.get(case.rule, 0) + len(rows) - case.accepted
        deadline = time.monotonic() + 120
        while True:  # gate on the scheduler's own counts, not on a sleep
            stats = call(scheduler.stats)
            if stats.ledger.rejected_samples_by_rule == expected and stats.steps_emitted >= 2:
                break
            assert not stats.dataset_errors, stats.dataset_errors
            assert time.monotonic() < deadline, (stats.ledger.rejected_samples_by_rule, expected)
            time.sleep(0.2)
        assert call(scheduler.step_record, 1).rollout_ids == ("good-row",)  # a good row after all the bad ones trains
        assert stats.failure is None
    finally:
        ray.kill(scheduler)
