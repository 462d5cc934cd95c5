"""The public agent API: what a user's agent receives, what it returns, and its sessions.

    from vgbs_ray.agents import AgentResult, RolloutContext, SamplingConfig

    def make_agent(max_turns: int = 3):             # named in the job config by import path
        async def agent(row: dict, ctx: RolloutContext) -> AgentResult:
            chat = ctx.chat([{"role": "user", "content": row["question"]}])
            ...
            return AgentResult(reward=1.0, metrics={"turns": 2})
        return agent

See docs/agents.md. Everything here is importable without Ray, Megatron or vLLM.
"""

from vgbs_ray.agents.context import RolloutContext
from vgbs_ray.agents.generation import Generation, RequestTooLongError, SamplingConfig
from vgbs_ray.agents.loading import load_agent, resolve
from vgbs_ray.agents.rollout import DROP_REASONS, Agent, AgentResult, GroupOutcome, run_group
from vgbs_ray.agents.session import ChatSession, Segment, SessionError, TextSession, TokenSession

__all__ = ["Agent", "AgentResult", "ChatSession", "DROP_REASONS", "Generation", "GroupOutcome", "RequestTooLongError",
           "RolloutContext", "SamplingConfig", "Segment", "SessionError", "TextSession", "TokenSession", "load_agent",
           "resolve", "run_group"]
