"""SchedulerActor on a real in-process Ray: steps, leftovers, validation, backpressure.

Each test starts its own named scheduler on the shared `ray_session` and kills it at the end.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import ray

from vgbs_ray.scheduler.types import SchedulerConfig, SubmitResult
from actors.shard_ref import ShardRef
from actors.scheduler_actor import create_scheduler
from tests.rollout_factory import many_rollouts, rollout_rows, sample_row
from tests.scheduler_harness import call, drain, rollouts_of
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.scheduler.intake import IntakeConfig
from vgbs_ray.errors import (
    ConfigError, RolloutValidationError, SchedulerStateError, SchedulerTimeoutError, VgbsError,
)


@pytest.fixture
def scheduler_factory(ray_session):
    made = []

    def make(name: str, **cfg):
        batch = cfg.pop("batch")
        intake = IntakeConfig(**{k: cfg.pop(k) for k in list(cfg) if k in IntakeConfig.__dataclass_fields__})
        handle = create_scheduler(SchedulerConfig(batch=batch, intake=intake, **cfg), name=name)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        ray.kill(handle)


def push_shuffled(scheduler, rollouts: list[list[dict]], *, seed: int, chunk: int = 5) -> list:
    """Push every sample, rollouts interleaved in a shuffled order, `chunk` samples per call.

    Returns rollout ids in completion order as the scheduler reported them.
    """
    rows = [r for rollout in rollouts for r in rollout]
    random.Random(seed).shuffle(rows)
    completed = []
    for start in range(0, len(rows), chunk):
        result: SubmitResult = call(scheduler.submit, rows[start:start + chunk])
        assert result.accepted == len(rows[start:start + chunk]) and not result.rejected and not result.deferred
        completed += result.completed_rollouts
    return completed


def wait_for_state(scheduler, condition, what: str, timeout_s: float = 60):
    """Poll the scheduler's stats until `condition(stats)` holds; returns those stats. The deadline only guards a hang."""
    deadline = time.monotonic() + timeout_s
    while not condition(stats := call(scheduler.stats)):
        assert time.monotonic() < deadline, f"the scheduler never showed {what}: {stats}"
        time.sleep(0.05)
    return stats


def assert_ledger_closed(stats, pushed_ids: set, *, trained: int, dropped: int = 0):
    """Every accepted rollout in exactly one state; none trained twice; none disappeared."""
    states = stats.rollout_states
    assert pushed_ids <= set(states), f"rollouts vanished: {pushed_ids - set(states)}"
    by_state = stats.ledger.rollouts_by_state
    assert by_state["trained"] == trained and by_state["dropped"] == dropped
    assert by_state["buffered"] == 0 and by_state["scheduled"] == 0
    trained_ids = [rid for step in stats.recent_steps for rid in step.rollout_ids]
    assert len(trained_ids) == len(set(trained_ids)) == trained  # none in two steps
    for step in stats.recent_steps:
        for rid in step.rollout_ids:
            assert states[rid] == ("trained", step.step, None)


