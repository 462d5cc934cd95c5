"""SchedulerActor: the one place where rollouts become training steps.

    scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(...)), name="vgbs-scheduler")
    ray.get(scheduler.register_train_group.remote(ParallelConfig(dp_size=4)))
    result = ray.get(scheduler.submit.remote(samples))        # producers push, any order
    ray.get(scheduler.consume_dataset.remote(ds))              # and/or a Ray Data stream
    refs = ray.get(scheduler.get_step.remote(step, timeout_s=60))   # a train group's driver: every rank's
    shard = refs[rank].fetch(); ...                                    # each rank pulls its own shard
    ray.get(scheduler.ack_ranks.remote(step, {rank: metric_pairs, ...}))   # one ack for every rank
    (get_shard(step, rank) and ack_step(step, rank, pairs) are the per-rank forms.)

An asyncio Ray actor (named, `num_cpus=0`) and a thin shell around `vgbs_ray.scheduler_core.
SchedulerCore`, which owns the state and every decision (intake, ledger, emitted steps, records,
the step chooser). What stays here is Ray's: the calls and their waits (awaits: a thousand ranks
parked in `get_shard` cost no threads), the emitter coroutine that lays steps out and puts them
in the object store (actors/step_emitter.py), the Ray Data readers (actors/dataset_streams.py)
and metrics publishing. The event loop is the core's only caller: no locks.

Staleness (`SchedulerConfig.max_staleness`; vgbs_ray.staleness): step k trains policy version k.
Producers `admit` a group before starting it (and `abandon` what they give up); the emitter
drops ready rollouts too stale for the next step (reason `stale`), fills steps oldest version
first and waits for an admitted rollout in flight whose last chance the step is; flushes never
wait. The decisions are the core's chooser, a `StalenessWindow` (vgbs_ray.staleness_window).

Checkpoints: `export_state(n)` (every step < n trained) returns a `SchedulerState`;
`create_scheduler(..., restore=state)` resumes it in a new job: steps keep their global numbers
(the first one emitted is n), settled rollouts stay settled, untrained ones train first.

Backpressure contract: `submit` never blocks by default; samples it cannot take are returned
as `SubmitResult.deferred` positions with `retry_after_s`: resubmit those. With `wait_s > 0`
it waits up to that long for room first. A Ray Data consumer simply waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

import ray

from actors.dataset_streams import DatasetStreams
from actors.gc_tuning import relax_gc_in_this_process
from actors.scheduler_metrics import SchedulerMetrics
from actors.shard_placement import ranks_by_node
from actors.shard_ref import ShardRef
from actors.step_emitter import StepEmitter
from vgbs_ray.config import ParallelConfig
from vgbs_ray.eligibility import SchedulingDecision
from vgbs_ray.errors import ConfigError, SchedulerStateError, SchedulerTimeoutError
from vgbs_ray.sample import Sample
from vgbs_ray.scheduler_core import SchedulerCore, StepSlot
from vgbs_ray.scheduler_state import SchedulerState
from vgbs_ray.scheduler_types import Admission, FlushResult, SchedulerConfig, SchedulerStats, StepRecord, SubmitResult

__all__ = ["DEFAULT_NAME", "SchedulerActor", "create_scheduler"]

DEFAULT_NAME = "vgbs-scheduler"
METRICS_PUBLISH_S = 1.0


class SchedulerActor:
    """Plain class; `create_scheduler` makes it a named asyncio Ray actor. See the module docstring."""

    def __init__(self, config: SchedulerConfig, name: str = DEFAULT_NAME, restore: SchedulerState | None = None):
        self.config = config
        self.name = name
        if ray.get_runtime_context().get_actor_id() is not None:
            relax_gc_in_this_process()  # this worker process is the actor's alone
        self.log = logging.getLogger(f"vgbs_ray.scheduler.{name}")
        if not self.log.handlers:
            self.log.addHandler(logging.StreamHandler())
            self.log.setLevel(logging.INFO)
        self.metrics = SchedulerMetrics(name)
        self.core = SchedulerCore(config, name=name, events=self.metrics, log=self.log, restore=restore,
                                  now=time.monotonic())
        self._datasets = DatasetStreams(name, self.log)
        self._emitter: StepEmitter | None = None   # made on the event loop, at the first call (`_start`)
        self._tasks: list[asyncio.Task] = []
        if restore is not None:
            self._publish_metrics()

    def _start(self) -> None:
        """On the event loop, at the first call: the emitter (its signals belong to this loop), its
        coroutine and the metrics publisher's."""
        if self._emitter is None:
            self._emitter = StepEmitter(self.core, self.config.batch, self.name, self.log,
                                        active_datasets=lambda: self._datasets.active, after_flush=self._publish_metrics)
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._emitter.run()), loop.create_task(self._publish_metrics_loop())]

    # -- train side ------------------------------------------------------------------
    async def register_train_group(self, parallel: ParallelConfig, advertise_layout: bool = True,
                                   rank_nodes: Sequence[str] | None = None) -> SchedulingDecision:
        """Advertise the train group's parallel layout; steps are laid out only after this.

        The layout path is decided here, once: rollout-side layouts, or the legacy path (even DP
        split, micro-batches chosen by each rank) with advertise_layout=False or a feature that needs
        train-side ordering. `rank_nodes`, the Ray node of each DP rank, puts the shards of the DP
        ranks on one node as one object (one `ray.put` per node and step instead of one per rank;
        each ShardRef says which entry is its rank's, `ShardRef.fetch()`); None puts one object per
        rank. Returns the scheduling decision. Raises ConfigError for a pair of configs that can
        never be laid out, or a different layout once steps were emitted.
        """
        self._start()
        if rank_nodes is not None and len(rank_nodes) != parallel.dp_size:
            raise ConfigError(f"rank_nodes names {len(rank_nodes)} nodes, one per DP rank is needed (dp_size={parallel.dp_size})")
        decision = self.core.register(parallel, advertise_layout)
        self._emitter.ranks_by_node = None if rank_nodes is None else ranks_by_node(rank_nodes)
        self._emitter.changed.notify()
        return decision

    async def get_shard(self, step: int, rank: int, timeout_s: float = 60.0) -> ShardRef | None:
        """Wait until rank `rank`'s shard of `step` is in the object store; return where it is.

        Returns None once input ended and `step` will never exist. Raises
        SchedulerTimeoutError after `timeout_s`, SchedulerStateError for a released step or
        after an internal failure.
        """
        layout = self.core.layout
        if layout is not None and not 0 <= rank < layout.parallel.dp_size:
            raise ConfigError(f"rank {rank} is outside dp_size={layout.parallel.dp_size}")
        slot = await self._wait_for_step(step, timeout_s, f"step {step}, rank {rank}")
        if slot is None:
            return None
        if not 0 <= rank < len(slot.where):  # the train group registered while this call waited
            raise ConfigError(f"rank {rank} is outside dp_size={len(slot.where)}")
        ref, index = slot.where[rank]
        return ShardRef(step, rank, ref, len(slot.rollouts), index)

    async def get_step(self, step: int, timeout_s: float = 60.0) -> list[ShardRef] | None:
        """`get_shard` for every DP rank of `step` at once, in rank order: what a train group's driver
        asks, handing each rank its ShardRef (one call per step instead of one per rank, each of which
        costs the scheduler's process ~1 ms of CPU on 2 cores). None once input ended."""
        slot = await self._wait_for_step(step, timeout_s, f"step {step}")
        if slot is None:
            return None
        return [ShardRef(step, rank, ref, len(slot.rollouts), index) for rank, (ref, index) in enumerate(slot.where)]

    async def _wait_for_step(self, step: int, timeout_s: float, who: str) -> StepSlot | None:
        """The slot of `step` once emitted; None once input ended and it never will be (see get_shard)."""
        self._start()
        deadline = time.monotonic() + timeout_s
        while True:
            self._emitter.raise_if_failed()
            slot = self.core.slots.get(step)
            if slot is not None:
                return slot
            if step < self.core.next_step:
                raise SchedulerStateError(f"step {step} was acknowledged by every rank and released")
            if self.core.ended:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SchedulerTimeoutError(f"{who}: no shard after {timeout_s} s; {self.core.describe_wait()}")
            await self._emitter.published.wait(remaining)

    async def ack_step(self, step: int, rank: int, metrics: dict[str, tuple[float, float]] | None = None) -> bool:
        """DP rank `rank` trained `step`, with its `(sum, count)` metric pairs: `ack_ranks(step, {rank: metrics})`."""
        return await self.ack_ranks(step, {rank: metrics})

    async def ack_ranks(self, step: int, metrics_by_rank: Mapping[int, dict[str, tuple[float, float]] | None]) -> bool:
        """These DP ranks trained `step`, each with its `(sum, count)` metric pairs (the only way metrics
        travel: no collective carries them). One call may ack every rank (a train group's driver does:
        one call per step instead of one per rank). Returns True when this ack completes the step: its
        shards are released and the pairs of all ranks are reduced into the step's record. Checks every
        rank before recording any: a refused ack changes nothing.
        """
        self._start()
        self._emitter.raise_if_failed()
        completed = self.core.ack(step, metrics_by_rank)
        if completed:
            self._emitter.changed.notify()  # admission may reopen (max_steps_ahead)
        return completed

    async def checkpointed(self, next_step: int) -> None:
        """A checkpoint holds every step < `next_step`: their rollouts are settled for good."""
        self._start()
        self.core.checkpointed(next_step)

    async def rewind(self, next_step: int) -> int:
        """A new train group restored the checkpoint that holds every step < `next_step`.

        Every later step (acknowledged but not checkpointed, or still in flight) did not happen:
        its shards are released and its rollouts go back to the front of the buffer in their
        original order, to train again exactly once; steps are numbered from `next_step` again.
        Returns the number of rollouts put back. Raises LedgerError if such a step was
        already declared checkpointed, or was trained without `retain_until_checkpoint`.
        """
        self._start()
        self._emitter.raise_if_failed()
        async with self._emitter.acting:  # never in the middle of an emission
            ended = self.core.ended
            rollouts = self.core.rewind(next_step)
            if ended:  # the input had ended: end it again after the replayed steps
                self._emitter.request_flush("end_of_input", end_of_input=True)
            self._publish_metrics()
            self._emitter.changed.notify()
            return len(rollouts)

    async def drop_untrained(self, next_step: int, reason: str = "run_ended") -> int:
        """The run ended after step `next_step - 1` (its last checkpoint holds every step before):
        the steps emitted after it and every ready rollout still buffered are dropped with `reason`,
        so every accepted rollout ends trained, dropped or rejected. Call after `end_of_input`
        (which closes incomplete rollouts); later `get_shard` calls return None. Returns the number
        of rollouts dropped. Raises like `rewind` if a step >= `next_step` was already settled.
        """
        self._start()
        self._emitter.raise_if_failed()
        async with self._emitter.acting:
            dropped = self.core.drop_untrained(next_step, reason)
            self._emitter.published.notify()
            self._emitter.changed.notify()
            self._publish_metrics()
            return dropped

    # -- checkpoints -------------------------------------------------------------------
    async def export_state(self, next_step: int) -> SchedulerState:
        """The state a checkpoint holding every step < `next_step` needs to resume this scheduler
        in a new job (`create_scheduler(..., restore=state)`); see vgbs_ray.scheduler_state.

        Precondition: every step < `next_step` was acknowledged by every rank (trained). Steps
        >= `next_step` already emitted (in flight, or trained with retain_until_checkpoint) are
        exported as untrained, in front. Changes nothing here: the run goes on. Raises
        SchedulerStateError if a step < `next_step` is not trained, `next_step` was never reached,
        or a step >= `next_step` was trained and released (no retain_until_checkpoint).
        """
        self._start()
        self._emitter.raise_if_failed()
        async with self._emitter.acting:  # between emissions: nothing is half taken
            return self.core.export_state(next_step)

    # -- admission control (staleness) -------------------------------------------------------
    async def admit(self, rollout_ids: Sequence, engine_version: int, producer: int | None = None) -> Admission:
        """May a producer start these rollouts (a GRPO group: all or none) with an engine at policy
        version `engine_version`? Without max_staleness every group is admitted (enforced=False).
        `producer` (its index) lets `producer_lost` free what it had in flight.

        Ids the scheduler already holds (accepted samples, trained, dropped) are never admitted
        again: they come back in `known` and a resumed producer skips them; if all are known the
        answer admits nothing new. Ids admitted before and not yet in a step stay admitted.
        Raises ConfigError when the group could never be admitted (check_admission_config).
        """
        self._start()
        self._emitter.raise_if_failed()
        return self.core.admit(rollout_ids, engine_version, producer)

    async def producer_lost(self, producer: int) -> int:
        """Producer `producer` died: the rollouts it had admitted and not finished no longer hold room in the
        staleness window and no step waits for them (its restart admits them again); returns how many."""
        self._start()
        freed = self.core.producer_lost(producer)
        self._emitter.changed.notify()
        return freed

    async def abandon(self, rollout_ids: Sequence) -> None:
        """The producer gave these admitted rollouts up (engine died, producer stopped): they no longer
        hold room in the staleness window and no step waits for them. Samples of them already pushed
        stay buffered and end `incomplete_rollout` at end of input, as any unfinished rollout."""
        self._start()
        self.core.abandon(rollout_ids)
        self._emitter.changed.notify()  # a full step may have waited for one of them

    async def fail_rollouts(self, rollout_ids: Sequence, reason: str) -> int:
        """The producer lost these admitted rollouts before pushing any sample (its agent raised,
        hung, returned a non-finite reward, ...): each unknown id is recorded DROPPED(reason) in the
        ledger and leaves the staleness window. Ids the scheduler already holds keep their state.
        Returns how many were recorded."""
        self._start()
        self._emitter.raise_if_failed()
        recorded = self.core.fail_rollouts(rollout_ids, reason)
        if recorded:
            self._emitter.changed.notify()  # a full step may have waited for one of them
        return recorded

    # -- producer side ---------------------------------------------------------------
    async def submit(self, samples: Sequence[Sample | dict[str, Any]], wait_s: float = 0.0) -> SubmitResult:
        """Take a batch of samples (any rollouts, any order); see SubmitResult for what happened to each."""
        self._start()
        self._emitter.raise_if_failed()
        if self.core.input_closed:
            raise SchedulerStateError(f"scheduler {self.name!r}: end_of_input() was called; no more samples")
        deadline = time.monotonic() + wait_s
        pending = list(range(len(samples)))
        accepted, rejected, completed = 0, [], []
        while True:
            batch = samples if len(pending) == len(samples) else [samples[i] for i in pending]
            out = self.core.ingest(batch, now=time.monotonic())
            accepted += out.accepted
            rejected += out.rejections
            completed += out.completed
            if out.completed:
                self._emitter.changed.notify()
            pending = [pending[p] for p in out.deferred]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                break
            await self._emitter.changed.wait(min(remaining, 0.5))
        reason = None
        if pending:
            self.core.deferred(len(pending))
            reason = self.core.admission()[1] or "buffer_full"
        return SubmitResult(accepted=accepted, rejected=tuple(rejected), deferred=tuple(pending),
                            retry_after_s=self.config.retry_after_s if pending else None,
                            backpressure_reason=reason, completed_rollouts=tuple(completed))

    async def consume_dataset(self, dataset: "ray.data.Dataset", end_input_when_done: bool = False) -> None:
        """Start consuming `dataset` rows in completion order in the background; returns at once.

        Each row is one sample (`Sample.from_dict` keys); a row without `rollout_size` is a
        one-sample rollout. The end of one stream is not the end of input (producers may still
        push): it emits nothing, unless `end_input_when_done` (then `end_of_input` runs). A
        consumer never defers: it waits for room (Ray Data backs off upstream). Rejected rows
        are counted like pushed samples; a failing stream lands in stats().dataset_errors.
        """
        self._start()
        self._emitter.raise_if_failed()
        if self.core.input_closed:
            raise SchedulerStateError(f"scheduler {self.name!r}: end_of_input() was called; no more datasets")
        self._datasets.start(dataset, self._ingest_row, lambda: self._dataset_done(end_input_when_done))

    async def flush(self, timeout_s: float = 60.0) -> FlushResult:
        """Emit every full step, then treat what is left by the leftover policy. Waits for it."""
        self._start()
        return await self._emitter.flush_result(self._emitter.request_flush("flush", end_of_input=False), timeout_s)

    async def end_of_input(self, timeout_s: float = 120.0) -> FlushResult:
        """No more pushes: after running datasets finish, flush, close incomplete rollouts
        (reported in stats().incomplete_rollouts, recorded as dropped), and end the stream:
        get_shard past the last step then returns None."""
        self._start()
        self.core.input_closed = True
        return await self._emitter.flush_result(self._emitter.request_flush("end_of_input", end_of_input=True), timeout_s)

    # -- reports ---------------------------------------------------------------------
    async def step_record(self, step: int) -> StepRecord:
        """The record of one step: any step not yet trained, or one of the newest
        `step_record_window` records of trained steps. O(1)."""
        return self.core.step_record(step)

    async def stats(self, include_rollouts: bool = False, check_ledger: bool = False) -> SchedulerStats:
        """Counts, the newest step records and the ledger summary: O(step_record_window).

        include_rollouts adds every rollout id's (state, step, reason); check_ledger also runs
        the ledger invariants (raises LedgerError on a scheduler bug). Both are O(rollouts).
        """
        self._start()
        return replace(self.core.stats(include_rollouts, check_ledger), failure=self._emitter.failure,
                       dataset_errors=tuple(self._datasets.errors))

    async def close(self) -> None:
        """Stop the emitter (the actor may then be killed)."""
        for task in self._tasks:
            task.cancel()
        self._publish_metrics()
        if self._emitter is not None:
            self._emitter.close()

    # -- internals: the Ray Data consumer ----------------------------------------------------
    async def _ingest_row(self, row: dict) -> None:
        while True:  # a dataset is never deferred: it waits for room
            out = self.core.ingest([row], now=time.monotonic())
            if out.completed:
                self._emitter.changed.notify()
            if not out.deferred or self._emitter.failure is not None:
                return
            await self._emitter.changed.wait(0.5)

    def _dataset_done(self, end_input_when_done: bool) -> None:
        if end_input_when_done:
            self.core.input_closed = True
            self._emitter.request_flush("end_of_input", end_of_input=True)
        self._emitter.changed.notify()

    # -- internals: metrics ----------------------------------------------------------------
    async def _publish_metrics_loop(self) -> None:
        """The metrics every METRICS_PUBLISH_S (and at restores, rewinds, flushes and close): pushes, steps
        and acks only buffer theirs (actors/scheduler_metrics.py says why)."""
        while True:
            self._publish_metrics()
            await asyncio.sleep(METRICS_PUBLISH_S)

    def _publish_metrics(self) -> None:
        core = self.core
        self.metrics.on_state(buffered_rollouts=core.intake.num_buffered_rollouts,
                              buffered_samples=core.intake.buffered_samples,
                              steps_in_flight=core.next_step - core.steps_trained, policy_version=core.next_step)
        self.metrics.publish()


def create_scheduler(config: SchedulerConfig, name: str = DEFAULT_NAME, *, namespace: str | None = None,
                     lifetime: str | None = None, restore: SchedulerState | None = None):
    """Start the SchedulerActor as a named asyncio Ray actor (num_cpus=0) and return its handle.

    Producers find it with `ray.get_actor(name)`. Raises ValueError if the name is taken.
    restore: a `SchedulerState` from `export_state(n)`: the new scheduler's first step is n (steps
    keep their global numbers), trained and dropped rollouts stay settled, and the untrained
    ones train first, in their exported order.
    """
    options: dict[str, Any] = dict(name=name, num_cpus=0, max_concurrency=config.max_concurrency)
    if namespace is not None:
        options["namespace"] = namespace
    if lifetime is not None:
        options["lifetime"] = lifetime
    return ray.remote(SchedulerActor).options(**options).remote(config, name, restore)
