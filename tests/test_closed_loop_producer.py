"""EnvProducer against a real SchedulerActor and a stand-in engine (no vLLM, no trainer).

The stand-in engine answers the digit task right for half the members of a group (so rewards
vary and groups carry signal) and reports a policy version the test sets. What is checked:
whole groups pushed with the engine's version and log-probs, dataset prompts answered besides
the generator's, stop() abandoning the groups in flight, and a producer resumed from `cursor()`
pushing every prompt exactly once (the scheduler's `known` ids are skipped, none is re-pushed).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray

from actors.env_producer import EnvProducerConfig, start_env_producer
from actors.rollout_engine import EngineClient, Generation
from actors.scheduler_actor import SchedulerConfig, create_scheduler
from vgbs_ray.config import BatchConfig
from vgbs_ray.envs.digits import SEP, VOCAB_SIZE, DigitTaskConfig, prompt_rows
from vgbs_ray.intake import IntakeConfig

pytestmark = pytest.mark.slow  # Ray actors and a Ray Data stream: ~20 s


@ray.remote(num_cpus=0)
class StandInEngine:
    """Answers every even-numbered request of a call right, the others wrong (one token, log-prob -0.5)."""

    def __init__(self, policy_version: int, fail_after_calls: int | None = None):
        self.policy_version = policy_version
        self.calls, self.fail_after_calls = 0, fail_after_calls
        self.release = asyncio.Event()
        self.release.set()
        self.held = 0

    async def generate(self, prompts, sampling) -> list[Generation]:
        self.calls += 1
        if self.fail_after_calls is not None and self.calls > self.fail_after_calls:
            raise RuntimeError("stand-in engine failure")
        if not self.release.is_set():
            self.held += 1
            await self.release.wait()
            self.held -= 1
        out = []
        for i, prompt in enumerate(prompts):
            prompt = np.asarray(prompt, dtype=np.int64)
            sep = int(np.flatnonzero(prompt == SEP)[0])
            right = (int(prompt[sep - 1]) + 1) % 10
            answer = right if i % 2 == 0 else (right + 3) % 10
            out.append(Generation(prompt_token_ids=prompt, response_token_ids=np.array([answer]),
                                  response_log_probs=np.array([-0.5], dtype=np.float32),
                                  policy_version=self.policy_version, finish_reason="length", engine="stand-in"))
        return out

    def current_policy_version(self) -> int:
        return self.policy_version

    def waiting(self) -> int:
        """Generate calls held now."""
        return self.held

    def hold(self) -> None:
        """Later generate calls wait until `go` (groups stay in flight)."""
        self.release.clear()

    def go(self) -> None:
        self.release.set()


@pytest.fixture
def scheduler(ray_session):
    batch = BatchConfig(global_batch_size=16, max_tokens_per_gpu=512, leftover="partial")
    handle = create_scheduler(SchedulerConfig(batch=batch, intake=IntakeConfig(vocab_size=VOCAB_SIZE,
                                                                                 drop_uniform_groups=True)),
                              name=f"closed-loop-producer-{time.monotonic_ns()}")
    yield handle
    ray.kill(handle)


def held_rollouts(scheduler) -> dict:
    return ray.get(scheduler.stats.remote(include_rollouts=True), timeout=30).rollout_states or {}


def test_producer_pushes_whole_groups_from_its_generator_and_the_dataset(scheduler):
    engine = StandInEngine.remote(policy_version=3)
    task = DigitTaskConfig()
    rows = prompt_rows(task, seed=77, start=0, count=4)
    config = EnvProducerConfig(task=task, group_size=4, groups_in_flight=3, max_prompts=6)
    actor, run = start_env_producer(0, config, scheduler, EngineClient([engine], ["stand-in"]), seed=5,
                                    dataset=ray.data.from_items(rows))
    report = ray.get(run, timeout=120)
    assert (report.groups, report.dataset_groups, report.rollouts) == (10, 4, 40)
    assert report.abandoned_rollouts == 0 and report.rejected_samples == 0 and not report.stopped
    # Members 0, 2: right at once (1.0, one sample). Members 1, 3 retry (two samples each) as requests
    # 0 and 1 of the second call: one right (0.5), one wrong (0). Mean (1 + 1 + 0.5 + 0) / 4.
    assert report.samples == 40 + 20 and report.mean_reward == pytest.approx(0.625)
    assert report.cursor == {"seed": 5, "next_index": 6}
    stats = ray.get(scheduler.stats.remote(), timeout=30)
    assert stats.accepted_samples == report.samples
    held = held_rollouts(scheduler)
    assert {rid.rsplit("-r", 1)[0] for rid in held} == {f"s5-p{i}" for i in range(6)} | {f"s77-p{i}" for i in range(4)}
    ray.kill(actor)


def test_stop_abandons_groups_in_flight_and_a_resumed_producer_pushes_each_prompt_once(scheduler):
    engine = StandInEngine.remote(policy_version=0)
    client = EngineClient([engine], ["stand-in"])
    config = EnvProducerConfig(group_size=4, groups_in_flight=3)
    actor, run = start_env_producer(0, config, scheduler, client, seed=9)
    deadline = time.monotonic() + 60
    while len(held_rollouts(scheduler)) < 5 * 4:  # at least five groups pushed
        assert time.monotonic() < deadline, "the producer pushed fewer than five groups in 60 s"
        time.sleep(0.05)
    ray.get(engine.hold.remote(), timeout=30)  # the next groups stay in flight
    deadline = time.monotonic() + 60
    while ray.get(engine.waiting.remote(), timeout=30) < 3:  # every worker's group waits on the engine
        assert time.monotonic() < deadline, "three groups never got in flight"
        time.sleep(0.05)
    stopping = actor.stop.remote()
    while not ray.get(actor.report.remote(), timeout=30).stopped:  # stop() has begun: no group is pushed now
        time.sleep(0.01)
    ray.get(engine.go.remote(), timeout=30)
    stopped = ray.get(stopping, timeout=60)
    first = ray.get(run, timeout=60)
    assert first.stopped and stopped.groups == first.groups
    assert first.abandoned_rollouts == 3 * 4 and first.in_flight == 0  # the three groups in flight, whole
    pushed = {rid.rsplit("-r", 1)[0] for rid in held_rollouts(scheduler)}
    cursor = first.cursor
    assert f"s9-p{cursor['next_index']}" not in pushed  # the oldest prompt not pushed
    assert all(f"s9-p{i}" in pushed for i in range(cursor["next_index"]))
    ray.kill(actor)

    upto = max(int(p.rsplit("-p", 1)[1]) for p in pushed) + 3
    resumed_config = EnvProducerConfig(group_size=4, groups_in_flight=3, max_prompts=upto - cursor["next_index"])
    actor, run = start_env_producer(0, resumed_config, scheduler, client, cursor=cursor)
    second = ray.get(run, timeout=120)
    assert second.rejected_samples == 0  # nothing the scheduler held was pushed again
    assert second.groups + first.groups == upto  # every prompt below `upto` pushed exactly once
    assert {rid.rsplit("-r", 1)[0] for rid in held_rollouts(scheduler)} == {f"s9-p{i}" for i in range(upto)}
    ray.kill(actor)


def test_an_engine_failure_fails_the_producer_after_its_other_groups_are_abandoned(scheduler):
    engine = StandInEngine.remote(policy_version=0, fail_after_calls=10)
    actor, run = start_env_producer(0, EnvProducerConfig(group_size=4, groups_in_flight=3), scheduler,
                                    EngineClient([engine], ["stand-in"]), seed=3)
    with pytest.raises(ray.exceptions.RayTaskError, match="stand-in engine failure"):
        ray.get(run, timeout=120)
    report = ray.get(actor.report.remote(), timeout=30)
    assert report.stopped and report.in_flight == 0
    assert report.abandoned_rollouts > 0 and report.abandoned_rollouts % 4 == 0  # whole groups
    assert len(held_rollouts(scheduler)) == 4 * report.groups  # every pushed group whole, none in part
    ray.kill(actor)
