"""Which ready rollouts the next step takes: one small protocol, two implementations.

    chooser = FifoChooser(gbs=64)                                   # no staleness rules
    chooser = StalenessWindow(gbs=64, max_staleness=1)             # vgbs_ray.scheduler.staleness_window
    choice = chooser.choose(intake.ready_rollouts(), replay=ids)   # StepChoice: take, stale, waiting_for

`vgbs_ray.scheduler.core.SchedulerCore` asks its chooser what the next step is and reports back
what happened to rollouts (finished, discarded, formed into a step); it never asks which kind
of chooser it holds, except that admission control (`admit`) is only recorded when the chooser
`enforced`s it. `FifoChooser` takes the first `gbs` ready rollouts in buffer order (a rewind puts
the rollouts it returns at the front of the buffer, so a replayed step is the step that was
trained) and admits every group; `StalenessWindow` applies the three rules of
`vgbs_ray.scheduler.staleness` (stale drops, last-chance waits, admission).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Collection, Hashable, Iterable, Protocol

from vgbs_ray.scheduler.intake import ReadyRollout
from vgbs_ray.scheduler.staleness import AdmissionDecision


@dataclass(frozen=True)
class StepChoice:
    """What the next step should be: which ready rollouts it takes, which are stale, why it may wait."""

    take: list
    """Rollout ids for the step, in the order it takes them; empty when no step can form now."""
    stale: list
    """Ready rollouts too stale for this or any later step: drop them with reason `stale`."""
    waiting_for: int
    """Admitted rollouts in flight with their last chance in this step (`take` is empty while > 0)."""
    num_fresh: int
    """Ready rollouts that may still train (ready minus stale)."""


class StepChooser(Protocol):
    """The scheduler's step-formation rules (see module docstring). `steps_formed` is the policy
    version the next step trains (= the step counter); the scheduler keeps it equal to its next
    step number through emissions, rewinds and restores."""

    gbs: int
    steps_formed: int
    enforced: bool
    """Whether admission control applies (`admit` decides; stats report pending and in flight)."""

    @property
    def pending_rollouts(self) -> int: ...

    @property
    def in_flight_rollouts(self) -> int: ...

    def choose(self, ready: Collection[ReadyRollout], *, replay: Collection = (), allow_partial: bool = False,
               wait_for_in_flight: bool = True) -> StepChoice:
        """The next step from the ready rollouts (buffer order). A full step takes `gbs`; `allow_partial`
        (a flush) takes fewer; `wait_for_in_flight=False` (a flush) never waits. Changes nothing."""

    def check_group(self, group_size: int) -> None:
        """Raises ConfigError when a group of this size could never be admitted."""

    def try_admit(self, rollout_ids: Iterable[Hashable], engine_version: int,
                  owner: Hashable | None = None) -> AdmissionDecision: ...

    def is_pending(self, rollout_id: Hashable) -> bool: ...

    def add_pending(self, rollout_ids: Iterable[Hashable]) -> None: ...

    def finished(self, rollout_id: Hashable) -> None: ...

    def discard(self, rollout_ids: Iterable[Hashable]) -> None: ...

    def discard_owner(self, owner: Hashable) -> list: ...

    def discard_in_flight(self) -> list: ...

    def step_formed(self, rollout_ids: Iterable[Hashable]) -> None: ...


class FifoChooser:
    """No staleness rules: a step takes the first `gbs` ready rollouts (fewer in a flush); every group is
    admitted and nothing is tracked. O(gbs) per full step, O(1) otherwise."""

    enforced = False
    pending_rollouts = 0
    in_flight_rollouts = 0

    def __init__(self, *, gbs: int, steps_formed: int = 0):
        if gbs < 1 or steps_formed < 0:
            raise ValueError(f"FifoChooser needs gbs >= 1 and steps_formed >= 0, got gbs={gbs}, steps_formed={steps_formed}")
        self.gbs = gbs
        self.steps_formed = steps_formed

    def choose(self, ready: Collection[ReadyRollout], *, replay: Collection = (), allow_partial: bool = False,
               wait_for_in_flight: bool = True) -> StepChoice:
        can_form = len(ready) >= self.gbs or (allow_partial and len(ready) > 0)
        take = [r.rollout_id for r in islice(ready, self.gbs)] if can_form else []
        return StepChoice(take, [], 0, len(ready))

    def check_group(self, group_size: int) -> None:
        pass

    def try_admit(self, rollout_ids: Iterable[Hashable], engine_version: int,
                  owner: Hashable | None = None) -> AdmissionDecision:
        return AdmissionDecision(True, self.steps_formed, self.steps_formed - engine_version)

    def is_pending(self, rollout_id: Hashable) -> bool:
        return False

    def add_pending(self, rollout_ids: Iterable[Hashable]) -> None:
        pass

    def finished(self, rollout_id: Hashable) -> None:
        pass

    def discard(self, rollout_ids: Iterable[Hashable]) -> None:
        pass

    def discard_owner(self, owner: Hashable) -> list:
        return []

    def discard_in_flight(self) -> list:
        return []

    def step_formed(self, rollout_ids: Iterable[Hashable]) -> None:
        self.steps_formed += 1
