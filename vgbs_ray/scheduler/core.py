"""The scheduler's state and every decision on it, synchronous and Ray-free.

    core = SchedulerCore(SchedulerConfig(batch=BatchConfig(global_batch_size=8)))
    core.register(ParallelConfig(dp_size=2))
    out = core.ingest(samples, now=time.monotonic())           # validate, buffer, complete, advantage
    action = core.next_action(now=..., flush_requests=(), active_datasets=0)
    rollouts = core.take(action.rollout_ids)                    # EmitFullStep: the step's rollouts
    planned = plan_step(rollouts, step=core.next_step, parallel=core.parallel, batch=config.batch)
    record = core.publish(rollouts, planned, where=shards_in_store, trigger="full", ...)
    core.ack(record.step, {0: pairs, 1: pairs})                 # True: every rank trained it

`SchedulerCore` owns the intake (`RolloutIntake`), the ledger (`Ledger`), the emitted steps
until every rank acknowledged them (`StepSlot`), the step records, the counters and a
`StepChooser` (`FifoChooser`, or the `StalenessWindow` with `max_staleness`): the SchedulerActor
(actors/scheduler_actor.py) keeps only what is Ray's around it: waits and signals, the layout
thread, `ray.put` of the shards, the Ray Data consumer and metrics publishing. Every method
runs to completion and is called by one owner at a time (the actor's event loop); times are
passed in (`now`, monotonic seconds), so tests drive it in milliseconds without Ray.

Invariants (tests/test_scheduler_core.py): every accepted rollout is in exactly one ledger
state; a step's rollouts are scheduled in it once and train once; `next_step` is the policy
version the next step trains (= the chooser's `steps_formed`) through emissions, rewinds and
restores; a rewound or restored step takes the rollouts it took before, in their order; and the
decisions never stall (`next_action` returns a wait only when no action can make progress).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, Sequence

from vgbs_ray.config import ParallelConfig, check_schedule_configs
from vgbs_ray.errors import ConfigError, SchedulerStateError
from vgbs_ray.scheduler.intake import IngestOutcome, ReadyRollout, RolloutIntake
from vgbs_ray.scheduler.ledger import Ledger
from vgbs_ray.metrics import reduce_metric_pairs
from vgbs_ray.sample import Sample
from vgbs_ray.scheduler.policy import Action, FlushRequest, SchedulerView, admit_new_rollouts, next_action
from vgbs_ray.scheduler.state import SchedulerState
from vgbs_ray.scheduler.types import ENGINES_BUDGET, Admission, SchedulerConfig, SchedulerStats, StepRecord
from vgbs_ray.scheduler.settled_ids import SettledIds
from vgbs_ray.scheduler.token_budget import TokenBudget
from vgbs_ray.scheduler.staleness import STALE_REASON, oldest_versions, staleness_stats
from vgbs_ray.scheduler.staleness_window import StalenessWindow
from vgbs_ray.scheduler.step_choice import FifoChooser, StepChooser
from vgbs_ray.scheduler.stepping import PlannedStep, leftover_action, leftover_drop_reason


class SchedulerEvents:
    """What the core reports as it goes (the actor's Ray metrics implement it); these do nothing."""

    def on_submit(self, accepted: int, rejected_rules: Sequence[str], deferred: int) -> None: ...

    def on_drop(self, reason: str, count: int = 1) -> None: ...

    def on_stale_drop(self, count: int) -> None: ...

    def on_step(self, record: StepRecord) -> None: ...


@dataclass
class StepSlot:
    """An emitted step until every DP rank acknowledged it: where its shards are and who acked."""

    where: list
    """Per DP rank, where its shard is (the actor's (ObjectRef, index or None)); opaque here."""
    rollouts: list
    """The step's rollouts, kept until it is acknowledged (a rewind puts them back in front)."""
    acks: dict = field(default_factory=dict)
    """DP rank -> its (sum, count) metric pairs."""


class SchedulerCore:
    """See the module docstring. `restore`: a `SchedulerState` from `export_state(n)`; `now` starts the
    restored rollouts' clocks."""

    def __init__(self, config: SchedulerConfig, *, name: str = "scheduler", events: SchedulerEvents | None = None,
                 log: logging.Logger | None = None, restore: SchedulerState | None = None, now: float = 0.0):
        self.config = config
        self.name = name
        self.events = events or SchedulerEvents()
        self.log = log or logging.getLogger(f"vgbs_ray.scheduler.{name}")
        self.ledger = Ledger()
        self.intake = RolloutIntake(config.intake, self.ledger)
        gbs = config.batch.global_batch_size
        self.chooser: StepChooser = (FifoChooser(gbs=gbs) if config.max_staleness is None
                                     else StalenessWindow(gbs=gbs, max_staleness=config.max_staleness))
        self.parallel: ParallelConfig | None = None
        """The registered train group's parallel config (`register`): steps are laid out for it."""
        self.slots: dict[int, StepSlot] = {}
        self._retained: dict[int, list[ReadyRollout]] = {}  # trained, not yet in a checkpoint (retain_until_checkpoint)
        self._records: OrderedDict[int, StepRecord] = OrderedDict()
        self._trained_records = 0  # records of trained steps among _records (the window bounds these)
        self._replay: set = set()  # ready rollouts put back by a rewind or a restore: they form steps first, in order
        self.next_step = 0
        """The next step's number = the policy version it trains (= chooser.steps_formed)."""
        self.steps_trained = 0
        self.input_closed = False
        self.ended = False
        """Input closed and its last flush ran: no step is emitted any more."""
        self._partial_steps = self._padded_steps = 0
        self._accepted = self._rejected = self._deferred = 0
        self._admitted = self._refused_admissions = 0
        self.tokens: TokenBudget | None = None
        """Admission by tokens (vgbs_ray/scheduler/token_budget.py), when configured (for "engines": once they set it)."""
        if config.admission_token_budget not in (None, ENGINES_BUDGET):
            self.set_token_budget(config.admission_token_budget)
        self._incomplete: list = []
        self._hold_released_at: int | None = None  # the step whose hold for last-chance rollouts was last released
        if restore is not None:
            self._restore(restore, now)

    def _restore(self, state: SchedulerState, now: float) -> None:
        if not isinstance(state, SchedulerState):
            raise ConfigError(f"restore must be a SchedulerState (export_state), got {type(state).__name__}")
        settled = SettledIds.from_bytes(state.settled)
        again = next((rid for rid in state.intake.rollout_ids if rid in settled), None)
        if again is not None:
            raise ConfigError(f"SchedulerState lists rollout {again!r} both as settled and as untrained")
        self.ledger = Ledger.restored(settled, next_step=state.next_step,
                                      rejected_samples_by_rule=state.rejected_samples_by_rule)
        self.intake = RolloutIntake(self.config.intake, self.ledger)
        self.intake.restore(state.intake, now=now)
        self.next_step = self.steps_trained = state.next_step
        self._replay.update(state.untrained_rollout_ids[:state.replay_rollouts])
        self.chooser.steps_formed = state.policy_version
        self.chooser.add_pending(state.intake.rollout_ids)  # they fill the next steps: admissions land behind them
        self._accepted, self._rejected = state.accepted_samples, state.rejected_samples
        self.log.info("%s: restored at step %d: %d settled rollouts, %d untrained back in the buffer",
                      self.name, state.next_step, len(settled), state.num_live_rollouts)

    # -- train side --------------------------------------------------------------------
    def register(self, parallel: ParallelConfig) -> None:
        """The train group's parallel config; steps are laid out only after this, every one for it.
        Raises ConfigError for configs that can never be laid out, or a different config once steps were
        emitted."""
        check_schedule_configs(parallel, self.config.batch)
        if self.parallel is not None and self.next_step and parallel != self.parallel:
            raise ConfigError(f"scheduler {self.name!r} already emitted steps for {self.parallel}; "
                              "start a new scheduler for a different train group")
        self.parallel = parallel
        self.log.info("%s: train group registered (%s)", self.name, parallel)

    def ack(self, step: int, metrics_by_rank: Mapping[int, dict[str, tuple[float, float]] | None]) -> bool:
        """These DP ranks trained `step`, with their (sum, count) metric pairs. True when the step is complete:
        its slot is released and the pairs of every rank are reduced into its record. Checks every rank
        before recording any: a refused ack changes nothing."""
        slot = self.slots.get(step)
        if slot is None:
            what = "was already acknowledged by every rank" if step < self.next_step else "was never emitted"
            raise SchedulerStateError(f"ack for step {step}, which {what}")
        for rank in metrics_by_rank:
            if not 0 <= rank < len(slot.where):
                raise ConfigError(f"rank {rank} is outside dp_size={len(slot.where)}")
            if rank in slot.acks:
                raise SchedulerStateError(f"step {step}: rank {rank} acknowledged twice")
        for rank, metrics in metrics_by_rank.items():
            slot.acks[rank] = dict(metrics or {})
        if len(slot.acks) < len(slot.where):
            return False
        retain = self.config.retain_until_checkpoint
        self.ledger.train_step(step, settle=not retain)
        if retain:
            self._retained[step] = slot.rollouts
        del self.slots[step]  # the scheduler's references go; borrowers keep theirs alive
        if step in self._records:
            reduced = reduce_metric_pairs(slot.acks[r] for r in sorted(slot.acks))
            self._records[step] = replace(self._records[step], trained=True, metrics=reduced)
            self._trained_records += 1
            self._trim_records()
        self.steps_trained += 1
        return True

    def checkpointed(self, next_step: int) -> None:
        """A checkpoint holds every step < `next_step`: their rollouts are settled for good."""
        self.ledger.settle_through(next_step)
        for step in [s for s in self._retained if s < next_step]:
            del self._retained[step]

    def rewind(self, next_step: int) -> list[ReadyRollout]:
        """A new train group restored the checkpoint holding every step < `next_step`: every later step did not
        happen; its rollouts go back to the front of the buffer in their order, to train again exactly once.
        Returns them. An ended stream is open again (`ended` False): the caller runs its end-of-input flush again
        after the replayed steps. Raises SchedulerStateError (changing nothing) if such a step was trained and
        released."""
        missing = [s for s in range(next_step, self.next_step) if s not in self.slots and s not in self._retained]
        if missing:
            raise SchedulerStateError(
                f"cannot rewind to step {next_step}: step {missing[0]} was trained and its rollouts released; "
                "set SchedulerConfig.retain_until_checkpoint=True and call checkpointed(n) after each checkpoint")
        rollouts = self._undo_steps_from(next_step)
        self.ended = False
        self.log.warning("%s: rewound to step %d: %d rollouts back in front of the buffer",
                         self.name, next_step, len(rollouts))
        return rollouts

    def drop_untrained(self, next_step: int, reason: str) -> int:
        """The run ended after step `next_step - 1`: later steps and every ready rollout are dropped with
        `reason` and the stream ends. Returns the number dropped. Raises like `rewind`."""
        self._undo_steps_from(next_step)  # back in front of the buffer, then dropped with the rest
        dropped = [r.rollout_id for r in self.intake.take_oldest(self.intake.num_ready)]
        self._drop(dropped, reason)
        self.chooser.discard_in_flight()
        self._release_all()
        self.input_closed = self.ended = True
        return len(dropped)

    def export_state(self, next_step: int) -> SchedulerState:
        """The state a checkpoint holding every step < `next_step` needs to resume this scheduler (see
        vgbs_ray.scheduler.state). Every step < `next_step` must be trained; steps >= it already emitted go
        first, as untrained. Changes nothing. Raises SchedulerStateError naming the step that prevents it."""
        if not 0 <= next_step <= self.next_step:
            raise SchedulerStateError(f"cannot export at step {next_step}: steps emitted so far are "
                                      f"< {self.next_step}, and a checkpoint holds trained steps only")
        untrained = sorted(s for s in self.slots if s < next_step)
        if untrained:
            raise SchedulerStateError(f"cannot export at step {next_step}: step {untrained[0]} is not acknowledged "
                                      "by every rank yet; export after acking every step before the checkpoint")
        released = [s for s in range(next_step, self.next_step) if s not in self.slots and s not in self._retained]
        if released:
            raise SchedulerStateError(
                f"cannot export at step {next_step}: step {released[0]} was trained and its rollouts released; "
                "set SchedulerConfig.retain_until_checkpoint=True or export at a later step")
        front = [r for s in range(next_step, self.next_step)
                 for r in (self.slots[s].rollouts if s in self.slots else self._retained[s])]
        settled = self.ledger.export_settled(next_step)
        return SchedulerState(
            next_step=next_step, settled=settled.to_bytes(), intake=self.intake.snapshot(front),
            policy_version=next_step, replay_rollouts=len(front),
            rejected_samples_by_rule=dict(self.ledger.summary().rejected_samples_by_rule),
            dropped_by_reason=settled.counts()[1], accepted_samples=self._accepted, rejected_samples=self._rejected)

    # -- producer side -----------------------------------------------------------------
    def admission(self) -> tuple[bool, str]:
        """Whether a new rollout may enter now, and if not, why (backpressure: steps ahead, buffer bounds)."""
        room, why = self.intake.has_room()
        return admit_new_rollouts(steps_in_flight=self.next_step - self.steps_trained,
                                  max_steps_ahead=self.config.max_steps_ahead, buffer_has_room=room, buffer_reason=why)

    def ingest(self, samples: Sequence[Sample | dict[str, Any]], *, now: float) -> IngestOutcome:
        """Validate and buffer one call's samples (see RolloutIntake.ingest); new rollouts are deferred while
        `admission()` refuses them. Never raises for bad data: see the outcome's rejections."""
        accept_new, _ = self.admission()
        out = self.intake.ingest(samples, now=now, accept_new=accept_new)
        for rid, tokens in zip(out.completed, out.completed_tokens):
            self.chooser.finished(rid)
            if self.tokens is not None:
                self.tokens.completed(rid, tokens)
        self._discard([rid for rid, _ in out.dropped])
        # A rejected rollout with nothing accepted never trains (unless sent again, then as a rollout that was
        # not admitted): free its room. An open one may still complete.
        self._discard([r.rollout_id for r in out.rejections
                       if self.chooser.is_pending(r.rollout_id) and self.ledger.get(r.rollout_id) is None])
        self._accepted += out.accepted
        self._rejected += len(out.rejections)
        self.events.on_submit(out.accepted, [r.rule for r in out.rejections], 0)
        for _, reason in out.dropped:
            self.events.on_drop(reason)
        if out.rejections:
            first = out.rejections[0]
            self.log.warning("%s: rejected %d sample(s); first: rollout %r, rule %s: %s", self.name,
                             len(out.rejections), first.rollout_id, first.rule, first.message)
        return out

    def deferred(self, count: int) -> str:
        """A submit returned `count` samples unaccepted (backpressure): counted, they were not taken. Returns
        why (the backpressure reason)."""
        self._deferred += count
        self.events.on_submit(0, (), count)
        return self.admission()[1] or "buffer_full"

    def set_token_budget(self, budget_tokens: int) -> None:
        """Admit by tokens against `budget_tokens` from now on (admission_token_budget="engines": their KV caches,
        set by the job before any producer runs). A later call changes the budget alone: the rollouts in flight
        and the expectation learned stay."""
        if not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise ConfigError(f"scheduler {self.name!r}: a token budget must be an integer >= 1, got {budget_tokens!r}")
        if self.tokens is not None:
            self.tokens.budget_tokens = budget_tokens
            return
        config = self.config
        self.tokens = TokenBudget(budget_tokens, config.admission_tokens_per_rollout
                                  or config.intake.max_sequence_length or budget_tokens)

    def admit(self, rollout_ids: Sequence, engine_version: int, producer: int | None = None) -> Admission:
        """May a producer start these rollouts (a group: all or none) with an engine at `engine_version`?
        Ids the scheduler already holds come back in `known` and are never admitted again; ids admitted before
        and not yet in a step stay admitted. See SchedulerActor.admit."""
        ids = list(rollout_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ConfigError(f"admit needs distinct rollout ids (one group), got {ids!r}")
        known = tuple(rid for rid in ids if self.ledger.get(rid) is not None)
        if not self.chooser.enforced:
            return Admission(True, self.next_step, self.next_step - engine_version, known=known, enforced=False)
        self.chooser.check_group(len(ids))
        skip = set(known)
        new = [rid for rid in ids if rid not in skip and not self.chooser.is_pending(rid)]
        if not new:
            return Admission(True, self.next_step, self.next_step - engine_version, known=known)
        if self.tokens is not None and not self.tokens.fits(len(new)):  # before the staleness rule records anything
            self.tokens.refusals += 1
            self._refused_admissions += 1
            return Admission(False, self.next_step, self.next_step - engine_version, known=known)
        decision = self.chooser.try_admit(new, engine_version, owner=producer)
        if decision.admit:
            self._admitted += len(new)
            if self.tokens is not None:
                self.tokens.add(new)
        else:
            self._refused_admissions += 1
        return Admission(decision.admit, decision.landing_step, decision.expected_staleness, known=known)

    def producer_lost(self, producer: int) -> int:
        """The rollouts `producer` admitted and did not finish no longer hold room; returns how many."""
        ids = self.chooser.discard_owner(producer)
        if self.tokens is not None:
            self.tokens.release(ids)
        return len(ids)

    def abandon(self, rollout_ids: Sequence) -> None:
        """The producer gave these admitted rollouts up: they no longer hold room and no step waits for them."""
        self._discard(list(rollout_ids))

    def fail_rollouts(self, rollout_ids: Sequence, reason: str) -> int:
        """The producer lost these rollouts before pushing a sample: each unknown id is DROPPED(reason) and
        leaves the chooser. Returns how many were recorded."""
        new = [rid for rid in dict.fromkeys(rollout_ids) if self.ledger.get(rid) is None]
        for rid in new:
            self.ledger.fail(rid, reason)
        self._discard(new)
        if new:
            self.events.on_drop(reason, len(new))
            self.log.info("%s: %d rollouts lost by their producer (%s)", self.name, len(new), reason)
        return len(new)

    # -- forming steps -----------------------------------------------------------------
    def next_action(self, *, now: float, flush_requests: Sequence[FlushRequest] = (), active_datasets: int = 0) -> Action:
        """What to do next (vgbs_ray.scheduler.policy.next_action over this state). O(ready log ready) with
        staleness rules, O(1) without (O(gbs) when a full step is ready). Changes nothing."""
        oldest = self.intake.oldest_ready_at()
        ready = self.intake.ready_rollouts()
        choice = self.chooser.choose(ready, replay=self._replay)
        hold_left = None
        if choice.waiting_for and self.config.max_hold_s is not None and self.parallel is not None:
            held_s = self._held_s(ready, choice, now)
            if held_s is not None and held_s >= self.config.max_hold_s:
                self._release_hold(held_s)
                choice = self.chooser.choose(ready, replay=self._replay, wait_for_in_flight=False)
            elif held_s is not None:
                hold_left = self.config.max_hold_s - held_s
        return next_action(SchedulerView(
            registered=self.parallel is not None, choice=choice, global_batch_size=self.config.batch.global_batch_size,
            leftover=self.config.batch.leftover, flush_requests=tuple(flush_requests), active_datasets=active_datasets,
            oldest_ready_age_s=None if oldest is None else now - oldest, max_wait_s=self.config.max_wait_s,
            hold_left_s=hold_left))

    def _held_s(self, ready: Sequence[ReadyRollout], choice, now: float) -> float | None:
        """Seconds the next step has been held for last-chance rollouts in flight: since its
        `global_batch_size`-th fresh rollout was ready (None: it does not have that many yet)."""
        gbs = self.config.batch.global_batch_size
        if choice.num_fresh < gbs:
            return None
        stale = set(choice.stale)
        ready_at = sorted(r.ready_at for r in ready if r.rollout_id not in stale)
        return now - ready_at[gbs - 1]

    def _release_hold(self, held_s: float) -> None:
        """Log, once per step, the rollouts a held step stops waiting for."""
        if self._hold_released_at == self.next_step:
            return
        self._hold_released_at = self.next_step
        late = self.chooser.last_chance_ids()
        self.log.warning("%s: step %d waited %.1f s (scheduler.max_hold_s=%s) for %d rollout(s) in flight on their last "
                         "chance %s; it forms without them: each trains in a later step if the versions that sampled its tokens "
                         "allow it when it ends, else it is dropped as %r", self.name,
                         self.next_step, held_s, self.config.max_hold_s, len(late), late[:8], STALE_REASON)

    def take(self, rollout_ids: Sequence) -> list[ReadyRollout]:
        """Take these ready rollouts out of the buffer for a step (`publish` it, or `return_front` them)."""
        return self.intake.take(rollout_ids)

    def drop_stale(self, rollout_ids: Sequence) -> None:
        """Rule 1: ready rollouts too old for the next step (so for every later one) are dropped."""
        if rollout_ids:
            self.intake.take(rollout_ids)
            self._drop(rollout_ids, STALE_REASON)
            self.events.on_stale_drop(len(rollout_ids))

    def flush(self, request: FlushRequest, dropped: list) -> Iterator[tuple[list[ReadyRollout], str]]:
        """The steps a flush emits, as (rollouts, trigger), for the caller to lay out and `publish` one by one:
        every full step still formable, then the leftover by its policy (a partial step, or dropped, or kept).
        An end of input then closes incomplete rollouts and ends the stream. A flush never waits for rollouts in
        flight. Appends what it drops to `dropped`."""
        gbs = self.config.batch.global_batch_size
        if request.end_of_input:
            self.chooser.discard_in_flight()  # nothing more arrives: no step may wait for them
            self._release_all()
        while self.parallel is not None and self.intake.num_ready >= gbs:
            rollouts = self._flush_take(partial=False)
            if not rollouts:
                break
            yield rollouts, "full"
        action = leftover_action(self.config.batch.leftover, end_of_input=request.end_of_input)
        if action == "partial":
            leftover = self._flush_take(partial=True)
            if leftover:
                yield leftover, request.trigger
        elif action == "drop":
            self.drop_stale(self._choose_for_flush(partial=False).stale)  # stale ones say so
            ids = [r.rollout_id for r in self.intake.take_oldest(self.intake.num_ready)]
            if ids:
                self._drop(ids, leftover_drop_reason(self.config.batch.leftover))
                dropped += ids
        if request.end_of_input:
            for rid, reason, detail in self.intake.close_incomplete():
                self.ledger.drop(rid, reason)
                self._discard((rid,))
                self.events.on_drop(reason)
                self._incomplete.append((rid, reason, detail))
                dropped.append(rid)
                self.log.warning("%s: rollout %r not trained at end of input: %s (%s)", self.name, rid, reason, detail)
            self.ended = True

    def publish(self, rollouts: list[ReadyRollout], planned: PlannedStep, where: list, trigger: str, *,
                triggered_at: float, now: float) -> StepRecord:
        """Step `next_step` is laid out (`planned`) and its shards are `where` (per DP rank): record it, schedule
        its rollouts in the ledger, and count the next step. Returns its record."""
        step = self.next_step
        ids = tuple(r.rollout_id for r in rollouts)
        waits = [now - r.completed_at for r in rollouts]
        versions = [v for v in oldest_versions(((r.rollout_id, r.samples) for r in rollouts), trained_version=step).values()
                    if v is not None]
        lag = staleness_stats(versions, trained_version=step) if versions else None
        record = StepRecord(
            step=step, num_rollouts=len(ids), num_samples=planned.num_samples, num_tokens=planned.num_tokens,
            microbatches_per_rank=tuple(s.num_microbatches for s in planned.shards),
            padding_microbatches=planned.num_padding_microbatches,
            samples_per_rank=tuple(s.num_samples for s in planned.shards),
            tokens_per_rank=tuple(s.num_tokens for s in planned.shards),
            trigger=trigger,
            partial=len(ids) < self.config.batch.global_batch_size,
            mean_completion_to_emission_s=sum(waits) / len(waits), max_completion_to_emission_s=max(waits),
            scheduling_latency_s=now - max(triggered_at, max(r.ready_at for r in rollouts)),
            rollout_ids=ids, policy_version=step, staleness_mean=None if lag is None else lag.mean,
            staleness_max=None if lag is None else lag.max,
        )
        self.ledger.schedule(ids, step)
        self.intake.settle(ids)
        self._replay.difference_update(ids)
        self.chooser.step_formed(ids)
        self.slots[step] = StepSlot(where=where, rollouts=rollouts)
        self._records[step] = record
        self._trim_records()
        self.next_step += 1
        self._partial_steps += record.partial
        self._padded_steps += record.padding_microbatches > 0
        self.events.on_step(record)
        self.log.info("%s step %d: %d rollouts, %d samples, %s micro-batches/rank (%d padding), %d tokens, %s, "
                      "latency %.1f ms", self.name, step, record.num_rollouts, record.num_samples,
                      record.microbatches_per_rank[0], record.padding_microbatches, record.num_tokens, trigger,
                      record.scheduling_latency_s * 1e3)
        return record

    def return_front(self, rollouts: list[ReadyRollout]) -> None:
        """A taken step was not published (its layout or put failed): its rollouts stay buffered, in front."""
        self.intake.return_front(rollouts)

    # -- reports -----------------------------------------------------------------------
    def step_record(self, step: int) -> StepRecord:
        """Any step not yet trained, or one of the newest `step_record_window` trained ones. O(1)."""
        record = self._records.get(step)
        if record is None:
            raise SchedulerStateError(
                f"no record of step {step}: {self.next_step} steps emitted, the newest "
                f"{self.config.step_record_window} trained ones are kept (SchedulerConfig.step_record_window)")
        return record

    def stats(self, include_rollouts: bool = False, check_ledger: bool = False) -> SchedulerStats:
        """Counts, the newest step records and the ledger summary: O(step_record_window). include_rollouts
        adds every rollout's (state, step, reason); check_ledger runs the ledger invariants. Both O(rollouts)."""
        if check_ledger:
            self.ledger.check()
        states = None
        if include_rollouts:
            states = {rid: (e.state.value, e.step, e.reason) for rid, e in self.ledger.entries()}
        enforced = self.chooser.enforced
        summary = self.ledger.summary()
        return SchedulerStats(
            accepted_samples=self._accepted, rejected_samples=self._rejected, deferred_samples=self._deferred,
            buffered_rollouts=self.intake.num_buffered_rollouts, buffered_samples=self.intake.buffered_samples,
            buffered_tokens=self.intake.buffered_tokens, ready_rollouts=self.intake.num_ready,
            steps_emitted=self.next_step, steps_trained=self.steps_trained,
            partial_steps=self._partial_steps, padded_steps=self._padded_steps,
            input_closed=self.input_closed, ended=self.ended, recent_steps=tuple(self._records.values()),
            ledger=summary, incomplete_rollouts=tuple(self._incomplete),
            rejections=tuple(self.ledger.recent_rejections), rollout_states=states, policy_version=self.next_step,
            stale_dropped_rollouts=summary.dropped_by_reason.get(STALE_REASON, 0),
            staleness_pending=self.chooser.pending_rollouts if enforced else None,
            staleness_in_flight=self.chooser.in_flight_rollouts if enforced else None,
            admitted_rollouts=self._admitted, refused_admissions=self._refused_admissions,
            token_refusals=self.tokens.refusals if self.tokens is not None else 0,
            tokens_in_use=self.tokens.tokens_in_use if self.tokens is not None else None,
            tokens_per_rollout=self.tokens.tokens_per_rollout if self.tokens is not None else None,
            token_budget=self.tokens.budget_tokens if self.tokens is not None else None,
        )

    def describe_wait(self) -> str:
        """Why no step is there yet, for a timeout's message."""
        return (f"{self.intake.num_ready} rollouts ready (global_batch_size={self.config.batch.global_batch_size}), "
                f"{self.intake.num_buffered_rollouts} buffered, {self.next_step} steps emitted, "
                f"train group registered: {self.parallel is not None}")

    # -- internals ---------------------------------------------------------------------
    def _choose_for_flush(self, *, partial: bool):
        return self.chooser.choose(self.intake.ready_rollouts(), replay=self._replay, allow_partial=partial,
                                   wait_for_in_flight=False)

    def _flush_take(self, *, partial: bool) -> list[ReadyRollout]:
        """A flush's next step: stale ones dropped first, no wait for rollouts in flight. Full steps only
        unless `partial`."""
        choice = self._choose_for_flush(partial=partial)
        self.drop_stale(choice.stale)
        if not partial and len(choice.take) < self.config.batch.global_batch_size:
            return []
        return self.intake.take(choice.take)

    def _drop(self, rollout_ids, reason: str) -> None:
        for rid in rollout_ids:
            self.ledger.drop(rid, reason)
        self.intake.settle(rollout_ids)
        self._replay.difference_update(rollout_ids)
        self._discard(rollout_ids)
        self.events.on_drop(reason, len(rollout_ids))
        if rollout_ids:
            self.log.info("%s: dropped %d rollouts (%s)", self.name, len(rollout_ids), reason)

    def _discard(self, rollout_ids) -> None:
        """These rollouts will never complete or train: they leave the chooser and the token budget."""
        self.chooser.discard(rollout_ids)
        if self.tokens is not None:
            self.tokens.release(rollout_ids)

    def _release_all(self) -> None:
        if self.tokens is not None:
            self.tokens.clear()

    def _undo_steps_from(self, next_step: int) -> list[ReadyRollout]:
        """Steps >= `next_step` did not happen: release their slots and records, put their rollouts back in
        front of the buffer in their original order, and number steps from `next_step` again. Raises
        LedgerError (changing nothing) if one of them already settled."""
        self.ledger.rewind(next_step)  # scheduled (and unsettled trained) -> buffered
        rollouts = []
        for step in range(next_step, self.next_step):
            slot = self.slots.pop(step, None)
            rollouts += slot.rollouts if slot is not None else self._retained.pop(step)
            undone = self._records.pop(step, None)
            self._trained_records -= bool(undone is not None and undone.trained)
        self.intake.return_front(rollouts)
        self._replay.update(r.rollout_id for r in rollouts)
        self.next_step = self.chooser.steps_formed = next_step
        self.steps_trained = min(self.steps_trained, next_step)
        return rollouts

    def _trim_records(self) -> None:
        """Keep every untrained step's record (the train side reads it after the step) and the newest trained
        ones up to step_record_window: evict only trained records, oldest first."""
        while self._trained_records > self.config.step_record_window:
            # Steps train in order, so the oldest trained record is (nearly always) the first one.
            step = next(step for step, r in self._records.items() if r.trained)
            del self._records[step]
            self._trained_records -= 1
