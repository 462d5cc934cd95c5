"""The scheduler's core without Ray: ledger, rewind, restore and never-stall properties in milliseconds.

`drive` plays the SchedulerActor's emitter loop synchronously (next action, carry it out, repeat
until the core says wait), with `plan_step` for the layout and the step number standing in for
where the shards are; everything else is the real `SchedulerCore`.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.rollout_factory import rollout_rows, sample_row
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.errors import SchedulerStateError
from vgbs_ray.scheduler.core import SchedulerCore
from vgbs_ray.scheduler.policy import DropStale, EmitFullStep, FlushRequest, MaxWaitFlush, RunFlush, WaitFor
from vgbs_ray.scheduler.types import SchedulerConfig, StepRecord
from vgbs_ray.scheduler.stepping import plan_step

END = FlushRequest("end_of_input", end_of_input=True)
FLUSH = FlushRequest("flush", end_of_input=False)


def make_core(gbs: int = 4, dp: int = 2, *, leftover: str = "partial", restore=None, **config) -> SchedulerCore:
    core = SchedulerCore(SchedulerConfig(batch=BatchConfig(global_batch_size=gbs, max_tokens_per_gpu=64,
                                                           leftover=leftover), **config), restore=restore)
    core.register(ParallelConfig(dp_size=dp))
    return core


def publish(core: SchedulerCore, rollouts, trigger: str, now: float) -> StepRecord:
    planned = plan_step(rollouts, step=core.next_step, parallel=core.parallel, batch=core.config.batch)
    return core.publish(rollouts, planned, where=[core.next_step] * len(planned.shards), trigger=trigger,
                        triggered_at=now, now=now)


def drive(core: SchedulerCore, flushes: list[FlushRequest] | None = None, now: float = 0.0) -> list[StepRecord]:
    """The actor's emitter loop until the core's next action is a wait; returns the steps it published."""
    flushes = flushes if flushes is not None else []
    published = []
    for _ in range(10_000):
        action = core.next_action(now=now, flush_requests=flushes)
        if isinstance(action, WaitFor):
            return published
        if isinstance(action, DropStale):
            core.drop_stale(action.rollout_ids)
        elif isinstance(action, EmitFullStep):
            published.append(publish(core, core.take(action.rollout_ids), "full", now))
        else:
            request = flushes.pop(action.index) if isinstance(action, RunFlush) else FlushRequest("max_wait", False)
            assert isinstance(action, (RunFlush, MaxWaitFlush))
            for rollouts, trigger in core.flush(request, []):
                published.append(publish(core, rollouts, trigger, now))
    raise AssertionError("the core never settled on a wait: its decisions spin")


def ack_all(core: SchedulerCore, records) -> None:
    for record in records:
        assert core.ack(record.step, {rank: {"loss": (1.0, 1.0)} for rank in range(core.parallel.dp_size)})


def push(core: SchedulerCore, ids, samples_each: int = 2, now: float = 0.0) -> None:
    for rid in ids:
        out = core.ingest(rollout_rows(rid, samples_each), now=now)
        assert out.accepted == samples_each and not out.rejections


def test_full_steps_form_in_arrival_order_and_acks_release_them():
    core = make_core(gbs=4)
    push(core, [f"r{i}" for i in range(10)])
    steps = drive(core)
    assert [s.rollout_ids for s in steps] == [("r0", "r1", "r2", "r3"), ("r4", "r5", "r6", "r7")]
    assert core.next_step == 2 and core.intake.num_ready == 2
    assert core.ack(0, {0: {}}) is False and 0 in core.slots          # one rank of two
    with pytest.raises(SchedulerStateError, match="rank 0 acknowledged twice"):
        core.ack(0, {0: {}})
    assert core.ack(0, {1: {}}) is True and 0 not in core.slots
    assert core.stats(check_ledger=True).steps_trained == 1


def test_end_of_input_flushes_a_partial_step_and_drops_incomplete_rollouts():
    core = make_core(gbs=4)
    push(core, ["a", "b", "c"])
    core.ingest([sample_row("open", 0, size=3)], now=0.0)              # 1 of 3 samples: never completes
    core.input_closed = True
    steps = drive(core, [END])
    assert [(s.rollout_ids, s.partial, s.trigger) for s in steps] == [(("a", "b", "c"), True, "end_of_input")]
    assert core.ended and [rid for rid, *_ in core.stats().incomplete_rollouts] == ["open"]
    assert core.stats(check_ledger=True).ledger.dropped_by_reason == {"incomplete_rollout": 1}


def test_a_rewind_trains_the_same_steps_again_in_the_same_order():
    core = make_core(gbs=3, retain_until_checkpoint=True)
    push(core, [f"r{i}" for i in range(9)])
    first = drive(core)
    ack_all(core, first)
    core.checkpointed(1)
    assert len(core.rewind(1)) == 6
    again = drive(core)
    assert [s.rollout_ids for s in again] == [s.rollout_ids for s in first[1:]]
    assert [s.step for s in again] == [1, 2]
    ack_all(core, again)
    states = core.stats(include_rollouts=True, check_ledger=True).rollout_states
    assert sorted(step for _, step, _ in states.values()) == [0] * 3 + [1] * 3 + [2] * 3
    released = make_core(gbs=3)                                         # without retain: trained steps are gone
    push(released, ["x", "y", "z"])
    ack_all(released, drive(released))
    with pytest.raises(SchedulerStateError, match="released"):
        released.rewind(0)


def test_a_restored_core_continues_the_step_numbers_and_replays_the_untrained_steps_first():
    core = make_core(gbs=2, retain_until_checkpoint=True)
    push(core, [f"r{i}" for i in range(7)])
    steps = drive(core)                                                 # 3 steps, r6 left over
    ack_all(core, steps[:2])
    state = core.export_state(2)
    restored = make_core(gbs=2, restore=state)
    assert restored.next_step == 2 and restored.chooser.steps_formed == 2
    push(restored, ["late"])
    replayed = drive(restored)
    assert [s.rollout_ids for s in replayed] == [steps[2].rollout_ids, ("r6", "late")]
    assert [s.step for s in replayed] == [2, 3]
    assert restored.stats(check_ledger=True).ledger.rollouts_by_state["trained"] == 4
    again = restored.ingest(rollout_rows("r0", 2), now=0.0)              # trained before the checkpoint
    assert again.accepted == 0 and {r.rule for r in again.rejections} == {"already_scheduled"}


def test_export_refuses_a_step_not_acknowledged_yet():
    core = make_core(gbs=2)
    push(core, ["a", "b", "c", "d"])
    steps = drive(core)
    ack_all(core, steps[:1])
    with pytest.raises(SchedulerStateError, match="step 1 is not acknowledged"):
        core.export_state(2)


def test_the_staleness_window_holds_a_full_step_for_a_last_chance_rollout_in_flight():
    core = make_core(gbs=3, max_staleness=0)
    assert core.admit(["slow"], engine_version=0).admit
    assert core.admit(["a", "b"], engine_version=0).admit
    assert not core.admit(["late"], engine_version=0).admit              # step 0 is full of admissions
    push(core, ["a", "b", "c"])                                          # c was never admitted: buffered anyway
    assert isinstance(core.next_action(now=0.0), WaitFor)               # "slow" has its last chance in step 0
    core.abandon(["slow"])
    assert [s.rollout_ids for s in drive(core)] == [("a", "b", "c")]


@settings(max_examples=60, deadline=None)
@given(
    gbs=st.integers(1, 6), dp=st.sampled_from([1, 2, 3]), leftover=st.sampled_from(["partial", "drop", "carry"]),
    sizes=st.lists(st.integers(1, 3), min_size=0, max_size=25), open_rollouts=st.integers(0, 2),
    acks_between=st.booleans(), max_staleness=st.one_of(st.none(), st.integers(0, 2)),
)
def test_every_rollout_ends_trained_or_dropped_with_a_reason_and_the_stream_ends(
        gbs, dp, leftover, sizes, open_rollouts, acks_between, max_staleness):
    """Never stalls: after the end of input every complete rollout is in a step or dropped with a reason,
    every incomplete one is dropped, the stream has ended, and the ledger's invariants hold."""
    if max_staleness is not None and gbs < 2:
        gbs = 2  # groups of 1 need room for one rollout per step (check_admission_config)
    core = make_core(gbs=max(gbs, dp), dp=dp, leftover=leftover, max_staleness=max_staleness)
    published = []
    for index, size in enumerate(sizes):
        rid = f"r{index}"
        if max_staleness is not None:
            assert core.admit([rid], engine_version=core.next_step).admit
        version = {} if max_staleness is None else dict(policy_version_min=core.next_step,
                                                          policy_version_max=core.next_step)
        core.ingest(rollout_rows(rid, size, **version), now=float(index))
        published += drive(core, now=float(index))
        if acks_between:
            ack_all(core, [s for s in published if s.step in core.slots])
    for index in range(open_rollouts):
        core.ingest([sample_row(f"open{index}", 0, size=2)], now=0.0)
    core.input_closed = True
    published += drive(core, [END])
    assert core.ended
    stats = core.stats(include_rollouts=True, check_ledger=True)
    in_steps = [rid for s in published for rid in s.rollout_ids]
    assert len(in_steps) == len(set(in_steps))                          # a rollout is in one step at most
    for rid, (state, step, reason) in stats.rollout_states.items():
        if rid in in_steps:
            assert state in ("scheduled", "trained", "settled") and step is not None
        else:
            assert state == "dropped" and reason, (rid, state)
    assert set(stats.rollout_states) == {f"r{i}" for i in range(len(sizes))} | {f"open{i}" for i in range(open_rollouts)}
    assert all(s.num_rollouts <= core.config.batch.global_batch_size for s in published)
    assert isinstance(core.next_action(now=1e9, flush_requests=[]), WaitFor)


