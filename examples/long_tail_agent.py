"""A long-tail agentic workload on the public agent API: most episodes one short turn, a few many long ones.

    python -m jobs.train --preset long_tail               (rollout.agent: examples.long_tail_agent:make_agent)

The digit task's prompts and tokenizer (examples/digit_agent.py). Each rollout draws its episode's shape from its
own id (the same in every run): 79% one turn of `short_tokens`, 16% 2-4 turns of `medium_tokens`, 5% 8-16 turns
of `long_tokens`; the long episodes hold most of the generated tokens, as agentic workloads' tails do. After each
answer the user says "higher" or "lower" and the episode goes on. The reward is the digit task's, on the first
answer token (so GRPO groups carry a signal and the policy learns whatever the episode's length): the turns after
it are the workload, the tail that holds engines and steps up.
"""

from __future__ import annotations

import random

from examples.digit_agent import RULES
from vgbs_ray.agents import AgentResult, RolloutContext, SamplingConfig


def episode_turns(rollout_id, shares=(0.79, 0.16)) -> tuple[str, int]:
    """(kind, turns) of a rollout's episode, a pure function of its id."""
    draw = random.Random(str(rollout_id))
    u = draw.random()
    if u < shares[0]:
        return "short", 1
    if u < shares[0] + shares[1]:
        return "medium", draw.randint(2, 4)
    return "long", draw.randint(8, 16)


def make_agent(short_tokens: int = 1, medium_tokens: int = 4, long_tokens: int = 8, rule: str = "successor_of_last",
               all_short: bool = False):
    """`all_short=True`: every episode one short turn (the control a long tail is measured against)."""
    tokens = {"short": short_tokens, "medium": medium_tokens, "long": long_tokens}

    async def agent(row: dict, ctx: RolloutContext) -> AgentResult:
        digits = [int(d) for d in row["digits"]]
        expected = str(RULES[rule](digits))
        kind, turns = ("short", 1) if all_short else episode_turns(ctx.rollout_id)
        chat = ctx.chat([{"role": "user", "content": " ".join(map(str, digits))}])
        reward = 0.0
        for turn in range(turns):
            answer = await chat.generate(SamplingConfig(max_tokens=tokens[kind], temperature=1.0))
            if turn == 0:
                reward = float(answer.split()[:1] == [expected])
            if turn + 1 < turns:
                chat.messages.append({"role": "user", "content": "higher" if turn % 2 else "lower"})
        return AgentResult(reward=reward, metrics={"turns": turns, "long": float(kind == "long")})

    return agent


def max_sequence_length(long_tokens: int = 8, max_turns: int = 16, max_digits: int = 3) -> int:
    """Longest episode in tokens: the prompt, then per turn the answer and <|end|> <|user|> feedback <|assistant|>."""
    return max_digits + 3 + max_turns * (long_tokens + 4)
