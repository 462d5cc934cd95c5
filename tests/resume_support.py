"""Helpers of the failure and resume tests: job overrides that select the synthetic preset (the
job's control flow, fast, without vLLM), a recording stand-in for the scheduler's push API, and a
producer that can be parked right after a partial push (fault injection, kept out of the product).

Ray workers import a test helper class by its module name, so it lives here (`tests.resume_support`)
rather than in a test module that pytest imports under another name."""

from __future__ import annotations

import asyncio
import os
import time

import ray

from actors.agent_producer import PRODUCER_NAME, AgentProducer
from actors.scheduler_actor import DEFAULT_NAME
from vgbs_ray.scheduler.types import Admission, SubmitResult


def synthetic_producers() -> list[str]:
    """`--set` items that select the synthetic preset (the job defaults to the closed loop)."""
    return ["preset=synthetic"]


def make_held_agent(hold_until: str, **synthetic_kwargs):
    """The synthetic agent, except that the groups of prompt positions 0 and 1 (each of two producers'
    first) finish only once the path `hold_until` exists: an event the test controls, not a delay."""
    from examples.synthetic_agent import make_agent

    agent = make_agent(**synthetic_kwargs)

    async def held(row, ctx):
        while ctx.group_id in ("p0", "p1") and not os.path.exists(hold_until):
            await asyncio.sleep(0.05)
        return await agent(row, ctx)

    return held


class HoldingProducer(AgentProducer):
    """An AgentProducer with one fault-injection point: `hold_at_next_partial_push()` arms it; after the
    next submit that leaves a rollout partly pushed (a `sample_push_fraction` group, pushed sample by
    sample), no worker submits again until `stop()` or the actor is killed. `holding()` then names the
    partly pushed rollouts (exactly, with `groups_in_flight=1`: another worker's submit already under
    way may still land). A test makes the job start it with
    `monkeypatch.setattr(actors.agent_producer, "AgentProducer", HoldingProducer)`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._armed = self._held = False
        self._samples_of: dict = {}  # rollout id -> its number of samples (its group's push)
        self._pushed: dict = {}  # rollout id -> samples of it pushed so far

    def hold_at_next_partial_push(self) -> None:
        self._armed = True

    def holding(self) -> list:
        """The ids of the partly pushed rollouts while held (else [])."""
        return self._partly_pushed() if self._held else []

    async def _push_one_by_one(self, samples: list[dict]) -> bool:
        for sample in samples:
            self._samples_of[sample["rollout_id"]] = self._samples_of.get(sample["rollout_id"], 0) + 1
        return await super()._push_one_by_one(samples)

    async def _push(self, samples: list[dict]) -> bool:
        if self._held:
            await self._stop.wait()
            return False
        pushed = await super()._push(samples)
        if pushed:
            for sample in samples:
                self._pushed[sample["rollout_id"]] = self._pushed.get(sample["rollout_id"], 0) + 1
        if self._armed and self._partly_pushed():
            self._held = True
        return pushed

    def _partly_pushed(self) -> list:
        return sorted(rid for rid, count in self._pushed.items() if count < self._samples_of.get(rid, 0))


class RecordingScheduler:
    """Admits every group, accepts every sample and records (rollout id, sample index, tokens) of each,
    in push order; `admit` names the ids pushed before as known, like the scheduler."""

    def __init__(self):
        self.samples: list[tuple] = []

    def admit(self, rollout_ids, engine_version: int, producer: int | None = None) -> Admission:
        pushed = {rid for rid, _, _ in self.samples}
        return Admission(True, 0, 0, known=tuple(rid for rid in rollout_ids if rid in pushed), enforced=False)

    def submit(self, samples, wait_s: float = 0.0) -> SubmitResult:
        self.samples += [(s["rollout_id"], s["sample_index"], tuple(int(t) for t in s["tokens"])) for s in samples]
        return SubmitResult(accepted=len(samples))

    def fail_rollouts(self, rollout_ids, reason: str) -> int:
        raise AssertionError(f"the synthetic agent lost {rollout_ids} ({reason})")

    def abandon(self, rollout_ids) -> None:
        pass

    def seen(self) -> list[tuple]:
        return list(self.samples)


def names_free(num_agents: int = 2, timeout_s: float = 60.0) -> None:
    """Wait until the previous run's named actors are gone (the next run reuses the names)."""
    names = [DEFAULT_NAME] + [PRODUCER_NAME.format(i) for i in range(num_agents)]
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            assert time.monotonic() < deadline, f"actor {name} still alive after {timeout_s} s"
            time.sleep(0.1)
