"""A gym-style environment (reset / step) runs as an agent: the conversation trains token for token, the reward
is the sum of the step rewards, a gymnasium 5-tuple works, and a bad `step` result loses the rollout by name."""

from __future__ import annotations

import asyncio

import pytest

from tests.test_agent_endpoint import END, TOKENIZER, TextEngine, trained_runs
from vgbs_ray.agents import RolloutContext, SamplingConfig, run_group
from vgbs_ray.agents.gym_env import make_agent
from vgbs_ray.errors import ConfigError


class GuessEnv:
    """Guess the number: 'higher' / 'lower' until the guess is right (reward 1, done) or the turns run out."""

    def __init__(self, secret: int = 7, gymnasium: bool = False):
        self.secret, self.gymnasium = secret, gymnasium

    def reset(self, row):
        return f"guess a number below {row['below']}", {"seed": 0}

    async def step(self, reply: str):
        guess = int(reply.strip().rstrip("."))
        done = guess == self.secret
        observation = "right" if done else ("higher" if guess < self.secret else "lower")
        if self.gymnasium:
            return observation, float(done), done, False, {"distance": abs(guess - self.secret)}
        return observation, float(done), done, {"distance": abs(guess - self.secret)}


class BadEnv(GuessEnv):
    def step(self, reply):
        return "nothing"


def context(engine, rollout_id="g1-r0") -> RolloutContext:
    return RolloutContext(rollout_id=rollout_id, group_id="g1", member=0, group_size=1, engine_generate=engine,
                          tokenizer=TOKENIZER, default_sampling=SamplingConfig(max_tokens=16, stop_token_ids=(END,)))


@pytest.mark.parametrize("gymnasium", [False, True])
def test_an_environment_runs_turn_by_turn_and_trains_the_engines_tokens(gymnasium):
    engine = TextEngine(["3", "9", "7"])
    ctx = context(engine)
    agent = make_agent(f"{__name__}:GuessEnv", {"gymnasium": gymnasium}, max_turns=5)
    result = asyncio.run(agent({"below": 10}, ctx))
    assert result.reward == 1.0 and result.metrics == {"turns": 3.0, "distance": 0.0}
    (row,) = ctx.samples()  # one conversation: the observations are context (mask 0), the replies trained
    assert trained_runs(row) == engine.outputs
    text = TOKENIZER.decode(row["tokens"].tolist())
    assert "guess a number below 10" in text and "higher" in text and "lower" in text


def test_the_turn_limit_ends_a_rollout_and_a_bad_step_result_loses_it_by_name():
    ctx = context(TextEngine(["1", "2"]))
    result = asyncio.run(make_agent(f"{__name__}:GuessEnv", max_turns=2)({"below": 10}, ctx))
    assert result.reward == 0.0 and result.metrics["turns"] == 2.0
    outcome = asyncio.run(run_group(make_agent(f"{__name__}:BadEnv"), {"below": 10},
                                    [context(TextEngine(["1"]), "g2-r0")], timeout_s=10))
    reason, _, detail = outcome.failure
    assert reason == "agent_error" and "BadEnv.step must return (observation, reward, done, info)" in detail
    with pytest.raises(ConfigError, match="max_turns must be an int >= 1"):
        make_agent(f"{__name__}:GuessEnv", max_turns=0)
