"""The SchedulerActor's background half: one coroutine that turns the core's decisions into steps.

`StepEmitter.run` loops on the actor's event loop: it asks the core (vgbs_ray.scheduler.core) for
its `next_action` and carries it out: drop stale rollouts, emit a full step, run a requested
flush or the max-wait flush, or wait for a change (`changed`). Laying a step out and `ray.put` of
its shards run on one worker thread (`run_in_executor`), so pushes and pulls go on meanwhile;
steps are numbered in emission order and announced on `published`.

An unexpected error (a bug, a failing object store) is not retried: `failure` records it, every
waiting flush ends with it, and the actor's calls raise it from then on, instead of a loop that
spins or a flush that times out. `acting` is held while one action is carried out: the actor's
rewind, drop and export take it too, so they never see a step half emitted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from actors.async_signal import Signal
from actors.flush_queue import FlushQueue, PendingFlush
from actors.shard_placement import put_shards
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.errors import SchedulerStateError, SchedulerTimeoutError
from vgbs_ray.scheduler.intake import ReadyRollout
from vgbs_ray.scheduler.core import SchedulerCore, StepSlot
from vgbs_ray.scheduler.policy import DropStale, EmitFullStep, FlushRequest, MaxWaitFlush, RunFlush, WaitFor
from vgbs_ray.scheduler.types import FlushResult
from vgbs_ray.scheduler.stepping import PlannedStep, plan_step


class StepEmitter:
    """Carries out `core.next_action()` in a loop. Create and use it on the actor's event loop only.

    changed: any change the emitter (or a waiting push) cares about; the actor notifies it.
    published: a step was published, the input ended, or the emitter failed; `get_shard` waits on it.
    ranks_by_node: the DP ranks of each node (one shard object per node and step), or None.
    """

    def __init__(self, core: SchedulerCore, batch: BatchConfig, name: str, log: logging.Logger, *,
                 active_datasets: Callable[[], int], after_flush: Callable[[], None]):
        self.core = core
        self.batch = batch
        self.name = name
        self.log = log
        self.changed = Signal()
        self.published = Signal()
        self.acting = asyncio.Lock()
        self.flushes = FlushQueue()
        self.failure: str | None = None
        self.ranks_by_node: list[list[int]] | None = None
        self._active_datasets = active_datasets
        self._after_flush = after_flush
        self._layout_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-layout")

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise SchedulerStateError(f"scheduler {self.name!r} failed: {self.failure}")

    async def wait_for_slot(self, step: int, timeout_s: float, who: str) -> StepSlot | None:
        """The slot of `step` once published; None once input ended and it never will be. Raises
        SchedulerTimeoutError after `timeout_s` (`who` names the caller), SchedulerStateError for a released
        step or once the emitter failed."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.raise_if_failed()
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
            await self.published.wait(remaining)

    def request_flush(self, trigger: str, *, end_of_input: bool) -> PendingFlush:
        pending = self.flushes.request(trigger, end_of_input=end_of_input)
        self.changed.notify()
        return pending

    async def flush_result(self, pending: PendingFlush, timeout_s: float) -> FlushResult:
        """The requested flush's result once run (raises as `FlushQueue.result`, or if the emitter failed)."""
        self.raise_if_failed()
        return await FlushQueue.result(pending, timeout_s, lambda: (
            f"train group registered: {self.core.parallel is not None}, "
            f"datasets still running: {self._active_datasets()}"))

    def close(self) -> None:
        self._layout_thread.shutdown(wait=False, cancel_futures=True)

    async def run(self) -> None:
        try:
            while True:
                async with self.acting:
                    action = self.core.next_action(now=time.monotonic(), flush_requests=self.flushes.requests(),
                                                   active_datasets=self._active_datasets())
                    if isinstance(action, DropStale):
                        self.core.drop_stale(action.rollout_ids)
                    elif isinstance(action, EmitFullStep):
                        rollouts = self.core.take(action.rollout_ids)
                        await self._emit(rollouts, "full", triggered_at=max(r.ready_at for r in rollouts))
                    elif isinstance(action, RunFlush):
                        await self._run_flush(self.flushes.pop(action.index))
                    elif isinstance(action, MaxWaitFlush):
                        await self._run_flush(PendingFlush(FlushRequest("max_wait", False), time.monotonic()))
                if isinstance(action, WaitFor):
                    await self.changed.wait(action.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - fail loudly and for good, never spin or hang
            self.failure = f"{type(e).__name__}: {e}"
            self.log.exception("%s: scheduler failed; every later call raises: %s", self.name, self.failure)
            self.flushes.fail_all(self.failure)
            self.published.notify()
            self.changed.notify()

    async def _run_flush(self, pending: PendingFlush) -> None:
        steps, dropped = [], []
        try:
            for rollouts, trigger in self.core.flush(pending.request, dropped):
                triggered_at = max(r.ready_at for r in rollouts) if trigger == "full" else pending.created_at
                steps.append(await self._emit(rollouts, trigger, triggered_at=triggered_at))
            if self.core.ended:
                self.published.notify()
            pending.result = FlushResult(steps=tuple(steps), dropped=tuple(dropped), kept=self.core.intake.num_ready)
        except Exception as e:
            pending.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            pending.done.set()
            self._after_flush()

    async def _emit(self, rollouts: list[ReadyRollout], trigger: str, *, triggered_at: float) -> int:
        """Lay out and put the shards on the layout thread, then publish on the loop. Returns the step."""
        step = self.core.next_step
        try:
            planned, where = await asyncio.get_running_loop().run_in_executor(
                self._layout_thread, self._plan_and_put, rollouts, step, self.core.parallel, self.ranks_by_node)
        except BaseException:
            self.core.return_front(rollouts)  # nothing of the step happened: the rollouts stay buffered
            raise
        self.core.publish(rollouts, planned, where, trigger, triggered_at=triggered_at, now=time.monotonic())
        self.published.notify()
        return step

    def _plan_and_put(self, rollouts, step: int, parallel: ParallelConfig,
                      node_ranks: list[list[int]] | None) -> tuple[PlannedStep, list]:
        """The layout thread: pure planning, then the shards into the object store (owned by this process)."""
        planned = plan_step(rollouts, step=step, parallel=parallel, batch=self.batch)
        return planned, put_shards(planned.shards, node_ranks)
