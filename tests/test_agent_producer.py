"""AgentProducer against a real SchedulerActor and a stand-in engine (no vLLM, no trainer).

The agent is the demo's (examples/digit_agent.py, chat sessions over its real tokenizer); the
stand-in engine answers a request right when its seed is even, else wrong, and reports a policy
version the test sets. What is checked: whole groups pushed with the engine's version and
log-probs, token-exact chat samples, a dataset source, stop() abandoning the groups in flight
without waiting for their agents, a producer resumed from `cursor()` pushing every prompt exactly
once, an engine failure failing the producer, and an agent failure losing only its group, dropped
by reason in the ledger.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray

from actors.agent_producer import PromptSpec, start_agent_producer
from vgbs_ray.producer_core import AgentProducerConfig
from actors.rollout_engine import EngineClient
from vgbs_ray.scheduler.types import SchedulerConfig
from actors.scheduler_actor import create_scheduler
from examples.digit_agent import ASSISTANT, VOCABULARY, build_tokenizer
from vgbs_ray.agents import Generation
from vgbs_ray.config import BatchConfig
from vgbs_ray.scheduler.intake import IntakeConfig

pytestmark = pytest.mark.slow  # Ray actors: ~30 s

TOKENIZER_DIR = "examples/digit_tokenizer"
ASSISTANT_ID = VOCABULARY.index(ASSISTANT)
DIGITS = {"generator": "examples.digit_agent:make_prompts"}


@ray.remote(num_cpus=0)
class StandInEngine:
    """Answers a request right when its seed is even (one token, log-prob -0.5); can hold or fail calls."""

    def __init__(self, policy_version: int, fail_after_calls: int | None = None):
        self.policy_version = policy_version
        self.calls, self.fail_after_calls = 0, fail_after_calls
        self.release = asyncio.Event()
        self.release.set()
        self.held = 0

    async def generate(self, prompts, samplings, adapter=None) -> list[Generation]:
        self.calls += 1
        if self.fail_after_calls is not None and self.calls > self.fail_after_calls:
            raise RuntimeError("stand-in engine failure")
        if not self.release.is_set():
            self.held += len(prompts)
            await self.release.wait()
            self.held -= len(prompts)
        out = []
        for prompt, sampling in zip(prompts, samplings):
            prompt = np.asarray(prompt, dtype=np.int64)
            first_answer_at = int(np.flatnonzero(prompt == ASSISTANT_ID)[0])
            right = (int(prompt[first_answer_at - 1]) + 1) % 10  # the rule: successor of the last digit
            answer = right if sampling.seed % 2 == 0 else (right + 3) % 10
            out.append(Generation(prompt_token_ids=prompt, response_token_ids=np.array([answer]),
                                  response_log_probs=np.array([-0.5], dtype=np.float32),
                                  policy_version=self.policy_version, finish_reason="length", engine="stand-in"))
        return out

    async def generate_each(self, prompts, samplings, adapter=None):
        """As the engine's: (index, Generation) per request (here all finish together)."""
        for index, generation in enumerate(await self.generate(prompts, samplings)):
            yield index, generation

    def current_policy_version(self, adapter=None) -> int:
        return self.policy_version

    def waiting(self) -> int:
        """Requests (prompts) held now."""
        return self.held

    def hold(self) -> None:
        self.release.clear()

    def go(self) -> None:
        self.release.set()


@pytest.fixture
def scheduler(ray_session):
    batch = BatchConfig(global_batch_size=16, max_tokens_per_gpu=512, leftover="partial")
    handle = create_scheduler(SchedulerConfig(batch=batch, intake=IntakeConfig(vocab_size=len(VOCABULARY),
                                                                                 drop_uniform_groups=True)),
                              name=f"agent-producer-{time.monotonic_ns()}")
    yield handle
    ray.kill(handle)


def held_rollouts(scheduler) -> dict:
    return ray.get(scheduler.stats.remote(include_rollouts=True), timeout=30).rollout_states or {}


