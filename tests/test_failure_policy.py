"""The job's failure policy, without Ray: restart while the budget lasts, stop on what a restart cannot cure;
the controller's `decide(state, event)` over typed states."""

from __future__ import annotations

import pytest

from vgbs_ray.errors import ConfigError
from vgbs_ray.failure_policy import (
    RECOVERABLE, ActionKind, ActorDied, FailureKind, FailureStatus, ProducerFailed, RecoveryDone,
    ReplacementFailed, RunEnding, RunPhase, RunState, TrainFailed, decide, make_decision,
)


def decide_train(kind: FailureKind, before: int, max_failures: int):
    return make_decision(FailureStatus(kind=kind, failures_before=before), max_failures)


@pytest.mark.parametrize("kind", sorted(RECOVERABLE))
def test_a_recoverable_failure_restarts_exactly_while_the_budget_lasts(kind):
    for max_failures in range(4):
        actions = [decide_train(kind, before, max_failures).kind for before in range(6)]
        assert actions == [ActionKind.RESTART_TRAIN_GROUP] * max_failures + [ActionKind.STOP] * (6 - max_failures)


def test_max_failures_zero_fails_fast_and_says_how_to_recover():
    decision = decide_train(FailureKind.RANK_DIED, 0, 0)
    assert decision.kind is ActionKind.STOP and "run.max_failures" in decision.reason


@pytest.mark.parametrize("kind", [k for k in FailureKind if k not in RECOVERABLE and k is not FailureKind.SCHEDULER_LOST])
def test_what_a_new_group_cannot_cure_stops_whatever_the_budget(kind):
    assert decide_train(kind, 0, 100).kind is ActionKind.STOP


def test_a_lost_scheduler_is_restored_while_the_budget_lasts_then_stops_naming_what_was_lost():
    for max_failures in range(4):
        actions = [decide_train(FailureKind.SCHEDULER_LOST, before, max_failures).kind for before in range(6)]
        assert actions == [ActionKind.RESTORE_SCHEDULER] * max_failures + [ActionKind.STOP] * (6 - max_failures)
    reason = decide_train(FailureKind.SCHEDULER_LOST, 2, 2).reason
    assert "buffered" in reason and "run.resume=true" in reason and "run.max_failures=2" in reason


def test_the_budget_message_names_the_setting():
    decision = decide_train(FailureKind.TIMEOUT, 2, 2)
    assert decision.kind is ActionKind.STOP and "failure 3" in decision.reason and "run.max_failures=2" in decision.reason


def test_bad_inputs_are_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="failures_before"):
        FailureStatus(kind=FailureKind.RANK_DIED, failures_before=-1)
    with pytest.raises(ConfigError, match="FailureKind"):
        FailureStatus(kind="rank_died", failures_before=0)
    with pytest.raises(ConfigError, match="max_failures"):
        make_decision(FailureStatus(kind=FailureKind.RANK_DIED, failures_before=0), -1)


def run(state: RunState, *events):
    """`decide` over `events` in order: the final state and every action."""
    actions = []
    for event in events:
        state, action = decide(state, event)
        actions.append(action)
    return state, actions


def test_one_budget_counts_train_and_scheduler_failures_together_and_each_replaced_actor_alone():
    state, actions = run(RunState(max_failures=2), TrainFailed(FailureKind.RANK_DIED), RecoveryDone(),
                         TrainFailed(FailureKind.SCHEDULER_LOST), RecoveryDone())
    assert [a.kind for a in actions] == [ActionKind.RESTART_TRAIN_GROUP, ActionKind.NONE,
                                         ActionKind.RESTORE_SCHEDULER, ActionKind.NONE]
    assert state.train_failures == 2 and state.phase is RunPhase.RUNNING
    # engines and producers count their own replacements, each index alone
    state, actions = run(state, ActorDied("engine", 0, "hung"), RecoveryDone(), ActorDied("engine", 0, "dead"),
                         RecoveryDone(), ActorDied("engine", 1, "dead"), RecoveryDone(), ActorDied("producer", 0),
                         RecoveryDone())
    assert [a.kind for a in actions if a.kind is not ActionKind.NONE] == [ActionKind.REPLACE_ENGINE] * 3 + [
        ActionKind.RESTART_PRODUCER]
    assert [a.index for a in actions if a.kind is not ActionKind.NONE] == [0, 0, 1, 0]
    assert dict(state.replacements) == {("engine", 0): 2, ("engine", 1): 1, ("producer", 0): 1}
    # the third train failure of either kind is past the budget: the run stops, and stays stopped
    stopped, (stop,) = run(state, TrainFailed(FailureKind.TIMEOUT))
    assert stop.kind is ActionKind.STOP and "failure 3" in stop.reason and "run.max_failures=2" in stop.reason
    assert stopped.phase is RunPhase.FAILED and stopped.failure == stop.reason and stopped.train_failures == 2
    assert [a.kind for a in run(stopped, ActorDied("producer", 1), RecoveryDone(), RunEnding())[1]] == [
        ActionKind.NONE] * 3


