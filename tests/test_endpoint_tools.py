"""Tool calls and streaming through the agent endpoint, driven by the `openai` client against the live server.

The engine is scripted (tests/test_agent_endpoint.py's TextEngine: known replies, recorded prompts and outputs),
the parser is vLLM's `hermes`, so each test compares what a sample trains with exactly what the "engine" was
given and said: the engine's own tokens of a call are kept (never re-rendered from the parsed JSON), only the
tool results and the template's separators are new context (mask 0).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import openai
import pytest

from tests.test_agent_endpoint import (END, TOKEN, TOKENIZER, TextEngine, client, encode, endpoint,  # noqa: F401
                                      post, trained_runs)
from vgbs_ray.agents import AgentResult, RolloutContext, SamplingConfig, run_group
from vgbs_ray.agents.openai_protocol import stream_chunks
from vgbs_ray.agents.openai_agent import report_reward

CALC = {"type": "function", "function": {"name": "calc", "description": "adds two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = '<tool_call>\n{"name": "calc", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
QUESTION = [{"role": "user", "content": "what is 3 + 4?"}]


def open_session(endpoint, engine, rollout_id):
    ctx = RolloutContext(rollout_id=rollout_id, group_id=rollout_id.split("-")[0], member=0, group_size=2,
                         engine_generate=engine, tokenizer=TOKENIZER,
                         default_sampling=SamplingConfig(max_tokens=128, stop_token_ids=(END,)))
    return ctx, endpoint.open(ctx)


def counted(endpoint, outcome: str) -> int:
    return endpoint.outcomes.get(outcome, 0)


def test_a_parsed_call_and_its_result_extend_the_sample_with_the_engines_own_tokens(endpoint):
    engine = TextEngine([CALL, "it is 7."])
    ctx, session = open_session(endpoint, engine, "t1-r0")
    api = client(session)
    before = counted(endpoint, "tool_calls/called")
    raw = api.chat.completions.with_raw_response.create(model="policy", messages=QUESTION, tools=[CALC])
    assert raw.headers["X-Rollout-Id"] == session.rollout_id == "t1-r0"  # what an outside agent trains as
    first = raw.parse()
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calc" and json.loads(call.function.arguments) == {
        "a": 3, "b": 4}
    assert counted(endpoint, "tool_calls/called") == before + 1
    # What an OpenAI-client agent sends back: the assistant message as returned, then the tool's result.
    messages = QUESTION + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    second = api.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    assert second.choices[0].message.content == "it is 7." and second.choices[0].finish_reason == "stop"

    (row,) = ctx.samples()  # one sample: the second request extended the first
    prompt = encode(TOKENIZER.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True))
    suffix = engine.prompts[1][len(prompt) + len(engine.outputs[0]):]
    assert TOKENIZER.decode(suffix) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    assert row["tokens"].tolist() == prompt + engine.outputs[0] + suffix + engine.outputs[1]
    assert trained_runs(row) == engine.outputs  # mask 1 exactly on the engine's tokens, the call's included
    endpoint.close(session)


def conversation(api, *, stream: bool) -> tuple[list, list]:
    """Two turns with a call between them; returns (each turn's (content, calls, finish_reason), the chunks)."""
    turns, chunks, messages = [], [], list(QUESTION)
    for _ in range(2):
        if stream:
            pieces = list(api.chat.completions.create(model="policy", messages=messages, tools=[CALC], stream=True,
                                                      stream_options={"include_usage": True}))
            chunks.append(pieces)
            content = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
            calls = [c for p in pieces if p.choices for c in (p.choices[0].delta.tool_calls or [])]
            finish = [p.choices[0].finish_reason for p in pieces if p.choices and p.choices[0].finish_reason]
            calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                  "arguments": c.function.arguments}} for c in calls]
            turns.append((content or None, calls, finish[0]))
        else:
            choice = api.chat.completions.create(model="policy", messages=messages, tools=[CALC]).choices[0]
            calls = [c.model_dump() for c in choice.message.tool_calls or []]
            turns.append((choice.message.content, calls, choice.finish_reason))
        content, calls, _ = turns[-1]
        messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": "7"} for c in calls]
    return turns, chunks


