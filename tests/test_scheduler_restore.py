"""Resume across job restarts (issue 11): export_state at a step boundary, restore into a new scheduler.

The pure half (intake snapshot, SchedulerState) runs without Ray; the actor half kills a scheduler
and resumes a new one from its exported state, with global step numbers.
"""

from __future__ import annotations

import pickle

import pytest
import ray

from vgbs_ray.scheduler.types import SchedulerConfig
from vgbs_ray.scheduler.state import SchedulerState
from actors.scheduler_actor import create_scheduler
from tests.rollout_factory import rollout_rows, sample_row
from tests.scheduler_harness import call
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.errors import ConfigError, SchedulerStateError
from vgbs_ray.scheduler.intake import IntakeConfig, IntakeSnapshot, RolloutIntake
from vgbs_ray.scheduler.ledger import Ledger
from vgbs_ray.sample import Sample


def _samples(rows):
    return [Sample.from_dict(r) for r in rows]


def test_intake_snapshot_restores_ready_waiting_open_and_group_state():
    ledger = Ledger()
    intake = RolloutIntake(IntakeConfig(), ledger)
    rows = rollout_rows("whole", 2) + rollout_rows("partial", 3)[:2]
    rows += [sample_row("g-a", 0, size=1, advantage=None, reward=1.0, group=("g", 3)),   # waits for its group
             sample_row("g-b", 0, size=1, advantage=None, reward=0.0, group=("g", 3))]
    rows += [sample_row("h-a", 0, size=1, advantage=None, reward=1.0, group=("h", 1))]  # its group closes at once
    out = intake.ingest(_samples(rows), now=0.0)
    assert not out.rejections
    snapshot = intake.snapshot()
    assert [rid for rid, _ in snapshot.ready] == ["whole", "h-a"]
    assert [rid for rid, _ in snapshot.waiting] == ["g-a", "g-b"]
    assert [(rid, expected, [s.sample_index for s in ss]) for rid, expected, ss in snapshot.open] == [("partial", 3, [0, 1])]
    snapshot = pickle.loads(pickle.dumps(snapshot))

    fresh_ledger = Ledger()
    restored = RolloutIntake(IntakeConfig(), fresh_ledger)
    restored.restore(snapshot, now=5.0)
    assert (restored.buffered_samples, restored.buffered_tokens) == (intake.buffered_samples, intake.buffered_tokens)
    assert fresh_ledger.summary().rollouts_by_state["buffered"] == 5
    again = restored.ingest(_samples([rollout_rows("partial", 3)[0], rollout_rows("whole", 2)[1],
                                      sample_row("h-b", 0, size=1, advantage=None, group=("h", 1))]), now=6.0)
    assert [(r.rollout_id, r.rule) for r in again.rejections] == [
        ("partial", "duplicate_sample"), ("whole", "already_complete"), ("h-b", "group_closed")]
    done = restored.ingest(_samples([rollout_rows("partial", 3)[2],
                                     sample_row("g-c", 0, size=1, advantage=None, reward=0.5, group=("g", 3))]), now=7.0)
    assert done.completed == ["partial", "g-c"] and not done.rejections
    taken = restored.take_oldest(10)
    assert [r.rollout_id for r in taken] == ["whole", "h-a", "partial", "g-a", "g-b", "g-c"]
    assert {r.rollout_id: r.samples[0].advantage for r in taken[3:]}["g-a"] > 0  # the group resolved with all three
    fresh_ledger.check()


def test_scheduler_state_is_validated_at_construction():
    snap = IntakeSnapshot(ready=(("a", ()), ("a", ())))
    with pytest.raises(ConfigError, match="'a' twice"):
        SchedulerState(next_step=2, settled=b"", intake=snap, policy_version=2)
    with pytest.raises(ConfigError, match="policy_version 1 != next_step 2"):
        SchedulerState(next_step=2, settled=b"", intake=IntakeSnapshot(), policy_version=1)
    with pytest.raises(ConfigError, match="next_step must be an int >= 0"):
        SchedulerState(next_step=-1, settled=b"", intake=IntakeSnapshot(), policy_version=-1)


@pytest.fixture
def schedulers(ray_session):
    made = []

    def make(name: str, restore=None, **cfg):
        handle = create_scheduler(SchedulerConfig(batch=BatchConfig(global_batch_size=2, max_tokens_per_gpu=64), **cfg),
                                  name=name, restore=restore)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        ray.kill(handle)


def _step_ids(scheduler, step: int, *, ack: bool) -> list:
    ref = call(scheduler.get_shard, step, 0, timeout_s=30)
    shard = ray.get(ref.ref, timeout=30)
    ids = list(call(scheduler.step_record, step).rollout_ids)  # the order the step took them (shards: layout order)
    assert ref.step == shard.step == step and set(shard.rollout_ids) == set(ids)
    if ack:
        call(scheduler.ack_ranks, step, {0: None})
    return ids


