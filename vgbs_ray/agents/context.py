"""The rollout context: everything an agent gets from the system for one rollout.

    async def my_agent(row: dict, ctx: RolloutContext) -> float:
        chat = ctx.chat([{"role": "user", "content": row["question"]}])
        answer = await chat.generate(SamplingConfig(max_tokens=64, stop=("</answer>",)))
        return 1.0 if row["expected"] in answer else 0.0

The context is made by the producer once per rollout; it owns the rollout's sessions, and the
rollout's samples are every session's segments and every `add_sample`, in the order they were
opened or added (`samples()`). `generate` goes to the job's engine pool (token ids in; token ids, behaviour
log-probs and policy version out) and records nothing: only what goes through a session is trained.

`add_sample` records a sample the agent made without the engines (sampled elsewhere, replayed,
or synthetic: `examples/synthetic_agent.py`); it is trained as given, and the scheduler validates
it like any pushed sample.

It holds no Ray handle itself: the producer passes `engine_generate`, an async callable
(token ids, SamplingConfig) -> Generation, so agents and their tests run without a cluster.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Awaitable, Callable, Hashable, Sequence

import numpy as np

from vgbs_ray.agents.generation import Generation, SamplingConfig
from vgbs_ray.agents.session import ChatSession, SessionError, TextSession, TokenSession

EngineGenerate = Callable[[Sequence[int], SamplingConfig], Awaitable[Generation]]


class RolloutContext:
    """One rollout's view of the system (see module docstring)."""

    def __init__(self, *, rollout_id: Hashable, group_id: Hashable, member: int, group_size: int,
                 engine_generate: EngineGenerate, tokenizer=None, default_sampling: SamplingConfig | None = None,
                 seed: int | None = None):
        self.rollout_id = rollout_id
        """The id every sample of this rollout carries (stable across resumes)."""
        self.group_id = group_id
        """The GRPO group: the `group_size` rollouts that answer one prompt row."""
        self.member = member
        """This rollout's index in its group, 0..group_size-1."""
        self.group_size = group_size
        self.tokenizer = tokenizer
        """The checkpoint's Hugging Face tokenizer, or None (token-id-only jobs)."""
        self.default_sampling = default_sampling or SamplingConfig()
        """What `generate` uses when given no SamplingConfig (the job's `rollout.sampling`)."""
        self.seed = seed
        """A seed distinct per rollout (None: unseeded); requests without their own seed derive from it."""
        self.endpoint = None
        """The rollout's session on the job's OpenAI-compatible endpoint (`EndpointSession`: base_url, api_key,
        reward_url) when the job serves one (rollout.endpoint.enabled), else None."""
        self._engine_generate = engine_generate
        self._sessions: list[TokenSession | TextSession | _AddedSample] = []
        self._requests = 0

    async def generate(self, token_ids: Sequence[int], sampling: SamplingConfig | None = None) -> Generation:
        """One request to the engine pool. Records nothing (use a session for what should be trained)."""
        if len(token_ids) == 0:
            raise SessionError(f"rollout {self.rollout_id!r}: generate needs a non-empty prompt")
        sampling = sampling or self.default_sampling
        if self.seed is not None or sampling.seed is not None:
            # Distinct per rollout and request, reproducible: a group's members must not share a seed.
            mixed = ((sampling.seed or 0) * 1_000_003 + (self.seed or 0)) * 7_919 + self._requests
            sampling = replace(sampling, seed=mixed % (1 << 31))
        self._requests += 1
        return await self._engine_generate(list(token_ids), sampling)

    def token_session(self, prompt_token_ids: Sequence[int]) -> TokenSession:
        """A token-in/token-out session starting from these ids (see `TokenSession`)."""
        session = TokenSession(self, prompt_token_ids)
        self._sessions.append(session)
        return session

    def chat(self, messages: Sequence[dict] = (), *, tools: Sequence[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> ChatSession:
        """A chat session rendered with the checkpoint's tokenizer and chat template (see `ChatSession`)."""
        session = ChatSession(self, self.tokenizer, messages, tools=tools, chat_template_kwargs=chat_template_kwargs)
        self._sessions.append(session)
        return session

    def text_session(self) -> TextSession:
        """A session fed whole texts that extend each other (see `TextSession`; the endpoint's branches)."""
        session = TextSession(self, self.tokenizer)
        self._sessions.append(session)
        return session

    def add_sample(self, token_ids: Sequence[int], loss_mask: Sequence[int], *,
                   rollout_log_probs: Sequence[float] | None = None, policy_version: int | None = None) -> None:
        """A sample this agent made itself: `token_ids` (prompt then response), `loss_mask` (one per response
        token: 1 trained, 0 context), so the response is the last `len(loss_mask)` tokens. Behaviour
        log-probs (one per response token) and the policy version that sampled it are optional: without
        them the loss must be on-policy (train.loss.off_policy.max_staleness=0, train.loss.policy=ppo).
        Nothing is checked here: the scheduler rejects a malformed sample, naming this rollout and the rule."""
        row = dict(tokens=np.asarray(token_ids, dtype=np.int64), response_length=len(loss_mask),
                   loss_mask=np.asarray(loss_mask, dtype=np.int8))
        if rollout_log_probs is not None:
            row["rollout_log_probs"] = np.asarray(rollout_log_probs, dtype=np.float32)
        if policy_version is not None:
            row["policy_version_min"] = row["policy_version_max"] = int(policy_version)
        self._sessions.append(_AddedSample(row))

    def samples(self) -> list[dict]:
        """Every session's samples and every added sample, in the order they were opened or added (rows
        without the shared fields)."""
        return [row for session in self._sessions for row in session.samples()]


class _AddedSample:
    """One `add_sample` row, kept in order among the sessions."""

    def __init__(self, row: dict):
        self._row = row

    def samples(self) -> list[dict]:
        return [self._row]
