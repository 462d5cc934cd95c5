"""SchedulerActor: the one place where rollouts become training steps.

    scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(...)), name="vgbs-scheduler")
    ray.get(scheduler.register_train_group.remote(ParallelConfig(dp_size=4)))
    result = ray.get(scheduler.submit.remote(samples))        # producers push, any order
    ray.get(scheduler.consume_dataset.remote(ds))              # and/or a Ray Data stream
    ref = ray.get(scheduler.get_shard.remote(step, rank, timeout_s=60))
    shard = ray.get(ref.ref); ...; ray.get(scheduler.ack_step.remote(step, rank, metrics))

A thin shell (named, `num_cpus=0`, threaded with `max_concurrency`) around the core:
`RolloutIntake` (validation, completion, group advantages, backpressure bounds), `Ledger`
(one state per rollout id) and `plan_step` (layout + shards). One lock guards them;
layout and `ray.put` run outside it on a single emitter thread (`scheduler_emission`),
so pushes, pulls and stats never wait for a step to be laid out, and steps are numbered
in emission order.

Threads: the emitter (forms full steps whenever gbs rollouts are ready, runs flush
requests, and the max-wait flush), one consumer per `consume_dataset`, and Ray's call
threads. Blocking calls (`get_shard`, `submit(wait_s>0)`, `flush`, `end_of_input`) wait with
a deadline on the one lock's condition variables: `get_shard` on its own (woken only when a
step is published or the stream ends, not by every push), the rest on the shared one.

Backpressure contract: `submit` never blocks by default; samples it cannot take are
returned as `SubmitResult.deferred` positions with `retry_after_s`: resubmit those. With
`wait_s > 0` it waits up to that long for room first. A Ray Data consumer simply waits.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import replace
from typing import Any, Sequence

import ray

from actors.scheduler_api import (
    FlushResult, SchedulerConfig, SchedulerStats, ShardRef, StepRecord, SubmitResult,
)
from actors.scheduler_emission import EmissionMixin, _FlushTicket, _StepSlot
from actors.scheduler_metrics import SchedulerMetrics
from vgbs_ray.config import ParallelConfig, check_schedule_configs
from vgbs_ray.eligibility import SchedulingDecision, decide_scheduling
from vgbs_ray.errors import ConfigError, SchedulerStateError, SchedulerTimeoutError
from vgbs_ray.intake import Rejection, RolloutIntake
from vgbs_ray.ledger import Ledger
from vgbs_ray.metrics import reduce_metric_pairs
from vgbs_ray.sample import Sample

__all__ = [
    "FlushResult", "SchedulerActor", "SchedulerConfig", "SchedulerStats", "ShardRef", "StepRecord",
    "SubmitResult", "create_scheduler",
]

DEFAULT_NAME = "vgbs-scheduler"


# CPython's cyclic GC thresholds for the scheduler's own worker process (see below).
_GC_THRESHOLDS = (50_000, 20, 100)


def _relax_gc_in_this_process() -> None:
    """Collect garbage less often in the scheduler actor's process (it is that actor's alone).

    The scheduler holds many long-lived small containers (buffered samples, ledger
    entries); under the default thresholds (700, 10, 10) the collector runs every few
    pushes and its older generations rescan them all. Nothing here creates reference
    cycles in bulk, so collecting less often only delays freeing a few. Measured with
    benchmarks/bench_scheduler.py on 2 cores: the push path went from 0.48 to 0.59 of a
    no-op actor's rate, pushes with steps emitting from 0.35 to 0.43.
    """
    gc.set_threshold(*_GC_THRESHOLDS)


class SchedulerActor(EmissionMixin):
    """Plain class; `create_scheduler` makes it a named Ray actor. See the module docstring."""

    def __init__(self, config: SchedulerConfig, name: str = DEFAULT_NAME):
        self.config = config
        self.name = name
        if ray.get_runtime_context().get_actor_id() is not None:
            _relax_gc_in_this_process()
        self.log = logging.getLogger(f"vgbs_ray.scheduler.{name}")
        if not self.log.handlers:
            self.log.addHandler(logging.StreamHandler())
            self.log.setLevel(logging.INFO)
        self.ledger = Ledger()
        self.intake = RolloutIntake(config.intake_config(), self.ledger)
        self.metrics = SchedulerMetrics(name)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # get_shard waits alone on its own condition (same lock): woken when a step is
        # published or the stream ends, not by each push (a herd of blocked pulls per submit).
        self._published = threading.Condition(lock)
        self._parallel: ParallelConfig | None = None
        self._advertise_layout = True
        self._steps: dict[int, _StepSlot] = {}
        self._next_step = 0
        self._steps_trained = 0
        self._tickets: list[_FlushTicket] = []
        self._active_datasets = 0
        self._input_closed = False
        self._ended = False
        self._stop = False
        self._accepted = self._rejected = self._deferred = 0
        self._rollouts_seen = 0
        self._incomplete: list = []
        self._dataset_errors: list[str] = []
        self._stalled_ready = -1
        self._last_decision: str | None = None
        self._emitter = threading.Thread(target=self._emit_loop, name=f"{name}-emitter", daemon=True)
        self._emitter.start()

    # -- train side ------------------------------------------------------------------
    def register_train_group(self, parallel: ParallelConfig, advertise_layout: bool = True) -> SchedulingDecision:
        """Advertise the train group's parallel layout; steps are laid out only after this.

        advertise_layout=False selects the legacy path (even DP split, no micro-batch layout).
        Returns the scheduling decision for a full step. Raises ConfigError for a pair of
        configs that can never be laid out, or a different layout once steps were emitted.
        """
        check_schedule_configs(parallel, self.config.batch)
        with self._cond:
            if self._parallel is not None and self._next_step and (parallel, advertise_layout) != (self._parallel, self._advertise_layout):
                raise ConfigError(f"scheduler {self.name!r} already emitted steps for {self._parallel}; "
                                  "start a new scheduler for a different train group")
            self._parallel, self._advertise_layout = parallel, advertise_layout
            self._wake_all()
        decision = decide_scheduling(parallel if advertise_layout else None, has_rollout_ids=True,
                                     num_rollouts=self.config.batch.global_batch_size,
                                     global_batch_size=self.config.batch.global_batch_size, features=self.config.features)
        self.log.info("%s: train group registered (%s); scheduling: %s", self.name, parallel, decision.reason)
        return decision

    def get_shard(self, step: int, rank: int, timeout_s: float = 60.0) -> ShardRef | None:
        """Block until rank `rank`'s shard of `step` is in the object store; return where it is.

        Returns None once input ended and `step` will never exist. Raises
        SchedulerTimeoutError after `timeout_s`, SchedulerStateError for a released step.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._parallel is not None and not 0 <= rank < self._parallel.dp_size:
                    raise ConfigError(f"rank {rank} is outside dp_size={self._parallel.dp_size}")
                slot = self._steps.get(step)
                if slot is not None:
                    if slot.refs is None:
                        raise SchedulerStateError(f"step {step} was acknowledged by every rank and released")
                    rec = slot.record
                    return ShardRef(step, rank, slot.refs[rank], rec.num_rollouts, rec.samples_per_rank[rank],
                                    rec.layout == "rollout_side")
                if self._ended and step >= self._next_step:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SchedulerTimeoutError(
                        f"step {step}, rank {rank}: no shard after {timeout_s} s; {self.intake.num_ready} rollouts ready "
                        f"(global_batch_size={self.config.batch.global_batch_size}), {self.intake.num_buffered_rollouts} "
                        f"buffered, {self._next_step} steps emitted, train group registered: {self._parallel is not None}")
                self._published.wait(remaining)

    def ack_step(self, step: int, rank: int, metrics: dict[str, tuple[float, float]] | None = None) -> bool:
        """Rank `rank` trained `step`. Returns True when this ack completes the step (shards released)."""
        with self._cond:
            slot = self._steps.get(step)
            if slot is None:
                raise SchedulerStateError(f"ack for step {step}, which was never emitted")
            dp_size = len(slot.record.samples_per_rank)
            if not 0 <= rank < dp_size:
                raise ConfigError(f"rank {rank} is outside dp_size={dp_size}")
            if rank in slot.acks:
                raise SchedulerStateError(f"step {step}: rank {rank} acknowledged twice")
            slot.acks[rank] = dict(metrics or {})
            if len(slot.acks) < dp_size:
                return False
            self.ledger.train_step(step)
            slot.refs = None  # the scheduler's references go; borrowers keep theirs alive
            reduced = reduce_metric_pairs(slot.acks[r] for r in sorted(slot.acks))
            slot.record = replace(slot.record, trained=True, metrics=reduced)
            self._steps_trained += 1
            self._refresh_gauges()
            self._cond.notify_all()
            return True

    # -- producer side ---------------------------------------------------------------
    def submit(self, samples: Sequence[Sample | dict[str, Any]], wait_s: float = 0.0) -> SubmitResult:
        """Take a batch of samples (any rollouts, any order); see SubmitResult for what happened to each."""
        deadline = time.monotonic() + wait_s
        pending = list(range(len(samples)))
        accepted, rejected, completed = 0, [], []
        with self._cond:
            if self._input_closed:
                raise SchedulerStateError(f"scheduler {self.name!r}: end_of_input() was called; no more samples")
            while True:
                accept_new, reason = self._admission()
                out = self.intake.ingest([samples[i] for i in pending], now=time.monotonic(), accept_new=accept_new)
                accepted += out.accepted
                rejected += out.rejections
                completed += out.completed
                self._after_ingest(out)
                pending = [pending[p] for p in out.deferred]
                remaining = deadline - time.monotonic()
                if not pending or remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.5))
            if pending:
                self._deferred += len(pending)
                self.metrics.on_submit(0, (), len(pending))
        return SubmitResult(accepted=accepted, rejected=tuple(rejected), deferred=tuple(pending),
                            retry_after_s=self.config.retry_after_s if pending else None,
                            backpressure_reason=(reason or "buffer_full") if pending else None,
                            completed_rollouts=tuple(completed))

    def consume_dataset(self, dataset: "ray.data.Dataset", end_input_when_done: bool = False,
                        flush_when_done: bool = True) -> None:
        """Start consuming `dataset` rows in completion order on a background thread; returns at once.

        Each row is one sample (`Sample.from_dict` keys); a row without `rollout_size` is a
        one-sample rollout. When the stream ends: `end_of_input` if `end_input_when_done`, else
        a flush (trigger "end_of_dataset": a partial step per the leftover policy) if
        `flush_when_done`. A consumer never defers: it waits for room (Ray Data backs off
        upstream). Errors of the stream land in stats().dataset_errors.
        """
        try:
            dataset.context.execution_options.preserve_order = False  # completion order, not input order
        except AttributeError:
            pass
        with self._cond:
            if self._input_closed:
                raise SchedulerStateError(f"scheduler {self.name!r}: end_of_input() was called; no more datasets")
            self._active_datasets += 1
        threading.Thread(target=self._consume, args=(dataset, end_input_when_done, flush_when_done),
                         name=f"{self.name}-dataset", daemon=True).start()

    def flush(self, timeout_s: float = 60.0) -> FlushResult:
        """Emit every full step, then treat what is left by the leftover policy. Waits for it."""
        return self._wait_ticket(self._enqueue("flush", end_of_input=False), timeout_s)

    def end_of_input(self, timeout_s: float = 120.0) -> FlushResult:
        """No more pushes: after running datasets finish, flush, close incomplete rollouts
        (reported in stats().incomplete_rollouts, recorded as dropped), and end the stream:
        get_shard past the last step then returns None."""
        with self._cond:
            self._input_closed = True
        return self._wait_ticket(self._enqueue("end_of_input", end_of_input=True), timeout_s)

    # -- reports ---------------------------------------------------------------------
    def stats(self, include_rollouts: bool = False, check_ledger: bool = False) -> SchedulerStats:
        """Counts, per-step records and the ledger summary (O(steps + rollouts seen)).

        include_rollouts adds every rollout id's (state, step, reason); check_ledger also runs
        the ledger invariants (raises LedgerError on a scheduler bug). Both are O(rollouts).
        """
        with self._cond:
            if check_ledger:
                self.ledger.check()
            states = None
            if include_rollouts:
                states = {}
                for rid, e in self.ledger.entries():
                    states[rid] = (e.state.value, e.step, e.reason)
            return SchedulerStats(
                accepted_samples=self._accepted, rejected_samples=self._rejected, deferred_samples=self._deferred,
                buffered_rollouts=self.intake.num_buffered_rollouts, buffered_samples=self.intake.buffered_samples,
                buffered_tokens=self.intake.buffered_tokens, ready_rollouts=self.intake.num_ready,
                steps_emitted=self._next_step, steps_trained=self._steps_trained,
                input_closed=self._input_closed, ended=self._ended,
                steps=tuple(self._steps[k].record for k in sorted(self._steps)),
                ledger=self.ledger.summary(), incomplete_rollouts=tuple(self._incomplete),
                rejections=tuple(self._recent_rejections()), dataset_errors=tuple(self._dataset_errors),
                rollout_states=states,
            )

    def _recent_rejections(self, limit: int = 1000) -> list[Rejection]:
        return [Rejection(r.rollout_id, r.sample_index, r.rule, r.message) for r in self.ledger.rejections[-limit:]]

    def close(self) -> None:
        """Stop the emitter thread (the actor may then be killed)."""
        with self._cond:
            self._stop = True
            self._wake_all()
        self._emitter.join(timeout=5)

    # -- internals: admission ----------------------------------------------------------
    def _admission(self) -> tuple[bool, str]:
        k = self.config.max_steps_ahead
        in_flight = self._next_step - self._steps_trained
        if k is not None and in_flight > k:
            return False, f"staleness: {in_flight} steps emitted but not trained (max_steps_ahead={k})"
        return self.intake.has_room()

    def _after_ingest(self, out) -> None:
        self._accepted += out.accepted
        self._rejected += len(out.rejections)
        self._rollouts_seen += len(out.completed)
        self.metrics.on_submit(out.accepted, [r.rule for r in out.rejections], 0)
        for _, reason in out.dropped:
            self.metrics.on_drop(reason)
        if out.rejections:
            first = out.rejections[0]
            self.log.warning("%s: rejected %d sample(s); first: rollout %r, rule %s: %s", self.name,
                             len(out.rejections), first.rollout_id, first.rule, first.message)
        self._refresh_gauges()
        if out.completed:
            self._cond.notify_all()

    def _wake_all(self) -> None:
        """Under the lock: wake every waiter, pulls included (a step was published, the stream ended)."""
        self._cond.notify_all()
        self._published.notify_all()

    def _refresh_gauges(self) -> None:
        self.metrics.on_buffer(self.intake.num_buffered_rollouts, self.intake.buffered_samples,
                               self._next_step - self._steps_trained)

    def _consume(self, dataset, end_input_when_done: bool, flush_when_done: bool) -> None:
        try:
            for row in dataset.iter_rows():
                with self._cond:
                    while True:  # a dataset is never deferred: it waits for room (Ray Data backs off upstream)
                        accept_new, _ = self._admission()
                        out = self.intake.ingest([dict(row)], now=time.monotonic(), accept_new=accept_new)
                        self._after_ingest(out)
                        if not out.deferred or self._stop:
                            break
                        self._cond.wait(0.5)
        except Exception as e:  # noqa: BLE001 - the stream's failure is reported, the scheduler lives on
            self.log.error("%s: dataset stream failed: %r", self.name, e)
            with self._cond:
                self._dataset_errors.append(repr(e))
        finally:
            with self._cond:
                self._active_datasets -= 1
                self._cond.notify_all()
            if end_input_when_done:
                with self._cond:
                    self._input_closed = True
                self._enqueue("end_of_input", end_of_input=True)
            elif flush_when_done:
                self._enqueue("end_of_dataset", end_of_input=False)

def create_scheduler(config: SchedulerConfig, name: str = DEFAULT_NAME, *, namespace: str | None = None,
                     lifetime: str | None = None):
    """Start the SchedulerActor as a named Ray actor (num_cpus=0, threaded) and return its handle.

    Producers find it with `ray.get_actor(name)`. Raises ValueError if the name is taken.
    """
    options: dict[str, Any] = dict(name=name, num_cpus=0, max_concurrency=config.max_concurrency)
    if namespace is not None:
        options["namespace"] = namespace
    if lifetime is not None:
        options["lifetime"] = lifetime
    return ray.remote(SchedulerActor).options(**options).remote(config, name)
