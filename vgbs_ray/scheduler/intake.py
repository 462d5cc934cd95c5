"""Rollout intake: samples in any order -> validated, complete, advantaged rollouts, oldest first.

    intake = RolloutIntake(IntakeConfig(...), ledger)
    outcome = intake.ingest(samples, now=time.monotonic(), accept_new=True)
    rollouts = intake.take_oldest(global_batch_size)

Completion. A sample that says `rollout_size` lets its siblings arrive in other calls, in
any order, interleaved with other rollouts; the rollout is complete when `rollout_size`
distinct `sample_index`es arrived. Samples without `rollout_size` are a whole rollout within
the one call that delivers them (a Ray Data row alone is a one-sample rollout).

Validation. A sample is rejected, with the rollout id and the rule, when it breaks the data
contract (`vgbs_ray.sample`, with the model's vocabulary size and maximum sequence length),
arrives in a push over the size limits (`push_size`), disagrees with the first accepted sample of its rollout
(reward, rollout_size, group, whether it carries an advantage), repeats a sample_index
(duplicate_sample), or belongs to a rollout that is already complete, scheduled, trained
or dropped. A rejection never touches anything already accepted: the rollout stays open
and may still complete with a corrected sample. A whole-call rollout is accepted or
rejected as a unit (nothing of it was accepted before).

Advantages. A rollout whose samples carry no advantage needs a group (`group_id`,
`group_size`); it waits until every rollout of its group is complete, then gets the
group-normalised reward (`vgbs_ray.losses.advantages`). A uniform-reward group is dropped when
`drop_uniform_groups` is set ("uniform_group_reward"), else trained with zero advantages.

Backpressure. A *new* rollout is admitted only while `accept_new` and the buffer (open +
waiting + ready samples and tokens) is under its bounds; otherwise its samples are
*deferred* (returned to the caller, who must resubmit them). Samples of rollouts already
open, and new rollouts of a group already open, are always admitted: refusing them could
never free the buffer (their rollouts would stay incomplete forever).

Ready order: first ready (completed and advantaged), first out.

Checkpoints: `snapshot()` is the buffered state as plain data (`IntakeSnapshot`: samples
with their arrays, ids, group bookkeeping); `restore()` loads one into an empty intake and
accepts its rollouts in the ledger again, ready ones in their order ahead of later pushes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Hashable, NamedTuple, Sequence

from vgbs_ray.losses.advantages import DEFAULT_EPS, group_advantages, is_uniform_group
from vgbs_ray.errors import ConfigError, RolloutValidationError
from vgbs_ray.scheduler.ledger import Ledger, Rejection, RolloutState
from vgbs_ray.sample import Sample, check_sibling, validate_sample
from vgbs_ray.scheduler.settled_ids import SettledIds

__all__ = ["IngestOutcome", "IntakeConfig", "IntakeSnapshot", "ReadyRollout", "Rejection", "RolloutIntake", "UNIFORM_GROUP_REASON"]

UNIFORM_GROUP_REASON = "uniform_group_reward"


@dataclass(frozen=True, kw_only=True)
class IntakeConfig:
    derived_keys: ClassVar[dict[str, str]] = {"vocab_size": "train.model.vocab_size"}

    max_buffered_samples: int | None = None
    """Bound on buffered samples (open + waiting for group + ready); None = unbounded."""
    max_buffered_tokens: int | None = None
    """Bound on buffered tokens (prompt + response); None = unbounded."""
    advantage_eps: float = DEFAULT_EPS
    """eps in (r - mean) / (std + eps) for group advantages."""
    advantage_std: bool = True
    """Divide group advantages by the group's reward std; false: r - mean only (the job sets it false for a
    loss that asks, e.g. train.loss.policy=dr_grpo)."""
    drop_uniform_groups: bool = False
    """Drop a group whose rollouts all have the same reward (no learning signal)."""
    vocab_size: int | None = None
    """The model's vocabulary: a token id outside [0, vocab_size) is rejected (token_range). None = unchecked."""
    max_sequence_length: int | None = None
    """The model's longest sequence in tokens: a longer sample is rejected (sequence_length). None = unchecked."""
    max_samples_per_push: int | None = 100_000
    """A push (one submit call) with more samples is rejected whole (push_size). None = unbounded."""
    max_tokens_per_push: int | None = 200_000_000
    """A push with more tokens in all is rejected whole (push_size). None = unbounded."""

    def __post_init__(self):
        for name in ("max_buffered_samples", "max_buffered_tokens", "vocab_size", "max_sequence_length",
                     "max_samples_per_push", "max_tokens_per_push"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"IntakeConfig.{name} must be a positive integer or None, got {value!r}")
        if self.advantage_eps < 0:
            raise ConfigError(f"IntakeConfig.advantage_eps must be >= 0, got {self.advantage_eps}")


