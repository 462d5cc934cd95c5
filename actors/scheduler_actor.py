"""SchedulerActor: the one place where rollouts become training steps.

    scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(...)), name="vgbs-scheduler")
    ray.get(scheduler.register_train_group.remote(ParallelConfig(dp_size=4)))
    result = ray.get(scheduler.submit.remote(samples))        # producers push, any order
    ray.get(scheduler.consume_dataset.remote(ds))              # and/or a Ray Data stream
    refs = ray.get(scheduler.get_step.remote(step, timeout_s=60))   # a train group's driver: every rank's
    shard = refs[rank].fetch(); ...                                    # each rank pulls its own shard
    ray.get(scheduler.ack_ranks.remote(step, {rank: metric_pairs, ...}))   # one ack for every rank
    (get_shard(step, rank) and ack_step(step, rank, pairs) are the per-rank forms.)

An asyncio Ray actor (named, `num_cpus=0`) and a thin shell around the core: `RolloutIntake`
(validation, completion, group advantages, buffer bounds), `Ledger` (one state per rollout,
compact once settled), `plan_step` (layout + shards) and `scheduler_policy` (what to do
next, whom to admit). The event loop is the only owner of that state: no locks. Waits are
awaits, so a thousand ranks parked in `get_shard` cost no threads.

One emitter coroutine runs `scheduler_policy.next_action` in a loop: emit a full step, run a
flush, run the max-wait flush, or wait for a change. Laying a step out and `ray.put` of its
shards run on one worker thread (`run_in_executor`), so pushes and pulls go on meanwhile;
steps are numbered in emission order. An unexpected error there (a bug, a failing object
store) is not retried: the scheduler records it as `failure` and every call then raises it,
instead of a loop that spins or a flush that times out.

Staleness (`SchedulerConfig.max_staleness`; vgbs_ray.staleness): step k trains policy version k.
Producers `admit` a group before starting it (and `abandon` what they give up); the emitter
drops ready rollouts too stale for the next step (reason `stale`), fills steps oldest version
first and waits for an admitted rollout in flight whose last chance the step is; flushes never
wait. The decisions are `scheduler_policy.choose_step` over a `StalenessWindow`.

Checkpoints: `export_state(n)` (every step < n trained) returns a `SchedulerState`;
`create_scheduler(..., restore=state)` resumes it in a new job: steps keep their global numbers
(the first one emitted is n), settled rollouts stay settled, untrained ones train first.

Backpressure contract: `submit` never blocks by default; samples it cannot take are returned
as `SubmitResult.deferred` positions with `retry_after_s`: resubmit those. With `wait_s > 0`
it waits up to that long for room first. A Ray Data consumer simply waits.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import ray

from actors.scheduler_api import (
    Admission, FlushResult, SchedulerConfig, SchedulerStats, ShardRef, StepRecord, SubmitResult,
)
from actors.scheduler_metrics import SchedulerMetrics
from vgbs_ray.config import ParallelConfig, check_schedule_configs
from vgbs_ray.eligibility import SchedulingDecision, decide_scheduling
from vgbs_ray.errors import ConfigError, SchedulerStateError, SchedulerTimeoutError
from vgbs_ray.intake import IngestOutcome, ReadyRollout, RolloutIntake
from vgbs_ray.ledger import Ledger
from vgbs_ray.metrics import reduce_metric_pairs
from vgbs_ray.sample import Sample
from vgbs_ray.scheduler_state import SchedulerState
from vgbs_ray.settled_ids import SettledIds
from vgbs_ray.scheduler_policy import (
    DropStale, EmitFullStep, FlushRequest, MaxWaitFlush, RunFlush, SchedulerView, StepChoice, WaitFor,
    admit_new_rollouts, choose_step, next_action, oldest_versions,
)
from vgbs_ray.staleness import STALE_REASON, check_admission_config, staleness_stats
from vgbs_ray.staleness_window import StalenessWindow
from vgbs_ray.stepping import PlannedStep, leftover_action, leftover_drop_reason, plan_step

__all__ = [
    "Admission", "FlushResult", "SchedulerActor", "SchedulerConfig", "SchedulerState", "SchedulerStats", "ShardRef", "StepRecord",
    "SubmitResult", "create_scheduler",
]

DEFAULT_NAME = "vgbs-scheduler"
MAX_DATASET_ERRORS = 100
METRICS_PUBLISH_S = 1.0

# CPython's cyclic GC thresholds for the scheduler's own worker process (see below).
_GC_THRESHOLDS = (50_000, 20, 100)


def _relax_gc_in_this_process() -> None:
    """Collect garbage less often in the scheduler actor's process (it is that actor's alone).

    The scheduler holds many long-lived small containers (buffered samples, ledger
    entries); under the default thresholds (700, 10, 10) the collector runs every few
    pushes and its older generations rescan them all. Nothing here creates reference
    cycles in bulk, so collecting less often only delays freeing a few. Measured with
    benchmarks/bench_scheduler.py on 2 cores: the push path went from 0.48 to 0.59 of a
    no-op actor's rate.
    """
    gc.set_threshold(*_GC_THRESHOLDS)


class _Signal:
    """A broadcast: `notify()` wakes every current `wait()`er (asyncio, one loop)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float | None) -> None:
        event = self._event
        if timeout_s is None:
            await event.wait()
            return
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass


@dataclass
class _PendingFlush:
    request: FlushRequest
    created_at: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: FlushResult | None = None
    error: str | None = None


