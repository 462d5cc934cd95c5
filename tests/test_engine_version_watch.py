"""A producer's workers share one read of the engines' version (actors/engine_version_watch.py)."""

from __future__ import annotations

import asyncio

from actors.engine_version_watch import EngineVersionWatch


class Engines:
    """The engine pool's `policy_version`, answered when the test releases it."""

    def __init__(self):
        self.version = 3
        self.calls = 0
        self.release = asyncio.Event()
        self.error: Exception | None = None

    async def policy_version(self) -> int:
        self.calls += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return self.version


def test_workers_asking_at_once_share_one_read_and_a_fresh_reading_is_reused():
    async def scenario():
        engines = Engines()
        watch = EngineVersionWatch(engines.policy_version, poll_s=3600.0)
        waiting = [asyncio.ensure_future(watch.current()) for _ in range(16)]
        await asyncio.sleep(0)
        engines.release.set()
        assert await asyncio.gather(*waiting) == [3] * 16
        engines.version = 4
        assert await watch.current() == 3  # read less than poll_s ago: not asked again
        return engines.calls, watch.reads

    assert asyncio.run(scenario()) == (1, 1)


def test_a_reading_older_than_poll_s_is_read_again():
    async def scenario():
        engines = Engines()
        engines.release.set()
        watch = EngineVersionWatch(engines.policy_version, poll_s=0.0)
        first = await watch.current()
        engines.version = 5
        return first, await watch.current(), engines.calls

    assert asyncio.run(scenario()) == (3, 5, 2)


def test_a_cancelled_worker_does_not_cancel_the_read_the_others_wait_for():
    async def scenario():
        engines = Engines()
        watch = EngineVersionWatch(engines.policy_version, poll_s=3600.0)
        cancelled, other = asyncio.ensure_future(watch.current()), asyncio.ensure_future(watch.current())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        engines.release.set()
        return await other, cancelled.cancelled(), engines.calls

    assert asyncio.run(scenario()) == (3, True, 1)


def test_a_failed_read_reaches_every_waiting_worker_and_the_next_call_reads_again():
    async def scenario():
        engines = Engines()
        engines.error = RuntimeError("every engine died")
        watch = EngineVersionWatch(engines.policy_version, poll_s=3600.0)
        waiting = [asyncio.ensure_future(watch.current()) for _ in range(3)]
        await asyncio.sleep(0)
        engines.release.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results), results
        engines.error = None
        return await watch.current(), engines.calls

    assert asyncio.run(scenario()) == (3, 2)
