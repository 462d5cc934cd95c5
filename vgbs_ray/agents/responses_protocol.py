"""OpenAI's Responses API (`/v1/responses`) as a view of the chat-completions path: one translation each way.

    chat_body = chat_request(body)              # a Responses request -> the chat request it means (400s named)
    answer = await rollout.chat_completion(chat_body)
    response = response_object(answer, body)    # the chat answer -> a Responses `response` object

Why a translation and not a second path: what is trained must not depend on which API an agent speaks. The chat
path already holds the token rule (a call this session returned is rendered as the engine's own text, never from
its parsed JSON), the tool parser, the sampling fields and every refusal; a Responses request is the same
conversation in other clothes. Input items map one to one: `instructions` -> a system message first; a message
item (`input_text` / `output_text` parts) -> a message of its role; consecutive `function_call` items -> one
assistant message with those `tool_calls` (their `call_id` is the id this endpoint returned); a
`function_call_output` -> a `tool` message. Output: a `message` item with the reply's text, and one
`function_call` item per parsed call (`call_id` = the chat call's id).

Stateless, as the chat path is: every request sends its whole input (`previous_response_id` and `conversation`
are refused, naming the field: the OpenAI Agents SDK sends the whole input unless told otherwise), `store` is
accepted and nothing is stored; fields that would change the sampled distribution are refused as on chat.
`stream: true` answers the Responses event stream (`response_events`: created, each output item added, its text
or arguments as one delta, done, completed) once the generation is complete, as chat streams are.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from vgbs_ray.errors import VgbsError

RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                    "max_output_tokens", "temperature", "top_p", "stream", "store", "metadata", "user", "include",
                    "truncation", "text", "reasoning", "service_tier", "previous_response_id", "conversation"}
"""Fields a Responses request may carry; of these, `previous_response_id` and `conversation` are refused; `include`,
`store`, `metadata`, `user`, `service_tier`, `truncation: disabled` and `reasoning` (the model has no reasoning
effort to set) are accepted and ignored."""
_PASSED = {"model": "model", "temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_tokens",
           "parallel_tool_calls": "parallel_tool_calls", "metadata": "metadata", "user": "user"}
"""Responses field -> the chat field it becomes."""


class ResponsesRequestError(VgbsError, ValueError):
    """A Responses request the endpoint refuses (400), naming the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def chat_request(body: dict) -> dict:
    """The chat-completions request a Responses request means (see module docstring)."""
    unknown = sorted(set(body) - RESPONSES_FIELDS)
    if unknown:
        raise ResponsesRequestError(f"unsupported field(s) {unknown} on /v1/responses", unknown[0])
    for field in ("previous_response_id", "conversation"):
        if body.get(field) is not None:
            raise ResponsesRequestError(f"{field}: this endpoint stores no responses; send the whole input each "
                                        "request", field)
    if body.get("truncation") not in (None, "disabled"):
        raise ResponsesRequestError(f"truncation={body['truncation']!r}: only 'disabled' (a conversation longer "
                                    "than the engine takes is refused, never cut)", "truncation")
    text_format = _text_format(body.get("text"))
    if text_format != "text":
        raise ResponsesRequestError(f"text.format.type={text_format!r} would constrain the sampled distribution "
                                    "(as response_format on chat): only 'text'", "text")
    chat = {chat_field: body[field] for field, chat_field in _PASSED.items() if body.get(field) is not None}
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    chat["messages"] = messages + _messages(body.get("input"))
    if body.get("tools") is not None:
        chat["tools"] = [_chat_tool(tool, index) for index, tool in enumerate(_list(body["tools"], "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    return chat


def response_object(answer: dict, body: dict) -> dict:
    """The Responses `response` object of a chat completion `answer` to the request `body`."""
    (choice,) = answer["choices"]  # the chat request carries no `n`: one choice
    message, output = choice["message"], []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "completed",
                       "role": "assistant", "content": [{"type": "output_text", "text": message["content"],
                                                         "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = answer.get("usage") or {}
    incomplete = choice["finish_reason"] == "length" and not message.get("tool_calls")
    response = {
        "id": f"resp_{secrets.token_hex(12)}", "object": "response", "created_at": int(time.time()),
        "model": answer.get("model", body.get("model")), "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
        "instructions": body.get("instructions"), "output": output, "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "metadata": body.get("metadata") or {}, "store": False,
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                  "total_tokens": usage.get("total_tokens", 0), "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }
    for extension in ("system_fingerprint", "prompt_token_ids"):  # the policy version; ids with return_token_ids
        if extension in answer:
            response[extension] = answer[extension]
    return response


def response_events(response: dict) -> list[dict]:
    """The Responses API's server-sent events for a whole `response` (its `type` is each event's name): created,
    in progress, then per output item: added, its text (a content part) or its arguments as one delta and done,
    the item done; then completed."""
    events: list[dict] = []

    def emit(kind: str, **fields) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    opening = dict(response, status="in_progress", output=[], usage=None)
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            emit("response.output_item.added", output_index=index, item=dict(item, status="in_progress", content=[]))
            (part,) = item["content"]
            emit("response.content_part.added", **where, content_index=0, part=dict(part, text=""))
            emit("response.output_text.delta", **where, content_index=0, delta=part["text"], logprobs=[])
            emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            emit("response.content_part.done", **where, content_index=0, part=part)
        else:  # function_call
            emit("response.output_item.added", output_index=index, item=dict(item, status="in_progress",
                                                                             arguments=""))
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            emit("response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)
    return events


def _messages(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for index, item in enumerate(_list(items, "input")):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise ResponsesRequestError(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise ResponsesRequestError(f"{where}: a message's role must be user, system, developer or "
                                            f"assistant, got {item.get('role')!r}", where)
            messages.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"), item.get("arguments"))):
                raise ResponsesRequestError(f"{where}: a function_call needs string call_id, name and arguments",
                                            where)
            previous = messages[-1] if messages else None
            if previous is not None and previous["role"] == "assistant" and previous.get("tool_calls"):
                previous["tool_calls"].append(call)  # parallel calls of one reply
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            continue  # the model writes no separate reasoning; an echoed item carries nothing to render
        else:
            raise ResponsesRequestError(f"{where}: input items of type {kind!r} are not supported (message, "
                                        "function_call, function_call_output)", where)
    return messages


def _text_format(text: Any) -> Any:
    """`text.format.type`, "text" where absent; the malformed field itself where it is not an object."""
    if text is None or (isinstance(text, dict) and text.get("format") is None):
        return "text"
    if not isinstance(text, dict) or not isinstance(text["format"], dict):
        return text if not isinstance(text, dict) else text["format"]
    return text["format"].get("type", "text")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = _list(content, f"{where}.content")
    if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
               and isinstance(p.get("text"), str) for p in parts):
        raise ResponsesRequestError(f"{where}.content: only text parts (input_text, output_text)", f"{where}.content")
    return "".join(p["text"] for p in parts)


def _chat_tool(tool: Any, index: int) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ResponsesRequestError(f"{where}: only function tools ({{type: function, name, parameters}})", where)
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ResponsesRequestError(f"tool_choice={choice!r}: 'none', 'auto', 'required' or {{type: function, "
                                        "name}}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # the chat path checks the strings


def _list(value: Any, field: str) -> list:
    if not isinstance(value, list):
        raise ResponsesRequestError(f"{field} must be a list", field)
    return value
