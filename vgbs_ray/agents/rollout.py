"""Running one GRPO group of an agent: `group_size` rollouts on one prompt row, and what became of them.

    outcome = await run_group(agent, row, contexts, timeout_s=60, max_sequence_length=512)
    outcome.failure        # None, or (reason, member, detail): the whole group is lost
    outcome.samples        # push-API sample dicts of every member, when none failed

The members run concurrently. A group is trained whole or not at all: GRPO advantages compare
its members, so one lost member loses the group. The first member to fail decides the reason
(`DROP_REASONS`) and the others are cancelled:

    agent_error        the agent raised
    agent_timeout      the agent ran past `timeout_s` (hung, or too slow)
    non_finite_reward  the reward is not a finite number
    too_long           a request did not fit the engine's context, or a sample is longer than the model's
    no_samples         the agent generated nothing through a session (nothing to train)

Exceptions in `fatal_errors` (a dead engine) are not the agent's fault: they propagate, and the
producer decides. Pure asyncio, no Ray: the producer actor and the tests call it alike.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

from vgbs_ray.agents.context import RolloutContext
from vgbs_ray.agents.generation import RequestTooLongError

AGENT_ERROR, AGENT_TIMEOUT, NON_FINITE_REWARD, TOO_LONG, NO_SAMPLES = (
    "agent_error", "agent_timeout", "non_finite_reward", "too_long", "no_samples")
DROP_REASONS = (AGENT_ERROR, AGENT_TIMEOUT, NON_FINITE_REWARD, TOO_LONG, NO_SAMPLES)


@dataclass(frozen=True)
class AgentResult:
    """What an agent returns for one rollout (a bare float is the reward alone)."""

    reward: float
    """One reward for the whole rollout, every sample of it (finite)."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Optional numbers about the rollout (turns, tool calls, ...); the producer reports their means."""


Agent = Callable[[dict, RolloutContext], Awaitable["float | AgentResult"]]
"""An agent: `async def agent(row, ctx) -> float | AgentResult`."""


class AgentFailure(Exception):
    """One member's failure, with its drop reason (internal to `run_group`)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class GroupOutcome:
    rollout_ids: tuple
    samples: list[dict]
    """Every member's sample dicts (shared fields set), empty when the group failed."""
    rewards: dict
    """rollout id -> reward, for the members that finished (all of them unless the group failed)."""
    metrics: dict[str, float]
    """Summed over the members: each metric an agent reported, and `num_samples`."""
    metric_counts: dict[str, int] = field(default_factory=dict)
    """Members that reported each metric (a mean is over them: a metric some rollouts omit is not a 0 for them)."""
    failure: tuple[str, int, str] | None = None
    """(drop reason, member, detail) of the first member that failed; None when the group finished."""


async def run_group(agent: Agent, row: dict, contexts: Sequence[RolloutContext], *, timeout_s: float,
                    max_sequence_length: int | None = None,
                    fatal_errors: tuple[type[BaseException], ...] = ()) -> GroupOutcome:
    """Run every member of one group (see module docstring)."""
    ids = tuple(ctx.rollout_id for ctx in contexts)
    tasks = [asyncio.ensure_future(_run_member(agent, dict(row), ctx, timeout_s, max_sequence_length, fatal_errors))
             for ctx in contexts]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    results: dict[int, tuple[float, dict, list[dict]]] = {}
    for member, task in enumerate(tasks):
        if task.cancelled():
            continue
        error = task.exception()
        if isinstance(error, AgentFailure):
            return GroupOutcome(ids, [], {ids[m]: r[0] for m, r in results.items()}, {},
                                failure=(error.reason, member, error.detail))
        if error is not None:
            raise error  # fatal: not the agent's fault
        results[member] = task.result()
    samples, metrics, counts = [], {"num_samples": 0.0}, {"num_samples": 0}
    for member, (reward, member_metrics, rows) in sorted(results.items()):
        ctx = contexts[member]
        shared = dict(rollout_id=ctx.rollout_id, reward=reward, rollout_size=len(rows), group_id=ctx.group_id,
                      group_size=ctx.group_size)
        samples += [dict(r, sample_index=i, **shared) for i, r in enumerate(rows)]
        metrics["num_samples"] += len(rows)
        counts["num_samples"] += 1
        for key, value in member_metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return GroupOutcome(ids, samples, {ids[m]: r[0] for m, r in results.items()}, metrics, counts)


async def _run_member(agent: Agent, row: dict, ctx: RolloutContext, timeout_s: float,
                      max_sequence_length: int | None, fatal_errors) -> tuple[float, dict, list[dict]]:
    try:
        result = await asyncio.wait_for(agent(row, ctx), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise AgentFailure(AGENT_TIMEOUT, f"rollout {ctx.rollout_id!r} ran past {timeout_s:g} s") from None
    except RequestTooLongError as error:
        raise AgentFailure(TOO_LONG, f"rollout {ctx.rollout_id!r}: {error}") from None
    except fatal_errors:
        raise
    except Exception as error:  # noqa: BLE001 - any agent bug loses its rollout, never the producer
        raise AgentFailure(AGENT_ERROR, f"rollout {ctx.rollout_id!r}: {type(error).__name__}: {error}") from None
    reward, metrics = _reward_and_metrics(result, ctx)
    rows = ctx.samples()
    if not rows:
        raise AgentFailure(NO_SAMPLES, f"rollout {ctx.rollout_id!r} generated nothing through a session")
    longest = max(len(r["tokens"]) for r in rows)
    if max_sequence_length is not None and longest > max_sequence_length:
        raise AgentFailure(TOO_LONG, f"rollout {ctx.rollout_id!r} has a {longest}-token sample; the model takes "
                                     f"at most {max_sequence_length}")
    return reward, metrics, rows


def _reward_and_metrics(result: Any, ctx: RolloutContext) -> tuple[float, dict]:
    if isinstance(result, AgentResult):
        reward, metrics = result.reward, dict(result.metrics)
    else:
        reward, metrics = result, {}
    try:
        value = float(reward)
    except (TypeError, ValueError):
        raise AgentFailure(NON_FINITE_REWARD, f"rollout {ctx.rollout_id!r} returned {reward!r}, not a number "
                                              "(return a float or AgentResult(reward=...))") from None
    if not math.isfinite(value) or isinstance(reward, bool):
        raise AgentFailure(NON_FINITE_REWARD, f"rollout {ctx.rollout_id!r} returned reward {reward!r}")
    for key, number in metrics.items():
        if not isinstance(number, (int, float)) or not math.isfinite(number):
            raise AgentFailure(AGENT_ERROR, f"rollout {ctx.rollout_id!r}: metric {key!r} = {number!r} is not a "
                                            "finite number")
    return value, metrics
