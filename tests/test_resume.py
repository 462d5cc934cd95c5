"""Resume pieces without a train group: a producer's cursor and stable rollout ids, and the
checkpoint's pure helpers (the ledger record, refusing a checkpoint without the scheduler's state).

The producer test drives a real AgentProducer actor running the synthetic agent (every group
pushed sample by sample) against a recording stand-in for the scheduler: it holds the producer
right after a push that sent only some samples of a rollout (tests/resume_support.py's
HoldingProducer, event-gated), takes its cursor, kills it, and checks that a producer started from that cursor
pushes exactly the prompts not wholly pushed before, with the same ids and samples.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest
import ray

from actors.agent_producer import PromptSpec
from vgbs_ray.producer_core import AgentProducerConfig
from examples.synthetic_agent import make_agent, make_prompts
from jobs.checkpoint import load_resume_point
from tests.resume_support import HoldingProducer, RecordingScheduler
from vgbs_ray.agents import RolloutContext
from vgbs_ray.errors import ConfigError
from vgbs_ray.scheduler.intake import IntakeSnapshot
from vgbs_ray.scheduler.resume import ledger_record
from vgbs_ray.scheduler.state import SchedulerState
from vgbs_ray.scheduler.settled_ids import SettledIds

NUM_PROMPTS, GROUP = 8, 2
AGENT_KWARGS = {"max_delay_s": 0.02, "vocab_size": 16, "multi_sample_fraction": 0.6}
PROMPT_KWARGS = {"uniform_group_fraction": 0.0, "bad_rollout_fraction": 0.0}
CONFIG = AgentProducerConfig(agent="examples.synthetic_agent:make_agent", agent_kwargs=AGENT_KWARGS, group_size=GROUP,
                             groups_in_flight=2, sample_push_fraction=1.0)
PROMPTS = PromptSpec(generator="examples.synthetic_agent:make_prompts", generator_kwargs=PROMPT_KWARGS,
                     num_prompts=NUM_PROMPTS)


def everything() -> dict[str, tuple[int, dict]]:
    """rollout id -> (prompt position, {sample index: tokens}), computed here without Ray or a producer."""
    agent, prompt = make_agent(**AGENT_KWARGS), make_prompts(seed=0, **PROMPT_KWARGS)

    async def rollout(position: int, member: int) -> list[dict]:
        ctx = RolloutContext(rollout_id=f"p{position}-r{member}", group_id=f"p{position}", member=member,
                             group_size=GROUP, engine_generate=None)
        await agent(prompt(position), ctx)
        return ctx.samples()

    out = {}
    for position in range(NUM_PROMPTS):
        for member in range(GROUP):
            rows = asyncio.run(rollout(position, member))
            out[f"p{position}-r{member}"] = (position, {i: tuple(int(t) for t in r["tokens"]) for i, r in enumerate(rows)})
    return out


def test_the_synthetic_agents_rollouts_are_a_pure_function_of_the_prompt_and_member():
    first, again = everything(), everything()
    assert first == again and len(first) == NUM_PROMPTS * GROUP
    assert first["p0-r0"][1] != first["p0-r1"][1] != first["p1-r0"][1]  # members and prompts differ
    assert any(len(samples) > 1 for _, samples in first.values())  # multi-sample rollouts to push one by one


def test_a_producer_resumed_from_its_cursor_pushes_exactly_what_was_not_wholly_pushed(ray_session):
    scheduler = ray.remote(RecordingScheduler).remote()
    producer_cls = ray.remote(num_cpus=0, max_concurrency=100)(HoldingProducer)
    first = producer_cls.remote(0, CONFIG, scheduler, None, PROMPTS)
    ray.get(first.hold_at_next_partial_push.remote())  # armed before it pushes anything
    first.run.remote()
    deadline = time.monotonic() + 120
    while not (held := ray.get(first.holding.remote())):
        assert time.monotonic() < deadline, "the producer never made a partial push"
        time.sleep(0.01)
    cursor = ray.get(first.cursor.remote())
    before = ray.get(scheduler.seen.remote())
    ray.kill(first)

    rollouts = everything()
    pushed = defaultdict(set)
    for rid, index, _ in before:
        pushed[rid].add(index)
    # The cursor: every prompt before it was wholly pushed; the held rollout is partly pushed, at or past it.
    assert 0 <= cursor["next_index"] < NUM_PROMPTS
    for rid, (position, samples) in rollouts.items():
        if position < cursor["next_index"]:
            assert pushed[rid] == set(samples), rid
    for rid in held:
        position, samples = rollouts[rid]
        assert position >= cursor["next_index"] and pushed[rid] and pushed[rid] < set(samples)

    second = producer_cls.remote(0, CONFIG, scheduler, None, PROMPTS, cursor=cursor)
    report = ray.get(second.run.remote(), timeout=120)
    assert not report.stopped and report.abandoned_rollouts == 0 and report.groups == NUM_PROMPTS - cursor["next_index"]
    assert ray.get(second.cursor.remote())["next_index"] == NUM_PROMPTS
    after = ray.get(scheduler.seen.remote())[len(before):]
    # The resumed producer sent exactly the prompts from the cursor on, every sample of them ...
    resent = defaultdict(set)
    for rid, index, _ in after:
        resent[rid].add(index)
    assert resent == {rid: set(samples) for rid, (position, samples) in rollouts.items()
                      if position >= cursor["next_index"]}
    # ... with the same samples under the same ids (what was pushed twice is the scheduler's to reject).
    assert [(rid, index) for rid, index, _ in after if (rid, index) in {(r, i) for r, i, _ in before}]
    for rid, index, tokens in before + after:
        assert rollouts[rid][1][index] == tokens, (rid, index)
    ray.kill(second)
    ray.kill(scheduler)


def _state(settled: SettledIds, *, ready=(), waiting=(), open_=(), next_step=3) -> SchedulerState:
    return SchedulerState(next_step=next_step, policy_version=next_step, settled=settled.to_bytes(),
                          intake=IntakeSnapshot(ready=tuple((rid, ()) for rid in ready),
                                                waiting=tuple((rid, ()) for rid in waiting),
                                                open=tuple((rid, 2, ()) for rid in open_)))


def test_the_ledger_record_of_a_checkpoint_lists_every_rollout_in_it():
    settled = SettledIds()
    settled.add("a", step=0)
    settled.add("b", reason="incomplete_rollout")
    record = ledger_record(_state(settled, ready=["c"], open_=["d"], next_step=1))
    assert record["rollouts"] == {"a": ["trained", 0, None], "b": ["dropped", None, "incomplete_rollout"],
                                  "c": ["buffered", None, None], "d": ["buffered", None, None]}
    assert record["summary"]["rollouts_by_state"] == {"trained": 1, "dropped": 1, "buffered": 2}
    assert record["summary"]["next_step"] == 1


def test_a_checkpoint_without_the_schedulers_state_is_not_resumed(tmp_path):
    (tmp_path / "job.json").write_text('{"next_step": 2}')
    with pytest.raises(ConfigError, match="scheduler.pkl"):
        load_resume_point(str(tmp_path))