class ReadyRollout(NamedTuple):
    """A complete rollout with advantages set, ready to be scheduled. Times are monotonic seconds.

    A NamedTuple, not a frozen dataclass: as immutable, and built in C (one per pushed rollout;
    the frozen __init__'s four object.__setattr__ calls cost more than the rest of its bookkeeping)."""

    rollout_id: Hashable
    samples: tuple[Sample, ...]
    completed_at: float
    ready_at: float

    @property
    def num_tokens(self) -> int:
        return sum(s.total_length for s in self.samples)


@dataclass(frozen=True)
class IntakeSnapshot:
    """The intake's buffered rollouts as plain data (no times: a restore starts their clocks anew)."""

    ready: tuple = ()
    """(rollout_id, samples) of complete, advantaged rollouts, in the order they are taken."""
    waiting: tuple = ()
    """(rollout_id, samples) of complete rollouts waiting for their group's advantages."""
    open: tuple = ()
    """(rollout_id, expected sample count or None, accepted samples by sample_index) of partly received rollouts."""
    groups: tuple = ()
    """(group_id, group_size, ((member, reward) of complete members), members seen) of open groups."""
    closed_groups: bytes = b""
    """`SettledIds.to_bytes()` of every group that had all its rollouts ("" = none)."""

    @property
    def rollout_ids(self) -> list:
        return [rid for part in (self.ready, self.waiting) for rid, _ in part] + [rid for rid, _, _ in self.open]


@dataclass
class IngestOutcome:
    accepted: int = 0
    rejections: list[Rejection] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    """Positions (in the call) of samples refused by backpressure: resubmit them."""
    completed: list = field(default_factory=list)
    """Rollout ids whose last sample arrived in this call."""
    completed_tokens: list[int] = field(default_factory=list)
    """Their tokens (prompt + response over every sample), in the same order."""
    dropped: list[tuple[Hashable, str]] = field(default_factory=list)


@dataclass
class _Open:
    first: Sample
    samples: dict[int, Sample]
    expected: int | None


@dataclass
class _Group:
    size: int
    rewards: dict = field(default_factory=dict)          # complete member -> reward
    members: set = field(default_factory=set)            # every member seen
    waiting: dict = field(default_factory=dict)          # member needing advantage -> (samples, completed_at)


def _check_whole_rollout(samples: Sequence[Sample]) -> None:
    """`validate_rollout` minus the per-sample rules, which `ingest` already checked."""
    first, seen = samples[0], set()
    for sample in samples:
        check_sibling(first, sample)
        if sample.sample_index in seen:
            raise RolloutValidationError(first.rollout_id, "duplicate_sample",
                                         f"sample_index {sample.sample_index} appears twice", sample_index=sample.sample_index)
        seen.add(sample.sample_index)