def test_32_rollouts_gbs_24_partial_emits_24_then_8(scheduler_factory):
    gbs, dp = 24, 2
    scheduler = scheduler_factory("sched-partial", batch=BatchConfig(global_batch_size=gbs, max_tokens_per_gpu=64,
                                                                     leftover="partial"))
    call(scheduler.register_train_group, ParallelConfig(dp_size=dp))
    rollouts = many_rollouts(32, seed=1, max_samples=3)
    completed = push_shuffled(scheduler, rollouts, seed=2)
    assert sorted(completed) == sorted(f"r{i}" for i in range(32))
    ref = call(scheduler.get_shard, 0, 1, timeout_s=30)  # the full step appears without a flush
    assert isinstance(ref, ShardRef) and ref.num_rollouts == 24
    with pytest.raises(SchedulerTimeoutError, match="step 1, rank 0"):
        call(scheduler.get_shard, 1, 0, timeout_s=0.2)
    result = call(scheduler.end_of_input)
    assert result.steps == (1,) and result.dropped == ()
    steps = drain(scheduler, dp)
    assert [s[0].num_rollouts for s in steps] == [24, 8]
    sizes = {f"r{i}": len(r) for i, r in enumerate(rollouts)}
    seen = {}
    for k, shards in enumerate(steps):
        counts = rollouts_of(shards)
        assert len(counts) == shards[0].num_rollouts
        for rid, n in counts.items():
            assert n == sizes[rid] and rid not in seen  # siblings never split, across ranks or steps
            seen[rid] = k
        assert len({s.num_microbatches for s in shards}) == 1
        for shard in shards:  # rollout mask sums cover the whole rollout, across ranks
            assert all(m == 6 * sizes[rid] for rid, m in zip(shard.rollout_ids, shard.rollout_mask_sums))
    assert set(steps_ids := [rid for rid, k in seen.items() if k == 0]) == set(completed[:24])  # first completed, first trained
    assert len(steps_ids) == 24
    stats = call(scheduler.stats, include_rollouts=True, check_ledger=True)
    assert [r.num_rollouts for r in stats.recent_steps] == [24, 8] and [r.partial for r in stats.recent_steps] == [False, True]
    assert stats.recent_steps[1].trigger == "end_of_input" and all(r.trained for r in stats.recent_steps)
    assert stats.recent_steps[0].scheduling_latency_s >= 0 and stats.recent_steps[0].microbatches_per_rank[0] >= 1
    assert stats.recent_steps[0].metrics["loss"][1] == stats.recent_steps[0].num_samples  # (sum, count) over ranks
    assert_ledger_closed(stats, set(sizes), trained=32)
    with pytest.raises(SchedulerStateError, match="released"):
        call(scheduler.get_shard, 0, 0, timeout_s=1)
    with pytest.raises(SchedulerStateError, match="acknowledged"):
        call(scheduler.ack_ranks, 0, {0: None})
    with pytest.raises(SchedulerStateError, match="end_of_input"):
        call(scheduler.submit, rollout_rows("late", 1))


def test_one_call_gets_every_rank_and_one_acks_them_and_a_refused_ack_changes_nothing(scheduler_factory):
    scheduler = scheduler_factory("sched-ack-ranks", batch=BatchConfig(global_batch_size=4, max_tokens_per_gpu=64))
    call(scheduler.register_train_group, ParallelConfig(dp_size=3))
    call(scheduler.submit, [row for rollout in many_rollouts(4, seed=3, max_samples=2) for row in rollout])
    assert all(call(scheduler.get_shard, 0, rank, timeout_s=30) is not None for rank in range(3))
    every_rank = call(scheduler.get_step, 0, timeout_s=30)  # a driver's one call: each rank's ShardRef, in rank order
    assert [(r.step, r.rank, r.num_rollouts) for r in every_rank] == [(0, rank, 4) for rank in range(3)]
    assert [r.ref for r in every_rank] == [call(scheduler.get_shard, 0, rank).ref for rank in range(3)]
    with pytest.raises(ConfigError, match="rank 3 is outside"):
        call(scheduler.get_shard, 0, 3)
    pairs = {"loss": (2.0, 4.0)}
    with pytest.raises(ConfigError, match="rank 3 is outside"):
        call(scheduler.ack_ranks, 0, {0: pairs, 3: pairs})
    assert call(scheduler.ack_ranks, 0, {0: pairs}) is False  # rank 0 alone: the refused call above recorded nothing
    with pytest.raises(SchedulerStateError, match="rank 0 acknowledged twice"):
        call(scheduler.ack_ranks, 0, {1: pairs, 0: pairs})
    assert not call(scheduler.step_record, 0).trained
    assert call(scheduler.ack_ranks, 0, {1: pairs, 2: {"loss": (1.0, 2.0)}}) is True
    record = call(scheduler.step_record, 0)
    assert record.trained and record.metrics["loss"] == (5.0, 10.0)  # the pairs of all three ranks, summed
    with pytest.raises(SchedulerStateError, match="released"):
        call(scheduler.get_step, 0)
    call(scheduler.end_of_input)
    assert call(scheduler.get_step, 1) is None  # input ended: step 1 never comes


