"""StalenessWindow: the scheduler's staleness state (the timing model in test_staleness drives it at random)."""

from __future__ import annotations

import pytest

from vgbs_ray.scheduler.staleness_window import StalenessWindow


def test_admission_counts_pending_until_formed_or_discarded():
    window = StalenessWindow(gbs=4, max_staleness=0, steps_formed=2)
    assert window.try_admit(["a", "b", "c"], engine_version=2).admit
    assert not window.try_admit(["d", "e"], engine_version=2).admit  # would straddle into step 3
    assert (window.pending_rollouts, window.in_flight_rollouts) == (3, 3)
    window.discard(["c"])  # e.g. a failed rollout: its room is free again
    assert window.try_admit(["d", "e"], engine_version=2).admit
    window.finished("a")
    assert (window.pending_rollouts, window.in_flight_rollouts) == (4, 3)
    with pytest.raises(ValueError, match="admitted twice"):
        window.try_admit(["a"], engine_version=2)
    with pytest.raises(ValueError, match="admitted twice"):
        window.try_admit(["x", "x"], engine_version=2)


def test_a_step_waits_for_last_chance_rollouts_then_takes_oldest_first():
    window = StalenessWindow(gbs=2, max_staleness=1, steps_formed=5)
    assert window.try_admit(["slow"], engine_version=4).admit  # its last chance: step 5
    buffered = {"new1": 5, "new2": 5, "old": 4}
    plan = window.next_step(buffered)
    assert plan.take == [] and plan.waiting_for == 1
    window.finished("slow")
    buffered["slow"] = 4
    plan = window.next_step(buffered)
    assert plan.take == ["old", "slow"] and plan.waiting_for == 0 and plan.stale == []
    window.step_formed(plan.take)
    assert window.steps_formed == 6 and window.pending_rollouts == 0


def test_stale_rollouts_are_listed_and_partial_steps_need_a_flush():
    window = StalenessWindow(gbs=3, max_staleness=1, steps_formed=7)
    buffered = {"ancient": 4, "fresh": 7, "synthetic": None}
    plan = window.next_step(buffered)
    assert plan.take == [] and plan.stale == ["ancient"]  # 2 fresh < gbs 3
    flushed = window.next_step(buffered, allow_partial=True)
    assert flushed.take == ["fresh", "synthetic"] and flushed.stale == ["ancient"]
    assert window.next_step({"ancient": 4}, allow_partial=True).take == []  # nothing fresh: no empty step


def test_rollouts_that_were_never_admitted_take_part_like_any_other():
    window = StalenessWindow(gbs=2, max_staleness=0)
    window.finished("pushed")  # never admitted: nothing to forget
    plan = window.next_step({"pushed": None, "also": 0})
    assert plan.take == ["also", "pushed"]
    window.step_formed(plan.take)
    assert window.steps_formed == 1 and window.pending_rollouts == 0


def test_a_rollout_past_its_last_chance_is_not_waited_for():
    window = StalenessWindow(gbs=1, max_staleness=0, steps_formed=3)
    assert window.try_admit(["late"], engine_version=3).admit
    window.step_formed([])  # a step formed without it (e.g. a partial flush): "late" can only be stale now
    assert window.next_step({"other": 4}).take == ["other"]


def test_bad_construction_is_named():
    with pytest.raises(ValueError, match="gbs >= 1"):
        StalenessWindow(gbs=0, max_staleness=0)


def test_restored_pending_and_end_of_input_discards():
    window = StalenessWindow(gbs=2, max_staleness=0, steps_formed=4)
    window.add_pending(["restored"])  # a restored scheduler's untrained rollout fills step 4 first
    assert not window.try_admit(["a", "b"], engine_version=4).admit  # would land in step 5
    assert window.try_admit(["a"], engine_version=4).admit and window.is_pending("restored")
    assert window.next_step({"x": 4, "y": 4}).waiting_for == 1
    assert window.next_step({"x": 4, "y": 4}, wait_for_in_flight=False).take == ["x", "y"]
    assert window.discard_in_flight() == ["a"]
    assert (window.pending_rollouts, window.in_flight_rollouts) == (1, 0)


def test_a_dead_producers_rollouts_in_flight_are_no_longer_waited_for_and_can_be_admitted_again():
    window = StalenessWindow(gbs=4, max_staleness=0)
    assert window.try_admit(["a0", "a1"], 0, owner=0).admit
    assert window.try_admit(["b0", "b1"], 0, owner=1).admit
    window.finished("a1")  # buffered: not in flight any more
    assert window.next_step({"a1": 0}).waiting_for == 3
    assert sorted(window.discard_owner(0)) == ["a0"]  # only what producer 0 had in flight
    assert window.next_step({"a1": 0}).waiting_for == 2 and window.pending_rollouts == 3
    assert window.try_admit(["a0"], 0, owner=0).admit  # its restart admits it again
