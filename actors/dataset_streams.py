"""The Ray Data streams a SchedulerActor consumes: one reader thread per stream, rows handed to the loop.

Each row is read on its own thread (`Dataset.iter_rows`, in completion order) and handed to the
actor's event loop, the only owner of the scheduler's state, one row at a time: the reader waits
for each row to be taken, so a full buffer backs the stream off upstream instead of deferring.
A failing stream is logged and kept in `errors` (at most MAX_ERRORS); the scheduler lives on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable, Callable

MAX_ERRORS = 100


class DatasetStreams:
    """The streams being consumed (`active`) and the errors of failed ones. Used on one event loop."""

    def __init__(self, name: str, log: logging.Logger):
        self.name = name
        self.log = log
        self.active = 0
        self.errors: list[str] = []

    def start(self, dataset, ingest_row: Callable[[dict], Awaitable[None]],
              on_finished: Callable[[], None]) -> None:
        """Read `dataset` on a new thread: `await ingest_row(row)` on this loop for each row, then
        `on_finished()` on this loop once the stream ended or failed (`active` already counts it out)."""
        try:
            dataset.context.execution_options.preserve_order = False  # completion order, not input order
        except AttributeError:
            pass
        self.active += 1
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(dataset, loop, ingest_row, on_finished),
                         name=f"{self.name}-dataset", daemon=True).start()

    def _read(self, dataset, loop: asyncio.AbstractEventLoop, ingest_row, on_finished) -> None:
        try:
            for row in dataset.iter_rows():
                asyncio.run_coroutine_threadsafe(ingest_row(dict(row)), loop).result()
        except Exception as e:  # noqa: BLE001 - the stream's failure is reported, the scheduler lives on
            self.log.error("%s: dataset stream failed: %r", self.name, e)
            loop.call_soon_threadsafe(self._record_error, repr(e))
        finally:
            loop.call_soon_threadsafe(self._finished, on_finished)

    def _record_error(self, error: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error)

    def _finished(self, on_finished: Callable[[], None]) -> None:
        self.active -= 1
        on_finished()
