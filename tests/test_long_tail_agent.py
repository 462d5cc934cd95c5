"""The long-tail workload (examples/long_tail_agent.py, `--preset long_tail`): the episode shapes it draws, and one
long episode through a chat session on a scripted engine (no Ray): its turns, tokens, mask and reward."""

from __future__ import annotations

import asyncio

import numpy as np

from examples.digit_agent import build_tokenizer
from examples.long_tail_agent import episode_turns, make_agent, max_sequence_length
from jobs.job_config import load_job_config
from tests.agent_support import ScriptedEngine
from vgbs_ray.agents import RolloutContext


def test_most_episodes_are_one_short_turn_and_the_few_long_ones_hold_most_tokens():
    shapes = [episode_turns(f"p{i}-r{m}") for i in range(2000) for m in range(8)]
    kinds = {kind: sum(1 for k, _ in shapes if k == kind) / len(shapes) for kind in ("short", "medium", "long")}
    assert 0.77 < kinds["short"] < 0.81 and 0.14 < kinds["medium"] < 0.18 and 0.035 < kinds["long"] < 0.065
    per_turn = {"short": 1, "medium": 4, "long": 8}
    tokens = {kind: sum(turns * per_turn[k] for k, turns in shapes if k == kind) for kind in per_turn}
    assert tokens["long"] > 0.5 * sum(tokens.values())
    assert episode_turns("p3-r1") == episode_turns("p3-r1")  # a pure function of the rollout id


def test_a_long_episode_runs_its_turns_and_trains_exactly_the_engines_tokens():
    tokenizer = build_tokenizer()
    rid = next(f"p{i}-r0" for i in range(1000) if episode_turns(f"p{i}-r0")[0] == "long")
    turns = episode_turns(rid)[1]
    engine = ScriptedEngine([[4] * 8] * turns)  # answers "4 4 4 ..." every turn: the first answer is right
    ctx = RolloutContext(rollout_id=rid, group_id=rid.split("-")[0], member=0, group_size=1, tokenizer=tokenizer,
                         engine_generate=engine)
    result = asyncio.run(make_agent()({"digits": [1, 3]}, ctx))
    assert len(engine.prompts) == turns and result.reward == 1.0 and result.metrics["turns"] == turns
    (sample,) = ctx.samples()
    assert len(sample["tokens"]) <= max_sequence_length()
    mask = np.asarray(sample["loss_mask"])
    assert int(mask.sum()) == 8 * turns  # exactly the engine's tokens train; the feedback is context
    assert load_job_config(None, [], preset="long_tail").rollout.engines.max_model_len >= max_sequence_length()