def test_export_then_restore_resumes_with_global_steps_and_exactly_once(schedulers):
    old = schedulers("sched-export")
    call(old.register_train_group, ParallelConfig(dp_size=1))
    call(old.submit, [r for i in range(7) for r in rollout_rows(f"e{i}", 1)])
    call(old.submit, rollout_rows("half", 2)[:1])  # partly received at the checkpoint
    trained = {step: _step_ids(old, step, ack=True) for step in range(2)}
    in_flight = _step_ids(old, 2, ack=False)  # step 2 emitted, not trained when the job stops
    with pytest.raises(SchedulerStateError, match="step 2 is not acknowledged"):
        call(old.export_state, 3)
    with pytest.raises(SchedulerStateError, match="steps emitted so far"):
        call(old.export_state, 9)
    state = call(old.export_state, 2)
    before = call(old.stats, include_rollouts=True)
    assert len(pickle.dumps(state)) < 20_000
    assert state.next_step == state.policy_version == 2
    assert call(old.stats, include_rollouts=True).rollout_states == before.rollout_states  # export changed nothing
    buffered = [f"e{i}" for i in range(7) if f"e{i}" not in {*trained[0], *trained[1], *in_flight}]
    assert state.untrained_rollout_ids[:2] == in_flight and state.untrained_rollout_ids[2:] == buffered
    assert call(old.admit, ["e0", "half", "never"], 0).known == ("e0", "half")  # what a resumed producer skips
    ray.kill(old)

    new = schedulers("sched-restored", restore=pickle.loads(pickle.dumps(state)))
    assert call(new.admit, [*trained[0], "half", "never"], 0).known == (*trained[0], "half")
    result = call(new.submit, rollout_rows(trained[0][0], 1) + rollout_rows(in_flight[0], 1) + rollout_rows("half", 2)[:1])
    assert [(r.rollout_id, r.rule) for r in result.rejected] == [
        (trained[0][0], "already_scheduled"), (in_flight[0], "already_complete"), ("half", "duplicate_sample")]
    assert "trained in step 0" in result.rejected[0].message
    assert result.accepted == 0
    call(new.submit, rollout_rows("half", 2)[1:] + [r for i in range(4) for r in rollout_rows(f"n{i}", 1)])
    call(new.register_train_group, ParallelConfig(dp_size=1))
    with pytest.raises(SchedulerStateError, match="released"):
        call(new.get_shard, 1, 0, timeout_s=5)  # steps before the checkpoint are not this scheduler's
    assert _step_ids(new, 2, ack=True) == in_flight  # the same rollouts, in the same order, same step number
    later = [rid for step in range(3, 6) for rid in _step_ids(new, step, ack=True)]
    assert later == buffered + ["half", "n0", "n1", "n2", "n3"]  # restored ones first, then the new pushes
    assert call(new.step_record, 5).trained
    stats = call(new.stats, include_rollouts=True, check_ledger=True)
    assert stats.steps_emitted == stats.steps_trained == 6
    assert stats.ledger.rollouts_by_state == {"buffered": 0, "scheduled": 0, "trained": 12, "dropped": 0}
    assert stats.ledger.rejected_samples_by_rule == {"already_scheduled": 1, "already_complete": 1, "duplicate_sample": 1}
    assert {rid: s[1] for rid, s in stats.rollout_states.items()}[trained[1][0]] == 1


def test_export_with_retention_puts_trained_steps_after_the_checkpoint_back(schedulers):
    old = schedulers("sched-export-retain", retain_until_checkpoint=True)
    call(old.register_train_group, ParallelConfig(dp_size=1))
    call(old.submit, [r for i in range(6) for r in rollout_rows(f"k{i}", 1)])
    steps = {step: _step_ids(old, step, ack=True) for step in range(3)}  # all trained, none checkpointed
    state = call(old.export_state, 1)  # the checkpoint holds step 0 only
    assert state.untrained_rollout_ids == steps[1] + steps[2]
    assert call(old.stats).ledger.rollouts_by_state["trained"] == 6  # the live run keeps its retained steps
    plain = schedulers("sched-export-plain")
    call(plain.register_train_group, ParallelConfig(dp_size=1))
    call(plain.submit, [r for i in range(4) for r in rollout_rows(f"j{i}", 1)])
    for step in range(2):
        _step_ids(plain, step, ack=True)
    with pytest.raises(SchedulerStateError, match="retain_until_checkpoint"):
        call(plain.export_state, 1)
    new = schedulers("sched-import-retain", restore=state)
    call(new.register_train_group, ParallelConfig(dp_size=1))
    assert [_step_ids(new, step, ack=True) for step in (1, 2)] == [steps[1], steps[2]]
    call(new.stats, check_ledger=True)


def _versioned(rid, version: int) -> list[dict]:
    return rollout_rows(rid, 1, policy_version_min=version, policy_version_max=version)


def test_restore_under_staleness_replays_the_exported_step_before_older_rollouts(schedulers):
    """Oldest-first fill would put "r" (version 0) into step 1; the replayed step 1 is the step that
    was emitted, and the window's version continues at the exported step."""
    old = schedulers("sched-export-stale", max_staleness=2)
    call(old.register_train_group, ParallelConfig(dp_size=1))
    call(old.submit, _versioned("x0", 0) + _versioned("x1", 0))
    assert _step_ids(old, 0, ack=True) == ["x0", "x1"]
    call(old.submit, _versioned("p", 1) + _versioned("q", 1))
    assert _step_ids(old, 1, ack=False) == ["p", "q"]
    call(old.submit, _versioned("r", 0))
    state = call(old.export_state, 1)
    assert state.untrained_rollout_ids == ["p", "q", "r"] and state.replay_rollouts == 2
    ray.kill(old)
    new = schedulers("sched-import-stale", restore=state, max_staleness=2)
    assert call(new.stats).staleness_pending == 3  # restored rollouts fill the next steps before new admissions
    assert call(new.admit, ["p", "late"], 1).known == ("p",)
    call(new.register_train_group, ParallelConfig(dp_size=1))
    assert _step_ids(new, 1, ack=True) == ["p", "q"]
    call(new.submit, _versioned("late", 1))
    assert _step_ids(new, 2, ack=True) == ["r", "late"]  # r lags 2 = max_staleness: still trained
    record = call(new.step_record, 2)
    assert (record.policy_version, record.staleness_max) == (2, 2)
    stats = call(new.stats, check_ledger=True)
    assert (stats.staleness_pending, stats.staleness_in_flight, stats.policy_version) == (0, 0, 3)
