"""The scheduler's decisions, without Ray: what next, and whom to admit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgbs_ray.scheduler.policy import (
    EmitFullStep, FlushRequest, MaxWaitFlush, RunFlush, SchedulerView, WaitFor, admit_new_rollouts, next_action,
)
from vgbs_ray.scheduler.step_choice import StepChoice

FLUSH = FlushRequest("flush", end_of_input=False)
END = FlushRequest("end_of_input", end_of_input=True)


FULL = "a full step of the first global_batch_size ready rollouts"


def view(num_ready: int = 0, num_stale: int = 0, waiting_for: int = 0, **overrides) -> SchedulerView:
    """A view whose chooser found `num_ready` fresh rollouts (taken as a full step when there are enough and
    no in-flight rollout has its last chance), `num_stale` stale ones, and `waiting_for` such waits."""
    base = dict(registered=True, global_batch_size=4, leftover="partial", flush_requests=(),
                active_datasets=0, oldest_ready_age_s=None, max_wait_s=None)
    base.update(overrides)
    fresh = [f"r{i}" for i in range(num_ready)]
    gbs = base["global_batch_size"]
    take = fresh[:gbs] if num_ready >= gbs and not waiting_for else []
    return SchedulerView(choice=StepChoice(take, [f"stale{i}" for i in range(num_stale)], waiting_for, num_ready), **base)


@pytest.mark.parametrize("state, expected", [
    (dict(num_ready=4), FULL),
    (dict(num_ready=9, flush_requests=(FLUSH,)), FULL),                      # full steps before flushes
    (dict(num_ready=4, registered=False), WaitFor(None)),                               # layouts need the train group
    (dict(num_ready=3), WaitFor(None)),
    (dict(num_ready=3, flush_requests=(FLUSH,)), RunFlush(0)),
    (dict(num_ready=0, flush_requests=(FLUSH,), registered=False), RunFlush(0)),       # nothing to lay out
    (dict(num_ready=3, flush_requests=(FLUSH,), registered=False), WaitFor(None)),     # a partial step needs a layout
    (dict(num_ready=3, flush_requests=(FLUSH,), registered=False, leftover="drop"), RunFlush(0)),
    (dict(num_ready=4, flush_requests=(FLUSH,), registered=False, leftover="drop"), WaitFor(None)),  # never drop a step
    (dict(flush_requests=(END,), active_datasets=1), WaitFor(None)),                    # a stream still brings input
    (dict(flush_requests=(END, FLUSH), active_datasets=1), RunFlush(1)),
    (dict(num_ready=1, oldest_ready_age_s=0.5, max_wait_s=2.0), WaitFor(1.5)),
    (dict(num_ready=1, oldest_ready_age_s=2.0, max_wait_s=2.0), MaxWaitFlush()),
    (dict(num_ready=1, oldest_ready_age_s=9.0, max_wait_s=2.0, leftover="carry"), WaitFor(None)),
    (dict(num_ready=1, oldest_ready_age_s=9.0, max_wait_s=2.0, registered=False), WaitFor(None)),
])
def test_next_action(state, expected):
    action = next_action(view(**state))
    if expected is FULL:
        assert action == EmitFullStep([f"r{i}" for i in range(4)])
    else:
        assert action == expected


@settings(max_examples=300, deadline=None)
@given(
    registered=st.booleans(), num_ready=st.integers(0, 20), gbs=st.integers(1, 8),
    leftover=st.sampled_from(["partial", "drop", "carry"]),
    requests=st.lists(st.sampled_from([FLUSH, END]), max_size=3), datasets=st.integers(0, 2),
    age=st.one_of(st.none(), st.floats(0, 10)), max_wait=st.one_of(st.none(), st.floats(0.1, 5)),
)
def test_every_action_is_allowed_by_the_state(registered, num_ready, gbs, leftover, requests, datasets, age, max_wait):
    """No action the state cannot carry out: so the loop never spins on an impossible one."""
    state = view(registered=registered, num_ready=num_ready, global_batch_size=gbs, leftover=leftover,
                 flush_requests=tuple(requests), active_datasets=datasets,
                 oldest_ready_age_s=age if num_ready else None, max_wait_s=max_wait)
    action = next_action(state)
    if isinstance(action, EmitFullStep):
        assert registered and num_ready >= gbs
    elif isinstance(action, RunFlush):
        request = requests[action.index]
        assert not (request.end_of_input and datasets)
        assert registered or (num_ready < gbs and (leftover != "partial" or num_ready == 0))
        assert all(r.end_of_input and datasets for r in requests[:action.index])  # oldest runnable first
    elif isinstance(action, MaxWaitFlush):
        assert registered and leftover != "carry" and num_ready and age >= max_wait
    else:
        assert action.timeout_s is None or action.timeout_s > 0
        assert not (registered and num_ready >= gbs)


def test_admission():
    assert admit_new_rollouts(steps_in_flight=3, max_steps_ahead=2, buffer_has_room=True, buffer_reason="")[0] is False
    ok, why = admit_new_rollouts(steps_in_flight=2, max_steps_ahead=2, buffer_has_room=False, buffer_reason="buffer_full: x")
    assert not ok and why == "buffer_full: x"
    assert admit_new_rollouts(steps_in_flight=9, max_steps_ahead=None, buffer_has_room=True, buffer_reason="") == (True, "")


def test_stale_rollouts_are_dropped_first_and_a_last_chance_wait_holds_a_full_step():
    from vgbs_ray.scheduler.policy import DropStale

    assert next_action(view(num_ready=4, num_stale=1)) == DropStale(["stale0"])
    assert isinstance(next_action(view(num_ready=4, num_stale=1, registered=False)), DropStale)  # needs no layout
    assert isinstance(next_action(view(num_ready=4, waiting_for=1)), WaitFor)
    assert isinstance(next_action(view(num_ready=4, waiting_for=1, flush_requests=(FLUSH,))), RunFlush)  # never stalls


def test_window_replays_put_back_rollouts_first_then_oldest_first():
    from vgbs_ray.scheduler.staleness import oldest_versions
    from vgbs_ray.scheduler.staleness_window import StalenessWindow

    window = StalenessWindow(gbs=3, max_staleness=1, steps_formed=5)
    ready = {"r1": 5, "r2": 4, "new": 4, "older": 4, "ancient": 2}
    choice = window.next_step(ready, replay={"r1", "r2"})
    assert choice.take == ["r1", "r2", "new"] and choice.stale == ["ancient"] and choice.num_fresh == 4
    assert window.next_step(ready).take == ["r2", "new", "older"]
    window.try_admit(["slow"], engine_version=4)
    assert window.next_step(ready).take == [] and window.next_step(ready).waiting_for == 1
    assert window.next_step(ready, wait_for_in_flight=False).take == ["r2", "new", "older"]
    assert window.next_step({"a": 5}, wait_for_in_flight=False).take == []
    assert window.next_step({"a": 5}, wait_for_in_flight=False, allow_partial=True).take == ["a"]

    from vgbs_ray.sample import Sample
    import numpy as np

    def sample(v):
        return Sample(rollout_id="x", tokens=np.arange(3), response_length=1, loss_mask=np.ones(1, np.int8), reward=0.0,
                      policy_version_min=v, policy_version_max=v)
    assert oldest_versions([("a", [sample(3), sample(2)]), ("b", [sample(None)]), ("c", [sample(9)])],
                           trained_version=5) == {"a": 2, "b": None, "c": 5}  # from "the future" (a rewind): current