def test_a_held_step_stops_waiting_for_a_slow_last_chance_rollout_after_max_hold_s(caplog):
    """A rollout in flight on its last chance holds a full step at most scheduler.max_hold_s after the step could
    form; then the step forms without it (named in a warning), and when it ends with its version-0 tokens it is
    too old for step 1 and dropped as stale."""
    core = make_core(gbs=3, max_staleness=0, max_hold_s=30.0)
    assert core.admit(["slow"], engine_version=0).admit
    assert core.admit(["a", "b"], engine_version=0).admit
    for index, rid in enumerate(["a", "b", "c"]):
        core.ingest(rollout_rows(rid, 1, policy_version_min=0, policy_version_max=0), now=float(index))
    waiting = core.next_action(now=12.0)                                  # the step could form at t=2
    assert isinstance(waiting, WaitFor) and waiting.timeout_s == pytest.approx(20.0)
    with caplog.at_level("WARNING"):
        steps = drive(core, now=32.0)
    assert [s.rollout_ids for s in steps] == [("a", "b", "c")]
    assert "step 0 waited 30.0 s (scheduler.max_hold_s=30.0) for 1 rollout(s) in flight on their last chance ['slow']" \
        in caplog.text
    core.ingest(rollout_rows("slow", 1, policy_version_min=0, policy_version_max=0), now=40.0)
    drive(core, now=40.0)
    assert core.stats(check_ledger=True).ledger.dropped_by_reason == {"stale": 1}
