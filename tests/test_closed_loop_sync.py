"""The trainer does not wait for the engines: `RolloutSource.publish` returns while a load is still
held in the engine, and the load's time is recorded once it finished, without a wait.

Stand-ins for the train group's export (`publish_weights`) and the engine pool; real Ray."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

import jobs.rollout_source as closed_loop
from actors.weight_sync import PublishedWeights, WeightLoad
from jobs.rollout_source import RolloutSource

pytestmark = pytest.mark.slow  # Ray actors: a few seconds


@ray.remote(num_cpus=0)
class HeldEngine:
    """Loads a version only when the test says so."""

    def __init__(self):
        self.release = asyncio.Event()

    async def update_weights(self, version: int, weights) -> WeightLoad:
        await self.release.wait()
        return WeightLoad(engine="held", policy_version=version, load_time_s=0.25, num_bytes=8)

    def go(self) -> None:
        self.release.set()


class StandInPool:
    def __init__(self):
        self.engine = HeldEngine.remote()

    def update_weights(self, published: PublishedWeights) -> list:
        return [self.engine.update_weights.remote(published.policy_version, published.ref)]


def test_publish_returns_before_the_engines_loaded_and_records_the_load_later(ray_session, monkeypatch):
    monkeypatch.setattr(closed_loop, "publish_weights", lambda group, version, **_: PublishedWeights(
        policy_version=version, ref=ray.put({"w": version}), num_bytes=8, publish_time_s=0.0))
    loop = RolloutSource(engines=StandInPool())
    loop.publish(group=None, policy_version=1)  # the engine holds the load: publish must not wait for it
    assert len(loop.loads) == 1 and loop.load_times_s == []
    ray.get(loop.engines.engine.go.remote(), timeout=30)
    deadline = time.monotonic() + 30
    while not ray.wait(loop.loads[0][1], timeout=0.1)[0]:  # the held load finishes
        assert time.monotonic() < deadline
    loop.publish(group=None, policy_version=2)  # collects version 1's load; version 2 loads at once now
    assert (1, 0.25) in loop.load_times_s
    assert loop.restored_versions == []
    loop.restore(group=None, policy_version=1)
    assert loop.restored_versions == [1]