def test_the_shards_of_a_nodes_ranks_are_one_object(scheduler_factory):
    scheduler = scheduler_factory("sched-node-objects", batch=BatchConfig(global_batch_size=6, max_tokens_per_gpu=64))
    with pytest.raises(ConfigError, match="one per DP rank"):
        call(scheduler.register_train_group, ParallelConfig(dp_size=3), ["a", "b"])
    call(scheduler.register_train_group, ParallelConfig(dp_size=3), ["node-b", "node-a", "node-b"])
    call(scheduler.submit, [row for rollout in many_rollouts(6, seed=4, max_samples=2) for row in rollout])
    refs = call(scheduler.get_step, 0, timeout_s=30)
    assert [r.index for r in refs] == [0, 0, 1] and refs[0].ref == refs[2].ref != refs[1].ref  # one object per node
    shards = [r.fetch(timeout_s=30) for r in refs]
    assert [s.rank for s in shards] == [0, 1, 2] and [s.rank for s in ray.get(refs[0].ref)] == [0, 2]
    assert call(scheduler.get_shard, 0, 2).fetch(timeout_s=30).rollout_ids == shards[2].rollout_ids
    assert sum(len(rollouts_of([s])) for s in shards) >= 6 and sum(s.num_samples for s in shards) == \
        sum(len(r) for r in many_rollouts(6, seed=4, max_samples=2))


def test_drop_policy_emits_24_and_records_8_dropped(scheduler_factory):
    scheduler = scheduler_factory("sched-drop", batch=BatchConfig(global_batch_size=24, max_tokens_per_gpu=64, leftover="drop"))
    call(scheduler.register_train_group, ParallelConfig(dp_size=2))
    rollouts = many_rollouts(32, seed=5)
    completed = push_shuffled(scheduler, rollouts, seed=6, chunk=7)
    result = call(scheduler.end_of_input)
    assert sorted(result.dropped) == sorted(completed[24:])
    steps = drain(scheduler, 2)
    assert [s[0].num_rollouts for s in steps] == [24]
    stats = call(scheduler.stats, include_rollouts=True, check_ledger=True)
    assert stats.ledger.dropped_by_reason == {"leftover": 8}
    assert all(stats.rollout_states[rid][0:3:2] == ("dropped", "leftover") for rid in completed[24:])
    assert_ledger_closed(stats, set(completed), trained=24, dropped=8)


