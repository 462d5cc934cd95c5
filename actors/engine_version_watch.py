"""One producer's reading of the engines' policy version, shared by all of its workers.

A worker asks the scheduler to admit a group at the engines' version (actors/agent_producer.py).
When it is refused, admission reopens almost always because the engines loaded a newer version,
so the worker waits for that instead of asking the scheduler again every poll: one read of the
engines per `poll_s` serves every worker of the producer, and a refused worker asks the scheduler
again once the version changed (or after its recheck interval: drops and abandons of other
rollouts reopen admission without a new version).

Before this, each refused worker asked the engines and the scheduler every 50 ms: in the 100-step
demo (two producers of eight workers) that was 3,600 refused admits and about 7 s of CPU.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable


class EngineVersionWatch:
    """The engines' version, read at most once per `poll_s` however many workers ask.

    Invariant: `current()` never returns a reading older than `poll_s` seconds, and at most one
    read is in flight; every caller waiting for it gets its result (or its error).
    """

    def __init__(self, read: Callable[[], Awaitable[int]], poll_s: float):
        self._read = read
        self.poll_s = poll_s
        self._version: int | None = None
        self._read_at = float("-inf")
        self._reading: asyncio.Task | None = None
        self.reads = 0
        """Reads of the engines so far (each one call per live engine)."""

    async def current(self) -> int:
        if self._version is not None and time.monotonic() - self._read_at < self.poll_s:
            return self._version
        if self._reading is None:
            self._reading = asyncio.get_running_loop().create_task(self._read_once())
        # shield: a worker cancelled while it waits must not cancel the read the others wait for
        return await asyncio.shield(self._reading)

    async def _read_once(self) -> int:
        try:
            self.reads += 1
            version = await self._read()
            self._version, self._read_at = version, time.monotonic()
            return version
        finally:
            self._reading = None


__all__ = ["EngineVersionWatch"]
