"""The rollout ledger: legal transitions only, and its invariants."""

from __future__ import annotations

import pytest

from vgbs_ray.ledger import Ledger, LedgerError, RolloutState


def test_lifecycle_and_summary():
    ledger = Ledger()
    for rid in "abcd":
        ledger.accept_sample(rid)
    ledger.accept_sample("a")
    ledger.schedule(["a", "b"], 0)
    ledger.drop("c", "leftover")
    ledger.reject("x", "mask_length", "bad mask", 0)
    ledger.reject("a", "duplicate_sample", "again", 1)  # an event only: a stays scheduled
    assert ledger.state("a") is RolloutState.SCHEDULED and ledger.get("a").num_samples == 2
    assert ledger.train_step(0) == ("a", "b")
    ledger.check()
    summary = ledger.summary()
    assert summary.rollouts_by_state == {"buffered": 1, "scheduled": 0, "trained": 2, "dropped": 1, "rejected": 1}
    assert summary.dropped_by_reason == {"leftover": 1}
    assert summary.rejected_rollouts_by_rule == {"mask_length": 1}
    assert summary.rejected_samples_by_rule == {"mask_length": 1, "duplicate_sample": 1}


def test_rejected_rollout_may_be_accepted_after_a_corrected_sample():
    ledger = Ledger()
    ledger.reject("r", "mask_length", "bad", 0)
    ledger.accept_sample("r")
    assert ledger.state("r") is RolloutState.BUFFERED
    ledger.reject("r", "duplicate_sample", "again", 0)
    assert ledger.state("r") is RolloutState.BUFFERED  # never back to rejected once accepted
    ledger.check()


@pytest.mark.parametrize("illegal", ["train_twice", "schedule_twice", "step_reused", "drop_scheduled", "accept_trained"])
def test_illegal_transitions_raise(illegal):
    ledger = Ledger()
    ledger.accept_sample("a")
    ledger.accept_sample("b")
    ledger.schedule(["a"], 0)
    with pytest.raises(LedgerError):
        if illegal == "train_twice":
            ledger.train_step(0)
            ledger.train_step(0)
        elif illegal == "schedule_twice":
            ledger.schedule(["a"], 1)
        elif illegal == "step_reused":
            ledger.schedule(["b"], 0)
        elif illegal == "drop_scheduled":
            ledger.drop("a", "leftover")
        else:
            ledger.train_step(0)
            ledger.accept_sample("a")
    ledger.check()  # a refused transition changed nothing


def test_check_catches_a_disappeared_rollout():
    ledger = Ledger()
    ledger.accept_sample("a")
    del ledger._entries["a"]  # simulate a bug
    with pytest.raises(LedgerError, match="disappeared"):
        ledger.check()