def _ranks_by_node(rank_nodes: Sequence[str]) -> list[list[int]]:
    """DP ranks grouped by node, ranks ascending, nodes in order of their first rank."""
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


@dataclass
class _StepSlot:
    """An emitted step until every DP rank acknowledged it: its shards and who acked."""

    refs: list
    """Per DP rank, where its shard is: (ObjectRef, None) for an object of its own, (ObjectRef, index)
    for its entry in its node's object."""
    rollouts: list
    """The step's rollouts, kept until it is acknowledged (a rewind puts them back in front)."""
    acks: dict = field(default_factory=dict)
    """DP rank -> its (sum, count) metric pairs."""


class SchedulerActor:
    """Plain class; `create_scheduler` makes it a named asyncio Ray actor. See the module docstring."""

    def __init__(self, config: SchedulerConfig, name: str = DEFAULT_NAME, restore: SchedulerState | None = None):
        self.config = config
        self.name = name
        if ray.get_runtime_context().get_actor_id() is not None:
            _relax_gc_in_this_process()
        self.log = logging.getLogger(f"vgbs_ray.scheduler.{name}")
        if not self.log.handlers:
            self.log.addHandler(logging.StreamHandler())
            self.log.setLevel(logging.INFO)
        self.ledger = Ledger()
        self.intake = RolloutIntake(config.intake, self.ledger)
        self.metrics = SchedulerMetrics(name)
        self._parallel: ParallelConfig | None = None
        self._advertise_layout = True
        self._ranks_by_node: list[list[int]] | None = None   # DP ranks per node: one shard object per node
        self._slots: dict[int, _StepSlot] = {}
        self._retained: dict[int, list[ReadyRollout]] = {}  # trained, not yet in a checkpoint (retain_until_checkpoint)
        self._records: OrderedDict[int, StepRecord] = OrderedDict()
        self._trained_records = 0  # records of trained steps among _records (the window bounds these)
        self._next_step = 0
        self._steps_trained = 0
        self._partial_steps = 0
        self._padded_steps = 0
        self._flushes: deque[_PendingFlush] = deque()
        self._active_datasets = 0
        self._input_closed = False
        self._ended = False
        self._failure: str | None = None
        self._accepted = self._rejected = self._deferred = 0
        self._rollouts_seen = 0
        self._incomplete: list = []
        self._dataset_errors: list[str] = []
        self._last_decision: str | None = None
        self._changed: _Signal | None = None     # any change the emitter or a waiting submit cares about
        self._published: _Signal | None = None   # a step was published, the stream ended, or a failure
        self._emitter: asyncio.Task | None = None
        self._metrics_publisher: asyncio.Task | None = None
        self._acting: asyncio.Lock | None = None       # held by the emitter while it carries out an action, and by rewind
        self._layout_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-layout")
        # Staleness (config.max_staleness): the window's steps_formed is the step counter (step k
        # trains version k), kept equal to _next_step through emissions, rewinds and restores.
        self.window: StalenessWindow | None = None
        if config.max_staleness is not None:
            self.window = StalenessWindow(gbs=config.batch.global_batch_size, max_staleness=config.max_staleness)
        self._replay: set = set()   # ready rollouts put back by a rewind or a restore: they form steps first, in order
        self._choice: StepChoice | None = None  # the emitter's last staleness plan (made and used under _acting)
        self._admitted = self._refused_admissions = 0
        if restore is not None:
            self._restore(restore)

    def _restore(self, state: SchedulerState) -> None:
        """Resume `state` (see vgbs_ray.scheduler_state): global step numbers continue at
        state.next_step, settled rollouts stay settled, untrained ones are buffered in front."""
        if not isinstance(state, SchedulerState):
            raise ConfigError(f"restore must be a SchedulerState (export_state), got {type(state).__name__}")
        settled = SettledIds.from_bytes(state.settled)
        again = next((rid for rid in state.intake.rollout_ids if rid in settled), None)
        if again is not None:
            raise ConfigError(f"SchedulerState lists rollout {again!r} both as settled and as untrained")
        self.ledger = Ledger.restored(settled, next_step=state.next_step,
                                      rejected_samples_by_rule=state.rejected_samples_by_rule)
        self.intake = RolloutIntake(self.config.intake, self.ledger)
        self.intake.restore(state.intake, now=time.monotonic())
        self._next_step = self._steps_trained = state.next_step
        front = state.untrained_rollout_ids[:state.replay_rollouts]
        self._replay.update(front)
        if self.window is not None:
            self.window.steps_formed = state.policy_version
            # They fill the next steps: admissions from now on must land behind them.
            self.window.add_pending(state.intake.rollout_ids)
        self._accepted, self._rejected = state.accepted_samples, state.rejected_samples
        self._rollouts_seen = len(state.intake.ready)
        self._publish_metrics()
        self.log.info("%s: restored at step %d: %d settled rollouts, %d untrained back in the buffer",
                      self.name, state.next_step, len(settled), state.num_live_rollouts)

    def _start(self) -> None:
        """On the event loop, at the first call: signals and the emitter coroutine."""
        if self._emitter is None:
            self._changed, self._published = _Signal(), _Signal()
            self._acting = asyncio.Lock()
            self._emitter = asyncio.get_running_loop().create_task(self._emit_loop())
            self._metrics_publisher = asyncio.get_running_loop().create_task(self._publish_metrics_loop())

    # -- train side ------------------------------------------------------------------
    async def register_train_group(self, parallel: ParallelConfig, advertise_layout: bool = True,
                                   rank_nodes: Sequence[str] | None = None) -> SchedulingDecision:
        """Advertise the train group's parallel layout; steps are laid out only after this.

        advertise_layout=False selects the legacy path (even DP split, no micro-batch layout).
        `rank_nodes`, the Ray node of each DP rank, puts the shards of the DP ranks on one node as
        one object (one `ray.put` per node and step instead of one per rank; each ShardRef says
        which entry is its rank's, `ShardRef.fetch()`); None puts one object per rank. Returns the
        scheduling decision for a full step. Raises ConfigError for a pair of configs that can
        never be laid out, or a different layout once steps were emitted.
        """
        self._start()
        check_schedule_configs(parallel, self.config.batch)
        if self._parallel is not None and self._next_step and (parallel, advertise_layout) != (self._parallel, self._advertise_layout):
            raise ConfigError(f"scheduler {self.name!r} already emitted steps for {self._parallel}; "
                              "start a new scheduler for a different train group")
        if rank_nodes is not None and len(rank_nodes) != parallel.dp_size:
            raise ConfigError(f"rank_nodes names {len(rank_nodes)} nodes, one per DP rank is needed (dp_size={parallel.dp_size})")
        self._parallel, self._advertise_layout = parallel, advertise_layout
        self._ranks_by_node = None if rank_nodes is None else _ranks_by_node(rank_nodes)
        self._changed.notify()
        gbs = self.config.batch.global_batch_size
        decision = decide_scheduling(parallel if advertise_layout else None, num_rollouts=gbs,
                                     global_batch_size=gbs, features=self.config.features)
        self.log.info("%s: train group registered (%s); scheduling: %s", self.name, parallel, decision.reason)
        return decision

    async def get_shard(self, step: int, rank: int, timeout_s: float = 60.0) -> ShardRef | None:
        """Wait until rank `rank`'s shard of `step` is in the object store; return where it is.

        Returns None once input ended and `step` will never exist. Raises
        SchedulerTimeoutError after `timeout_s`, SchedulerStateError for a released step or
        after an internal failure.
        """
        if self._parallel is not None and not 0 <= rank < self._parallel.dp_size:
            raise ConfigError(f"rank {rank} is outside dp_size={self._parallel.dp_size}")
        slot = await self._wait_for_step(step, timeout_s, f"step {step}, rank {rank}")
        if slot is None:
            return None
        if not 0 <= rank < len(slot.refs):  # the train group registered while this call waited
            raise ConfigError(f"rank {rank} is outside dp_size={len(slot.refs)}")
        ref, index = slot.refs[rank]
        return ShardRef(step, rank, ref, len(slot.rollouts), index)

    async def get_step(self, step: int, timeout_s: float = 60.0) -> list[ShardRef] | None:
        """`get_shard` for every DP rank of `step` at once, in rank order: what a train group's driver
        asks, handing each rank its ShardRef (one call per step instead of one per rank, each of which
        costs the scheduler's process ~1 ms of CPU on 2 cores). None once input ended."""
        slot = await self._wait_for_step(step, timeout_s, f"step {step}")
        if slot is None:
            return None
        return [ShardRef(step, rank, ref, len(slot.rollouts), index) for rank, (ref, index) in enumerate(slot.refs)]

    async def _wait_for_step(self, step: int, timeout_s: float, who: str) -> _StepSlot | None:
        """The slot of `step` once emitted; None once input ended and it never will be (see get_shard)."""
        self._start()
        deadline = time.monotonic() + timeout_s
        while True:
            self._raise_if_failed()
            slot = self._slots.get(step)
            if slot is not None:
                return slot
            if step < self._next_step:
                raise SchedulerStateError(f"step {step} was acknowledged by every rank and released")
            if self._ended:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SchedulerTimeoutError(
                    f"{who}: no shard after {timeout_s} s; {self.intake.num_ready} rollouts ready "
                    f"(global_batch_size={self.config.batch.global_batch_size}), {self.intake.num_buffered_rollouts} "
                    f"buffered, {self._next_step} steps emitted, train group registered: {self._parallel is not None}")
            await self._published.wait(remaining)

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
        self._raise_if_failed()
        slot = self._slots.get(step)
        if slot is None:
            what = "was already acknowledged by every rank" if step < self._next_step else "was never emitted"
            raise SchedulerStateError(f"ack for step {step}, which {what}")
        for rank in metrics_by_rank:
            if not 0 <= rank < len(slot.refs):
                raise ConfigError(f"rank {rank} is outside dp_size={len(slot.refs)}")
            if rank in slot.acks:
                raise SchedulerStateError(f"step {step}: rank {rank} acknowledged twice")
        for rank, metrics in metrics_by_rank.items():
            slot.acks[rank] = dict(metrics or {})
        if len(slot.acks) < len(slot.refs):
            return False
        retain = self.config.retain_until_checkpoint
        self.ledger.train_step(step, settle=not retain)
        if retain:
            self._retained[step] = slot.rollouts
        del self._slots[step]  # the scheduler's references go; borrowers keep theirs alive
        if step in self._records:
            reduced = reduce_metric_pairs(slot.acks[r] for r in sorted(slot.acks))
            self._records[step] = replace(self._records[step], trained=True, metrics=reduced)
            self._trained_records += 1
            self._trim_records()
        self._steps_trained += 1
        self._changed.notify()  # admission may reopen (max_steps_ahead)
        return True

    async def checkpointed(self, next_step: int) -> None:
        """A checkpoint holds every step < `next_step`: their rollouts are settled for good."""
        self._start()
        self.ledger.settle_through(next_step)
        for step in [s for s in self._retained if s < next_step]:
            del self._retained[step]

    async def rewind(self, next_step: int) -> int:
        """A new train group restored the checkpoint that holds every step < `next_step`.

        Every later step (acknowledged but not checkpointed, or still in flight) did not happen:
        its shards are released and its rollouts go back to the front of the buffer in their
        original order, to train again exactly once; steps are numbered from `next_step` again.
        Returns the number of rollouts put back. Raises LedgerError if such a step was
        already declared checkpointed, or was trained without `retain_until_checkpoint`.
        """
        self._start()
        self._raise_if_failed()
        async with self._acting:  # never in the middle of an emission
            missing = [s for s in range(next_step, self._next_step) if s not in self._slots and s not in self._retained]
            if missing:
                raise SchedulerStateError(
                    f"cannot rewind to step {next_step}: step {missing[0]} was trained and its rollouts released; "
                    "set SchedulerConfig.retain_until_checkpoint=True and call checkpointed(n) after each checkpoint")
            rollouts = self._undo_steps_from(next_step)
            if self._ended:  # the input had ended: end it again after the replayed steps
                self._ended = False
                self._request_flush("end_of_input", end_of_input=True)
            self.log.warning("%s: rewound to step %d: %d rollouts back in front of the buffer",
                             self.name, next_step, len(rollouts))
            self._publish_metrics()
            self._changed.notify()
            return len(rollouts)

    async def drop_untrained(self, next_step: int, reason: str = "run_ended") -> int:
        """The run ended after step `next_step - 1` (its last checkpoint holds every step before):
        the steps emitted after it and every ready rollout still buffered are dropped with `reason`,
        so every accepted rollout ends trained, dropped or rejected. Call after `end_of_input`
        (which closes incomplete rollouts); later `get_shard` calls return None. Returns the number
        of rollouts dropped. Raises like `rewind` if a step >= `next_step` was already settled.
        """
        self._start()
        self._raise_if_failed()
        async with self._acting:
            self._undo_steps_from(next_step)  # back in front of the buffer, then dropped with the rest
            dropped = [r.rollout_id for r in self.intake.take_oldest(self.intake.num_ready)]
            self._drop(dropped, reason)
            if self.window is not None:
                self.window.discard_in_flight()
            self._input_closed = self._ended = True
            self._published.notify()
            self._changed.notify()
            self._publish_metrics()
            return len(dropped)

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
        self._raise_if_failed()
        async with self._acting:  # between emissions: nothing is half taken
            if not 0 <= next_step <= self._next_step:
                raise SchedulerStateError(f"cannot export at step {next_step}: steps emitted so far are "
                                          f"< {self._next_step}, and a checkpoint holds trained steps only")
            untrained = sorted(s for s in self._slots if s < next_step)
            if untrained:
                raise SchedulerStateError(f"cannot export at step {next_step}: step {untrained[0]} is not acknowledged "
                                          "by every rank yet; export after acking every step before the checkpoint")
            released = [s for s in range(next_step, self._next_step) if s not in self._slots and s not in self._retained]
            if released:
                raise SchedulerStateError(
                    f"cannot export at step {next_step}: step {released[0]} was trained and its rollouts released; "
                    "set SchedulerConfig.retain_until_checkpoint=True or export at a later step")
            front = [r for s in range(next_step, self._next_step)
                     for r in (self._slots[s].rollouts if s in self._slots else self._retained[s])]
            settled = self.ledger.export_settled(next_step)
            summary = self.ledger.summary()
            return SchedulerState(
                next_step=next_step, settled=settled.to_bytes(), intake=self.intake.snapshot(front),
                policy_version=next_step, replay_rollouts=len(front), rejected_samples_by_rule=dict(summary.rejected_samples_by_rule),
                dropped_by_reason=settled.counts()[1], accepted_samples=self._accepted,
                rejected_samples=self._rejected)

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
        self._raise_if_failed()
        ids = list(rollout_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ConfigError(f"admit needs distinct rollout ids (one group), got {ids!r}")
        known = tuple(rid for rid in ids if self.ledger.get(rid) is not None)
        if self.window is None:
            return Admission(True, self._next_step, self._next_step - engine_version, known=known, enforced=False)
        check_admission_config(gbs=self.window.gbs, group_size=len(ids), max_staleness=self.window.max_staleness)
        skip = set(known)
        new = [rid for rid in ids if rid not in skip and not self.window.is_pending(rid)]
        if not new:
            return Admission(True, self._next_step, self._next_step - engine_version, known=known)
        decision = self.window.try_admit(new, engine_version, owner=producer)
        if decision.admit:
            self._admitted += len(new)
        else:
            self._refused_admissions += 1
        return Admission(decision.admit, decision.landing_step, decision.expected_staleness, known=known)

    async def producer_lost(self, producer: int) -> int:
        """Producer `producer` died: the rollouts it had admitted and not finished no longer hold room in the
        staleness window and no step waits for them (its restart admits them again); returns how many."""
        self._start()
        if self.window is None:
            return 0
        freed = self.window.discard_owner(producer)
        self._changed.notify()
        return len(freed)

    async def abandon(self, rollout_ids: Sequence) -> None:
        """The producer gave these admitted rollouts up (engine died, producer stopped): they no longer
        hold room in the staleness window and no step waits for them. Samples of them already pushed
        stay buffered and end `incomplete_rollout` at end of input, as any unfinished rollout."""
        self._start()
        if self.window is not None:
            self.window.discard(rollout_ids)
            self._changed.notify()  # a full step may have waited for one of them

    async def fail_rollouts(self, rollout_ids: Sequence, reason: str) -> int:
        """The producer lost these admitted rollouts before pushing any sample (its agent raised,
        hung, returned a non-finite reward, ...): each unknown id is recorded DROPPED(reason) in the
        ledger and leaves the staleness window. Ids the scheduler already holds keep their state.
        Returns how many were recorded."""
        self._start()
        self._raise_if_failed()
        new = [rid for rid in dict.fromkeys(rollout_ids) if self.ledger.get(rid) is None]
        for rid in new:
            self.ledger.fail(rid, reason)
        if self.window is not None and new:
            self.window.discard(new)
            self._changed.notify()  # a full step may have waited for one of them
        if new:
            self.metrics.on_drop(reason, len(new))
            self.log.info("%s: %d rollouts lost by their producer (%s)", self.name, len(new), reason)
        return len(new)

    # -- producer side ---------------------------------------------------------------
    async def submit(self, samples: Sequence[Sample | dict[str, Any]], wait_s: float = 0.0) -> SubmitResult:
        """Take a batch of samples (any rollouts, any order); see SubmitResult for what happened to each."""
        self._start()
        self._raise_if_failed()
        if self._input_closed:
            raise SchedulerStateError(f"scheduler {self.name!r}: end_of_input() was called; no more samples")
        deadline = time.monotonic() + wait_s
        pending = list(range(len(samples)))
        accepted, rejected, completed = 0, [], []
        reason = ""
        while True:
            accept_new, reason = self._admission()
            batch = samples if len(pending) == len(samples) else [samples[i] for i in pending]
            out = self.intake.ingest(batch, now=time.monotonic(), accept_new=accept_new)
            accepted += out.accepted
            rejected += out.rejections
            completed += out.completed
            self._after_ingest(out)
            pending = [pending[p] for p in out.deferred]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                break
            await self._changed.wait(min(remaining, 0.5))
        if pending:
            self._deferred += len(pending)
            self.metrics.on_submit(0, (), len(pending))
        return SubmitResult(accepted=accepted, rejected=tuple(rejected), deferred=tuple(pending),
                            retry_after_s=self.config.retry_after_s if pending else None,
                            backpressure_reason=(reason or "buffer_full") if pending else None,
                            completed_rollouts=tuple(completed))

    async def consume_dataset(self, dataset: "ray.data.Dataset", end_input_when_done: bool = False) -> None:
        """Start consuming `dataset` rows in completion order in the background; returns at once.

        Each row is one sample (`Sample.from_dict` keys); a row without `rollout_size` is a
        one-sample rollout. The end of one stream is not the end of input (producers may still
        push): it emits nothing, unless `end_input_when_done` (then `end_of_input` runs). A
        consumer never defers: it waits for room (Ray Data backs off upstream). Rejected rows
        are counted like pushed samples; a failing stream lands in stats().dataset_errors.
        """
        self._start()
        self._raise_if_failed()
        if self._input_closed:
            raise SchedulerStateError(f"scheduler {self.name!r}: end_of_input() was called; no more datasets")
        try:
            dataset.context.execution_options.preserve_order = False  # completion order, not input order
        except AttributeError:
            pass
        self._active_datasets += 1
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._consume, args=(dataset, loop, end_input_when_done),
                         name=f"{self.name}-dataset", daemon=True).start()

    async def flush(self, timeout_s: float = 60.0) -> FlushResult:
        """Emit every full step, then treat what is left by the leftover policy. Waits for it."""
        self._start()
        return await self._await_flush(self._request_flush("flush", end_of_input=False), timeout_s)

    async def end_of_input(self, timeout_s: float = 120.0) -> FlushResult:
        """No more pushes: after running datasets finish, flush, close incomplete rollouts
        (reported in stats().incomplete_rollouts, recorded as dropped), and end the stream:
        get_shard past the last step then returns None."""
        self._start()
        self._input_closed = True
        return await self._await_flush(self._request_flush("end_of_input", end_of_input=True), timeout_s)

    # -- reports ---------------------------------------------------------------------
    async def step_record(self, step: int) -> StepRecord:
        """The record of one step: any step not yet trained, or one of the newest
        `step_record_window` records of trained steps. O(1)."""
        record = self._records.get(step)
        if record is None:
            raise SchedulerStateError(
                f"no record of step {step}: {self._next_step} steps emitted, the newest "
                f"{self.config.step_record_window} trained ones are kept (SchedulerConfig.step_record_window)")
        return record

    async def stats(self, include_rollouts: bool = False, check_ledger: bool = False) -> SchedulerStats:
        """Counts, the newest step records and the ledger summary: O(step_record_window).

        include_rollouts adds every rollout id's (state, step, reason); check_ledger also runs
        the ledger invariants (raises LedgerError on a scheduler bug). Both are O(rollouts).
        """
        if check_ledger:
            self.ledger.check()
        states = None
        if include_rollouts:
            states = {rid: (e.state.value, e.step, e.reason) for rid, e in self.ledger.entries()}
        return SchedulerStats(
            accepted_samples=self._accepted, rejected_samples=self._rejected, deferred_samples=self._deferred,
            buffered_rollouts=self.intake.num_buffered_rollouts, buffered_samples=self.intake.buffered_samples,
            buffered_tokens=self.intake.buffered_tokens, ready_rollouts=self.intake.num_ready,
            steps_emitted=self._next_step, steps_trained=self._steps_trained,
            partial_steps=self._partial_steps, padded_steps=self._padded_steps,
            input_closed=self._input_closed, ended=self._ended, recent_steps=tuple(self._records.values()),
            ledger=self.ledger.summary(), incomplete_rollouts=tuple(self._incomplete),
            rejections=tuple(self.ledger.recent_rejections), dataset_errors=tuple(self._dataset_errors),
            failure=self._failure, rollout_states=states, policy_version=self._next_step,
            stale_dropped_rollouts=self.ledger.summary().dropped_by_reason.get(STALE_REASON, 0),
            staleness_pending=None if self.window is None else self.window.pending_rollouts,
            staleness_in_flight=None if self.window is None else self.window.in_flight_rollouts,
            admitted_rollouts=self._admitted, refused_admissions=self._refused_admissions,
        )

    async def close(self) -> None:
        """Stop the emitter (the actor may then be killed)."""
        for task in (self._emitter, self._metrics_publisher):
            if task is not None:
                task.cancel()
        self._publish_metrics()
        self._layout_thread.shutdown(wait=False, cancel_futures=True)

    # -- internals: intake ---------------------------------------------------------------
    def _admission(self) -> tuple[bool, str]:
        room, why = self.intake.has_room()
        return admit_new_rollouts(steps_in_flight=self._next_step - self._steps_trained,
                                  max_steps_ahead=self.config.max_steps_ahead, buffer_has_room=room, buffer_reason=why)

    def _after_ingest(self, out: IngestOutcome) -> None:
        if self.window is not None:
            for rid in out.completed:
                self.window.finished(rid)
            self.window.discard(rid for rid, _ in out.dropped)
            # A rejected rollout with nothing accepted never trains (unless sent again, then as a
            # rollout that was not admitted): free its room. An open one may still complete.
            self.window.discard(r.rollout_id for r in out.rejections
                                if self.window.is_pending(r.rollout_id) and self.ledger.get(r.rollout_id) is None)
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
        if out.completed:
            self._changed.notify()

    def _consume(self, dataset, loop: asyncio.AbstractEventLoop, end_input_when_done: bool) -> None:
        """A thread: reads the stream, hands each row to the event loop (the state's only owner)."""
        try:
            for row in dataset.iter_rows():
                asyncio.run_coroutine_threadsafe(self._ingest_row(dict(row)), loop).result()
        except Exception as e:  # noqa: BLE001 - the stream's failure is reported, the scheduler lives on
            self.log.error("%s: dataset stream failed: %r", self.name, e)
            loop.call_soon_threadsafe(self._record_dataset_error, repr(e))
        finally:
            asyncio.run_coroutine_threadsafe(self._dataset_done(end_input_when_done), loop)

    async def _ingest_row(self, row: dict) -> None:
        while True:  # a dataset is never deferred: it waits for room
            accept_new, _ = self._admission()
            out = self.intake.ingest([row], now=time.monotonic(), accept_new=accept_new)
            self._after_ingest(out)
            if not out.deferred or self._failure is not None:
                return
            await self._changed.wait(0.5)

    def _record_dataset_error(self, error: str) -> None:
        if len(self._dataset_errors) < MAX_DATASET_ERRORS:
            self._dataset_errors.append(error)

    async def _dataset_done(self, end_input_when_done: bool) -> None:
        self._active_datasets -= 1
        if end_input_when_done:
            self._input_closed = True
            self._request_flush("end_of_input", end_of_input=True)
        self._changed.notify()

    # -- internals: the emitter ------------------------------------------------------------
    def _plan(self, *, allow_partial: bool = False, wait_for_in_flight: bool = True) -> StepChoice:
        """The staleness plan for the next step from the ready rollouts (window set). O(ready log ready)."""
        versions = oldest_versions(((r.rollout_id, r.samples) for r in self.intake.ready_rollouts()),
                                   trained_version=self.window.steps_formed)
        return choose_step(versions, window=self.window, replay=self._replay, allow_partial=allow_partial,
                           wait_for_in_flight=wait_for_in_flight)

    def _view(self, now: float) -> SchedulerView:
        oldest = self.intake.oldest_ready_at()
        if self.window is not None:
            self._choice = self._plan()
            return SchedulerView(
                registered=self._parallel is not None, num_ready=self._choice.num_fresh,
                global_batch_size=self.config.batch.global_batch_size, leftover=self.config.batch.leftover,
                flush_requests=tuple(f.request for f in self._flushes), active_datasets=self._active_datasets,
                oldest_ready_age_s=None if oldest is None else now - oldest, max_wait_s=self.config.max_wait_s,
                num_stale=len(self._choice.stale), waiting_for=self._choice.waiting_for,
            )
        return SchedulerView(
            registered=self._parallel is not None, num_ready=self.intake.num_ready,
            global_batch_size=self.config.batch.global_batch_size, leftover=self.config.batch.leftover,
            flush_requests=tuple(f.request for f in self._flushes), active_datasets=self._active_datasets,
            oldest_ready_age_s=None if oldest is None else now - oldest, max_wait_s=self.config.max_wait_s,
        )

    async def _emit_loop(self) -> None:
        try:
            while True:
                async with self._acting:
                    action = next_action(self._view(time.monotonic()))
                    if isinstance(action, DropStale):
                        self._drop_stale(self._choice.stale)
                    elif isinstance(action, EmitFullStep):
                        if self.window is None:
                            rollouts = self.intake.take_oldest(self.config.batch.global_batch_size)
                        else:
                            rollouts = self.intake.take(self._choice.take)
                        await self._emit(rollouts, "full", triggered_at=max(r.ready_at for r in rollouts))
                    elif isinstance(action, RunFlush):
                        pending = self._flushes[action.index]
                        del self._flushes[action.index]
                        await self._run_flush(pending)
                    elif isinstance(action, MaxWaitFlush):
                        await self._run_flush(_PendingFlush(FlushRequest("max_wait", False), time.monotonic()))
                if isinstance(action, WaitFor):
                    await self._changed.wait(action.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - fail loudly and for good, never spin or hang
            self._failure = f"{type(e).__name__}: {e}"
            self.log.exception("%s: scheduler failed; every later call raises: %s", self.name, self._failure)
            for pending in self._flushes:
                pending.error = self._failure
                pending.done.set()
            self._flushes.clear()
            self._published.notify()
            self._changed.notify()

    def _flush_take(self, *, partial: bool) -> list[ReadyRollout]:
        """A flush's next step under the staleness rules: stale ones dropped first, no wait for
        rollouts in flight (a flush never stalls). Full steps only unless `partial`."""
        choice = self._plan(allow_partial=partial, wait_for_in_flight=False)
        self._drop_stale(choice.stale)
        if not partial and len(choice.take) < self.config.batch.global_batch_size:
            return []
        return self.intake.take(choice.take)

    async def _run_flush(self, pending: _PendingFlush) -> None:
        request, steps, dropped = pending.request, [], []
        try:
            gbs = self.config.batch.global_batch_size
            if self.window is not None and request.end_of_input:
                self.window.discard_in_flight()  # nothing more arrives: no step may wait for them
            while self._parallel is not None and self.intake.num_ready >= gbs:
                rollouts = self.intake.take_oldest(gbs) if self.window is None else self._flush_take(partial=False)
                if not rollouts:
                    break
                steps.append(await self._emit(rollouts, "full", triggered_at=max(r.ready_at for r in rollouts)))
            action = leftover_action(self.config.batch.leftover, end_of_input=request.end_of_input)
            if action == "keep":
                leftover = []
            elif self.window is None or action == "drop":
                if self.window is not None:
                    self._drop_stale(self._plan(wait_for_in_flight=False).stale)  # stale ones say so
                leftover = self.intake.take_oldest(self.intake.num_ready)
            else:
                leftover = self._flush_take(partial=True)
            if leftover and action == "drop":
                ids = [r.rollout_id for r in leftover]
                self._drop(ids, leftover_drop_reason(self.config.batch.leftover))
                dropped += ids
            elif leftover:
                steps.append(await self._emit(leftover, request.trigger, triggered_at=pending.created_at))
            if request.end_of_input:
                for rid, reason, detail in self.intake.close_incomplete():
                    self.ledger.drop(rid, reason)
                    if self.window is not None:
                        self.window.discard((rid,))
                    self.metrics.on_drop(reason)
                    self._incomplete.append((rid, reason, detail))
                    dropped.append(rid)
                    self.log.warning("%s: rollout %r not trained at end of input: %s (%s)", self.name, rid, reason, detail)
                self._ended = True
                self._published.notify()
            pending.result = FlushResult(steps=tuple(steps), dropped=tuple(dropped), kept=self.intake.num_ready)
        except Exception as e:
            pending.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            pending.done.set()
            self._publish_metrics()

    def _drop_stale(self, rollout_ids) -> None:
        """Rule 1: ready rollouts too old for the next step (so for every later one) are dropped."""
        if rollout_ids:
            self.intake.take(rollout_ids)
            self._drop(rollout_ids, STALE_REASON)
            self.metrics.on_stale_drop(len(rollout_ids))

    def _drop(self, rollout_ids, reason: str) -> None:
        for rid in rollout_ids:
            self.ledger.drop(rid, reason)
        self.intake.settle(rollout_ids)
        self._replay.difference_update(rollout_ids)
        if self.window is not None:
            self.window.discard(rollout_ids)
        self.metrics.on_drop(reason, len(rollout_ids))
        if rollout_ids:
            self.log.info("%s: dropped %d rollouts (%s)", self.name, len(rollout_ids), reason)

    async def _emit(self, rollouts: list[ReadyRollout], trigger: str, *, triggered_at: float) -> int:
        """Lay out and put the shards on the layout thread, then publish on the loop. Returns the step."""
        step = self._next_step
        try:
            planned, refs = await asyncio.get_running_loop().run_in_executor(
                self._layout_thread, self._plan_and_put, rollouts, step, self._parallel, self._advertise_layout,
                self._rollouts_seen, self._ranks_by_node)
        except BaseException:
            self.intake.return_front(rollouts)  # nothing of the step happened: the rollouts stay buffered
            raise
        published = time.monotonic()
        ids = tuple(r.rollout_id for r in rollouts)
        waits = [published - r.completed_at for r in rollouts]
        versions = [v for v in oldest_versions(((r.rollout_id, r.samples) for r in rollouts), trained_version=step).values()
                    if v is not None]
        lag = staleness_stats(versions, trained_version=step) if versions else None
        record = StepRecord(
            step=step, num_rollouts=len(ids), num_samples=planned.num_samples, num_tokens=planned.num_tokens,
            microbatches_per_rank=tuple(s.num_microbatches for s in planned.shards),
            padding_microbatches=planned.num_padding_microbatches,
            samples_per_rank=tuple(s.num_samples for s in planned.shards),
            tokens_per_rank=tuple(s.num_tokens for s in planned.shards),
            layout="rollout_side" if planned.decision.rollout_side else "legacy",
            decision_reason=planned.decision.reason, trigger=trigger,
            partial=len(ids) < self.config.batch.global_batch_size,
            mean_completion_to_emission_s=sum(waits) / len(waits), max_completion_to_emission_s=max(waits),
            scheduling_latency_s=published - max(triggered_at, max(r.ready_at for r in rollouts)),
            rollout_ids=ids, policy_version=step, staleness_mean=None if lag is None else lag.mean,
            staleness_max=None if lag is None else lag.max,
        )
        self.ledger.schedule(ids, step)
        self.intake.settle(ids)
        self._replay.difference_update(ids)
        if self.window is not None:
            self.window.step_formed(ids)
        self._slots[step] = _StepSlot(refs=refs, rollouts=rollouts)
        self._records[step] = record
        self._trim_records()
        self._next_step += 1
        self._partial_steps += record.partial
        self._padded_steps += record.padding_microbatches > 0
        self.metrics.on_step(record)
        self._published.notify()
        if record.layout != self._last_decision:
            self._last_decision = record.layout
            self.log.info("%s: scheduling decision: %s (%s)", self.name, record.layout, record.decision_reason)
        self.log.info("%s step %d: %d rollouts, %d samples, %s micro-batches/rank (%d padding), %d tokens, %s, "
                      "latency %.1f ms", self.name, step, record.num_rollouts, record.num_samples,
                      record.microbatches_per_rank[0], record.padding_microbatches, record.num_tokens, trigger,
                      record.scheduling_latency_s * 1e3)
        return step

    def _plan_and_put(self, rollouts, step: int, parallel: ParallelConfig, advertise_layout: bool,
                      rollouts_seen: int, node_ranks: list[list[int]] | None) -> tuple[PlannedStep, list]:
        """The layout thread: pure planning, then the shards into the object store (objects owned by this
        actor): one per rank, or one per node (`node_ranks`: the DP ranks of each node) holding its ranks'.
        Returns the plan and, per DP rank, (ObjectRef, index in its node's object or None)."""
        planned = plan_step(rollouts, step=step, parallel=parallel, batch=self.config.batch,
                            advertise_layout=advertise_layout, num_rollouts_seen=rollouts_seen,
                            features=self.config.features)
        if node_ranks is None:
            return planned, [(ray.put(shard), None) for shard in planned.shards]
        where: list = [None] * len(planned.shards)
        for ranks in node_ranks:
            ref = ray.put(tuple(planned.shards[rank] for rank in ranks))
            for index, rank in enumerate(ranks):
                where[rank] = (ref, index)
        return planned, where

    # -- internals: flush requests and failure ---------------------------------------------
    def _request_flush(self, trigger: str, *, end_of_input: bool) -> _PendingFlush:
        pending = _PendingFlush(FlushRequest(trigger, end_of_input), time.monotonic())
        self._flushes.append(pending)
        self._changed.notify()
        return pending

    async def _await_flush(self, pending: _PendingFlush, timeout_s: float) -> FlushResult:
        self._raise_if_failed()
        try:
            await asyncio.wait_for(pending.done.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise SchedulerTimeoutError(
                f"{pending.request.trigger} not done after {timeout_s} s: train group registered: "
                f"{self._parallel is not None}, datasets still running: {self._active_datasets}") from None
        if pending.error is not None:
            raise SchedulerStateError(f"{pending.request.trigger} failed in the scheduler: {pending.error}")
        return pending.result

    def _undo_steps_from(self, next_step: int) -> list[ReadyRollout]:
        """Steps >= `next_step` did not happen: release their shards and records, put their rollouts
        back in front of the buffer in their original order, and number steps from `next_step` again.
        Raises LedgerError (changing nothing) if one of them already settled."""
        self.ledger.rewind(next_step)  # scheduled (and unsettled trained) -> buffered
        rollouts = []
        for step in range(next_step, self._next_step):
            slot = self._slots.pop(step, None)
            rollouts += slot.rollouts if slot is not None else self._retained.pop(step)
            undone = self._records.pop(step, None)
            self._trained_records -= bool(undone is not None and undone.trained)
        self.intake.return_front(rollouts)
        self._replay.update(r.rollout_id for r in rollouts)
        self._next_step = next_step
        if self.window is not None:
            self.window.steps_formed = next_step
        self._steps_trained = min(self._steps_trained, next_step)
        return rollouts

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise SchedulerStateError(f"scheduler {self.name!r} failed: {self._failure}")

    def _trim_records(self) -> None:
        """Keep every untrained step's record (the train side reads it after the step) and the newest
        trained ones up to step_record_window: evict only trained records, oldest first."""
        while self._trained_records > self.config.step_record_window:
            # Steps train in order, so the oldest trained record is (nearly always) the first one.
            step = next(step for step, r in self._records.items() if r.trained)
            del self._records[step]
            self._trained_records -= 1

    async def _publish_metrics_loop(self) -> None:
        """The metrics every METRICS_PUBLISH_S (and at restores, rewinds, flushes and close): pushes, steps
        and acks only buffer theirs (actors/scheduler_metrics.py says why)."""
        while True:
            self._publish_metrics()
            await asyncio.sleep(METRICS_PUBLISH_S)

    def _publish_metrics(self) -> None:
        self.metrics.on_state(buffered_rollouts=self.intake.num_buffered_rollouts,
                              buffered_samples=self.intake.buffered_samples,
                              steps_in_flight=self._next_step - self._steps_trained, policy_version=self._next_step)
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
