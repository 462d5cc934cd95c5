"""The job's failure policy, without Ray: restart while the budget lasts, stop on what a restart cannot cure."""

from __future__ import annotations

import pytest

from vgbs_ray.errors import ConfigError
from vgbs_ray.failure_policy import (
    RECOVERABLE, FailureAction, FailureKind, FailureStatus, make_decision,
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
