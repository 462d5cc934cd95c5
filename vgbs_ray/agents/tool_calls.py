"""OpenAI tool calls from the engine's text, with vLLM's own tool parsers.

    parser = ToolCallParser("hermes", tokenizer)           # a vLLM parser name (vllm.tool_parsers)
    request = ToolRequest.parse(body)                      # tools, tool_choice, parallel_tool_calls; 400s named
    reply = await parser.parse(text, request)              # -> ToolReply(content, calls, outcome)

The parser is vLLM's (`ToolParserManager`: `hermes` for Qwen2.5 / Qwen3, `llama3_json` for Llama 3.x, any other
name it registers); this module only checks what it found against the request: a call to a function the request
did not offer, arguments that are not a JSON object or do not match the function's JSON schema, a call when
`tool_choice` is `none`, a second call when `parallel_tool_calls` is false, no call when `tool_choice` is
`required` or names a function. Each of those is an `outcome` (counted by the endpoint, docs/agents.md), and a
reply whose calls cannot be returned is returned as text: a client never gets a call it did not allow, and never
a 500. The text is the engine's own either way; the trained tokens do not depend on what was parsed.

vLLM is imported on the first parse (a few seconds, and torch), in a worker thread, so producers whose agents never
send `tools` do not pay it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from dataclasses import dataclass, field

from vgbs_ray.errors import VgbsError

FAMILY_PARSERS = {"llama": "llama3_json", "qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes"}
"""The vLLM tool parser of each supported model family (its chat template's call format)."""

CALLED, NO_CALL = "called", "no_call"
OUTCOMES = (CALLED, NO_CALL, "unparseable", "unknown_function", "bad_arguments", "not_allowed", "required_unmet",
            "parallel_cut")
"""What a reply's parse can end as; all but `called` and `no_call` are returned as text (parallel_cut: the first
call only)."""


class ToolParserUnavailable(VgbsError, RuntimeError):
    """The configured vLLM parser cannot run with this tokenizer (e.g. llama3_json without <|python_tag|>)."""


class ToolRequestError(VgbsError, ValueError):
    """A request's tools or tool_choice the endpoint refuses (400), naming the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tool fields, checked."""

    tools: list[dict]
    choice: str | None
    """'none', 'auto', 'required', or None with `named` set (a forced function)."""
    named: str | None = None
    parallel: bool = True

    @property
    def functions(self) -> dict[str, dict]:
        return {tool["function"]["name"]: tool["function"] for tool in self.tools}

    @classmethod
    def parse(cls, body: dict) -> "ToolRequest | None":
        """None when the request has no tools (its tool_choice must then be absent or 'none')."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ToolRequestError(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
        if tools is None or tools == []:
            if choice not in (None, "none"):
                raise ToolRequestError(f"tool_choice={choice!r} needs tools", "tool_choice")
            return None
        if not isinstance(tools, list):
            raise ToolRequestError("tools must be a list of {type: function, function: {name, parameters}} objects",
                                   "tools")
        for index, tool in enumerate(tools):
            where = f"tools[{index}]"
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise ToolRequestError(f"{where} must be an object with type 'function'", where)
            function = tool.get("function")
            if not isinstance(function, dict):
                raise ToolRequestError(f"{where}.function must be an object", f"{where}.function")
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise ToolRequestError(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
            parameters = function.get("parameters", {"type": "object"})
            if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
                raise ToolRequestError(f"{where}.function.parameters must be a JSON schema of type 'object', got "
                                       f"{parameters!r}", f"{where}.function.parameters")
        names = [tool["function"]["name"] for tool in tools]
        if len(set(names)) != len(names):
            raise ToolRequestError(f"tools name a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}",
                                   "tools")
        if choice is None or choice in ("none", "auto", "required"):
            return cls(tools=list(tools), choice=choice or "auto", parallel=parallel)
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or named not in names:
            raise ToolRequestError(f"tool_choice={choice!r} must be 'none', 'auto', 'required' or "
                                   f"{{type: function, function: {{name}}}} naming one of {names}", "tool_choice")
        return cls(tools=list(tools), choice=None, named=named, parallel=parallel)


@dataclass
class ToolReply:
    """What a reply becomes: its text content (None when it is only calls), the calls, and the outcome."""

    content: str | None
    calls: list[dict] = field(default_factory=list)
    outcome: str = NO_CALL
    detail: str = ""


class ToolCallParser:
    """One vLLM tool parser for a tokenizer (see module docstring); `name` is a vLLM parser name."""

    _import_lock = threading.Lock()

    def __init__(self, name: str, tokenizer):
        self.name, self._tokenizer = name, tokenizer
        self._parser = None
        self._requests: dict[str, object] = {}

    async def parse(self, text: str, request: ToolRequest) -> ToolReply:
        """The reply `text` (the engine's, end-of-turn token removed) as content and calls under `request`."""
        if request.choice == "none":
            return ToolReply(content=text)
        if self._parser is None:
            await asyncio.to_thread(self._load)
        extracted = self._parser.extract_tool_calls(text, self._vllm_request(request))  # cached per tool set
        if not extracted.tools_called:
            if self._marks_a_call(text):
                return ToolReply(content=text, outcome="unparseable", detail=f"{self.name} found no valid call")
            unmet = request.choice == "required" or request.named is not None
            return ToolReply(content=text, outcome="required_unmet" if unmet else NO_CALL)
        calls = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                  "function": {"name": call.function.name, "arguments": call.function.arguments}}
                 for call in extracted.tool_calls]
        problem = self._check(calls, request)
        if problem is not None:
            return ToolReply(content=text, outcome=problem[0], detail=problem[1])
        if not request.parallel and len(calls) > 1:
            return ToolReply(content=extracted.content, calls=calls[:1], outcome="parallel_cut",
                             detail=f"{len(calls)} calls, parallel_tool_calls=false: the first is returned")
        return ToolReply(content=extracted.content, calls=calls, outcome=CALLED)

    def _check(self, calls: list[dict], request: ToolRequest) -> tuple[str, str] | None:
        functions = request.functions
        for call in calls:
            name = call["function"]["name"]
            if name not in functions:
                return "unknown_function", f"the reply called {name!r}; the request offered {sorted(functions)}"
            if request.named is not None and name != request.named:
                return "not_allowed", f"tool_choice names {request.named!r}; the reply called {name!r}"
            try:
                arguments = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError as error:
                return "bad_arguments", f"{name}: arguments are not JSON ({error})"
            if not isinstance(arguments, dict):
                return "bad_arguments", f"{name}: arguments must be a JSON object, got {arguments!r}"
            reason = _schema_problem(arguments, functions[name].get("parameters", {"type": "object"}))
            if reason is not None:
                return "bad_arguments", f"{name}: {reason}"
        return None

    def _marks_a_call(self, text: str) -> bool:
        start = getattr(self._parser, "tool_call_start_token", None)
        return bool(start) and start in text

    def _load(self) -> None:
        with self._import_lock:
            if self._parser is not None:
                return
            from vllm.tool_parsers import ToolParserManager

            try:
                self._parser = ToolParserManager.get_tool_parser(self.name)(self._tokenizer)
            except Exception as error:  # noqa: BLE001 - vLLM raises KeyError, RuntimeError, ValueError here
                raise ToolParserUnavailable(
                    f"the vLLM tool parser {self.name!r} cannot run with this job's tokenizer ({error}); set "
                    "rollout.endpoint.tool_parser to the parser of the checkpoint's call format") from None

    def _vllm_request(self, request: ToolRequest):
        """vLLM's request object, which its parsers take (pydantic-validated: milliseconds); one per distinct tools
        and tool_choice, since an agent sends the same tools every turn."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        choice = request.choice if request.named is None else {"type": "function", "function": {"name": request.named}}
        key = json.dumps([request.tools, choice], sort_keys=True)
        if key not in self._requests:
            if len(self._requests) >= 1024:
                self._requests.clear()
            self._requests[key] = ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": ""}],
                                                        tools=request.tools, tool_choice=choice)
        return self._requests[key]


def check_parser_name(name: str) -> None:
    """Refuse a parser name vLLM does not register (imports vLLM: the job's start-up, not a producer)."""
    from vllm.tool_parsers import ToolParserManager

    if name not in ToolParserManager.list_registered():
        raise ToolRequestError(f"rollout.endpoint.tool_parser={name!r} is not a vLLM tool parser; registered: "
                               f"{sorted(ToolParserManager.list_registered())}", "rollout.endpoint.tool_parser")


def _schema_problem(arguments: dict, schema: dict) -> str | None:
    """Why `arguments` do not match the function's JSON schema, or None (jsonschema, Draft 2020-12)."""
    import jsonschema

    try:
        jsonschema.validate(arguments, schema)
    except jsonschema.ValidationError as error:
        return f"arguments do not match the schema: {error.message}"
    except jsonschema.SchemaError as error:
        return f"the function's schema is not valid: {error.message}"
    return None