def test_bad_inputs_are_rejected_and_reported_without_disturbing_accepted(scheduler_factory):
    scheduler = scheduler_factory("sched-bad", batch=BatchConfig(global_batch_size=2, max_tokens_per_gpu=64, leftover="partial"))
    call(scheduler.register_train_group, ParallelConfig(dp_size=1))
    good = rollout_rows("ok1", 2) + [sample_row("open", 0, size=2)]
    bad = [
        sample_row("bad_mask", 0, size=1, loss_mask=np.ones(3, dtype=np.int8)),
        sample_row("open", 0, size=2),                      # duplicate of an accepted sample
        sample_row("open", 1, size=2, reward=-1.0),         # sibling disagrees on reward
        sample_row("open", 1, size=3),                      # sibling disagrees on rollout_size
        sample_row("no_adv", 0, size=1, advantage=None),    # no advantage and no group
    ]
    result = call(scheduler.submit, good + bad)
    assert result.accepted == 3 and not result.deferred
    assert [(r.rollout_id, r.rule) for r in result.rejected] == [
        ("bad_mask", "mask_length"), ("open", "duplicate_sample"), ("open", "sibling_reward"),
        ("open", "sibling_rollout_size"), ("no_adv", "missing_advantage")]
    with pytest.raises(RolloutValidationError, match="'bad_mask'.*mask_length"):
        result.raise_for_rejections()
    assert call(scheduler.submit, rollout_rows("ok2", 1)).completed_rollouts == ("ok2",)
    ref = call(scheduler.get_shard, 0, 0, timeout_s=20)  # ok1 + ok2: one full step
    late = call(scheduler.submit, [sample_row("ok1", 0, size=2)])
    assert [(r.rollout_id, r.rule) for r in late.rejected] == [("ok1", "already_scheduled")]
    with pytest.raises(ConfigError, match="rank 3"):
        call(scheduler.get_shard, 0, 3, timeout_s=1)
    shard = ray.get(ref.ref, timeout=30)
    assert sorted(set(shard.rollout_ids)) == ["ok1", "ok2"]
    call(scheduler.ack_ranks, 0, {0: None})
    result = call(scheduler.end_of_input)
    assert result.dropped == ("open",)  # incomplete at end: reported, not trained
    stats = call(scheduler.stats, include_rollouts=True, check_ledger=True)
    assert stats.incomplete_rollouts[0][:2] == ("open", "incomplete_rollout")
    assert stats.ledger.rejected_samples_by_rule == {
        "mask_length": 1, "duplicate_sample": 1, "sibling_reward": 1, "sibling_rollout_size": 1,
        "missing_advantage": 1, "already_scheduled": 1}
    assert stats.rejected_samples == 6 and len(stats.rejections) == 6
    assert_ledger_closed(stats, {"ok1", "ok2", "open"}, trained=2, dropped=1)
    assert call(scheduler.get_shard, 1, 0, timeout_s=5) is None


def test_backpressure_staleness_and_blocking_submit(scheduler_factory):
    scheduler = scheduler_factory("sched-bp", batch=BatchConfig(global_batch_size=2, max_tokens_per_gpu=64),
                                  max_buffered_samples=4, max_steps_ahead=1, retry_after_s=0.2)
    rows = [r for i in range(6) for r in rollout_rows(f"b{i}", 1)]
    first = call(scheduler.submit, rows)  # no train group yet: nothing leaves the buffer
    assert first.accepted == 4 and first.deferred == (4, 5) and first.retry_after_s == 0.2
    assert first.backpressure_reason.startswith("buffer_full") and first.must_retry
    call(scheduler.register_train_group, ParallelConfig(dp_size=1))
    call(scheduler.get_shard, 1, 0, timeout_s=20)  # two steps emitted, buffer empty, none trained
    again = call(scheduler.submit, [rows[i] for i in first.deferred])
    assert again.deferred == (0, 1) and again.backpressure_reason.startswith("staleness")
    blocked = scheduler.submit.remote([rows[i] for i in first.deferred], wait_s=20)  # waits for room
    # What holds it: two steps emitted, none trained (max_steps_ahead=1), the blocked rows not taken in.
    wait_for_state(scheduler, lambda st: (st.steps_emitted, st.steps_trained, st.accepted_samples) == (2, 0, 4),
                   "two steps in flight with none trained and the blocked rows not accepted")
    assert ray.wait([blocked], timeout=0)[0] == []
    call(scheduler.ack_ranks, 0, {0: None})
    assert ray.get(blocked, timeout=30).accepted == 2
    stats = call(scheduler.stats)
    assert stats.deferred_samples == 4 and stats.accepted_samples == 6


