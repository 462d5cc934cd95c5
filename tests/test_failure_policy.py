"""The job's failure policy, without Ray: restart while the budget lasts, stop on what a restart cannot cure."""

from __future__ import annotations

import pytest

from vgbs_ray.errors import ConfigError
from vgbs_ray.failure_policy import (
    RECOVERABLE, FailureAction, FailureBudget, FailureKind, FailureStatus, make_decision,
)


def decide(kind: FailureKind, before: int, max_failures: int):
    return make_decision(FailureStatus(kind=kind, failures_before=before), max_failures)


@pytest.mark.parametrize("kind", sorted(RECOVERABLE))
def test_a_recoverable_failure_restarts_exactly_while_the_budget_lasts(kind):
    for max_failures in range(4):
        actions = [decide(kind, before, max_failures).action for before in range(6)]
        assert actions == [FailureAction.RESTART] * max_failures + [FailureAction.STOP] * (6 - max_failures)


def test_max_failures_zero_fails_fast_and_says_how_to_recover():
    decision = decide(FailureKind.RANK_DIED, 0, 0)
    assert decision.action is FailureAction.STOP and "run.max_failures" in decision.reason


@pytest.mark.parametrize("kind", [k for k in FailureKind if k not in RECOVERABLE and k is not FailureKind.SCHEDULER_LOST])
def test_what_a_new_group_cannot_cure_stops_whatever_the_budget(kind):
    assert decide(kind, 0, 100).action is FailureAction.STOP


def test_a_lost_scheduler_is_restored_while_the_budget_lasts_then_stops_naming_what_was_lost():
    for max_failures in range(4):
        actions = [decide(FailureKind.SCHEDULER_LOST, before, max_failures).action for before in range(6)]
        assert actions == [FailureAction.RESTORE] * max_failures + [FailureAction.STOP] * (6 - max_failures)
    reason = decide(FailureKind.SCHEDULER_LOST, 2, 2).reason
    assert "buffered" in reason and "run.resume=true" in reason and "run.max_failures=2" in reason


def test_the_budget_message_names_the_setting():
    decision = decide(FailureKind.TIMEOUT, 2, 2)
    assert decision.action is FailureAction.STOP and "failure 3" in decision.reason and "run.max_failures=2" in decision.reason


def test_bad_inputs_are_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="failures_before"):
        FailureStatus(kind=FailureKind.RANK_DIED, failures_before=-1)
    with pytest.raises(ConfigError, match="FailureKind"):
        FailureStatus(kind="rank_died", failures_before=0)
    with pytest.raises(ConfigError, match="max_failures"):
        make_decision(FailureStatus(kind=FailureKind.RANK_DIED, failures_before=0), -1)


def test_one_budget_counts_train_and_scheduler_failures_together_and_each_replaced_actor_alone():
    budget = FailureBudget(max_failures=2)
    assert budget.decide_train_failure(FailureKind.RANK_DIED).action is FailureAction.RESTART
    assert budget.decide_train_failure(FailureKind.SCHEDULER_LOST).action is FailureAction.RESTORE
    stop = budget.decide_train_failure(FailureKind.TIMEOUT)  # the third of either kind: past the budget
    assert stop.action is FailureAction.STOP and budget.train_failures == 2
    assert budget.decide_train_failure(FailureKind.NO_SHARD).action is FailureAction.STOP  # never curable
    for _ in range(2):
        assert budget.decide_replacement("engine", 0, "hung").action is FailureAction.RESTART
    refused = budget.decide_replacement("engine", 0, "died")
    assert refused.action is FailureAction.STOP and "engine 0 died and was replaced 2 times" in refused.reason
    assert "run.max_failures=2" in refused.reason
    # another engine, and a producer with the same index, have budgets of their own
    assert budget.decide_replacement("engine", 1, "died").action is FailureAction.RESTART
    assert budget.decide_replacement("producer", 0, "died").action is FailureAction.RESTART
    assert budget.replacements == {("engine", 0): 2, ("engine", 1): 1, ("producer", 0): 1}
    with pytest.raises(ConfigError, match="actor must be one of"):
        budget.decide_replacement("scheduler", 0, "died")
    with pytest.raises(ConfigError, match="run.max_failures must be an integer >= 0"):
        FailureBudget(max_failures=-1)


def test_a_budget_of_zero_replaces_nothing():
    budget = FailureBudget(max_failures=0)
    assert budget.decide_replacement("producer", 3, "died").action is FailureAction.STOP
    assert budget.decide_train_failure(FailureKind.RANK_DIED).action is FailureAction.STOP
