"""The rollout ledger: the one state of every rollout id the scheduler has seen.

States and the only legal transitions:

    (new) ──accept──▶ BUFFERED ──schedule(k)──▶ SCHEDULED(k) ──train(k)──▶ TRAINED(k)
      │                  │ ▲
      │                  │ └─accept (a corrected sample after every earlier one was rejected)
      │                  └──drop(reason)──▶ DROPPED(reason)
      └──reject(rule)──▶ REJECTED(rule)

Invariants (`check()`, tests/test_ledger.py): every rollout id is in exactly one state;
every rollout that was ever accepted is BUFFERED, SCHEDULED, TRAINED or DROPPED (none
disappears, none goes back to REJECTED); a rollout is scheduled in at most one step and
trained at most once, in the step it was scheduled in. Any other transition raises
LedgerError naming the rollout and both states: it is a scheduler bug, never data.

Rejections of single samples of a live rollout (a duplicate, a sample of a scheduled
rollout) leave its state alone and are kept as events (`rejections`).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Iterable

from vgbs_ray.errors import VgbsError


class LedgerError(VgbsError, RuntimeError):
    """An illegal rollout state transition (a scheduler bug)."""


class RolloutState(str, enum.Enum):
    BUFFERED = "buffered"
    SCHEDULED = "scheduled"
    TRAINED = "trained"
    DROPPED = "dropped"
    REJECTED = "rejected"


@dataclass(frozen=True)
class LedgerEntry:
    """One rollout's current state; `step` for SCHEDULED/TRAINED, `reason` for DROPPED/REJECTED."""

    state: RolloutState
    step: int | None = None
    reason: str | None = None
    num_samples: int = 0
    """Samples accepted for this rollout (0 for a rejected one)."""


@dataclass(frozen=True)
class RejectionEvent:
    rollout_id: Hashable
    sample_index: int | None
    rule: str
    message: str


@dataclass(frozen=True)
class LedgerSummary:
    """Counts of rollouts per state, drops by reason, rejected samples by rule."""

    rollouts_by_state: dict[str, int]
    dropped_by_reason: dict[str, int]
    rejected_rollouts_by_rule: dict[str, int]
    rejected_samples_by_rule: dict[str, int]
    num_rollouts_seen: int


