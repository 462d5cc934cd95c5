"""What the SchedulerActor does next, and whether it admits a new rollout: pure decisions.

    action = next_action(SchedulerView(...))   # DropStale | EmitFullStep | RunFlush | MaxWaitFlush | WaitFor
    admitted, reason = admit_new_rollouts(...)

`SchedulerCore.next_action` builds a `SchedulerView` of its state (with its chooser's
`StepChoice` for the next step) and asks `next_action`; the actor carries the action out and
repeats; neither decides anything itself (the shape of Ray Train v2's controller and its
`FailurePolicy.make_decision`). Priorities, highest first:

0. Drop stale rollouts (staleness enforced: `SchedulerConfig.max_staleness`): a ready rollout
   too old for the next step is too old for every later one (rule 1 of `vgbs_ray.scheduler.staleness`).
1. A full step, whenever the chooser took `global_batch_size` trainable rollouts, a train group
   is registered (layouts need its parallel config) and no admitted rollout in flight has its
   last chance in this step (rule 2; `waiting_for`), or the step has been held for them
   `max_hold_s` already (`SchedulerCore.next_action` then chooses without the wait).
2. The oldest pending flush request (`flush()`, `end_of_input()`), once it can run: an end of
   input waits for running Ray Data streams to finish; any flush waits for the train group
   while what it would emit needs a layout (a full step, or a partial step under
   leftover="partial"), so a flush before registration never drops what could train.
3. The max-wait flush: the oldest ready rollout waited `max_wait_s` (not with
   leftover="carry", which never flushes mid-run).
4. Otherwise wait: for a change of state, or until the max-wait or the hold deadline.

Which ready rollouts a step takes and which are stale is the chooser's (`vgbs_ray.scheduler.step_choice`).

Every action makes progress (a step can always be laid out: empty padding micro-batches fill
an alignment that real samples cannot reach), so the loop cannot spin on the same state.
"""

from __future__ import annotations

from dataclasses import dataclass

from vgbs_ray.config import LeftoverPolicy
from vgbs_ray.scheduler.step_choice import StepChoice


@dataclass(frozen=True)
class FlushRequest:
    """A pending flush: "flush" (explicit), "end_of_input", or "max_wait"."""

    trigger: str
    end_of_input: bool


@dataclass(frozen=True)
class SchedulerView:
    """What the decision needs of the scheduler's state. Ages in seconds."""

    registered: bool
    choice: StepChoice
    """The chooser's next step: what a full step takes, what is stale, how many may still train."""
    global_batch_size: int
    leftover: LeftoverPolicy
    flush_requests: tuple[FlushRequest, ...]
    """Pending flush requests, oldest first."""
    active_datasets: int
    oldest_ready_age_s: float | None
    max_wait_s: float | None
    hold_left_s: float | None = None
    """While a full step is held for last-chance rollouts in flight: seconds until it stops waiting for them
    (`SchedulerConfig.max_hold_s`); None otherwise."""


@dataclass(frozen=True)
class EmitFullStep:
    """Take these ready rollouts (`global_batch_size` of them, in this order) and emit them as one step."""

    rollout_ids: list


@dataclass(frozen=True)
class DropStale:
    """Drop these ready rollouts, too stale to train (reason `stale`)."""

    rollout_ids: list


@dataclass(frozen=True)
class RunFlush:
    """Run flush request number `index` of `SchedulerView.flush_requests` (and remove it)."""

    index: int


@dataclass(frozen=True)
class MaxWaitFlush:
    """Flush because the oldest ready rollout waited `max_wait_s`."""


@dataclass(frozen=True)
class WaitFor:
    """Nothing to do: wait for a change of state, at most `timeout_s` (None: no deadline)."""

    timeout_s: float | None


Action = DropStale | EmitFullStep | RunFlush | MaxWaitFlush | WaitFor


def next_action(view: SchedulerView) -> Action:
    """The scheduler's next action (see module docstring for the priorities)."""
    choice = view.choice
    if choice.stale:
        return DropStale(choice.stale)
    full_step_ready = choice.num_fresh >= view.global_batch_size
    if view.registered and len(choice.take) >= view.global_batch_size:
        return EmitFullStep(choice.take)
    for index, request in enumerate(view.flush_requests):
        if request.end_of_input and view.active_datasets:
            continue  # a running stream still brings input
        needs_layout = full_step_ready or (view.leftover == "partial" and choice.num_fresh > 0)
        if needs_layout and not view.registered:
            continue  # never drop or strand what could train: wait for the train group
        return RunFlush(index)
    age = view.oldest_ready_age_s
    if view.max_wait_s is None or age is None or view.leftover == "carry" or not view.registered:
        return WaitFor(view.hold_left_s)
    if age >= view.max_wait_s:
        return MaxWaitFlush()
    return WaitFor(view.max_wait_s - age if view.hold_left_s is None else min(view.max_wait_s - age, view.hold_left_s))


def admit_new_rollouts(*, steps_in_flight: int, max_steps_ahead: int | None,
                       buffer_has_room: bool, buffer_reason: str) -> tuple[bool, str]:
    """Whether a *new* rollout may enter now, and if not, why (backpressure).

    Refused while more than `max_steps_ahead` steps are emitted but not trained, or while the
    buffer is full. Samples of rollouts already open are always
    taken (the intake's rule): refusing them could never free the buffer.
    """
    if max_steps_ahead is not None and steps_in_flight > max_steps_ahead:
        return False, (f"staleness: {steps_in_flight} steps emitted but not trained "
                       f"(max_steps_ahead={max_steps_ahead})")
    if not buffer_has_room:
        return False, buffer_reason
    return True, ""