def wait_until(condition, what: str, timeout_s: float = 300) -> None:
    """Poll `condition` until it holds; the deadline only guards against a hang (a loaded machine is slow)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def producer_config(**kwargs) -> AgentProducerConfig:
    base = dict(agent="examples.digit_agent:make_agent", group_size=4, groups_in_flight=3, tokenizer_dir=TOKENIZER_DIR)
    return AgentProducerConfig(**{**base, **kwargs})


def test_a_producer_pushes_whole_token_exact_groups_from_a_dataset(scheduler):
    engine = StandInEngine.remote(policy_version=3)
    rows = [{"digits": [d, (d * 3) % 10], "note": "unused"} for d in range(5)]
    config = producer_config()
    actor, run = start_agent_producer(0, config, scheduler, EngineClient([engine], ["stand-in"]),
                                      PromptSpec(rows=rows, keys=("digits",)))
    report = ray.get(run, timeout=120)
    assert (report.groups, report.rollouts) == (5, 20) and report.failed_groups == {}
    assert report.abandoned_rollouts == 0 and report.rejected_samples == 0 and not report.stopped
    assert report.cursor == {"next_index": 5}
    assert 1 <= report.agent_metrics["turns"] <= 2
    states = held_rollouts(scheduler)
    assert {rid.rsplit("-r", 1)[0] for rid in states} == {f"e0-row{i}" for i in range(5)}
    stats = ray.get(scheduler.stats.remote(), timeout=30)
    # a rollout is one sample per turn (the digit agent's retry is a sample of its own)
    assert stats.accepted_samples == report.samples == round(20 * report.agent_metrics["turns"]) > 20
    ray.kill(actor)


@pytest.mark.parametrize("retry_as_new_sample", [True, False])
def test_the_samples_are_the_chat_tokens_the_engine_saw_and_said(scheduler, retry_as_new_sample):
    """The stand-in's answers (mask 1) between the digit tokenizer's renderings (mask 0), in order: a retry is a
    second sample whose prompt is the whole conversation, or (retry_as_new_sample=False) one appended sample."""
    from vgbs_ray.agents import RolloutContext, load_agent

    tokenizer = build_tokenizer()
    engine = StandInEngine.remote(policy_version=0)
    client = EngineClient([engine], ["stand-in"])
    agent = load_agent("examples.digit_agent:make_agent", {"retry_as_new_sample": retry_as_new_sample})

    async def generate(ids, sampling):
        (generation,) = await client.generate([ids], [sampling])
        return generation

    ctx = RolloutContext(rollout_id="x-r1", group_id="x", member=1, group_size=2, engine_generate=generate,
                         tokenizer=tokenizer, seed=1)  # seed 1: the first request's seed is odd, wrong at once
    result = asyncio.run(agent({"digits": [3, 7]}, ctx))
    assert result.metrics == {"turns": 2}
    rows = ctx.samples()
    whole = rows[-1]["tokens"].tolist()  # either way the last sample holds the whole conversation
    text = tokenizer.decode(whole)
    assert text.startswith("<|user|> 3 7 <|assistant|>") and " <|end|> <|user|> " in text
    if retry_as_new_sample:
        first, second = rows
        assert first["loss_mask"].tolist() == [1] and second["loss_mask"].tolist() == [1]
        assert whole[:len(first["tokens"])] == first["tokens"].tolist()  # the first answer is the retry's context
        assert len(whole) == len(first["tokens"]) + 4 + 1  # <|end|> <|user|> feedback <|assistant|>, answer
    else:
        (row,) = rows
        assert row["loss_mask"].tolist() == [1, 0, 0, 0, 0, 1]  # answer, <|end|> <|user|> feedback <|assistant|>, answer


def test_stop_abandons_groups_in_flight_and_a_resumed_producer_pushes_each_prompt_once(scheduler):
    engine = StandInEngine.remote(policy_version=0)
    client = EngineClient([engine], ["stand-in"])
    actor, run = start_agent_producer(0, producer_config(), scheduler, client, PromptSpec(**DIGITS, seed=9))
    wait_until(lambda: len(held_rollouts(scheduler)) >= 5 * 4, "the producer pushed fewer than five groups")
    ray.get(engine.hold.remote(), timeout=30)  # the next groups stay in flight

    held = {}

    def three_groups_held() -> bool:
        # The engine first: a request it holds stays awaited until go(), so equal counts read in this order mean
        # every request the producer awaits is held (none sent before hold() is still being answered).
        held["requests"] = ray.get(engine.waiting.remote(), timeout=30)
        report = ray.get(actor.report.remote(), timeout=30)
        return report.awaiting_engine == 3 and report.awaiting_requests == held["requests"]

    wait_until(three_groups_held, "three groups never waited on the engine together, all held")
    # stop() returns while the engine still holds the groups' requests: their agents are cancelled, not waited for
    stopped = ray.get(actor.stop.remote(), timeout=60)
    first = ray.get(run, timeout=60)
    assert ray.get(engine.waiting.remote(), timeout=30) == held["requests"] > 0
    ray.get(engine.go.remote(), timeout=30)
    assert first.stopped and stopped.groups == first.groups
    assert first.abandoned_rollouts == 3 * 4 and first.in_flight == 0  # the three groups in flight, whole
    pushed = {rid.rsplit("-r", 1)[0] for rid in held_rollouts(scheduler)}
    cursor = first.cursor
    assert f"p{cursor['next_index']}" not in pushed  # the oldest prompt not pushed
    assert all(f"p{i}" in pushed for i in range(cursor["next_index"]))
    ray.kill(actor)

    upto = max(int(p[1:]) for p in pushed) + 3
    resumed = producer_config(max_prompts=upto - cursor["next_index"])
    actor, run = start_agent_producer(0, resumed, scheduler, client, PromptSpec(**DIGITS, seed=9), cursor=cursor)
    second = ray.get(run, timeout=120)
    assert second.rejected_samples == 0  # nothing the scheduler held was pushed again
    assert second.groups + second.skipped_known_groups + first.groups == upto
    assert {rid.rsplit("-r", 1)[0] for rid in held_rollouts(scheduler)} == {f"p{i}" for i in range(upto)}
    ray.kill(actor)


def test_an_engine_failure_fails_the_producer_after_its_other_groups_are_abandoned(scheduler):
    engine = StandInEngine.remote(policy_version=0, fail_after_calls=10)
    actor, run = start_agent_producer(0, producer_config(), scheduler, EngineClient([engine], ["stand-in"]),
                                      PromptSpec(**DIGITS, seed=3))
    with pytest.raises(ray.exceptions.RayTaskError, match="stand-in engine failure"):
        ray.get(run, timeout=120)
    report = ray.get(actor.report.remote(), timeout=30)
    assert report.stopped and report.in_flight == 0
    assert report.abandoned_rollouts > 0 and report.abandoned_rollouts % 4 == 0  # whole groups
    assert len(held_rollouts(scheduler)) == 4 * report.groups  # every pushed group whole, none in part
    ray.kill(actor)


def test_a_failing_agent_loses_only_its_groups_with_the_reason_in_the_ledger(scheduler):
    engine = StandInEngine.remote(policy_version=0)
    config = producer_config(agent="tests.agent_support:make_flaky_agent", agent_kwargs={"fail_every": 3},
                             max_prompts=9)
    actor, run = start_agent_producer(0, config, scheduler, EngineClient([engine], ["stand-in"]),
                                      PromptSpec(**DIGITS, seed=4))
    report = ray.get(run, timeout=120)
    assert report.failed_groups == {"agent_error": 3} and report.groups == 6
    stats = ray.get(scheduler.stats.remote(include_rollouts=True, check_ledger=True), timeout=30)
    dropped = {rid for rid, (state, _, reason) in stats.rollout_states.items() if reason == "agent_error"}
    assert dropped == {f"p{p}-r{m}" for p in (0, 3, 6) for m in range(4)}  # whole groups, by name
    assert stats.ledger.dropped_by_reason["agent_error"] == 12
    ray.kill(actor)
