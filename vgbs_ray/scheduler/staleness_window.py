"""The scheduler's staleness state, and the three rules of `vgbs_ray.scheduler.staleness` applied to it.

    window = StalenessWindow(gbs=64, max_staleness=1, steps_formed=restored_version)
    decision = window.try_admit(rollout_ids, engine_version)   # a producer asks before starting a group
    window.finished(rollout_id)                                # all its samples arrived: it is buffered
    window.discard(rollout_ids)                                # filtered, rejected, failed, dropped stale
    choice = window.next_step(buffered_oldest)                 # what to do: StepChoice(take, stale, waiting_for)
    window.step_formed(choice.take)                            # after the scheduler formed that step

It is the staleness-enforcing `vgbs_ray.scheduler.step_choice.StepChooser` (`choose` takes the ready
rollouts themselves; `FifoChooser` is the other one).

The window holds only what the rules need: the rollouts admitted and not yet in a step or
discarded (`pending`), the version each in-flight one started with, and the number of steps
formed (= the version the next step trains). The buffered rollouts themselves stay with the
caller (the scheduler's intake), which passes their oldest versions to `next_step`.
`next_step` decides and changes nothing; the caller acts (drops `stale` with reason
`stale`, forms `take`) and reports back. Rollouts that were never admitted (synthetic
producers, pushes that did not ask) are fine everywhere: they are not pending, never waited
for, and take part in steps like any other.

Invariants (tests/test_staleness_window.py, and the timing model's property test): no
planned rollout has staleness above `max_staleness` at `steps_formed`; a plan takes nothing
while an admitted rollout in flight has its last chance in this step; pending and in-flight
never hold a rollout that was formed or discarded. A rollout admitted and then lost without
`discard` would hold its last-chance step forever: callers must discard failures.
"""

from __future__ import annotations

from typing import Collection, Hashable, Iterable, Mapping

from vgbs_ray.scheduler.intake import ReadyRollout
from vgbs_ray.scheduler.staleness import (AdmissionDecision, admit_rollouts, check_admission_config, last_chance_in_flight,
                                oldest_first, oldest_versions, split_stale)
from vgbs_ray.scheduler.step_choice import StepChoice


