"""The demo's digit agent, with one chosen rollout that takes `sleep_s` seconds first (a long-tail episode, or an
agent hung until its timeout): tests/test_slow_rollout_job.py trains with it by import path."""

from __future__ import annotations

import asyncio

from examples.digit_agent import make_agent as digit_agent


def make_agent(slow_rollout: str, sleep_s: float, **kwargs):
    inner = digit_agent(**kwargs)

    async def agent(row, ctx):
        if ctx.rollout_id == slow_rollout:
            await asyncio.sleep(sleep_s)
        return await inner(row, ctx)

    return agent
