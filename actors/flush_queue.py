"""The SchedulerActor's pending flushes: requested by callers, carried out by its emitter, in order.

A caller (`flush`, `end_of_input`, a rewind after the input ended, a Ray Data stream that ends
the input) appends a request and may wait for its result; the emitter passes `requests()` to the
core's `next_action`, which says which one to run (`RunFlush.index`), and finishes it with a
result or an error. If the emitter fails, `fail_all` ends every waiter with that error.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from vgbs_ray.errors import SchedulerStateError, SchedulerTimeoutError
from vgbs_ray.scheduler.policy import FlushRequest
from vgbs_ray.scheduler.types import FlushResult


@dataclass
class PendingFlush:
    """One requested flush; `done` is set once `result` or `error` is."""

    request: FlushRequest
    created_at: float  # time.monotonic(): a flush's steps count their scheduling latency from here
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: FlushResult | None = None
    error: str | None = None


class FlushQueue:
    """The flushes not yet run, oldest first. Used on one event loop only."""

    def __init__(self) -> None:
        self._pending: deque[PendingFlush] = deque()

    def request(self, trigger: str, *, end_of_input: bool) -> PendingFlush:
        pending = PendingFlush(FlushRequest(trigger, end_of_input), time.monotonic())
        self._pending.append(pending)
        return pending

    def requests(self) -> list[FlushRequest]:
        return [pending.request for pending in self._pending]

    def pop(self, index: int) -> PendingFlush:
        pending = self._pending[index]
        del self._pending[index]
        return pending

    def fail_all(self, error: str) -> None:
        for pending in self._pending:
            pending.error = error
            pending.done.set()
        self._pending.clear()

    @staticmethod
    async def result(pending: PendingFlush, timeout_s: float, describe_wait: Callable[[], str]) -> FlushResult:
        """The flush's result once run. Raises SchedulerTimeoutError after `timeout_s` (the message ends
        with `describe_wait()`), SchedulerStateError if it failed."""
        try:
            await asyncio.wait_for(pending.done.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise SchedulerTimeoutError(
                f"{pending.request.trigger} not done after {timeout_s} s: {describe_wait()}") from None
        if pending.error is not None:
            raise SchedulerStateError(f"{pending.request.trigger} failed in the scheduler: {pending.error}")
        return pending.result
