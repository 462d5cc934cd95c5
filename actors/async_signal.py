"""A broadcast signal for coroutines on one asyncio event loop."""

from __future__ import annotations

import asyncio


class Signal:
    """`notify()` wakes every coroutine waiting at that moment; later waiters wait for the next one.

    Not thread-safe: notify and wait on the loop that created it (other threads use
    `loop.call_soon_threadsafe(signal.notify)`).
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float | None) -> None:
        """Until the next notify, or `timeout_s` seconds (None: no limit); never raises on timeout."""
        event = self._event
        if timeout_s is None:
            await event.wait()
            return
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
