"""The synthetic preset's agent (examples/synthetic_agent.py) and `ctx.add_sample`, without Ray: the
samples an agent adds are its rollout's, in order with its sessions, and validate as the scheduler
will validate them; the agent's shapes (several samples, uniform groups, one malformed sample in a
bad group) are there (tests/test_job_config.py: the synthetic preset names this agent)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from examples.synthetic_agent import make_agent, make_prompts
from tests.agent_support import ScriptedEngine
from vgbs_ray.agents import RolloutContext, run_group
from vgbs_ray.errors import RolloutValidationError
from vgbs_ray.sample import Sample, validate_sample

VOCAB = 32


def run(agent, row, group_size=2, engine=None):
    contexts = [RolloutContext(rollout_id=f"p0-r{m}", group_id="p0", member=m, group_size=group_size,
                               engine_generate=engine) for m in range(group_size)]
    return asyncio.run(run_group(agent, row, contexts, timeout_s=60, max_sequence_length=256))


def check(row: dict):
    validate_sample(Sample.from_dict(row), vocab_size=VOCAB, max_sequence_length=256)


def test_added_samples_are_the_rollouts_in_order_with_its_sessions_and_carry_what_was_given():
    async def agent(row, ctx):
        ctx.add_sample([1, 2, 3, 4], [1, 0], rollout_log_probs=[-0.5, -1.0], policy_version=7)
        session = ctx.token_session([5, 6])
        await session.generate()
        ctx.add_sample([7, 8, 9], [1])
        return 0.5 + ctx.member

    outcome = run(agent, {}, engine=ScriptedEngine([(10, 11)] * 2))
    assert outcome.failure is None
    first = [s for s in outcome.samples if s["rollout_id"] == "p0-r0"]
    assert [list(s["tokens"]) for s in first] == [[1, 2, 3, 4], [5, 6, 10, 11], [7, 8, 9]]
    assert [s["sample_index"] for s in first] == [0, 1, 2] and {s["rollout_size"] for s in first} == {3}
    assert first[0]["response_length"] == 2 and list(first[0]["loss_mask"]) == [1, 0]
    assert list(first[0]["rollout_log_probs"]) == [-0.5, -1.0]
    assert first[0]["policy_version_min"] == first[0]["policy_version_max"] == 7
    assert "rollout_log_probs" not in first[2] and "policy_version_min" not in first[2]
    for sample in outcome.samples:
        check(sample)


def test_an_agent_that_adds_nothing_loses_its_group_as_no_samples():
    async def agent(row, ctx):
        return 1.0

    assert run(agent, {}).failure[0] == "no_samples"


def test_the_synthetic_agent_makes_several_samples_and_uniform_and_bad_groups():
    agent = make_agent(max_delay_s=0.0, vocab_size=VOCAB, multi_sample_fraction=0.9)
    prompts = make_prompts(seed=3, uniform_group_fraction=0.3, bad_rollout_fraction=0.3)
    rows = [prompts(p) for p in range(40)]
    assert rows == [prompts(p) for p in range(40)]  # a pure function of (seed, position)
    kinds, sizes = {"plain": 0, "uniform": 0, "bad": 0}, set()
    for row in rows:
        outcome = run(agent, row, group_size=3)
        assert outcome.failure is None
        rewards = list(outcome.rewards.values())
        if row["uniform"]:
            assert rewards == [1.0, 1.0, 1.0]
        sizes |= {s["rollout_size"] for s in outcome.samples}
        for sample in outcome.samples:
            malformed = row["bad"] and sample["rollout_id"] == "p0-r0" and sample["sample_index"] == 0
            if malformed:  # the one id past the vocabulary: what a wrong tokenizer gives
                with pytest.raises(RolloutValidationError, match="token_range"):
                    check(sample)
            else:
                check(sample)
        again = run(agent, row, group_size=3)  # a rerun (a resumed producer) makes the same samples
        assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(outcome.samples, again.samples))
        kinds["bad" if row["bad"] else "uniform" if row["uniform"] else "plain"] += 1
    assert min(kinds.values()) >= 3, kinds
    assert {1, 2, 3, 4} <= sizes  # 1..max_samples_per_rollout samples per rollout

