"""The rollout ledger: the one state of every rollout the scheduler accepted, in bounded memory.

States and the only legal transitions:

    (new) ──accept──▶ BUFFERED ──schedule(k)──▶ SCHEDULED(k) ──train(k)──▶ TRAINED(k)
      │                  │
      │                  └──drop(reason)──▶ DROPPED(reason)
      └──fail(reason)───────────────────────▶ DROPPED(reason)

`fail` is a producer's report that a rollout it started never produced samples (its agent
raised, hung, ...): the rollout is accepted and dropped in one transition, so it is counted
with its reason like every other drop, and a later push of the same id is rejected.

Live rollouts (BUFFERED, SCHEDULED) are entries of a dict; settled ones (TRAINED, DROPPED)
move into `SettledIds`, an exact compact table (tens of bytes per rollout), so the ledger
keeps exact duplicate detection for a whole run in memory that grows by a few tens of
bytes per rollout.

Rejections are events about *samples*, not rollout states: a rejected sample leaves its
rollout's state alone (a rollout none of whose samples was accepted has no state). They are
counted by rule and the latest `recent_rejections_limit` are kept (`recent_rejections`).

Recovery. `train_step(k, settle=False)` keeps step k's rollouts live as TRAINED until
`settle_through(n)` says a checkpoint holds every step < n; `rewind(n)` puts the rollouts of
every step >= n that is not settled (trained or only scheduled) back to BUFFERED, so they
train again, once, after the train group restored the checkpoint of step n.

Resume across job restarts. `export_settled(n)` is the settled table a checkpoint holding every
step < n needs (steps < n trained but not yet settled are written as trained, the live ledger is
left alone); `Ledger.restored(settled, next_step=n, ...)` starts a ledger from it, numbering the
next scheduled step n. Rollouts still untrained at the checkpoint are accepted again (BUFFERED).

Invariants (`check()`, tests/test_ledger.py): every accepted rollout is in exactly one state
(accepted = buffered + scheduled + trained + dropped: none disappears); a rollout is
scheduled in at most one step and trained at most once, in the step it was scheduled in;
a step is trained at most once. Any other transition raises LedgerError naming the rollout
and both states: it is a scheduler bug, never data.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator

from vgbs_ray.errors import RolloutValidationError, VgbsError
from vgbs_ray.scheduler.settled_ids import SettledIds

DEFAULT_RECENT_REJECTIONS = 1000


class LedgerError(VgbsError, RuntimeError):
    """An illegal rollout state transition (a scheduler bug)."""


class RolloutState(str, enum.Enum):
    BUFFERED = "buffered"
    SCHEDULED = "scheduled"
    TRAINED = "trained"
    DROPPED = "dropped"


@dataclass(frozen=True)
class LedgerEntry:
    """One rollout's current state; `step` for SCHEDULED/TRAINED, `reason` for DROPPED."""

    state: RolloutState
    step: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Rejection:
    """One rejected sample: which rollout, which sample, which rule, why."""

    rollout_id: Hashable
    sample_index: int | None
    rule: str
    message: str

    def error(self) -> RolloutValidationError:
        return RolloutValidationError(self.rollout_id, self.rule, self.message, sample_index=self.sample_index)


@dataclass(frozen=True)
class LedgerSummary:
    """Counts of rollouts per state, drops by reason, rejected samples by rule."""

    rollouts_by_state: dict[str, int]
    dropped_by_reason: dict[str, int]
    rejected_samples_by_rule: dict[str, int]
    num_rollouts_accepted: int