def test_max_wait_flushes_a_partial_step(scheduler_factory):
    scheduler = scheduler_factory("sched-wait", batch=BatchConfig(global_batch_size=8, max_tokens_per_gpu=64),
                                  max_wait_s=0.3)
    call(scheduler.register_train_group, ParallelConfig(dp_size=2))
    call(scheduler.submit, [r for i in range(3) for r in rollout_rows(f"w{i}", 2)])
    refs = [call(scheduler.get_shard, 0, rank, timeout_s=20) for rank in range(2)]
    shards = [ray.get(r.ref, timeout=30) for r in refs]
    assert [s.num_rollouts for s in shards] == [3, 3]
    assert shards[0].num_microbatches == shards[1].num_microbatches == len(shards[1].micro_batch_indices)
    assert sum(s.num_samples for s in shards) == 6
    record = call(scheduler.step_record, 0)
    assert record.trigger == "max_wait" and record.partial
    assert record.max_completion_to_emission_s >= 0.3
    with pytest.raises(ConfigError, match="dp_size"):
        call(scheduler.register_train_group, ParallelConfig(dp_size=4))  # a different group after steps


def test_errors_are_vgbs_errors():
    assert issubclass(SchedulerTimeoutError, VgbsError) and issubclass(SchedulerStateError, VgbsError)


def test_carry_policy_flush_waits_for_train_group_and_drops_at_end(scheduler_factory):
    scheduler = scheduler_factory("sched-carry", batch=BatchConfig(global_batch_size=4, max_tokens_per_gpu=64, leftover="carry"))
    call(scheduler.submit, [r for i in range(6) for r in rollout_rows(f"c{i}", 1)])
    flushing = scheduler.flush.remote(timeout_s=30)
    # What holds it: every rollout ready, a full step formable, none emitted (no train group to lay it out for).
    wait_for_state(scheduler, lambda st: (st.ready_rollouts, st.steps_emitted) == (6, 0),
                   "six ready rollouts and no step emitted")
    assert ray.wait([flushing], timeout=0)[0] == []  # 4 ready rollouts are a step: wait for the train group
    call(scheduler.register_train_group, ParallelConfig(dp_size=1))
    assert ray.get(flushing, timeout=30).kept == 2  # carried: they wait for the next step
    ref = call(scheduler.get_shard, 0, 0, timeout_s=10)
    assert ref.num_rollouts == 4
    call(scheduler.ack_ranks, 0, {0: None})
    result = call(scheduler.end_of_input)
    assert sorted(result.dropped) == ["c4", "c5"]
    stats = call(scheduler.stats, include_rollouts=True, check_ledger=True)
    assert stats.ledger.dropped_by_reason == {"carried_at_end_of_input": 2}
    assert_ledger_closed(stats, {f"c{i}" for i in range(6)}, trained=4, dropped=2)


def test_gc_thresholds_are_relaxed_only_in_the_scheduler_process(scheduler_factory):
    import gc

    from actors.gc_tuning import GC_THRESHOLDS

    scheduler = scheduler_factory("vgbs-test-gc", batch=BatchConfig(global_batch_size=2, max_tokens_per_gpu=64))
    in_actor = ray.get(scheduler.__ray_call__.remote(lambda self: gc.get_threshold()), timeout=60)
    assert tuple(in_actor) == GC_THRESHOLDS
    assert gc.get_threshold() != GC_THRESHOLDS  # the driver (this test process) keeps its own


def test_rewind_replays_the_steps_after_a_checkpoint_in_order_exactly_once(scheduler_factory):
    scheduler = scheduler_factory("sched-rewind", batch=BatchConfig(global_batch_size=2, max_tokens_per_gpu=64),
                                  retain_until_checkpoint=True)
    call(scheduler.register_train_group, ParallelConfig(dp_size=1))
    call(scheduler.submit, [r for i in range(8) for r in rollout_rows(f"w{i}", 1)])
    first = {}
    for step in range(4):
        ref = call(scheduler.get_shard, step, 0, timeout_s=30)
        first[step] = ray.get(ref.ref, timeout=30).rollout_ids
        if step < 3:  # step 3 is in flight when the train group dies
            call(scheduler.ack_ranks, step, {0: None})
    call(scheduler.checkpointed, 1)  # the last checkpoint holds step 0 only
    assert call(scheduler.rewind, 1) == 6
    replayed = {}
    for step in range(1, 4):
        ref = call(scheduler.get_shard, step, 0, timeout_s=30)
        replayed[step] = ray.get(ref.ref, timeout=30).rollout_ids
        call(scheduler.ack_ranks, step, {0: None})
    assert replayed == {step: first[step] for step in range(1, 4)}  # same rollouts, same order
    call(scheduler.checkpointed, 4)
    stats = call(scheduler.stats, include_rollouts=True, check_ledger=True)
    assert stats.ledger.rollouts_by_state["trained"] == 8 and stats.steps_trained == 4
    assert {rid: state[1] for rid, state in stats.rollout_states.items()} == {
        rid: step for step, ids in first.items() for rid in ids}
    with pytest.raises(SchedulerStateError, match="already settled|released"):
        call(scheduler.rewind, 2)


