"""Sessions: the conversations of one rollout, held as token ids, turned into its training samples.

    session = ctx.token_session(prompt_token_ids)        # token-in/token-out
    gen = await session.generate(SamplingConfig(max_tokens=8))
    session.append(tool_reply_ids)                       # environment tokens: context, not trained

    chat = ctx.chat([{"role": "user", "content": "3 + 4?"}])   # rendered with the tokenizer's chat template
    answer = await chat.generate()                       # the assistant's text; appended to chat.messages
    chat.messages.append({"role": "user", "content": "and times 2?"})
    answer = await chat.generate()

A session holds *segments*; each becomes one sample of the rollout. A segment's tokens are its
prompt, then, in order, every generated response (loss mask 1, the engine's behaviour log-probs)
and every appended environment piece (mask 0, log-prob 0.0). Its response is everything after
the prompt: the tokens before the segment's first generation.

Token exactness (the invariant): a sample's tokens are, unchanged and in order, the ids the
engine was given and the ids it returned. Nothing is tokenized twice: `ChatSession` renders the
whole conversation with the chat template each turn (text), checks that the text its ids stand
for is a prefix of the new rendering, and tokenizes only the new suffix. When it is not a prefix
(a template that rewrites history, e.g. drops earlier reasoning; an agent that compacted or
edited its messages), the session closes the segment and starts a new one from the full
rendering: a new sample under the same rollout id (`ChatSession.restarts` counts them).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from vgbs_ray.agents.generation import Generation, SamplingConfig
from vgbs_ray.errors import VgbsError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vgbs_ray.agents.context import RolloutContext


class SessionError(VgbsError, ValueError):
    """A session was misused (empty prompt, generate without a tokenizer, ...); names the rollout."""


def run_lengths(values: Sequence[int]) -> np.ndarray:
    """int64 [k, 2]: (value, count) runs of `values` in order (a sample's `policy_version_runs`)."""
    values = np.asarray(values, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    return np.stack([values[starts], np.diff(np.r_[starts, len(values)])], axis=1)


@dataclass
class Segment:
    """One append-only token history of a session; it becomes one sample (see module docstring)."""

    prompt_length: int
    tokens: list[int]
    loss_mask: list[int] = field(default_factory=list)
    """One per token after the prompt: 1 generated, 0 appended by the environment."""
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Policy versions of every generation in this segment."""
    token_versions: list[int] = field(default_factory=list)
    """One per token after the prompt: the version that sampled it, -1 for an appended one."""

    def to_row(self) -> dict:
        """The segment as a push-API sample dict (without the rollout's shared fields)."""
        return dict(tokens=np.asarray(self.tokens, dtype=np.int64), response_length=len(self.loss_mask),
                    loss_mask=np.asarray(self.loss_mask, dtype=np.int8),
                    rollout_log_probs=np.asarray(self.log_probs, dtype=np.float32),
                    policy_version_min=min(self.versions), policy_version_max=max(self.versions),
                    policy_version_runs=run_lengths(self.token_versions))


class TokenSession:
    """Token-in/token-out multi-turn generation (see module docstring)."""

    def __init__(self, context: "RolloutContext", prompt_token_ids: Sequence[int]):
        self._context = context
        self.segments: list[Segment] = []
        self.restart(prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The current segment's ids (what the next `generate` continues); a copy."""
        return list(self.segments[-1].tokens)

    async def generate(self, sampling: SamplingConfig | None = None) -> Generation:
        """Sample a response after the current ids; it is appended (trained, mask 1)."""
        segment = self.segments[-1]
        generation = await self._context.generate(segment.tokens, sampling)
        response = [int(t) for t in generation.response_token_ids]
        segment.tokens += response
        segment.loss_mask += [1] * len(response)
        segment.log_probs += [float(p) for p in generation.response_log_probs]
        segment.versions += [version for version, _ in generation.version_runs] or [int(generation.policy_version)]
        segment.token_versions += generation.token_versions().tolist()
        return generation

    def append(self, token_ids: Sequence[int]) -> None:
        """Environment or tool tokens: context for later turns, never trained (mask 0). Before the
        segment's first generation they extend its prompt."""
        ids = [int(t) for t in token_ids]
        segment = self.segments[-1]
        if not segment.versions:  # nothing generated yet: still the prompt
            segment.tokens += ids
            segment.prompt_length += len(ids)
            return
        segment.tokens += ids
        segment.loss_mask += [0] * len(ids)
        segment.log_probs += [0.0] * len(ids)
        segment.token_versions += [-1] * len(ids)

    def restart(self, prompt_token_ids: Sequence[int]) -> None:
        """Start a new segment (a new sample of the same rollout) from these ids; the current one is kept."""
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise SessionError(f"rollout {self._context.rollout_id!r}: a session needs a non-empty prompt")
        if self.segments and not self.segments[-1].versions:
            self.segments.pop()  # nothing was generated in it: no sample to keep
        self.segments.append(Segment(prompt_length=len(ids), tokens=ids))

    def samples(self) -> list[dict]:
        """Every segment with at least one generated token, as sample rows (prompt-only ones are dropped)."""
        return [segment.to_row() for segment in self.segments if segment.versions]


class TextSession:
    """Text in, held as token ids: the incremental rendering behind `ChatSession` and the endpoint.

    `complete(text)` samples a response after `text`, which must extend what the session holds
    (its earlier texts and the engine's outputs, decoded): only the new suffix is tokenized and
    appended (mask 0). When `text` does not extend it, the current segment is closed and a new one
    starts from the whole of `text` (a new sample of the rollout; `restarts` counts them).
    """

    def __init__(self, context: "RolloutContext", tokenizer):
        if tokenizer is None:
            raise SessionError(f"rollout {context.rollout_id!r}: a chat session needs the checkpoint's tokenizer, and "
                               "this job has none (set rollout.tokenizer_dir, or use ctx.token_session)")
        self._context = context
        self._tokenizer = tokenizer
        self._tokens: TokenSession | None = None
        self._text: str | None = None
        """The text the current segment's ids stand for: the renderings and generations so far."""
        self.restarts = 0
        """Times a text did not extend the held history, so a new segment (sample) began."""

    @property
    def token_ids(self) -> list[int]:
        return [] if self._tokens is None else self._tokens.token_ids

    def extends(self, text: str) -> bool:
        """Whether `text` continues this session's held history (a `complete` would append, not restart)."""
        return self._text is not None and text.startswith(self._text)

    async def complete(self, text: str, sampling: SamplingConfig | None = None) -> Generation:
        """A response sampled after `text` (see class docstring)."""
        ((_, generation),) = await self.complete_n(text, sampling, 1)
        return generation

    async def complete_n(self, text: str, sampling: SamplingConfig | None, n: int
                         ) -> list[tuple["TextSession", Generation]]:
        """`n` responses sampled after `text`, from the same ids: the first continues this session, each other
        one a fork of it (`fork`); returns each with the session that holds it."""
        self._sync_tokens(text)
        sessions = [self] + [self.fork() for _ in range(n - 1)]
        generations = await asyncio.gather(*[session._generate(sampling) for session in sessions])
        return list(zip(sessions, generations))

    def fork(self) -> "TextSession":
        """A new session of the same rollout whose prompt is everything this one holds (all context, mask 0),
        so tokens generated here are trained once, in this session's sample."""
        forked = copy.copy(self)
        forked._tokens = self._context.token_session(self._tokens.token_ids)
        forked.restarts = 0
        return forked

    def reply_text(self, generation: Generation, sampling: SamplingConfig | None = None) -> str:
        """The reply as an assistant message holds it: the response without the end-of-turn stop token
        (the template writes that itself, so the next rendering extends the held ids)."""
        response = [int(t) for t in generation.response_token_ids]
        stop_ids = set((sampling or self._context.default_sampling).stop_token_ids)
        if generation.finish_reason == "stop" and response and response[-1] in stop_ids:
            response = response[:-1]
        return self._tokenizer.decode(response, skip_special_tokens=False)

    def samples(self) -> list[dict]:
        return [] if self._tokens is None else self._tokens.samples()

    async def _generate(self, sampling: SamplingConfig | None) -> Generation:
        generation = await self._tokens.generate(sampling)
        self._text += self._tokenizer.decode([int(t) for t in generation.response_token_ids],
                                             skip_special_tokens=False)
        return generation

    def _sync_tokens(self, text: str) -> None:
        if self.extends(text):
            suffix = text[len(self._text):]
            if suffix:
                self._tokens.append(self._encode(suffix))
        else:
            ids = self._encode(text)
            if self._tokens is None:
                self._tokens = TokenSession(self._context, ids)
            else:
                self._tokens.restart(ids)
                self.restarts += 1
        self._text = text

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def dropped_roles(messages: Sequence[dict], rendered: str) -> list[str]:
    """The roles of messages whose text the rendering does not hold: a chat template that drops them (e.g. one
    that renders only user and assistant turns). The model never sees those messages; the caller reports it."""
    return sorted({m["role"] for m in messages if isinstance(m.get("content"), str) and m["content"].strip()
                   and m["content"].strip() not in rendered})


def report_dropped(messages: Sequence[dict], rendered: str, reported: set[str], where: str) -> list[str]:
    """Log, once per role per conversation (`reported`, updated), messages the template dropped; returns the newly
    reported roles."""
    new = [role for role in dropped_roles(messages, rendered) if role not in reported]
    for role in new:
        log.warning("%s: the chat template dropped a %r message (its text is not in the rendering): the model never "
                    "sees it; render every role the agent sends", where, role)
    reported.update(new)
    return new


class ChatSession(TextSession):
    """A conversation rendered with the tokenizer's chat template, incrementally (see module docstring).

    `messages` is the agent's to read and edit between turns (append tool results, user turns, or
    replace it wholesale for a compaction); `generate` appends the assistant's reply to it.
    """

    def __init__(self, context: "RolloutContext", tokenizer, messages: Sequence[dict] = (), *,
                 tools: Sequence[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None):
        super().__init__(context, tokenizer)
        self.messages: list[dict] = [dict(m) for m in messages]
        self._tools = list(tools) if tools else None
        self._template_kwargs = dict(chat_template_kwargs or {})
        self.dropped_roles: set[str] = set()
        """Roles of messages the chat template dropped from a rendering (each reported once, as a warning)."""

    def fork(self) -> "ChatSession":
        forked = super().fork()
        forked.messages = [dict(m) for m in self.messages]
        return forked

    def render(self, messages: Sequence[dict] | None = None, tools: Sequence[dict] | None = None) -> str:
        """The chat template's text for `messages` (default: the session's) with the generation prompt; a message
        the template drops is reported (`dropped_roles`)."""
        messages = list(self.messages if messages is None else messages)
        text = self._tokenizer.apply_chat_template(messages, tools=tools or self._tools, tokenize=False,
                                                   add_generation_prompt=True, **self._template_kwargs)
        report_dropped(messages, text, self.dropped_roles, f"rollout {self._context.rollout_id!r}")
        return text

    async def generate(self, sampling: SamplingConfig | None = None) -> str:
        """The assistant's next reply: renders the messages, appends only the new suffix's tokens
        (or starts a new segment, see module docstring), samples, appends the reply to `messages`."""
        generation = await self.complete(self.render(), sampling)
        content = self.reply_text(generation, sampling)
        self.messages.append({"role": "assistant", "content": content})
        return content