def test_past_its_budget_a_producer_is_given_up_and_an_engine_stops_the_run():
    state, (give_up,) = run(RunState(max_failures=1, replacements=((("producer", 3), 1),)), ActorDied("producer", 3))
    assert give_up.kind is ActionKind.GIVE_UP_PRODUCER and give_up.index == 3 and state.phase is RunPhase.RUNNING
    assert "producer 3 died and was replaced 1 times" in give_up.reason and "run.max_failures=1" in give_up.reason
    state, actions = run(RunState(max_failures=1), ActorDied("engine", 0, "dead"), RecoveryDone(),
                         ActorDied("engine", 0, "hung"))
    assert actions[-1].kind is ActionKind.STOP and state.phase is RunPhase.FAILED
    assert "engine 0 hung and was replaced 1 times" in state.failure


def test_a_failed_producer_or_a_replacement_that_did_not_start():
    state, (action,) = run(RunState(max_failures=5), ProducerFailed(2))
    assert action.kind is ActionKind.GIVE_UP_PRODUCER and action.index == 2 and state.replacements == ()
    state, actions = run(RunState(max_failures=5), ActorDied("producer", 1), ReplacementFailed("producer", 1, "boom"))
    assert [a.kind for a in actions] == [ActionKind.RESTART_PRODUCER, ActionKind.GIVE_UP_PRODUCER]
    assert state.phase is RunPhase.RUNNING
    state, actions = run(RunState(max_failures=5), ActorDied("engine", 1), ReplacementFailed("engine", 1, "no GPU"))
    assert actions[-1].kind is ActionKind.STOP and state.phase is RunPhase.FAILED and "no GPU" in state.failure


def test_while_the_producers_stop_none_is_restarted_and_at_the_end_no_engine_is_replaced():
    # restoring the scheduler stops every producer: one that dies meanwhile is given up, its budget untouched
    state, (restore, died) = run(RunState(max_failures=2), TrainFailed(FailureKind.SCHEDULER_LOST),
                                 ActorDied("producer", 0))
    assert restore.kind is ActionKind.RESTORE_SCHEDULER and state.phase is RunPhase.RESTORING_SCHEDULER
    assert died.kind is ActionKind.GIVE_UP_PRODUCER and state.replaced("producer", 0) == 0
    state, actions = run(RunState(max_failures=2), RunEnding(), ActorDied("producer", 0), ActorDied("engine", 0))
    assert state.phase is RunPhase.FINISHED
    assert [a.kind for a in actions] == [ActionKind.NONE, ActionKind.GIVE_UP_PRODUCER, ActionKind.NONE]
    assert state.replacements == ()


def test_a_budget_of_zero_replaces_nothing():
    state = RunState(max_failures=0)
    assert decide(state, ActorDied("producer", 3))[1].kind is ActionKind.GIVE_UP_PRODUCER
    assert decide(state, ActorDied("engine", 0))[1].kind is ActionKind.STOP
    assert decide(state, TrainFailed(FailureKind.RANK_DIED))[1].kind is ActionKind.STOP


def test_bad_states_and_events_are_refused_by_name():
    with pytest.raises(ConfigError, match="run.max_failures must be an integer >= 0"):
        RunState(max_failures=-1)
    with pytest.raises(ConfigError, match="RunPhase"):
        RunState(max_failures=1, phase="running")
    with pytest.raises(ConfigError, match="actor must be one of"):
        decide(RunState(max_failures=1), ActorDied("scheduler", 0))