class Ledger:
    """State of every accepted rollout; O(1) per transition (see module docstring)."""

    def __init__(self, recent_rejections_limit: int = DEFAULT_RECENT_REJECTIONS) -> None:
        self._live: dict[Hashable, LedgerEntry] = {}
        self._settled = SettledIds()
        self._pending_steps: dict[int, tuple] = {}   # scheduled, not yet trained
        self._unsettled_steps: dict[int, tuple] = {}  # trained, kept live until a checkpoint holds them
        self._last_scheduled_step = -1
        self._num_accepted = 0
        self._by_state: Counter = Counter()
        self._by_drop_reason: Counter = Counter()
        self._rejected_samples_by_rule: Counter = Counter()
        self.recent_rejections: deque[Rejection] = deque(maxlen=recent_rejections_limit)

    # -- queries ---------------------------------------------------------------------
    def get(self, rollout_id: Hashable) -> LedgerEntry | None:
        entry = self._live.get(rollout_id)
        if entry is not None:
            return entry
        settled = self._settled.get(rollout_id)
        if settled is None:
            return None
        state, step, reason = settled
        return LedgerEntry(RolloutState(state), step=step, reason=reason)

    def state(self, rollout_id: Hashable) -> RolloutState | None:
        entry = self.get(rollout_id)
        return None if entry is None else entry.state

    def entries(self) -> Iterator[tuple[Hashable, LedgerEntry]]:
        """Every accepted rollout and its state: settled ones first, in settling order. O(rollouts)."""
        for rid, (state, step, reason) in self._settled:
            yield rid, LedgerEntry(RolloutState(state), step=step, reason=reason)
        yield from list(self._live.items())

    def settled_nbytes(self) -> int:
        return self._settled.nbytes()

    # -- checkpoints -----------------------------------------------------------------
    def export_settled(self, next_step: int) -> SettledIds:
        """A copy of the settled table plus every trained step < `next_step` not settled yet (a
        checkpoint that holds those steps settles them). Leaves this ledger unchanged. Raises
        LedgerError if a step < `next_step` is scheduled but not trained."""
        untrained = sorted(s for s in self._pending_steps if s < next_step)
        if untrained:
            raise LedgerError(f"step {untrained[0]} < {next_step} is scheduled but not trained: "
                              "a checkpoint can only hold trained steps")
        table = self._settled.copy()
        for step in sorted(s for s in self._unsettled_steps if s < next_step):
            table.add_many(self._unsettled_steps[step], step=step)
        return table

    @classmethod
    def restored(cls, settled: SettledIds, *, next_step: int, rejected_samples_by_rule: dict | None = None,
                 recent_rejections_limit: int = DEFAULT_RECENT_REJECTIONS) -> "Ledger":
        """A ledger resuming a checkpoint: `settled` (trained and dropped rollouts, owned by the new
        ledger from now on), the next step scheduled is `next_step`, rejection counts carried on.
        Rollouts untrained at the checkpoint are accepted again by the caller (`accept_sample`)."""
        if next_step < 0:
            raise LedgerError(f"next_step must be >= 0, got {next_step}")
        ledger = cls(recent_rejections_limit)
        ledger._settled = settled
        trained, dropped = settled.counts()
        ledger._by_state[RolloutState.TRAINED] = trained
        ledger._by_state[RolloutState.DROPPED] = sum(dropped.values())
        ledger._by_drop_reason.update(dropped)
        ledger._num_accepted = len(settled)
        ledger._rejected_samples_by_rule.update(rejected_samples_by_rule or {})
        ledger._last_scheduled_step = next_step - 1
        return ledger

    # -- transitions -----------------------------------------------------------------
    def accept_sample(self, rollout_id: Hashable) -> None:
        """A sample of `rollout_id` was accepted into the buffer (a new rollout becomes BUFFERED).

        The caller has looked the rollout up (`get`) and found it live or unknown: a settled
        rollout accepted again is not re-checked here (the hot path), but `check()` finds it.
        """
        old = self._live.get(rollout_id)
        if old is not None:
            if old.state is not RolloutState.BUFFERED:
                raise LedgerError(f"rollout {rollout_id!r}: sample accepted while {old.state.value} in step {old.step}")
            return
        self._live[rollout_id] = _BUFFERED
        self._by_state[RolloutState.BUFFERED] += 1
        self._num_accepted += 1

    def reject(self, rejection: Rejection) -> None:
        """Record a rejected sample (counted by rule; the latest few kept); no state changes."""
        self._rejected_samples_by_rule[rejection.rule] += 1
        self.recent_rejections.append(rejection)

    def schedule(self, rollout_ids: Iterable[Hashable], step: int) -> None:
        ids = tuple(rollout_ids)
        if step <= self._last_scheduled_step:
            raise LedgerError(f"step {step} was already scheduled (last scheduled: {self._last_scheduled_step})")
        for rid in ids:  # check all before changing any: a refused transition changes nothing
            self._expect(rid, RolloutState.BUFFERED, "scheduled")
        if len(set(ids)) != len(ids):
            raise LedgerError(f"step {step} lists a rollout twice")
        entry = LedgerEntry(RolloutState.SCHEDULED, step=step)
        for rid in ids:
            self._live[rid] = entry
        self._by_state[RolloutState.BUFFERED] -= len(ids)
        self._by_state[RolloutState.SCHEDULED] += len(ids)
        self._pending_steps[step] = ids
        self._last_scheduled_step = step

    def train_step(self, step: int, *, settle: bool = True) -> tuple:
        """Every rollout of `step` becomes TRAINED(step); returns their ids.

        settle=False keeps them live (rewindable) until `settle_through` passes the step.
        """
        ids = self._pending_steps.get(step)
        if ids is None:
            if 0 <= step <= self._last_scheduled_step:
                raise LedgerError(f"step {step} was already trained: its rollouts would be trained twice")
            raise LedgerError(f"step {step} was never scheduled")
        for rid in ids:
            old = self._live.get(rid)
            if old is None or old.state is not RolloutState.SCHEDULED or old.step != step:
                raise LedgerError(f"rollout {rid!r}: expected scheduled in step {step}, is {old}")
        del self._pending_steps[step]
        if settle:
            self._settled.add_many(ids, step=step)
            for rid in ids:
                del self._live[rid]
        else:
            trained = LedgerEntry(RolloutState.TRAINED, step=step)
            for rid in ids:
                self._live[rid] = trained
            self._unsettled_steps[step] = ids
        self._by_state[RolloutState.SCHEDULED] -= len(ids)
        self._by_state[RolloutState.TRAINED] += len(ids)
        return ids

    def settle_through(self, next_step: int) -> None:
        """A checkpoint holds every step < `next_step`: their trained rollouts settle for good."""
        for step in sorted(s for s in self._unsettled_steps if s < next_step):
            ids = self._unsettled_steps.pop(step)
            self._settled.add_many(ids, step=step)
            for rid in ids:
                del self._live[rid]

    def rewind(self, next_step: int) -> list[tuple]:
        """Steps >= `next_step` did not happen (the train group restored an older checkpoint).

        Their rollouts, trained-but-unsettled or only scheduled, become BUFFERED again; returns
        each such step's rollout ids, in step order. Raises LedgerError if one of those steps
        already settled (its rollouts could not train again without training twice).
        """
        settled_after = [s for s in range(next_step, self._last_scheduled_step + 1)
                         if s not in self._unsettled_steps and s not in self._pending_steps]
        if settled_after:
            raise LedgerError(f"cannot rewind to step {next_step}: step {settled_after[0]} already settled "
                              "(settle_through was told a checkpoint holds it)")
        steps = sorted(s for s in [*self._unsettled_steps, *self._pending_steps] if s >= next_step)
        rewound = []
        for step in steps:
            trained = step in self._unsettled_steps
            ids = self._unsettled_steps.pop(step) if trained else self._pending_steps.pop(step)
            for rid in ids:
                self._live[rid] = _BUFFERED
            self._by_state[RolloutState.TRAINED if trained else RolloutState.SCHEDULED] -= len(ids)
            self._by_state[RolloutState.BUFFERED] += len(ids)
            rewound.append(ids)
        self._last_scheduled_step = next_step - 1
        return rewound

    def drop(self, rollout_id: Hashable, reason: str) -> None:
        self._expect(rollout_id, RolloutState.BUFFERED, "dropped")
        del self._live[rollout_id]
        self._settled.add(rollout_id, reason=reason)
        self._by_state[RolloutState.BUFFERED] -= 1
        self._by_state[RolloutState.DROPPED] += 1
        self._by_drop_reason[reason] += 1

    def fail(self, rollout_id: Hashable, reason: str) -> None:
        """A rollout the producer lost before any sample arrived: accepted and DROPPED(reason) at once.
        The caller has checked (`get`) that the ledger does not know it."""
        self.accept_sample(rollout_id)
        self.drop(rollout_id, reason)

    def _expect(self, rollout_id, state: RolloutState, new: str) -> None:
        old = self._live.get(rollout_id)
        if old is None or old.state is not state:
            settled = None if old is not None else self._settled.get(rollout_id)
            was = old.state.value if old is not None else (settled[0] if settled else None)
            raise LedgerError(f"rollout {rollout_id!r}: illegal transition {was} -> {new}")

    # -- reports ---------------------------------------------------------------------
    def summary(self) -> LedgerSummary:
        """Counts kept current by every transition: O(states + reasons), not O(rollouts)."""
        return LedgerSummary(
            rollouts_by_state={s.value: self._by_state[s] for s in RolloutState},
            dropped_by_reason={k: n for k, n in self._by_drop_reason.items() if n},
            rejected_samples_by_rule=dict(self._rejected_samples_by_rule),
            num_rollouts_accepted=self._num_accepted,
        )

    def check(self) -> None:
        """Raise LedgerError if an invariant in the module docstring does not hold. O(rollouts)."""
        recount: Counter = Counter(e.state for e in self._live.values())
        for rid, (state, _, _) in self._settled:
            if rid in self._live:
                raise LedgerError(f"rollout {rid!r} is both {self._live[rid].state.value} and {state}")
            recount[RolloutState(state)] += 1
        if +recount != +self._by_state:
            raise LedgerError(f"summary counts {dict(+self._by_state)} disagree with the entries {dict(recount)}")
        if sum(recount.values()) != self._num_accepted:
            raise LedgerError(f"{self._num_accepted} rollouts accepted but {sum(recount.values())} have a state: "
                              "a rollout disappeared")
        listed: dict[Hashable, int] = {}
        for step, ids in self._pending_steps.items():
            for rid in ids:
                if rid in listed:
                    raise LedgerError(f"rollout {rid!r} is in steps {listed[rid]} and {step}")
                listed[rid] = step
                entry = self._live.get(rid)
                if entry is None or entry.state is not RolloutState.SCHEDULED or entry.step != step:
                    raise LedgerError(f"rollout {rid!r} listed in step {step} but is {entry}")
        scheduled = sum(1 for e in self._live.values() if e.state is RolloutState.SCHEDULED)
        if scheduled != len(listed):
            raise LedgerError(f"{scheduled} rollouts are scheduled but {len(listed)} are listed in pending steps")
        for step, ids in self._unsettled_steps.items():
            for rid in ids:
                entry = self._live.get(rid)
                if entry is None or entry.state is not RolloutState.TRAINED or entry.step != step or rid in listed:
                    raise LedgerError(f"rollout {rid!r} listed as trained in step {step} but is {entry}")
                listed[rid] = step
        trained_live = sum(1 for e in self._live.values() if e.state is RolloutState.TRAINED)
        if trained_live != sum(len(ids) for ids in self._unsettled_steps.values()):
            raise LedgerError(f"{trained_live} live trained rollouts but the unsettled steps list "
                              f"{sum(len(ids) for ids in self._unsettled_steps.values())}")


_BUFFERED = LedgerEntry(RolloutState.BUFFERED)
