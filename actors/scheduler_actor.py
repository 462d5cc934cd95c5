"""SchedulerActor: the one place where rollouts become training steps.

    scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(...)), name="vgbs-scheduler")
    ray.get(scheduler.register_train_group.remote(ParallelConfig(dp_size=4)))
    result = ray.get(scheduler.submit.remote(samples))        # producers push, any order
    ray.get(scheduler.consume_dataset.remote(ds))              # and/or a Ray Data stream
    refs = ray.get(scheduler.get_step.remote(step, timeout_s=60))   # a train group's driver: every rank's
    shard = refs[rank].fetch(); ...                                    # each rank pulls its own shard
    ray.get(scheduler.ack_ranks.remote(step, {rank: metric_pairs, ...}))   # one ack for every rank

An asyncio Ray actor (named, `num_cpus=0`) and a thin shell around `vgbs_ray.scheduler.core.
SchedulerCore`, which owns the state and every decision (intake, ledger, steps, records, the
staleness window). What stays here is Ray's: the calls and their waits (a thousand ranks parked
in `get_shard` cost no threads), the emitter coroutine that lays steps out and puts them in the
object store (actors/step_emitter.py), the Ray Data readers (actors/dataset_streams.py) and
metrics publishing. The event loop is the core's only caller: no locks. docs/scheduler.md
explains backpressure, admission and staleness, replay and checkpoints (`export_state`,
`create_scheduler(..., restore=)`).
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
from vgbs_ray.errors import ConfigError, SchedulerStateError
from vgbs_ray.sample import Sample
from vgbs_ray.scheduler.core import SchedulerCore
from vgbs_ray.scheduler.state import SchedulerState
from vgbs_ray.scheduler.types import Admission, FlushResult, SchedulerConfig, SchedulerStats, StepRecord, SubmitResult

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
            self.metrics.publish_state(self.core)

    def _start(self) -> None:
        """On the event loop, at the first call: the emitter (its signals belong to this loop), its
        coroutine and the metrics publisher's."""
        if self._emitter is None:
            self._emitter = StepEmitter(self.core, self.config.batch, self.name, self.log,
                                        active_datasets=lambda: self._datasets.active, after_flush=lambda: self.metrics.publish_state(self.core))
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._emitter.run()),
                           loop.create_task(self.metrics.publish_every(self.core, METRICS_PUBLISH_S))]

    def _start_or_raise(self) -> None:
        """`_start()`, then raise the emitter's failure if it failed (every later call fails the same way)."""
        self._start()
        self._emitter.raise_if_failed()

    # -- train side ------------------------------------------------------------------
    async def register_train_group(self, parallel: ParallelConfig, rank_nodes: Sequence[str] | None = None) -> None:
        """Advertise the train group's parallel config; steps are laid out for it, only after this
        (SchedulerCore.register). `rank_nodes`, the Ray node of each DP rank, puts the
        shards of one node's ranks in one object (one `ray.put` per node and step; `ShardRef.fetch()` picks
        the rank's entry); None puts one object per rank."""
        self._start()
        node_ranks = None if rank_nodes is None else ranks_by_node(rank_nodes, parallel.dp_size)
        self.core.register(parallel)
        self._emitter.ranks_by_node = node_ranks
        self._emitter.changed.notify()

    async def get_shard(self, step: int, rank: int, timeout_s: float = 60.0) -> ShardRef | None:
        """Wait until rank `rank`'s shard of `step` is in the object store; return where it is. None once
        input ended and `step` will never exist. Raises SchedulerTimeoutError after `timeout_s`,
        SchedulerStateError for a released step or after an internal failure."""
        parallel = self.core.parallel
        if parallel is not None and not 0 <= rank < parallel.dp_size:
            raise ConfigError(f"rank {rank} is outside dp_size={parallel.dp_size}")
        self._start()
        slot = await self._emitter.wait_for_slot(step, timeout_s, f"step {step}, rank {rank}")
        if slot is None:
            return None
        if not 0 <= rank < len(slot.where):  # the train group registered while this call waited
            raise ConfigError(f"rank {rank} is outside dp_size={len(slot.where)}")
        ref, index = slot.where[rank]
        return ShardRef(step, rank, ref, len(slot.rollouts), index)

    async def get_step(self, step: int, timeout_s: float = 60.0) -> list[ShardRef] | None:
        """`get_shard` for every DP rank of `step` at once, in rank order (a train group's driver: one
        call per step instead of one per rank, ~1 ms of the scheduler's CPU each). None once input ended."""
        self._start()
        slot = await self._emitter.wait_for_slot(step, timeout_s, f"step {step}")
        if slot is None:
            return None
        return [ShardRef(step, rank, ref, len(slot.rollouts), index) for rank, (ref, index) in enumerate(slot.where)]

    async def ack_ranks(self, step: int, metrics_by_rank: Mapping[int, dict[str, tuple[float, float]] | None]) -> bool:
        """These DP ranks trained `step`, each with its `(sum, count)` metric pairs (the only way metrics
        travel). A train group's driver acks every rank in one call. True when the step is complete and its
        shards released; a refused ack changes nothing (SchedulerCore.ack)."""
        self._start_or_raise()
        completed = self.core.ack(step, metrics_by_rank)
        if completed:
            self._emitter.changed.notify()  # admission may reopen (max_steps_ahead)
        return completed

    async def checkpointed(self, next_step: int) -> None:
        """A checkpoint holds every step < `next_step`: their rollouts are settled for good."""
        self._start()
        self.core.checkpointed(next_step)

    async def rewind(self, next_step: int) -> int:
        """A new train group restored the checkpoint that holds every step < `next_step`: every later step
        did not happen, its shards are released and its rollouts train again exactly once, steps numbered
        from `next_step` again (SchedulerCore.rewind). Returns the number of rollouts put back."""
        self._start_or_raise()
        async with self._emitter.acting:  # never in the middle of an emission
            ended = self.core.ended
            rollouts = self.core.rewind(next_step)
            if ended:  # the input had ended: end it again after the replayed steps
                self._emitter.request_flush("end_of_input", end_of_input=True)
            self.metrics.publish_state(self.core)
            self._emitter.changed.notify()
            return len(rollouts)

    async def drop_untrained(self, next_step: int, reason: str = "run_ended") -> int:
        """The run ended after step `next_step - 1`: later steps and every ready rollout are dropped with
        `reason`, so every accepted rollout ends trained, dropped or rejected. Call after `end_of_input`;
        later `get_shard` calls return None. Returns the number dropped (SchedulerCore.drop_untrained)."""
        self._start_or_raise()
        async with self._emitter.acting:
            dropped = self.core.drop_untrained(next_step, reason)
            self._emitter.published.notify()
            self._emitter.changed.notify()
            self.metrics.publish_state(self.core)
            return dropped

    # -- checkpoints -------------------------------------------------------------------
    async def export_state(self, next_step: int) -> SchedulerState:
        """The state a checkpoint holding every step < `next_step` needs to resume this scheduler in a new
        job (`create_scheduler(..., restore=state)`); the run goes on (SchedulerCore.export_state)."""
        self._start_or_raise()
        async with self._emitter.acting:  # between emissions: nothing is half taken
            return self.core.export_state(next_step)

    # -- admission control (staleness) -------------------------------------------------------
    async def set_token_budget(self, budget_tokens: int) -> None:
        """Admit by tokens against `budget_tokens` (the engines' KV caches; SchedulerCore.set_token_budget)."""
        self._start()
        self.core.set_token_budget(budget_tokens)

    async def admit(self, rollout_ids: Sequence, engine_version: int, producer: int | None = None) -> Admission:
        """May a producer start these rollouts (a GRPO group: all or none) with an engine at policy
        version `engine_version`? See `Admission`: ids the scheduler already holds come back in `known`
        and are never admitted again; without max_staleness every group is admitted. `producer` (its
        index) lets `producer_lost` free what it had in flight. Raises ConfigError for a group that could
        never be admitted (check_admission_config)."""
        self._start_or_raise()
        return self.core.admit(rollout_ids, engine_version, producer)

    async def producer_lost(self, producer: int) -> int:
        """Producer `producer` died: the rollouts it had admitted and not finished no longer hold room in the
        staleness window and no step waits for them (its restart admits them again); returns how many."""
        self._start()
        freed = self.core.producer_lost(producer)
        self._emitter.changed.notify()
        return freed

    async def abandon(self, rollout_ids: Sequence) -> None:
        """The producer gave these admitted rollouts up: they no longer hold room in the staleness window
        and no step waits for them (samples already pushed end `incomplete_rollout` at end of input)."""
        self._start()
        self.core.abandon(rollout_ids)
        self._emitter.changed.notify()  # a full step may have waited for one of them

    async def fail_rollouts(self, rollout_ids: Sequence, reason: str) -> int:
        """The producer lost these admitted rollouts before pushing any sample (its agent raised, hung,
        ...): each id the scheduler does not hold is recorded DROPPED(reason); returns how many."""
        self._start_or_raise()
        recorded = self.core.fail_rollouts(rollout_ids, reason)
        if recorded:
            self._emitter.changed.notify()  # a full step may have waited for one of them
        return recorded

    # -- producer side ---------------------------------------------------------------
    async def submit(self, samples: Sequence[Sample | dict[str, Any]], wait_s: float = 0.0) -> SubmitResult:
        """Take a batch of samples (any rollouts, any order); see SubmitResult for what happened to each."""
        self._start_or_raise()
        if self.core.input_closed:
            raise SchedulerStateError(f"scheduler {self.name!r}: end_of_input() was called; no more samples")
        accepted, rejected, completed, pending = await self._ingest(samples, time.monotonic() + wait_s)
        reason = self.core.deferred(len(pending)) if pending else None
        return SubmitResult(accepted=accepted, rejected=tuple(rejected), deferred=tuple(pending),
                            retry_after_s=self.config.retry_after_s if pending else None,
                            backpressure_reason=reason, completed_rollouts=tuple(completed))

    async def consume_dataset(self, dataset: "ray.data.Dataset", end_input_when_done: bool = False) -> None:
        """Consume `dataset` rows (one sample each, `Sample.from_dict` keys) in completion order in the
        background; returns at once. A stream's end is not the end of input unless `end_input_when_done`.
        It never defers: it waits for room (Ray Data backs off upstream). A failing stream lands in
        stats().dataset_errors."""
        self._start_or_raise()
        if self.core.input_closed:
            raise SchedulerStateError(f"scheduler {self.name!r}: end_of_input() was called; no more datasets")
        self._datasets.start(dataset, lambda row: self._ingest([row], float("inf")), lambda: self._dataset_done(end_input_when_done))

    async def flush(self, timeout_s: float = 60.0) -> FlushResult:
        """Emit every full step, then treat what is left by the leftover policy. Waits for it."""
        self._start()
        return await self._emitter.flush_result(self._emitter.request_flush("flush", end_of_input=False), timeout_s)

    async def end_of_input(self, timeout_s: float = 120.0) -> FlushResult:
        """No more pushes: once running datasets finish, flush, drop incomplete rollouts (stats().incomplete_rollouts)
        and end the stream (get_shard past the last step returns None)."""
        self._start()
        self.core.input_closed = True
        return await self._emitter.flush_result(self._emitter.request_flush("end_of_input", end_of_input=True), timeout_s)

    # -- reports ---------------------------------------------------------------------
    async def step_record(self, step: int) -> StepRecord:
        """The record of one step (SchedulerCore.step_record)."""
        return self.core.step_record(step)

    async def stats(self, include_rollouts: bool = False, check_ledger: bool = False) -> SchedulerStats:
        """Counts, the newest step records and the ledger summary (SchedulerCore.stats), with the emitter's
        failure and the datasets' errors."""
        self._start()
        return replace(self.core.stats(include_rollouts, check_ledger), failure=self._emitter.failure,
                       dataset_errors=tuple(self._datasets.errors))

    async def close(self) -> None:
        """Stop the emitter (the actor may then be killed)."""
        for task in self._tasks:
            task.cancel()
        self.metrics.publish_state(self.core)
        if self._emitter is not None:
            self._emitter.close()

    # -- internals ---------------------------------------------------------------------------
    async def _ingest(self, samples: Sequence, deadline: float) -> tuple[int, list, list, list[int]]:
        """Ingest `samples`, waiting for room until `deadline` (or an emitter failure); returns (accepted,
        rejections, completed rollout ids, positions still deferred)."""
        pending = list(range(len(samples)))
        accepted, rejected, completed = 0, [], []
        while True:
            batch = samples if len(pending) == len(samples) else [samples[i] for i in pending]
            out = self.core.ingest(batch, now=time.monotonic())
            accepted, rejected, completed = accepted + out.accepted, rejected + out.rejections, completed + out.completed
            if out.completed:
                self._emitter.changed.notify()
            pending = [pending[p] for p in out.deferred]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0 or self._emitter.failure is not None:
                return accepted, rejected, completed, pending
            await self._emitter.changed.wait(min(remaining, 0.5))

    def _dataset_done(self, end_input_when_done: bool) -> None:
        if end_input_when_done:
            self.core.input_closed = True
            self._emitter.request_flush("end_of_input", end_of_input=True)
        self._emitter.changed.notify()


def create_scheduler(config: SchedulerConfig, name: str = DEFAULT_NAME, *, namespace: str | None = None,
                     lifetime: str | None = None, restore: SchedulerState | None = None):
    """Start the SchedulerActor as a named asyncio Ray actor (num_cpus=0) and return its handle; producers
    find it with `ray.get_actor(name)`. restore: a `SchedulerState` from `export_state(n)`: the first step
    is n, settled rollouts stay settled, the untrained ones train first."""
    options = {key: value for key, value in dict(namespace=namespace, lifetime=lifetime).items() if value is not None}
    return ray.remote(SchedulerActor).options(name=name, num_cpus=0, max_concurrency=config.max_concurrency,
                                              **options).remote(config, name, restore)
