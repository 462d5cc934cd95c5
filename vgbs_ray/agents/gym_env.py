"""Gym-style environments (`reset` / `step`, as SkyRL and NeMo-RL users write them) as agents.

    --set rollout.agent=vgbs_ray.agents.gym_env:make_agent
    --set rollout.agent_kwargs='{env: my_pkg.envs:GuessEnv, env_kwargs: {secret_range: 10}, max_turns: 4}'

One environment object per rollout, built by `env(**env_kwargs)`:

    observation = env.reset(row)                        # str, or (str, info): the first user message
    observation, reward, done, info = env.step(reply)   # gym's 4-tuple, or gymnasium's 5-tuple
                                                        # (observation, reward, terminated, truncated, info)

Each turn the policy's reply (text) goes to `step`; the observation it returns is the next user message
(`observation_role`, e.g. "tool"), until `done` (terminated or truncated) or `max_turns` replies. The rollout's
reward is the sum of the step rewards, its metrics `turns` and every number in the last `info`. The conversation
is a `ChatSession`, so what trains is what the engine sampled, token for token (docs/agents.md). `reset` and
`step` may be coroutines; a synchronous one runs on the producer's event loop, so keep it quick (or make it
async).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

from vgbs_ray.agents.context import RolloutContext
from vgbs_ray.agents.loading import resolve
from vgbs_ray.agents.rollout import AgentResult
from vgbs_ray.errors import ConfigError


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def _step_result(result: Any, env_name: str) -> tuple[str, float, bool, dict]:
    if not isinstance(result, tuple) or len(result) not in (4, 5):
        raise TypeError(f"{env_name}.step must return (observation, reward, done, info) or gymnasium's "
                        f"(observation, reward, terminated, truncated, info), got {result!r}")
    if len(result) == 5:
        observation, reward, terminated, truncated, info = result
        return observation, float(reward), bool(terminated or truncated), dict(info or {})
    observation, reward, done, info = result
    return observation, float(reward), bool(done), dict(info or {})


def make_agent(env: str, env_kwargs: dict | None = None, max_turns: int = 8, max_tokens: int | None = None,
               observation_role: str = "user"):
    """The agent that runs the environment class (or factory) `env` names (see module docstring)."""
    factory = resolve(env, "rollout.agent_kwargs.env")
    kwargs = dict(env_kwargs or {})
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ConfigError(f"rollout.agent_kwargs.max_turns must be an int >= 1, got {max_turns!r}")
    if observation_role not in ("user", "tool", "system"):
        raise ConfigError(f"rollout.agent_kwargs.observation_role={observation_role!r} must be user, tool or system")

    async def agent(row: dict, ctx: RolloutContext) -> AgentResult:
        environment = factory(**kwargs)
        first = await _maybe_await(environment.reset(row))
        observation = first[0] if isinstance(first, tuple) else first
        chat = ctx.chat([{"role": "user", "content": str(observation)}])
        sampling = None if max_tokens is None else replace(ctx.default_sampling, max_tokens=max_tokens)
        total, info, turns = 0.0, {}, 0
        for turns in range(1, max_turns + 1):
            reply = await chat.generate(sampling)
            observation, reward, done, info = _step_result(await _maybe_await(environment.step(reply)), env)
            total += reward
            if done:
                break
            chat.messages.append({"role": observation_role, "content": str(observation)})
        metrics = {"turns": float(turns), **{k: float(v) for k, v in info.items()
                                            if isinstance(v, (int, float)) and not isinstance(v, bool)}}
        return AgentResult(reward=total, metrics=metrics)

    return agent
