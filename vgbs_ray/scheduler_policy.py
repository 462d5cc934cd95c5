"""What the SchedulerActor does next, and whether it admits a new rollout: pure decisions.

    action = next_action(SchedulerView(...))       # EmitFullStep | RunFlush | MaxWaitFlush | WaitFor
    admitted, reason = admit_new_rollouts(...)

The actor is a loop that builds a `SchedulerView` of its state, asks `next_action`, carries
the action out, and repeats; it never decides anything itself (the shape of Ray Train v2's
controller and its `FailurePolicy.make_decision`). Priorities, highest first:

0. Drop stale rollouts (staleness enforced: `SchedulerConfig.max_staleness`): a ready rollout
   too old for the next step is too old for every later one (rule 1 of `vgbs_ray.staleness`).
1. A full step, whenever `global_batch_size` trainable rollouts are ready, a train group is
   registered (layouts need its parallel config) and no admitted rollout in flight has its
   last chance in this step (rule 2; `waiting_for`).
2. The oldest pending flush request (`flush()`, `end_of_input()`), once it can run: an end of
   input waits for running Ray Data streams to finish; any flush waits for the train group
   while what it would emit needs a layout (a full step, or a partial step under
   leftover="partial"), so a flush before registration never drops what could train.
3. The max-wait flush: the oldest ready rollout waited `max_wait_s` (not with
   leftover="carry", which never flushes mid-run).
4. Otherwise wait: for a change of state, or until the max-wait deadline.

With staleness enforced, `choose_step` decides which ready rollouts a step takes (oldest
version first, rule 2; rollouts put back by a rewind or a restore first, in their order, so a
replayed step is the step that was trained) and which are stale.

Every action makes progress (a step can always be laid out: empty padding micro-batches fill
an alignment that real samples cannot reach), so the loop cannot spin on the same state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Hashable, Iterable, Mapping

from vgbs_ray.config import LeftoverPolicy
from vgbs_ray.sample import Sample
from vgbs_ray.staleness_window import StalenessWindow


@dataclass(frozen=True)
class FlushRequest:
    """A pending flush: "flush" (explicit), "end_of_input", or "max_wait"."""

    trigger: str
    end_of_input: bool


@dataclass(frozen=True)
class SchedulerView:
    """What the decision needs of the scheduler's state. Ages in seconds."""

    registered: bool
    num_ready: int
    """Complete, advantaged rollouts waiting for a step."""
    global_batch_size: int
    leftover: LeftoverPolicy
    flush_requests: tuple[FlushRequest, ...]
    """Pending flush requests, oldest first."""
    active_datasets: int
    oldest_ready_age_s: float | None
    max_wait_s: float | None
    num_stale: int = 0
    """Ready rollouts too stale to train (staleness enforced); dropped before anything else."""
    waiting_for: int = 0
    """Admitted rollouts in flight whose last chance is the next step: no full step until they arrive."""


@dataclass(frozen=True)
class EmitFullStep:
    """Take the oldest `global_batch_size` ready rollouts and emit them as one step."""


@dataclass(frozen=True)
class DropStale:
    """Drop the ready rollouts too stale to train (reason `stale`)."""


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
    if view.num_stale:
        return DropStale()
    full_step_ready = view.num_ready >= view.global_batch_size
    if view.registered and full_step_ready and not view.waiting_for:
        return EmitFullStep()
    for index, request in enumerate(view.flush_requests):
        if request.end_of_input and view.active_datasets:
            continue  # a running stream still brings input
        needs_layout = full_step_ready or (view.leftover == "partial" and view.num_ready > 0)
        if needs_layout and not view.registered:
            continue  # never drop or strand what could train: wait for the train group
        return RunFlush(index)
    age = view.oldest_ready_age_s
    if view.max_wait_s is None or age is None or view.leftover == "carry" or not view.registered:
        return WaitFor(None)
    if age >= view.max_wait_s:
        return MaxWaitFlush()
    return WaitFor(view.max_wait_s - age)


def admit_new_rollouts(*, steps_in_flight: int, max_steps_ahead: int | None,
                       buffer_has_room: bool, buffer_reason: str) -> tuple[bool, str]:
    """Whether a *new* rollout may enter now, and if not, why (backpressure).

    Refused while more than `max_steps_ahead` steps are emitted but not trained (bounded
    staleness), or while the buffer is full. Samples of rollouts already open are always
    taken (the intake's rule): refusing them could never free the buffer.
    """
    if max_steps_ahead is not None and steps_in_flight > max_steps_ahead:
        return False, (f"staleness: {steps_in_flight} steps emitted but not trained "
                       f"(max_steps_ahead={max_steps_ahead})")
    if not buffer_has_room:
        return False, buffer_reason
    return True, ""


@dataclass(frozen=True)
class StepChoice:
    """Which ready rollouts the next step takes, which are stale, and why it may have to wait."""

    take: list
    """Rollout ids for the step, in the order it takes them; empty when no step can form now."""
    stale: list
    """Ready rollouts too stale for this or any later step: drop them with reason `stale`."""
    waiting_for: int
    """Admitted rollouts in flight with their last chance in this step (a full step waits for them)."""
    num_fresh: int
    """Ready rollouts that may still train."""


def choose_step(ready_oldest: Mapping[Hashable, int | None], *, window: StalenessWindow, replay: Collection = (),
                allow_partial: bool = False, wait_for_in_flight: bool = True) -> StepChoice:
    """The next step under the staleness rules, from the ready rollouts (id -> oldest version,
    None = unversioned, in buffer order).

    Rollouts in `replay` (put back in front by a rewind or a restore) go first, in their order:
    a replayed step takes what it took before. Moving a rollout earlier only lowers its staleness,
    so replays are never dropped unless they were stale already. The rest fill oldest version
    first (`StalenessWindow.next_step`). `allow_partial`: a flush takes fewer than gbs;
    `wait_for_in_flight=False`: a flush never waits for rollouts in flight. Changes nothing.
    """
    plan = window.next_step(ready_oldest, allow_partial=allow_partial, wait_for_in_flight=wait_for_in_flight)
    num_fresh = len(ready_oldest) - len(plan.stale)
    take = plan.take
    if take and replay:
        stale = set(plan.stale)
        front = [rid for rid in ready_oldest if rid in replay and rid not in stale][:window.gbs]
        chosen = set(front)
        take = front + [rid for rid in take if rid not in chosen][:window.gbs - len(front)]
    return StepChoice(take, plan.stale, plan.waiting_for, num_fresh)


def oldest_versions(rollouts: Iterable[tuple[Hashable, Iterable[Sample]]], *, trained_version: int) -> dict:
    """id -> oldest policy version of each rollout (None when no sample carries one), in order.

    A version newer than `trained_version` (engines that kept the weights of a run rewound to an
    older checkpoint) counts as `trained_version`: staleness 0, never "from the future". Siblings
    that disagree on carrying versions use the ones that do (the intake does not reject them; the
    emitter must not fail on them either).
    """
    out = {}
    for rid, samples in rollouts:
        versions = [s.policy_version_min for s in samples if s.policy_version_min is not None]
        out[rid] = min(min(versions), trained_version) if versions else None
    return out