class StalenessWindow:
    """Admission, last-chance waits and stale drops for one stream of steps (see module docstring)."""

    enforced = True

    def __init__(self, *, gbs: int, max_staleness: int, steps_formed: int = 0):
        if gbs < 1 or max_staleness < 0 or steps_formed < 0:
            raise ValueError(f"StalenessWindow needs gbs >= 1, max_staleness >= 0, steps_formed >= 0; got "
                             f"gbs={gbs}, max_staleness={max_staleness}, steps_formed={steps_formed}")
        self.gbs = gbs
        self.max_staleness = max_staleness
        self.steps_formed = steps_formed
        self._pending: set = set()
        self._in_flight: dict = {}  # rollout id -> version it was admitted with
        self._owner: dict = {}  # rollout id in flight -> who admitted it (a producer index), when given

    @property
    def pending_rollouts(self) -> int:
        return len(self._pending)

    @property
    def in_flight_rollouts(self) -> int:
        return len(self._in_flight)

    def is_pending(self, rollout_id: Hashable) -> bool:
        return rollout_id in self._pending

    def add_pending(self, rollout_ids: Iterable[Hashable]) -> None:
        """Count buffered rollouts as pending without admitting them (a restored scheduler's untrained
        rollouts: they fill the next steps, so later admissions must land behind them). Not in flight."""
        self._pending.update(rollout_ids)

    def discard_in_flight(self) -> list:
        """Nothing in flight will arrive any more (end of input): forget those rollouts; returns their ids."""
        ids = list(self._in_flight)
        self.discard(ids)
        return ids

    def check_group(self, group_size: int) -> None:
        """Raises ConfigError when a group of this size could never be admitted (check_admission_config)."""
        check_admission_config(gbs=self.gbs, group_size=group_size, max_staleness=self.max_staleness)

    def try_admit(self, rollout_ids: Iterable[Hashable], engine_version: int,
                  owner: Hashable | None = None) -> AdmissionDecision:
        """Admit all of `rollout_ids` (a group) or none; admitted ones count as pending and in flight
        (of `owner`, when given: `discard_owner` frees them if it dies)."""
        ids = list(rollout_ids)
        again = [rid for rid in ids if rid in self._pending]
        if again or len(set(ids)) != len(ids):
            raise ValueError(f"rollout ids admitted twice: {again or ids}; a resumed producer must not re-admit "
                             "rollouts the window still holds")
        decision = admit_rollouts(num_rollouts=len(ids), engine_version=engine_version, steps_formed=self.steps_formed,
                                  pending_rollouts=len(self._pending), gbs=self.gbs, max_staleness=self.max_staleness)
        if decision.admit:
            self._pending.update(ids)
            self._in_flight.update((rid, engine_version) for rid in ids)
            if owner is not None:
                self._owner.update((rid, owner) for rid in ids)
        return decision

    def discard_owner(self, owner: Hashable) -> list:
        """`owner` died: its rollouts in flight will not arrive from it (a restarted one admits them again);
        forget them, so no step waits for them; returns their ids."""
        ids = [rid for rid, who in self._owner.items() if who == owner]
        self.discard(ids)
        return ids

    def finished(self, rollout_id: Hashable) -> None:
        """The rollout is complete and buffered (still pending until a step takes it)."""
        self._in_flight.pop(rollout_id, None)
        self._owner.pop(rollout_id, None)

    def discard(self, rollout_ids: Iterable[Hashable]) -> None:
        """The rollouts will never be trained (filtered, rejected, failed, dropped): free their room."""
        for rid in rollout_ids:
            self._pending.discard(rid)
            self._in_flight.pop(rid, None)
            self._owner.pop(rid, None)

    def last_chance_ids(self) -> list:
        """The admitted rollouts in flight whose last chance is the next step (the ones rule 2 holds it for)."""
        deadline = self.steps_formed - self.max_staleness
        return [rid for rid, version in self._in_flight.items() if version == deadline]

    def choose(self, ready: Collection[ReadyRollout], *, replay: Collection = (), allow_partial: bool = False,
               wait_for_in_flight: bool = True) -> StepChoice:
        """`next_step` from the ready rollouts themselves (their oldest versions). O(ready log ready)."""
        versions = oldest_versions(((r.rollout_id, r.samples) for r in ready), trained_version=self.steps_formed)
        return self.next_step(versions, replay=replay, allow_partial=allow_partial, wait_for_in_flight=wait_for_in_flight)

    def next_step(self, buffered_oldest: Mapping[Hashable, int | None], *, replay: Collection = (),
                  allow_partial: bool = False, wait_for_in_flight: bool = True) -> StepChoice:
        """The step that trains version `steps_formed`, from the buffered rollouts (id -> oldest version,
        None = unversioned, in arrival order). A full step takes `gbs`; with `allow_partial` (a flush,
        end of input) it takes whatever fresh rollouts there are. wait_for_in_flight=False (a flush: it
        must never stall) plans without rule 2's wait.

        Rollouts in `replay` (put back in front by a rewind or a restore) go first, in their order: a
        replayed step takes what it took before. Moving a rollout earlier only lowers its staleness, so
        replays are never dropped unless they were stale already. The rest fill oldest version first."""
        split = split_stale(buffered_oldest, trained_version=self.steps_formed, max_staleness=self.max_staleness)
        num_fresh = len(split.fresh)
        waiting = last_chance_in_flight(self._in_flight.values(), trained_version=self.steps_formed,
                                        max_staleness=self.max_staleness) if wait_for_in_flight else 0
        if waiting or not split.fresh or (num_fresh < self.gbs and not allow_partial):
            return StepChoice([], split.stale, waiting, num_fresh)
        take = oldest_first(split.fresh, buffered_oldest)[:self.gbs]
        if replay:
            stale = set(split.stale)
            front = [rid for rid in buffered_oldest if rid in replay and rid not in stale][:self.gbs]
            chosen = set(front)
            take = front + [rid for rid in take if rid not in chosen][:self.gbs - len(front)]
        return StepChoice(take, split.stale, 0, num_fresh)

    def step_formed(self, rollout_ids: Iterable[Hashable]) -> None:
        """The scheduler formed the next step from `rollout_ids`: the next one trains one version later."""
        self.discard(rollout_ids)
        self.steps_formed += 1
