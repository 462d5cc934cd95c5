"""The agent endpoint's OpenAI wire format, and one rollout's conversations behind it (`EndpointRollout`).

    rollout = EndpointRollout(ctx)                  # ctx: the rollout's RolloutContext (its tokenizer)
    body = await rollout.chat_completion(request)   # /v1/chat/completions: an OpenAI response dict
    body = await rollout.completion(request)        # /v1/completions: a string or token-id prompt
    body = await rollout.response(request)          # /v1/responses: the chat path, in the Responses format
    rollout.report_reward({"reward": 1.0, "metrics": {"turns": 2}})
    result = await rollout.result()                 # the AgentResult, once reported

Pure (no HTTP, no Ray): actors/agent_endpoint.py serves it; tests call it directly.

Token exactness, as for a Python agent's sessions (vgbs_ray/agents/session.py): an OpenAI client
sends the whole conversation every call. The rollout keeps *branches* (`TextSession`s for chat
and string prompts, `TokenSession`s for token-id prompts); a request continues the most recent
branch whose held history its rendering extends, so only the new suffix (tool results, the next
user turn, the template's separators) is tokenized and the engine's earlier output is never
re-tokenized. A request that extends no branch (a compacted or edited history, a second
conversation) starts a new branch: a new sample under the same rollout id. With `n` > 1 every
extra choice is a fork whose prompt is the branch's whole history (context), so each generated
token is trained exactly once.

Where this differs from OpenAI (all documented in docs/agents.md):
- `stop` strings are cut from the returned content, as OpenAI does; the trained tokens keep them.
  An assistant message sent back with exactly the content returned is rendered with its full
  text again, so the history still extends the held ids.
- log-probs (`logprobs: true`) are those of the raw model distribution (before temperature and
  top-p), one per generated token including the end-of-turn token; `top_logprobs` > 0 is refused.
- extensions: `return_token_ids: true` adds `prompt_token_ids` and each choice's `token_ids`;
  `system_fingerprint` is `policy-v{version}`, the oldest policy version that sampled the choices.
- tool calls (`tools`): the reply is parsed with vLLM's tool parser of the model family
  (`vgbs_ray/agents/tool_calls.py`); an assistant message sent back with calls this session returned is
  rendered as the engine's own text of them, never re-rendered from the parsed JSON, so the next turn
  extends the held ids; only tool results and the template's separators are new (mask 0).
- `stream: true` answers OpenAI's chunks as server-sent events once the generation is complete (the engine
  call is one request); what is trained is the same as without streaming.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from vgbs_ray.agents.context import RolloutContext
from vgbs_ray.agents.generation import Generation, RequestTooLongError, SamplingConfig
from vgbs_ray.agents.rollout import TOO_LONG, AgentResult
from vgbs_ray.agents.responses_protocol import ResponsesRequestError, chat_request, response_object
from vgbs_ray.agents.session import TextSession, TokenSession, report_dropped
from vgbs_ray.agents.tool_calls import ToolCallParser, ToolParserUnavailable, ToolRequest, ToolRequestError
from vgbs_ray.errors import ConfigError, VgbsError

MAX_CHOICES = 16
"""`n` at most (each choice is a full engine request)."""

_COMMON = {"model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "user", "stream", "logprobs",
           "frequency_penalty", "presence_penalty", "logit_bias", "return_token_ids", "metadata", "store",
           "stream_options", "service_tier"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "response_format"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
ROLES = {"system", "developer", "user", "assistant", "tool"}


class ProtocolError(VgbsError, ValueError):
    """A request the endpoint refuses: an HTTP status, and an OpenAI error body naming the field."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                409: "conflict_error", 501: "not_implemented"}.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def _refuse_unsupported(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ProtocolError(f"unsupported field {unknown[0]!r} (this endpoint takes {sorted(allowed)})",
                            param=unknown[0])
    inert = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
             "logit_bias": (None, {}), "echo": (None, False), "suffix": (None,), "best_of": (None, 1),
             "top_logprobs": (None, 0), "service_tier": (None, "auto"),
             "response_format": (None, {"type": "text"})}
    for name, accepted in inert.items():
        if name in body and body[name] not in accepted:
            raise ProtocolError(f"{name}={body[name]!r} is not supported (accepted: {list(accepted)}); the trained "
                                "tokens must be exactly what the engine sampled", param=name)
    if body.get("stream") not in (None, False, True):
        raise ProtocolError(f"stream must be true or false, got {body['stream']!r}", param="stream")
    if body.get("stream") and body.get("n") not in (None, 1):
        raise ProtocolError(f"stream=true with n={body['n']!r}: this endpoint streams one choice; send n=1 or "
                            "stream=false", param="n")
    options = body.get("stream_options")
    if options is not None and (not body.get("stream") or not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise ProtocolError(f"stream_options={options!r}: only {{include_usage: bool}}, with stream=true",
                            param="stream_options")


def _number(body: dict, name: str, low: float, high: float, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ProtocolError(f"{name} must be a number in [{low}, {high}], got {value!r}", param=name)
    return value


def _integer(body: dict, name: str, low: int, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ProtocolError(f"{name} must be an integer >= {low}, got {value!r}", param=name)
    return value


def parse_sampling(body: dict, default: SamplingConfig) -> tuple[SamplingConfig, int]:
    """(the request's SamplingConfig, n): OpenAI's fields over the job's default sampling."""
    max_tokens = _integer(body, "max_completion_tokens", 1, None) or _integer(body, "max_tokens", 1, None)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not 0 < len(stop) <= 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise ProtocolError(f"stop must be a non-empty string or a list of 1-4 of them, got {body['stop']!r}",
                            param="stop")
    n = _integer(body, "n", 1, 1)
    if n > MAX_CHOICES:
        raise ProtocolError(f"n must be at most {MAX_CHOICES}, got {n}", param="n")
    try:
        sampling = SamplingConfig(
            max_tokens=max_tokens or default.max_tokens,
            temperature=float(_number(body, "temperature", 0.0, 2.0, default.temperature)),
            top_p=float(_number(body, "top_p", 1e-9, 1.0, default.top_p)),
            seed=_integer(body, "seed", 0, default.seed), stop_token_ids=default.stop_token_ids,
            stop=tuple(stop) if stop is not None else default.stop)
    except ConfigError as error:
        raise ProtocolError(str(error)) from None
    return sampling, n


def parse_messages(body: dict) -> list[dict]:
    """The request's messages, each content flattened to a string (text parts only)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list of {role, content} objects", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ProtocolError(f"{where} must be an object with a role in {sorted(ROLES)}", param=where)
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ProtocolError(f"{where}.content: only text parts are supported", param=f"{where}.content")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise ProtocolError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        parsed.append(dict(message, content=content if content is not None else ""))
    return parsed


def parse_prompt(body: dict) -> str | list[int]:
    """A completion's one prompt: a string or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        return list(prompt)
    raise ProtocolError("prompt must be one non-empty string or one non-empty list of token ids (one prompt per "
                        "request)", param="prompt")


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    cuts = [text.find(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


class EndpointRollout:
    """One rollout's conversations through the endpoint, and its reported reward (see module docstring)."""

    def __init__(self, context: RolloutContext, tool_parser: ToolCallParser | None = None,
                 outcomes: dict[str, int] | None = None):
        self.context = context
        self._tokenizer = context.tokenizer
        self._tool_parser = tool_parser
        self.outcomes: dict[str, int] = outcomes if outcomes is not None else {}
        """Tool-call parse outcomes (`tool_calls/<outcome>`) and `new_sample`s (a request that extends no held
        conversation: a compaction, an edit, a template rendering history differently), counted (shared with the
        endpoint's other sessions)."""
        self._dropped: set[str] = set()
        """Roles the chat template dropped from a rendering of this session (reported once each)."""
        self._calls: dict[str, str] = {}
        """Id of every tool call this session returned -> the engine's text of the reply that made it."""
        self._text_branches: list[TextSession] = []
        self._token_branches: list[TokenSession] = []
        self._full_replies: dict[str, str] = {}
        """Content returned without its stop string -> the text the engine generated (see module docstring)."""
        self._result: AgentResult | None = None
        self._reported = asyncio.Event()
        self.failure: tuple[str, str] | None = None
        """(drop reason, detail) when a request lost the rollout (too long for the engine)."""
        self.fatal_error: BaseException | None = None
        """An engine failure met by a request: not the agent's fault (the producer fails, see rollout.py)."""
        self.requests = 0

    # -- the two endpoints ------------------------------------------------------------------

    async def chat_completion(self, body: dict) -> dict:
        _refuse_unsupported(body, CHAT_FIELDS)
        self._need_tokenizer("/v1/chat/completions")
        sampling, n = parse_sampling(body, self.context.default_sampling)
        try:
            tools = ToolRequest.parse(body)
        except ToolRequestError as error:
            raise ProtocolError(str(error), param=error.param) from None
        messages = self._restore_all(parse_messages(body))
        text = self._tokenizer.apply_chat_template(messages, tools=tools.tools if tools else None, tokenize=False,
                                                   add_generation_prompt=True)
        for role in report_dropped(messages, text, self._dropped, f"session of rollout {self.context.rollout_id!r}"):
            self._count(f"dropped_message/{role}")
        branch = self._text_branch(text)
        generations = await self._sample(self._complete_text(branch, text, sampling, n))
        choices = []
        for index, generation in enumerate(generations):
            full = branch.reply_text(generation, sampling)
            content = _cut_at_stop(full, sampling.stop) if generation.finish_reason == "stop" else full
            if content != full:
                self._full_replies[content] = full
            message, finish_reason = {"role": "assistant", "content": content}, generation.finish_reason
            if tools is not None:
                reply = await self._parse_tools(full, tools)
                if reply.calls:
                    message = {"role": "assistant", "content": reply.content, "tool_calls": reply.calls}
                    finish_reason = "tool_calls"
                    self._calls.update({call["id"]: full for call in reply.calls})
            choice = {"index": index, "message": message, "finish_reason": finish_reason}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
                    for token, logprob in self._token_logprobs(generation)]}
            choices.append(self._with_ids(choice, generation, body))
        return self._response("chat.completion", choices, generations, body)

    async def response(self, body: dict) -> dict:
        """/v1/responses: the chat request it means, answered as a Responses object (responses_protocol.py)."""
        try:
            chat_body = chat_request(body)
        except ResponsesRequestError as error:
            raise ProtocolError(str(error), param=error.param) from None
        return response_object(await self.chat_completion(chat_body), body)

    async def completion(self, body: dict) -> dict:
        _refuse_unsupported(body, COMPLETION_FIELDS)
        sampling, n = parse_sampling(body, self.context.default_sampling)
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0) and logprobs is not False:
            raise ProtocolError(f"logprobs={logprobs!r}: only the sampled tokens' log-probs are returned (logprobs=0)",
                                param="logprobs")
        prompt = parse_prompt(body)
        if isinstance(prompt, str):
            self._need_tokenizer("/v1/completions with a string prompt (send token ids instead)")
            generations = await self._sample(self._complete_text(self._text_branch(prompt), prompt, sampling, n))
        else:
            generations = await self._sample(self._complete_tokens(prompt, sampling, n))
        choices = []
        for index, generation in enumerate(generations):
            text = self._decode(generation.response_token_ids) if self._tokenizer is not None else ""
            if generation.finish_reason == "stop":
                text = _cut_at_stop(text, sampling.stop)
            choice = {"index": index, "text": text, "finish_reason": generation.finish_reason, "logprobs": None}
            if logprobs is not None:
                pairs = self._token_logprobs(generation)
                choice["logprobs"] = {"tokens": [t for t, _ in pairs], "token_logprobs": [p for _, p in pairs],
                                      "top_logprobs": None, "text_offset": None}
            choices.append(self._with_ids(choice, generation, body))
        return self._response("text_completion", choices, generations, body)

    # -- the reward ---------------------------------------------------------------------------

    def report_reward(self, body: Any) -> None:
        """`{"reward": number, "metrics": {name: number}}`: ends the rollout (its samples are pushed)."""
        if self._reported.is_set():
            raise ProtocolError(f"rollout {self.context.rollout_id!r}: its reward was reported already", status=409)
        if not isinstance(body, dict) or set(body) - {"reward", "metrics"} or "reward" not in body:
            raise ProtocolError('the reward report must be {"reward": number, "metrics": {name: number}}',
                                param="reward")
        reward, metrics = body["reward"], body.get("metrics") or {}
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ProtocolError(f"reward must be a number, got {reward!r}", param="reward")
        if not isinstance(metrics, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                                    and not isinstance(v, bool) for k, v in metrics.items()):
            raise ProtocolError("metrics must be an object of names to numbers", param="metrics")
        self._result = AgentResult(reward=float(reward), metrics={k: float(v) for k, v in metrics.items()})
        self._reported.set()

    @property
    def reported(self) -> bool:
        return self._reported.is_set()

    async def result(self) -> AgentResult:
        """The reported reward; waits for it."""
        await self._reported.wait()
        return self._result

    # -- internals ----------------------------------------------------------------------------

    def _need_tokenizer(self, what: str) -> None:
        if self._tokenizer is None:
            raise ProtocolError(f"{what} needs the checkpoint's tokenizer and this job has none (set "
                                "rollout.tokenizer_dir)", param="messages")

    def _restore_all(self, messages: list[dict]) -> list[dict]:
        """The messages as the engine's text holds them: a reply returned without its stop string gets it back, and
        an assistant message carrying calls this session returned becomes the engine's text of that reply (the
        template never re-renders a call from its parsed JSON). A `tool` message's `tool_call_id`, when it has one,
        must name a call of this session or of an assistant message in the request."""
        offered = {call.get("id") for m in messages if m["role"] == "assistant"
                   for call in (m.get("tool_calls") or []) if isinstance(call, dict)}
        restored = []
        for index, message in enumerate(messages):
            answered = message.get("tool_call_id") if message["role"] == "tool" else None
            if answered is not None and answered not in self._calls.keys() | offered:
                raise ProtocolError(f"messages[{index}].tool_call_id={message.get('tool_call_id')!r} answers no tool "
                                    "call of this session or of this request", param=f"messages[{index}].tool_call_id")
            if message["role"] == "assistant":
                calls = [call.get("id") for call in (message.get("tool_calls") or []) if isinstance(call, dict)]
                if calls and calls[0] in self._calls:
                    message = {"role": "assistant", "content": self._calls[calls[0]]}
                elif message["content"] in self._full_replies:
                    message = dict(message, content=self._full_replies[message["content"]])
            restored.append(message)
        return restored

    async def _parse_tools(self, text: str, tools: ToolRequest):
        if self._tool_parser is None:
            raise ProtocolError("this job's endpoint parses no tool calls (rollout.endpoint.tool_parser=none); "
                                "send no tools, or set the parser of the checkpoint's call format", param="tools",
                                status=501)
        try:
            reply = await self._tool_parser.parse(text, tools)
        except ToolParserUnavailable as error:
            raise ProtocolError(str(error), param="tools", status=501) from None
        self._count(f"tool_calls/{reply.outcome}")
        return reply

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _text_branch(self, text: str) -> TextSession:
        for branch in reversed(self._text_branches):
            if branch.extends(text):
                self._text_branches.remove(branch)
                self._text_branches.append(branch)  # most recently used last
                return branch
        if self._text_branches:  # a compaction, an edit, or a template rendering history differently
            self._count("new_sample")
        branch = self.context.text_session()
        self._text_branches.append(branch)
        return branch

    async def _complete_text(self, branch: TextSession, text: str, sampling: SamplingConfig, n: int
                             ) -> list[Generation]:
        pairs = await branch.complete_n(text, sampling, n)
        self._text_branches += [session for session, _ in pairs[1:]]
        return [generation for _, generation in pairs]

    async def _complete_tokens(self, prompt: list[int], sampling: SamplingConfig, n: int) -> list[Generation]:
        branch = None
        for candidate in reversed(self._token_branches):
            held = candidate.token_ids
            if len(held) <= len(prompt) and prompt[:len(held)] == held:
                branch = candidate
                break
        if branch is None:
            branch = self.context.token_session(prompt)
            self._token_branches.append(branch)
        else:
            branch.append(prompt[len(branch.token_ids):])
        forks = [self.context.token_session(prompt) for _ in range(n - 1)]
        self._token_branches += forks
        return list(await asyncio.gather(*[b.generate(sampling) for b in [branch, *forks]]))

    async def _sample(self, generating) -> list[Generation]:
        self.requests += 1
        try:
            return await generating
        except RequestTooLongError as error:
            self.failure = (TOO_LONG, str(error))
            raise ProtocolError(f"rollout {self.context.rollout_id!r}: {error}", code="context_length_exceeded",
                                param="max_tokens") from None

    def _decode(self, token_ids) -> str:
        return self._tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=False)

    def _token_logprobs(self, generation: Generation) -> list[tuple[str, float]]:
        ids = [int(t) for t in generation.response_token_ids]
        tokens = ([self._decode([t]) for t in ids] if self._tokenizer is not None else [f"token_id:{t}" for t in ids])
        return [(token, float(p)) for token, p in zip(tokens, generation.response_log_probs)]

    @staticmethod
    def _with_ids(choice: dict, generation: Generation, body: dict) -> dict:
        if body.get("return_token_ids"):
            choice["token_ids"] = [int(t) for t in generation.response_token_ids]
        return choice

    def _response(self, kind: str, choices: list[dict], generations: list[Generation], body: dict) -> dict:
        first = generations[0]
        completion_tokens = sum(len(g.response_token_ids) for g in generations)
        response = {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{self.context.rollout_id}-{self.requests}",
            "object": kind, "created": int(time.time()), "model": body.get("model") or "policy",
            "system_fingerprint": f"policy-v{min(g.policy_version for g in generations)}",
            "choices": choices,
            "usage": {"prompt_tokens": len(first.prompt_token_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(first.prompt_token_ids) + completion_tokens}}
        if body.get("return_token_ids"):
            response["prompt_token_ids"] = [int(t) for t in first.prompt_token_ids]
        return response


def stream_chunks(response: dict, include_usage: bool = False) -> list[dict]:
    """An answer (`chat_completion` / `completion`, one choice) as OpenAI's stream chunks, in order: the role, the
    content (with its log-probs), each tool call whole, the finish reason, then the usage when asked."""
    chat = response["object"] == "chat.completion"
    head = {key: response[key] for key in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}
    (choice,) = response["choices"]

    def chunk(delta: dict, finish_reason=None, **fields) -> dict:
        body = {"index": 0, "finish_reason": finish_reason, **fields}
        body.update({"delta": delta} if chat else delta)
        return {**head, "choices": [body], **extra}

    if chat:
        message = choice["message"]
        chunks = [chunk({"role": "assistant", "content": ""})]
        if message["content"]:
            chunks.append(chunk({"content": message["content"]}, **({"logprobs": choice["logprobs"]}
                                                                    if "logprobs" in choice else {})))
        for index, call in enumerate(message.get("tool_calls") or []):
            chunks.append(chunk({"tool_calls": [dict(call, index=index)]}))
        chunks.append(chunk({}, choice["finish_reason"]))
    else:
        chunks = [chunk({"text": choice["text"], "logprobs": choice["logprobs"]}),
                  chunk({"text": "", "logprobs": None}, choice["finish_reason"])]
    if "token_ids" in choice:
        chunks[-1]["choices"][0]["token_ids"] = choice["token_ids"]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks


class EndpointSession:
    """What an agent needs to reach its rollout's endpoint session (`ctx.endpoint`).

        client = openai.AsyncOpenAI(base_url=ctx.endpoint.base_url, api_key=ctx.endpoint.api_key)

    `base_url` names the session in its path (`.../sessions/{session_id}/v1`); `reward_url` takes
    the reward report (`POST {"reward": 1.0}`) from any process; `rollout` is the conversations'
    state in this process.
    """

    def __init__(self, *, address: str, session_id: str, api_key: str, rollout: EndpointRollout):
        self.session_id = session_id
        self.rollout_id = rollout.context.rollout_id
        """The rollout everything sent to this session trains as (also each answer's `X-Rollout-Id` header)."""
        self.base_url = f"{address}/sessions/{session_id}/v1"
        self.reward_url = f"{address}/sessions/{session_id}/reward"
        self.api_key = api_key
        self.rollout = rollout