def test_streaming_answers_openai_chunks_and_trains_the_same_tokens(endpoint):
    plain_ctx, plain = open_session(endpoint, TextEngine([CALL, "it is 7."]), "t2-r0")
    streamed_ctx, streamed = open_session(endpoint, TextEngine([CALL, "it is 7."]), "t2-r1")
    plain_turns, _ = conversation(client(plain), stream=False)
    stream_turns, chunks = conversation(client(streamed), stream=True)
    strip = [(content, [c["function"] for c in calls], finish) for content, calls, finish in plain_turns]
    assert strip == [(content, [c["function"] for c in calls], finish) for content, calls, finish in stream_turns]
    assert strip[0][2] == "tool_calls" and strip[1] == ("it is 7.", [], "stop")
    first = chunks[0]
    assert first[0].choices[0].delta.role == "assistant" and first[-1].choices == []  # the usage chunk last
    assert first[-1].usage.completion_tokens > 0 and all(p.object == "chat.completion.chunk" for p in first)
    (plain_row,), (streamed_row,) = plain_ctx.samples(), streamed_ctx.samples()
    for key in ("tokens", "loss_mask", "rollout_log_probs"):
        assert plain_row[key].tolist() == streamed_row[key].tolist()
    endpoint.close(plain)
    endpoint.close(streamed)