def test_rewind_without_retention_covers_only_unacknowledged_steps(scheduler_factory):
    scheduler = scheduler_factory("sched-rewind-plain", batch=BatchConfig(global_batch_size=2, max_tokens_per_gpu=64))
    call(scheduler.register_train_group, ParallelConfig(dp_size=1))
    call(scheduler.submit, [r for i in range(4) for r in rollout_rows(f"v{i}", 1)])
    call(scheduler.get_shard, 1, 0, timeout_s=30)
    call(scheduler.ack_ranks, 0, {0: None})
    with pytest.raises(SchedulerStateError, match="retain_until_checkpoint"):
        call(scheduler.rewind, 0)
    assert call(scheduler.rewind, 1) == 2  # step 1 was in flight: it comes back
    assert ray.get(call(scheduler.get_shard, 1, 0, timeout_s=30).ref, timeout=30).rollout_ids in (["v2", "v3"], ["v3", "v2"])
    call(scheduler.stats, check_ledger=True)


def test_step_records_of_untrained_steps_outlive_the_window(scheduler_factory):
    """A train side far behind the producers still finds the record of the step it just trained."""
    scheduler = scheduler_factory("sched-records", batch=BatchConfig(global_batch_size=1, max_tokens_per_gpu=64),
                                  step_record_window=2)
    call(scheduler.register_train_group, ParallelConfig(dp_size=1))
    call(scheduler.submit, [r for i in range(5) for r in rollout_rows(f"q{i}", 1)])
    call(scheduler.get_shard, 4, 0, timeout_s=30)  # five steps emitted, none trained
    for step in range(5):
        call(scheduler.ack_ranks, step, {0: None})
        assert call(scheduler.step_record, step).trained  # read after the step, like the job does
    assert [r.step for r in call(scheduler.stats).recent_steps] == [3, 4]  # trained ones: the newest 2
    with pytest.raises(SchedulerStateError, match="step_record_window"):
        call(scheduler.step_record, 2)


def test_drop_untrained_ends_a_run_with_every_rollout_trained_or_dropped(scheduler_factory):
    scheduler = scheduler_factory("sched-drop-untrained", batch=BatchConfig(global_batch_size=2, max_tokens_per_gpu=64),
                                  retain_until_checkpoint=True)
    call(scheduler.register_train_group, ParallelConfig(dp_size=1))
    call(scheduler.submit, [r for i in range(7) for r in rollout_rows(f"u{i}", 1)])
    call(scheduler.get_shard, 2, 0, timeout_s=30)  # steps 0-2 emitted, u6 still buffered
    call(scheduler.ack_ranks, 0, {0: None})
    call(scheduler.checkpointed, 1)  # the run stops after step 0: steps 1 and 2 never train
    assert call(scheduler.drop_untrained, 1) == 5
    stats = call(scheduler.stats, include_rollouts=True, check_ledger=True)
    assert stats.ledger.rollouts_by_state == {"buffered": 0, "scheduled": 0, "trained": 2, "dropped": 5}
    assert stats.ledger.dropped_by_reason == {"run_ended": 5}
    assert call(scheduler.get_shard, 1, 0, timeout_s=5) is None  # the stream ended