class RolloutIntake:
    """Buffers samples until rollouts are complete and advantaged (see module docstring)."""

    def __init__(self, config: IntakeConfig, ledger: Ledger):
        self.config = config
        self.ledger = ledger
        self._open: dict[Hashable, _Open] = {}
        self._groups: dict[Hashable, _Group] = {}
        self._closed_groups = SettledIds()   # every group id that had all its rollouts, exactly, compactly
        self._waiting_group: dict[Hashable, Hashable] = {}   # rollout id -> group id
        self._ready: OrderedDict[Hashable, ReadyRollout] = OrderedDict()
        self._taken: set = set()   # taken for a step, not yet settled in the ledger
        self.buffered_samples = 0
        self.buffered_tokens = 0

    # -- queries ---------------------------------------------------------------------
    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def num_buffered_rollouts(self) -> int:
        return len(self._open) + len(self._waiting_group) + len(self._ready)

    def oldest_ready_at(self) -> float | None:
        return next(iter(self._ready.values())).ready_at if self._ready else None

    def has_room(self) -> tuple[bool, str]:
        """Whether a new rollout may enter, and if not, the bound that is full."""
        c = self.config
        if c.max_buffered_samples is not None and self.buffered_samples >= c.max_buffered_samples:
            return False, f"buffer_full: {self.buffered_samples} samples buffered (max_buffered_samples={c.max_buffered_samples})"
        if c.max_buffered_tokens is not None and self.buffered_tokens >= c.max_buffered_tokens:
            return False, f"buffer_full: {self.buffered_tokens} tokens buffered (max_buffered_tokens={c.max_buffered_tokens})"
        return True, ""

    # -- ingestion -------------------------------------------------------------------
    def ingest(self, rows: Sequence[Sample | dict[str, Any]], *, now: float, accept_new: bool = True) -> IngestOutcome:
        """Validate and buffer one call's samples. Never raises for bad data: see `rejections`."""
        out = IngestOutcome()
        c = self.config
        if c.max_samples_per_push is not None and len(rows) > c.max_samples_per_push:
            self._reject_push(out, rows, f"{len(rows)} samples in one push exceed max_samples_per_push={c.max_samples_per_push}")
            return out
        by_rollout: OrderedDict[Hashable, list[tuple[int, Sample]]] = OrderedDict()
        push_tokens = 0
        for position, row in enumerate(rows):
            if not isinstance(row, (Sample, dict)):
                self._reject(out, None, None, "wrong_type", f"a sample must be a dict or a Sample, got {type(row).__name__}")
                continue
            try:
                sample = row if isinstance(row, Sample) else Sample.from_dict(row)
                validate_sample(sample, vocab_size=c.vocab_size, max_sequence_length=c.max_sequence_length)
                push_tokens += sample.total_length
            except RolloutValidationError as e:
                self._reject(out, e.rollout_id, e.sample_index, e.rule, e.detail)
                continue
            except (TypeError, ValueError, KeyError) as e:
                rid = row.get("rollout_id") if hasattr(row, "get") else None
                self._reject(out, rid, None, "data_contract", f"sample cannot be read: {e}")
                continue
            try:
                by_rollout.setdefault(sample.rollout_id, []).append((position, sample))
            except TypeError:
                self._reject(out, repr(sample.rollout_id), sample.sample_index, "rollout_id", "rollout_id must be hashable")
        if c.max_tokens_per_push is not None and push_tokens > c.max_tokens_per_push:
            self._reject_push(out, rows, f"{push_tokens} tokens in one push exceed max_tokens_per_push={c.max_tokens_per_push}")
            return out
        deferring = False
        for rid, items in by_rollout.items():
            closed = None if rid in self._open else self._closed_reason(rid)  # an open rollout is never closed
            if rid not in self._open and not closed:
                group_open = items[0][1].group_id in self._groups
                if not group_open:
                    room, _ = self.has_room()
                    deferring = deferring or not (accept_new and room)
                if deferring and not group_open:
                    out.deferred.extend(p for p, _ in items)
                    continue
            self._ingest_rollout(rid, [s for _, s in items], now, out, closed)
        return out

    def _closed_reason(self, rid) -> str | None:
        """Why a sample of `rid` (not open) can no longer be accepted, or None."""
        entry = self.ledger.get(rid)
        state = None if entry is None else entry.state
        if state in (RolloutState.SCHEDULED, RolloutState.TRAINED):
            return f"already_scheduled: rollout is {state.value} in step {entry.step}"
        if state is RolloutState.DROPPED:
            return f"already_dropped: rollout was dropped ({entry.reason})"
        if rid in self._taken:
            return "already_scheduled: rollout is being scheduled"
        if rid in self._ready or rid in self._waiting_group:
            return "already_complete: rollout already has all its samples"
        return None

    def _ingest_rollout(self, rid, samples: list[Sample], now: float, out: IngestOutcome, closed: str | None) -> None:
        if closed:
            rule, detail = closed.split(": ", 1)
            for s in samples:
                self._reject(out, rid, s.sample_index, rule, f"{detail}; a late sample is never trained")
            return
        if rid not in self._open and len(samples) == 1 and samples[0].rollout_size in (None, 1):
            # A one-sample rollout (the common case): the checks of both paths below, without an _Open.
            sample = samples[0]
            try:
                self._check_new_rollout(sample)
            except RolloutValidationError as e:
                self._reject(out, rid, sample.sample_index, e.rule, e.detail)
                return
            self._buffer(rid, sample, out)
            out.completed.append(rid)
            out.completed_tokens.append(sample.total_length)
            self._complete(rid, (sample,), now, out)
            return
        if rid not in self._open and samples[0].rollout_size is None:
            # A whole rollout in this call: accept or reject it as a unit.
            try:
                _check_whole_rollout(samples)
                if len({s.advantage is None for s in samples}) > 1:
                    raise RolloutValidationError(rid, "sibling_advantage",
                                                 "siblings must all carry an advantage or all leave it to the group")
                self._check_new_rollout(samples[0])
            except RolloutValidationError as e:
                for s in samples:
                    self._reject(out, rid, s.sample_index, e.rule, e.detail)
                return
            self._open[rid] = _Open(samples[0], {}, expected=len(samples))
            for s in samples:
                self._accept(rid, self._open[rid], s, now, out)
            return
        for s in samples:
            self._add_to_open(rid, s, now, out)

    def _check_new_rollout(self, first: Sample) -> None:
        rid = first.rollout_id
        if first.advantage is None and first.group_id is None:
            raise RolloutValidationError(rid, "missing_advantage",
                                         "sample has neither an advantage nor a group_id/group_size to compute one")
        if first.group_id is None:
            return
        group = self._groups.get(first.group_id)
        if group is None and first.group_id in self._closed_groups:  # an open group is never closed
            raise RolloutValidationError(rid, "group_closed", f"group {first.group_id!r} already had all its rollouts")
        if group is not None and group.size != first.group_size:
            raise RolloutValidationError(rid, "group_size",
                                         f"group_size {first.group_size} differs from group {first.group_id!r}'s {group.size}")
        if group is not None and len(group.members) >= group.size:
            raise RolloutValidationError(rid, "group_full", f"group {first.group_id!r} already has {group.size} rollouts")

    def _add_to_open(self, rid, sample: Sample, now: float, out: IngestOutcome) -> None:
        entry = self._open.get(rid)
        try:
            if entry is None:
                self._check_new_rollout(sample)
            else:
                check_sibling(entry.first, sample)
                if (entry.first.advantage is None) != (sample.advantage is None):
                    raise RolloutValidationError(rid, "sibling_advantage",
                                                 "siblings must all carry an advantage or all leave it to the group",
                                                 sample_index=sample.sample_index)
                if sample.sample_index in entry.samples:
                    raise RolloutValidationError(rid, "duplicate_sample", f"sample_index {sample.sample_index} already arrived",
                                                 sample_index=sample.sample_index)
        except RolloutValidationError as e:
            self._reject(out, rid, sample.sample_index, e.rule, e.detail)
            return
        if entry is None:
            entry = self._open[rid] = _Open(sample, {}, expected=sample.rollout_size)
        self._accept(rid, entry, sample, now, out)

    def _accept(self, rid, entry: _Open, sample: Sample, now: float, out: IngestOutcome) -> None:
        """Buffer a sample that passed every check; complete its rollout when it is the last."""
        entry.samples[sample.sample_index] = sample
        self._buffer(rid, sample, out)
        if len(entry.samples) == entry.expected:
            del self._open[rid]
            out.completed.append(rid)
            out.completed_tokens.append(sum(s.total_length for s in entry.samples.values()))
            self._complete(rid, tuple(entry.samples[i] for i in sorted(entry.samples)), now, out)

    def _buffer(self, rid, sample: Sample, out: IngestOutcome) -> None:
        """Count an accepted sample: its group's members, the ledger, the buffer's bounds."""
        if sample.group_id is not None:
            group = self._groups.get(sample.group_id)
            if group is None:  # not setdefault: that would build a _Group for every sample
                group = self._groups[sample.group_id] = _Group(size=sample.group_size)
            group.members.add(rid)
        self.ledger.accept_sample(rid)
        self.buffered_samples += 1
        self.buffered_tokens += sample.total_length
        out.accepted += 1

    def _complete(self, rid, samples: tuple[Sample, ...], now: float, out: IngestOutcome) -> None:
        first = samples[0]
        if first.group_id is None:
            self._ready[rid] = ReadyRollout(rid, samples, completed_at=now, ready_at=now)
            return
        group = self._groups[first.group_id]
        group.rewards[rid] = first.reward
        if first.advantage is None:
            group.waiting[rid] = (samples, now)
            self._waiting_group[rid] = first.group_id
        else:
            self._ready[rid] = ReadyRollout(rid, samples, completed_at=now, ready_at=now)
        if len(group.rewards) == group.size:
            self._resolve_group(first.group_id, group, now, out)

    def _resolve_group(self, group_id, group: _Group, now: float, out: IngestOutcome) -> None:
        del self._groups[group_id]
        self._closed_groups.add(group_id, reason="closed")
        # Only the drop policy needs to know (a uniform group's advantages are zeros anyway).
        drop = self.config.drop_uniform_groups and is_uniform_group(list(group.rewards.values()))
        advantages = group_advantages(group.rewards, self.config.advantage_eps, self.config.advantage_std)
        for rid, (samples, completed_at) in group.waiting.items():
            del self._waiting_group[rid]
            if drop:
                self._release(samples)
                self.ledger.drop(rid, UNIFORM_GROUP_REASON)
                out.dropped.append((rid, UNIFORM_GROUP_REASON))
                continue
            advantaged = tuple([s.with_advantage(advantages[rid]) for s in samples])
            self._ready[rid] = ReadyRollout(rid, advantaged, completed_at=completed_at, ready_at=now)

    def _reject(self, out: IngestOutcome, rid, sample_index, rule: str, message: str) -> None:
        rejection = Rejection(rid, sample_index, rule, message)
        out.rejections.append(rejection)
        self.ledger.reject(rejection)

    def _reject_push(self, out: IngestOutcome, rows, message: str) -> None:
        """Reject every sample of a push that breaks a size limit (nothing of it is read further)."""
        for row in rows:
            rid = row.rollout_id if isinstance(row, Sample) else (row.get("rollout_id") if hasattr(row, "get") else None)
            index = row.sample_index if isinstance(row, Sample) else (row.get("sample_index") if hasattr(row, "get") else None)
            self._reject(out, rid, index, "push_size", message)

    def _release(self, samples: Sequence[Sample]) -> None:
        self.buffered_samples -= len(samples)
        self.buffered_tokens -= sum(s.total_length for s in samples)

    # -- checkpoints -----------------------------------------------------------------
    def snapshot(self, front: Sequence[ReadyRollout] = ()) -> IntakeSnapshot:
        """The buffered state as plain data; `front` (e.g. rollouts of emitted, untrained steps) goes
        ahead of the ready ones. Changes nothing. Call between emissions (nothing taken)."""
        if self._taken:
            raise RuntimeError(f"{len(self._taken)} rollouts are being scheduled: snapshot between emissions")
        return IntakeSnapshot(
            ready=tuple((r.rollout_id, r.samples) for r in [*front, *self._ready.values()]),
            waiting=tuple((rid, self._groups[gid].waiting[rid][0]) for rid, gid in self._waiting_group.items()),
            open=tuple((rid, e.expected, tuple(e.samples[i] for i in sorted(e.samples))) for rid, e in self._open.items()),
            groups=tuple((gid, g.size, tuple(g.rewards.items()), tuple(g.members)) for gid, g in self._groups.items()),
            closed_groups=self._closed_groups.to_bytes() if len(self._closed_groups) else b"",
        )

    def restore(self, snapshot: IntakeSnapshot, *, now: float) -> None:
        """Load `snapshot` into this empty intake and accept its rollouts in the ledger (BUFFERED)."""
        if self.num_buffered_rollouts or self._groups or len(self._closed_groups):
            raise RuntimeError("restore needs an empty intake")
        if snapshot.closed_groups:
            self._closed_groups = SettledIds.from_bytes(snapshot.closed_groups)
        for gid, size, rewards, members in snapshot.groups:
            self._groups[gid] = _Group(size=size, rewards=dict(rewards), members=set(members))
        for rid, samples in snapshot.ready:
            self._ready[rid] = ReadyRollout(rid, tuple(samples), completed_at=now, ready_at=now)
        for rid, samples in snapshot.waiting:
            gid = samples[0].group_id
            self._groups[gid].waiting[rid] = (tuple(samples), now)
            self._waiting_group[rid] = gid
        for rid, expected, samples in snapshot.open:
            self._open[rid] = _Open(samples[0], {s.sample_index: s for s in samples}, expected)
        for rid in snapshot.rollout_ids:
            self.ledger.accept_sample(rid)
        every = [s for part in (snapshot.ready, snapshot.waiting) for _, ss in part for s in ss]
        every += [s for _, _, ss in snapshot.open for s in ss]
        self.buffered_samples = len(every)
        self.buffered_tokens = sum(s.total_length for s in every)

    # -- leaving the buffer ----------------------------------------------------------
    def take_oldest(self, count: int) -> list[ReadyRollout]:
        """Remove and return up to `count` ready rollouts, first ready first.

        They stay in the ledger as BUFFERED until the caller schedules or drops them and
        calls `settle`; meanwhile a late sample of one is rejected (already_scheduled).
        """
        ready, taken = self._ready, []
        while ready and len(taken) < count:
            taken.append(ready.popitem(last=False)[1])
        self._taken.update([rollout.rollout_id for rollout in taken])
        self._release([sample for rollout in taken for sample in rollout.samples])  # once per step, not per rollout
        return taken

    def ready_rollouts(self):
        """The ready rollouts, first ready first (a view: do not change the intake while iterating)."""
        return self._ready.values()

    def take(self, rollout_ids) -> list[ReadyRollout]:
        """Remove and return the named ready rollouts, in the given order (like `take_oldest`, by id).
        Raises KeyError for an id that is not ready (nothing is taken then)."""
        missing = [rid for rid in rollout_ids if rid not in self._ready]
        if missing:
            raise KeyError(f"rollouts {missing[:3]} are not ready")
        taken = [self._ready.pop(rid) for rid in rollout_ids]
        for rollout in taken:
            self._release(rollout.samples)
            self._taken.add(rollout.rollout_id)
        return taken

    def settle(self, rollout_ids) -> None:
        """Taken rollouts are now scheduled or dropped in the ledger."""
        self._taken.difference_update(rollout_ids)

    def return_front(self, rollouts: Sequence[ReadyRollout]) -> None:
        """Put taken rollouts back at the head of the queue, in their order (a step that was not emitted)."""
        for rollout in reversed(rollouts):
            self._taken.discard(rollout.rollout_id)
            self._ready[rollout.rollout_id] = rollout
            self._ready.move_to_end(rollout.rollout_id, last=False)
            self.buffered_samples += len(rollout.samples)
            self.buffered_tokens += rollout.num_tokens

    def close_incomplete(self) -> list[tuple[Hashable, str, str]]:
        """End of input: drop every open rollout and every rollout waiting for its group.

        Returns (rollout_id, reason, detail) for each; the caller records them in the ledger.
        """
        closed = []
        for rid, entry in self._open.items():
            have = sorted(entry.samples)
            closed.append((rid, "incomplete_rollout", f"has sample_index {have} of rollout_size {entry.expected}"))
            self._release(list(entry.samples.values()))
        self._open.clear()
        for rid, group_id in self._waiting_group.items():
            group = self._groups[group_id]
            samples, _ = group.waiting[rid]
            closed.append((rid, "incomplete_group", f"group {group_id!r} has {len(group.rewards)} of {group.size} rollouts complete"))
            self._release(samples)
        self._waiting_group.clear()
        self._groups.clear()
        return closed