def test_a_client_gone_mid_stream_leaves_the_session_consistent(endpoint):
    import urllib.request

    engine = TextEngine(["it is 7.", "yes."])
    ctx, session = open_session(endpoint, engine, "t2-r2")
    body = json.dumps({"model": "policy", "messages": QUESTION, "stream": True}).encode()
    request = urllib.request.Request(f"{session.base_url}/chat/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        answer.readline()  # one line of the stream, then the client goes
    client(session).chat.completions.create(model="policy", messages=QUESTION + [
        {"role": "assistant", "content": "it is 7."}, {"role": "user", "content": "sure?"}])
    (row,) = ctx.samples()  # what the engine generated was recorded; the next call extended it
    assert trained_runs(row) == engine.outputs
    endpoint.close(session)


@pytest.mark.parametrize("reply, tool_choice, parallel, outcome, returns_call", [
    ("it is 7.", "required", True, "required_unmet", False),
    ("it is 7.", {"type": "function", "function": {"name": "calc"}}, True, "required_unmet", False),
    (CALL, "none", True, None, False),
    (CALL + CALL.replace("3", "5"), "auto", False, "parallel_cut", True),
    ('<tool_call>\n{"name": "calc", "arguments": {"a": 3\n</tool_call>', "auto", True, "unparseable", False),
    ('<tool_call>\n{"name": "divide", "arguments": {"a": 3, "b": 4}}\n</tool_call>', "auto", True, "unknown_function",
     False),
    ('<tool_call>\n{"name": "calc", "arguments": {"a": "three"}}\n</tool_call>', "required", True, "bad_arguments",
     False),
])
def test_tool_choice_and_bad_calls_answer_text_and_count_never_a_500(endpoint, reply, tool_choice, parallel, outcome,
                                                                      returns_call):
    ctx, session = open_session(endpoint, TextEngine([reply]), "t3-r0")
    before = counted(endpoint, f"tool_calls/{outcome}")
    answer = client(session).chat.completions.create(model="policy", messages=QUESTION, tools=[CALC],
                                                     tool_choice=tool_choice, parallel_tool_calls=parallel)
    choice = answer.choices[0]
    if returns_call:
        assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
    else:
        assert choice.message.tool_calls is None and choice.message.content == reply and choice.finish_reason == "stop"
    if outcome is not None:
        assert counted(endpoint, f"tool_calls/{outcome}") == before + 1
    endpoint.close(session)


@pytest.mark.parametrize("fields, param", [
    (dict(tools={"calc": CALC}), "tools"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[CALC], tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(stream=True, n=2), "n"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
])
def test_malformed_tool_and_stream_fields_are_400s_naming_the_field(endpoint, fields, param):
    ctx, session = open_session(endpoint, TextEngine([]), "t4-r0")
    status, body = post(f"{session.base_url}/chat/completions",
                        json.dumps({"model": "policy", "messages": QUESTION, **fields}).encode(),
                        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert status == 400 and body["error"]["param"] == param, body
    if param == "n":
        assert "stream" in body["error"]["message"]
    endpoint.close(session)


def test_the_responses_api_is_the_chat_path_a_call_in_its_items_trains_the_engines_own_tokens(endpoint):
    """/v1/responses with the plain `openai` client: the call comes back as a `function_call` item, its output goes
    back as a `function_call_output` item, and the sample is the same as over chat completions: the engine's own
    tokens of the call, the tool result's rendering as context, one sample."""
    engine = TextEngine([CALL, "it is 7.", "it is 7."])
    ctx, session = open_session(endpoint, engine, "t7-r0")
    api = client(session)
    tools = [{"type": "function", "name": "calc", "description": "adds two integers",
              "parameters": CALC["function"]["parameters"]}]
    first = api.responses.create(model="policy", input="what is 3 + 4?", instructions="Use calc.", tools=tools)
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "calc", {"a": 3, "b": 4})
    second = api.responses.create(model="policy", instructions="Use calc.", tools=tools, input=[
        {"role": "user", "content": "what is 3 + 4?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "7"}])
    assert second.output_text == "it is 7." and second.status == "completed"
    streamed = list(api.responses.create(model="policy", instructions="Use calc.", tools=tools, stream=True, input=[
        {"role": "user", "content": "what is 3 + 4?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "7"}]))
    assert [e.type for e in streamed][:2] == ["response.created", "response.in_progress"]
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output_text == "it is 7."
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == "it is 7."
    row, again = ctx.samples()  # the streamed request sent the same history again: a new sample of the rollout
    tool_result = engine.prompts[1][len(engine.prompts[0]) + len(engine.outputs[0]):]
    assert row["tokens"].tolist() == engine.prompts[0] + engine.outputs[0] + tool_result + engine.outputs[1]
    assert trained_runs(row) == engine.outputs[:2]
    assert again["tokens"].tolist() == engine.prompts[1] + engine.outputs[2] and engine.prompts[2] == engine.prompts[1]
    endpoint.close(session)


@pytest.mark.parametrize("fields, param", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {}}}), "text"),
    (dict(input=[{"type": "web_search_call"}]), "input[0]"),
    (dict(tools=[{"type": "web_search"}]), "tools[0]"),
    (dict(logit_bias={"5": 10}), "logit_bias"),
])
def test_responses_fields_the_endpoint_cannot_honour_are_400s_naming_the_field(endpoint, fields, param):
    ctx, session = open_session(endpoint, TextEngine([]), "t8-r0")
    status, body = post(f"{session.base_url}/responses",
                        json.dumps({"model": "policy", "input": "hi", **fields}).encode(),
                        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert status == 400 and body["error"]["param"] == param, body
    endpoint.close(session)


def test_a_tool_result_for_no_call_of_the_session_is_a_400(endpoint):
    ctx, session = open_session(endpoint, TextEngine([]), "t5-r0")
    with pytest.raises(openai.BadRequestError) as refused:
        client(session).chat.completions.create(model="policy", tools=[CALC], messages=QUESTION + [
            {"role": "tool", "tool_call_id": "call_nobody", "content": "7"}])
    assert refused.value.body["param"] == "messages[1].tool_call_id"
    endpoint.close(session)


def test_a_call_the_template_renders_differently_starts_a_counted_new_sample(endpoint):
    """An assistant message with calls this session never returned (an agent's own history) is rendered by the
    chat template; where that does not extend the held ids, the documented restart happens: a new sample."""
    engine = TextEngine([CALL, "it is 7."])
    ctx, session = open_session(endpoint, engine, "t6-r0")
    api = client(session)
    api.chat.completions.create(model="policy", messages=QUESTION, tools=[CALC])
    before = counted(endpoint, "new_sample")
    edited = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_mine", "type": "function", "function": {"name": "calc", "arguments": '{"a": 3, "b": 4}'}}]}
    api.chat.completions.create(model="policy", tools=[CALC], messages=QUESTION + [
        edited, {"role": "tool", "tool_call_id": "call_mine", "content": "7"}])
    assert counted(endpoint, "new_sample") == before + 1
    assert [trained_runs(row) for row in ctx.samples()] == [[engine.outputs[0]], [engine.outputs[1]]]
    endpoint.close(session)


def test_requests_to_an_ended_session_are_counted_apart_from_refused_ones(endpoint):
    _, session = open_session(endpoint, TextEngine([]), "t7-r0")
    report_reward(session.base_url, TOKEN, 1.0)
    endpoint.close(session)
    refused, after_end = endpoint.refused, endpoint.after_end
    status, body = post(session.reward_url, b'{"reward": 0.0}', {"Authorization": f"Bearer {TOKEN}"})
    assert status == 409 and "ended" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="has ended"):  # an agent still running after its group ended
        client(session).chat.completions.create(model="policy", messages=QUESTION)
    assert (endpoint.refused, endpoint.after_end) == (refused, after_end + 2)
    status, _ = post(session.reward_url.replace("t7-r0", "t7-r9"), b'{"reward": 0.0}',
                     {"Authorization": f"Bearer {TOKEN}"})
    assert status == 404 and endpoint.refused == refused + 1  # a session that never existed: a client's mistake


def test_the_chunks_of_a_completion_carry_text_then_the_finish_reason():
    answer = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "policy",
              "system_fingerprint": "policy-v1", "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
              "choices": [{"index": 0, "text": "42", "finish_reason": "stop", "logprobs": None}]}
    chunks = stream_chunks(answer)
    assert [c["choices"][0]["text"] for c in chunks] == ["42", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]


def test_a_metric_some_rollouts_omit_is_averaged_over_those_that_report_it():
    async def agent(row, ctx: RolloutContext):
        ctx.add_sample([1, 2, 3], [1])
        return AgentResult(reward=float(ctx.member), metrics={"turns": 2.0} if ctx.member == 0 else {})

    contexts = [RolloutContext(rollout_id=f"m-r{m}", group_id="m", member=m, group_size=3, engine_generate=None)
                for m in range(3)]
    outcome = asyncio.run(run_group(agent, {}, contexts, timeout_s=10))
    assert outcome.metrics["turns"] == 2.0 and outcome.metric_counts["turns"] == 1
    assert outcome.metric_counts["num_samples"] == 3


HUNG_RUN = textwrap.dedent("""
    import asyncio, threading
    from vgbs_ray.agents.openai_agent import make_agent
    from vgbs_ray.agents.openai_protocol import EndpointRollout

    def run(row, base_url, api_key):
        threading.Event().wait()  # a sync run that never returns

    class Session:
        base_url, api_key = "http://127.0.0.1:9/v1", "x"

    class Context:
        endpoint = Session()

    async def main():
        Session.rollout = type("R", (), {"result": lambda self: asyncio.sleep(3600)})()
        agent = make_agent("__main__:run")
        try:
            await asyncio.wait_for(agent({}, Context()), timeout=0.5)
        except asyncio.TimeoutError:
            print("timed out", flush=True)

    asyncio.run(main())
""")


def test_a_sync_run_that_never_returns_does_not_hold_the_process_at_exit(tmp_path):
    """The hung-thread leak: a ThreadPoolExecutor's exit hook joined the hung thread forever. The process exits."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG_RUN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert done.returncode == 0 and "timed out" in done.stdout, done.stderr


# -- agent frameworks, unchanged, against the endpoint (the examples' own code) ----------------------------------


@pytest.mark.parametrize("run, kwargs", [
    ("examples.agents_sdk_agent:run", {"streaming": False}), ("examples.agents_sdk_agent:run", {"streaming": True}),
    ("examples.agents_sdk_agent:run", {"api": "responses"}),  # the SDK's default model: /v1/responses
    ("examples.agents_sdk_agent:run", {"api": "responses", "streaming": True}),
    ("examples.langgraph_agent:run", {"streaming": False}), ("examples.langgraph_agent:run", {"streaming": True})])
def test_a_framework_agent_calls_the_tool_and_trains_exactly_what_the_engine_said(endpoint, run, kwargs):
    from vgbs_ray.agents.openai_agent import make_agent

    engine = TextEngine(['<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>', "It is 7."])
    ctx, _ = open_session(endpoint, engine, "f1-r0")
    agent = make_agent(run, kwargs)
    future = asyncio.run_coroutine_threadsafe(agent({"a": 3, "b": 4}, ctx), endpoint.loop)
    assert future.result(timeout=60) == 1.0  # the framework ran the tool on our parsed call, then answered
    assert len(engine.prompts) == 2
    (row,) = ctx.samples()  # the framework's second request extended the first: one sample
    first_prompt = engine.prompts[0]
    tool_result = engine.prompts[1][len(first_prompt) + len(engine.outputs[0]):]
    assert "7" in TOKENIZER.decode(tool_result) and "<|im_start|>assistant" in TOKENIZER.decode(tool_result)
    assert row["tokens"].tolist() == first_prompt + engine.outputs[0] + tool_result + engine.outputs[1]
    assert trained_runs(row) == engine.outputs  # mask 1 exactly on the engine's tokens
    endpoint.close(ctx.endpoint)


def test_a_message_the_template_drops_is_reported_once_per_role(endpoint, caplog):
    from tests.agent_support import bpe_chat_tokenizer

    users_only = ("{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
                  "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ctx = RolloutContext(rollout_id="d1-r0", group_id="d1", member=0, group_size=1, engine_generate=TextEngine(
        ["ok.", "ok."]), tokenizer=bpe_chat_tokenizer(users_only), default_sampling=SamplingConfig(
        max_tokens=16, stop_token_ids=(END,)))
    session = endpoint.open(ctx)
    before = counted(endpoint, "dropped_message/system")
    messages = [{"role": "system", "content": "be brief"}] + QUESTION
    with caplog.at_level("WARNING"):
        for _ in range(2):
            client(session).chat.completions.create(model="policy", messages=messages)
    assert counted(endpoint, "dropped_message/system") == before + 1  # once per session and role
    assert sum("dropped a 'system' message" in record.message for record in caplog.records) == 1
    endpoint.close(session)


def test_the_demo_template_renders_every_role():
    from vgbs_ray.agents.session import dropped_roles
    from vgbs_ray.checkpoint_files import load_tokenizer

    tokenizer = load_tokenizer("examples/digit_tokenizer")
    messages = [{"role": "system", "content": "3"}, {"role": "user", "content": "1 2"},
                {"role": "assistant", "content": "4"}, {"role": "tool", "content": "higher"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert dropped_roles(messages, text) == []
    assert text == "<|user|> 3 <|user|> 1 2 <|assistant|> 4 <|end|> <|user|> higher <|assistant|> "