class Ledger:
    """State of every rollout id; O(1) per transition."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, LedgerEntry] = {}
        self._ever_accepted: set[Hashable] = set()
        self._step_rollouts: dict[int, tuple] = {}
        self._trained_steps: set[int] = set()
        self.rejections: list[RejectionEvent] = []
        self._by_state: Counter = Counter()
        self._by_drop_reason: Counter = Counter()
        self._by_reject_rule: Counter = Counter()
        self._rejected_samples_by_rule: Counter = Counter()

    # -- queries ---------------------------------------------------------------------
    def get(self, rollout_id: Hashable) -> LedgerEntry | None:
        return self._entries.get(rollout_id)

    def state(self, rollout_id: Hashable) -> RolloutState | None:
        entry = self._entries.get(rollout_id)
        return None if entry is None else entry.state

    def entries(self) -> list[tuple[Hashable, LedgerEntry]]:
        return list(self._entries.items())

    def step_rollouts(self, step: int) -> tuple:
        return self._step_rollouts.get(step, ())

    def __len__(self) -> int:
        return len(self._entries)

    # -- transitions -----------------------------------------------------------------
    def _move(self, rollout_id, allowed: tuple, new: LedgerEntry) -> None:
        old = self._entries.get(rollout_id)
        old_state = None if old is None else old.state
        if old_state not in allowed:
            raise LedgerError(
                f"rollout {rollout_id!r}: illegal transition {old_state and old_state.value} -> {new.state.value}"
                f"{'' if old is None or old.step is None else f' (step {old.step})'}"
            )
        self._set(rollout_id, new)

    def _set(self, rollout_id, new: "LedgerEntry") -> None:
        """The one place an entry changes: keeps the summary counts current (O(1) summaries)."""
        old = self._entries.get(rollout_id)
        if old is not None:
            self._count(old, -1)
        self._entries[rollout_id] = new
        self._count(new, +1)

    def _count(self, entry: "LedgerEntry", delta: int) -> None:
        self._by_state[entry.state.value] += delta
        if entry.state is RolloutState.DROPPED:
            self._by_drop_reason[entry.reason] += delta
        elif entry.state is RolloutState.REJECTED:
            self._by_reject_rule[entry.reason] += delta

    def accept_sample(self, rollout_id: Hashable) -> None:
        """A sample of `rollout_id` was accepted into the buffer."""
        old = self._entries.get(rollout_id)
        if old is not None and old.state is RolloutState.BUFFERED:
            self._set(rollout_id, LedgerEntry(RolloutState.BUFFERED, num_samples=old.num_samples + 1))
            return
        self._move(rollout_id, (None, RolloutState.REJECTED), LedgerEntry(RolloutState.BUFFERED, num_samples=1))
        self._ever_accepted.add(rollout_id)

    def reject(self, rollout_id: Hashable, rule: str, message: str, sample_index: int | None = None) -> None:
        """Record a rejected sample; a rollout with no accepted sample becomes REJECTED(rule)."""
        self.rejections.append(RejectionEvent(rollout_id, sample_index, rule, message))
        self._rejected_samples_by_rule[rule] += 1
        old = self._entries.get(rollout_id)
        if old is None or old.state is RolloutState.REJECTED:
            self._set(rollout_id, LedgerEntry(RolloutState.REJECTED, reason=rule))

    def schedule(self, rollout_ids: Iterable[Hashable], step: int) -> None:
        ids = tuple(rollout_ids)
        if step in self._step_rollouts:
            raise LedgerError(f"step {step} was already scheduled")
        for rid in ids:
            old = self._entries.get(rid)
            self._move(rid, (RolloutState.BUFFERED,), LedgerEntry(RolloutState.SCHEDULED, step=step,
                                                                   num_samples=old.num_samples if old else 0))
        self._step_rollouts[step] = ids

    def train_step(self, step: int) -> tuple:
        """Every rollout of `step` becomes TRAINED(step); returns their ids."""
        if step not in self._step_rollouts:
            raise LedgerError(f"step {step} was never scheduled")
        if step in self._trained_steps:
            raise LedgerError(f"step {step} was already trained: its rollouts would be trained twice")
        for rid in self._step_rollouts[step]:
            old = self._entries[rid]
            if old.state is not RolloutState.SCHEDULED or old.step != step:
                raise LedgerError(f"rollout {rollout_id_repr(rid)}: expected scheduled in step {step}, is {old}")
            self._set(rid, LedgerEntry(RolloutState.TRAINED, step=step, num_samples=old.num_samples))
        self._trained_steps.add(step)
        return self._step_rollouts[step]

    def drop(self, rollout_id: Hashable, reason: str) -> None:
        old = self._entries.get(rollout_id)
        self._move(rollout_id, (RolloutState.BUFFERED,), LedgerEntry(
            RolloutState.DROPPED, reason=reason, num_samples=old.num_samples if old else 0))

    # -- reports ---------------------------------------------------------------------
    def summary(self) -> LedgerSummary:
        """Counts kept current by every transition: O(states + reasons), not O(rollouts)."""
        return LedgerSummary(
            rollouts_by_state={s.value: self._by_state[s.value] for s in RolloutState},
            dropped_by_reason={k: n for k, n in self._by_drop_reason.items() if n},
            rejected_rollouts_by_rule={k: n for k, n in self._by_reject_rule.items() if n},
            rejected_samples_by_rule=dict(self._rejected_samples_by_rule),
            num_rollouts_seen=len(self._entries),
        )

    def check(self) -> None:
        """Raise LedgerError if an invariant in the module docstring does not hold."""
        for rid in self._ever_accepted:
            entry = self._entries.get(rid)
            if entry is None or entry.state is RolloutState.REJECTED:
                raise LedgerError(f"rollout {rollout_id_repr(rid)} was accepted but is now {entry}: it disappeared")
        seen: dict[Hashable, int] = {}
        for step, ids in self._step_rollouts.items():
            for rid in ids:
                if rid in seen:
                    raise LedgerError(f"rollout {rollout_id_repr(rid)} is in steps {seen[rid]} and {step}")
                seen[rid] = step
                entry = self._entries[rid]
                if entry.state not in (RolloutState.SCHEDULED, RolloutState.TRAINED) or entry.step != step:
                    raise LedgerError(f"rollout {rollout_id_repr(rid)} listed in step {step} but is {entry}")
        for rid, entry in self._entries.items():
            if entry.state in (RolloutState.SCHEDULED, RolloutState.TRAINED) and seen.get(rid) != entry.step:
                raise LedgerError(f"rollout {rollout_id_repr(rid)} is {entry} but not listed in that step")
        recount = Counter(e.state.value for e in self._entries.values())
        if +recount != +self._by_state:
            raise LedgerError(f"summary counts {dict(+self._by_state)} disagree with the entries {dict(recount)}")


def rollout_id_repr(rollout_id: Hashable) -> str:
    return repr(rollout_id)
