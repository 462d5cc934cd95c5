"""Step emission of the SchedulerActor: the emitter thread, flush tickets, leftover handling.

A mixin of `SchedulerActor` (it uses the actor's lock `_cond`, `intake`, `ledger`, `config`,
`metrics`). One emitter thread is the only one that takes ready rollouts out of the intake
and numbers steps, so steps come in emission order. It lays a step out and puts its shards
into the object store *outside* the lock, then publishes under it: pushes, pulls and stats
never wait for a layout. Jobs, in priority order: a full step whenever gbs rollouts are
ready (and a train group is registered); a flush ticket (`flush`, end of a dataset,
`end_of_input`: full steps, then the leftover policy, then at end of input the incomplete
rollouts are closed); the max-wait flush.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

from actors.scheduler_api import FlushResult, StepRecord
from vgbs_ray.errors import ScheduleError, SchedulerStateError, SchedulerTimeoutError
from vgbs_ray.intake import ReadyRollout
from vgbs_ray.stepping import leftover_action, leftover_drop_reason, plan_step

TOO_SMALL_REASON = "too_few_samples_for_partial_step"


@dataclass
class _FlushTicket:
    trigger: str
    end_of_input: bool
    created_at: float
    done: bool = False
    result: FlushResult | None = None
    error: str | None = None


@dataclass
class _StepSlot:
    refs: list | None
    record: StepRecord
    acks: dict = field(default_factory=dict)


class EmissionMixin:
    """The emitter half of SchedulerActor (see module docstring)."""

    # -- internals: emission -------------------------------------------------------------
    def _enqueue(self, trigger: str, *, end_of_input: bool) -> _FlushTicket:
        ticket = _FlushTicket(trigger, end_of_input, time.monotonic())
        with self._cond:
            self._tickets.append(ticket)
            self._cond.notify_all()
        return ticket

    def _wait_ticket(self, ticket: _FlushTicket, timeout_s: float) -> FlushResult:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not ticket.done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SchedulerTimeoutError(
                        f"{ticket.trigger} not done after {timeout_s} s: train group registered: "
                        f"{self._parallel is not None}, datasets still running: {self._active_datasets}")
                self._cond.wait(remaining)
            if ticket.error is not None:
                raise SchedulerStateError(f"{ticket.trigger} failed in the scheduler: {ticket.error}")
            return ticket.result

    def _next_job(self):
        """Under the lock: the emitter's next job, or None to keep waiting."""
        gbs = self.config.batch.global_batch_size
        if self._parallel is not None and self.intake.num_ready >= gbs and self.intake.num_ready != self._stalled_ready:
            return ("full", self.intake.take_oldest(gbs))
        for ticket in self._tickets:
            if ticket.end_of_input and self._active_datasets:
                continue  # end of input waits for running datasets
            needs_layout = leftover_action(self.config.batch.leftover, end_of_input=ticket.end_of_input) == "partial"
            ready = self.intake.num_ready
            if self._parallel is None and ((needs_layout and ready) or ready >= gbs):
                continue  # waits for register_train_group: never drop what could form a step
            self._tickets.remove(ticket)
            return ("ticket", ticket)
        wait = self.config.max_wait_s
        oldest = self.intake.oldest_ready_at()
        if (wait is not None and oldest is not None and self._parallel is not None and self.config.batch.leftover != "carry"
                and time.monotonic() - oldest >= wait and self.intake.num_ready != self._stalled_ready):
            return ("ticket", _FlushTicket("max_wait", False, time.monotonic()))
        return None

    def _emit_loop(self) -> None:
        while True:
            with self._cond:
                job = None
                while job is None and not self._stop:
                    job = self._next_job()
                    if job is None:
                        self._cond.wait(self._idle_wait_s())
                if self._stop:
                    return
            try:
                if job[0] == "full":
                    self._emit(job[1], "full", triggered_at=job[1][-1].ready_at, end_of_input=False)
                else:
                    self._run_ticket(job[1])
            except Exception as e:  # noqa: BLE001 - a bug must not kill the emitter silently
                self.log.exception("%s: emitter failed on %s: %r", self.name, job[0], e)
                if job[0] == "ticket":
                    with self._cond:
                        job[1].error, job[1].done = repr(e), True
                        self._cond.notify_all()

    def _idle_wait_s(self) -> float:
        if self.config.max_wait_s is None:
            return 1.0
        return max(0.01, min(1.0, self.config.max_wait_s / 4))

    def _run_ticket(self, ticket: _FlushTicket) -> None:
        steps, dropped, gbs = [], [], self.config.batch.global_batch_size
        while True:
            with self._cond:
                full = self.intake.take_oldest(gbs) if self._parallel and self.intake.num_ready >= gbs else None
            if not full:
                break
            steps.append(self._emit(full, "full", triggered_at=full[-1].ready_at, end_of_input=False))
        action = leftover_action(self.config.batch.leftover, end_of_input=ticket.end_of_input)
        with self._cond:
            leftover = self.intake.take_oldest(self.intake.num_ready) if action != "keep" else []
            if action == "drop":
                self._drop([r.rollout_id for r in leftover], leftover_drop_reason(self.config.batch.leftover))
                dropped += [r.rollout_id for r in leftover]
                leftover = []
        if leftover:
            step = self._emit(leftover, ticket.trigger, triggered_at=ticket.created_at, end_of_input=ticket.end_of_input)
            steps.append(step)
            if step is None and ticket.end_of_input:
                dropped += [r.rollout_id for r in leftover]
        with self._cond:
            if ticket.end_of_input:
                for rid, reason, detail in self.intake.close_incomplete():
                    self.ledger.drop(rid, reason)
                    self.metrics.on_drop(reason)
                    self._incomplete.append((rid, reason, detail))
                    dropped.append(rid)
                    self.log.warning("%s: rollout %r not trained at end of input: %s (%s)", self.name, rid, reason, detail)
                self._ended = True
            ticket.result = FlushResult(steps=tuple(s for s in steps if s is not None), dropped=tuple(dropped),
                                        kept=self.intake.num_ready)
            ticket.done = True
            self._refresh_gauges()
            self._wake_all()

    def _drop(self, rollout_ids, reason: str) -> None:
        """Under the lock."""
        for rid in rollout_ids:
            self.ledger.drop(rid, reason)
        self.intake.settle(rollout_ids)
        self.metrics.on_drop(reason, len(rollout_ids))
        if rollout_ids:
            self.log.info("%s: dropped %d rollouts (%s)", self.name, len(rollout_ids), reason)

    def _emit(self, rollouts: list[ReadyRollout], trigger: str, *, triggered_at: float, end_of_input: bool) -> int | None:
        """Emitter thread only: lay out, put shards, publish. Returns the step, or None if too small."""
        step = self._next_step
        ids = [r.rollout_id for r in rollouts]
        try:
            planned = plan_step(rollouts, step=step, parallel=self._parallel, batch=self.config.batch,
                                advertise_layout=self._advertise_layout, num_rollouts_seen=self._rollouts_seen,
                                features=self.config.features)
        except Exception as e:
            with self._cond:
                if not isinstance(e, ScheduleError):  # a bug or a store failure: keep the rollouts, re-raise
                    self.intake.return_front(rollouts)
                    self._stalled_ready = self.intake.num_ready
                    raise
                if end_of_input:
                    self._drop(ids, TOO_SMALL_REASON)
                else:
                    self.intake.return_front(rollouts)
                    self._stalled_ready = self.intake.num_ready
                self.log.warning("%s: %s step not emitted: %s", self.name, trigger, e)
            return None
        try:
            refs = [ray.put(shard) for shard in planned.shards]  # owned by this actor: they outlive producers
        except Exception:
            with self._cond:
                self.intake.return_front(rollouts)
                self._stalled_ready = self.intake.num_ready
            raise
        published = time.monotonic()
        waits = [published - r.completed_at for r in rollouts]
        record = StepRecord(
            step=step, num_rollouts=len(ids), num_samples=planned.num_samples, num_tokens=planned.num_tokens,
            microbatches_per_rank=tuple(s.num_microbatches for s in planned.shards),
            samples_per_rank=tuple(s.num_samples for s in planned.shards),
            tokens_per_rank=tuple(s.num_tokens for s in planned.shards),
            layout="rollout_side" if planned.decision.rollout_side else "legacy",
            decision_reason=planned.decision.reason, trigger=trigger,
            partial=len(ids) < self.config.batch.global_batch_size,
            mean_completion_to_emission_s=sum(waits) / len(waits), max_completion_to_emission_s=max(waits),
            scheduling_latency_s=published - max(triggered_at, max(r.ready_at for r in rollouts)),
            rollout_ids=tuple(ids),
        )
        with self._cond:
            self.ledger.schedule(ids, step)
            self.intake.settle(ids)
            self._steps[step] = _StepSlot(refs=refs, record=record)
            self._next_step += 1
            self._stalled_ready = -1
            self.metrics.on_step(record)
            self._refresh_gauges()
            self._wake_all()
        if record.layout != self._last_decision:
            self._last_decision = record.layout
            self.log.info("%s: scheduling decision: %s (%s)", self.name, record.layout, record.decision_reason)
        self.log.info("%s step %d: %d rollouts, %d samples, %s micro-batches/rank, %d tokens, %s, latency %.1f ms",
                      self.name, step, record.num_rollouts, record.num_samples, record.microbatches_per_rank[0],
                      record.num_tokens, trigger, record.scheduling_latency_s * 1e3)
        return step
