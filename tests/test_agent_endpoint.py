"""The agent endpoint, driven by the `openai` client against the live HTTP server.

A real AgentEndpoint (aiohttp) listens on loopback in a background event loop; the engine side of
each rollout's context is a scripted engine that answers with known token ids, so every test can
compare what a sample trains with exactly what the "engine" was given and said. The vLLM engine
path behind the same contexts is covered by the agent producer and job tests.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from actors.agent_endpoint import AgentEndpoint, listen_address
from tests.agent_support import bpe_chat_tokenizer
from vgbs_ray.agents import Generation, RequestTooLongError, RolloutContext, SamplingConfig, run_group
from vgbs_ray.agents.openai_agent import make_agent, report_reward
from vgbs_ray.errors import ConfigError

TOKEN = "t" * 32
TOKENIZER = bpe_chat_tokenizer()
END = TOKENIZER.eos_token_id


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class TextEngine:
    """Answers request k with `replies[k]` (text, encoded; an end-of-turn token unless it ends in '...')."""

    def __init__(self, replies: list[str], *, max_model_len: int = 4096):
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.max_model_len = max_model_len

    async def __call__(self, token_ids, sampling: SamplingConfig) -> Generation:
        if len(token_ids) + sampling.max_tokens > self.max_model_len:
            raise RequestTooLongError(f"{len(token_ids)} prompt tokens + max_tokens {sampling.max_tokens} > "
                                      f"max_model_len {self.max_model_len}")
        text = self.replies[len(self.prompts)]
        ids = encode(text[:-3]) if text.endswith("...") else encode(text) + [END]
        ids = ids[:sampling.max_tokens]
        stopped = ids[-1] == END or any(s in TOKENIZER.decode(ids) for s in sampling.stop)
        self.prompts.append(list(token_ids))
        self.outputs.append(ids)
        return Generation(prompt_token_ids=np.asarray(token_ids, dtype=np.int64),
                          response_token_ids=np.asarray(ids, dtype=np.int64),
                          response_log_probs=-0.25 * np.arange(1, len(ids) + 1, dtype=np.float32),
                          policy_version=5, finish_reason="stop" if stopped else "length", engine="text")


@pytest.fixture(scope="module")
def endpoint():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    served = AgentEndpoint(host=listen_address("loopback"), token=TOKEN, tool_parser="hermes")  # vLLM's, for `tools`
    asyncio.run_coroutine_threadsafe(served.start(), loop).result(timeout=30)
    served.loop = loop
    yield served
    asyncio.run_coroutine_threadsafe(served.stop(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)


def open_session(endpoint, engine, rollout_id="q1-r0", member=0):
    ctx = RolloutContext(rollout_id=rollout_id, group_id="q1", member=member, group_size=2, engine_generate=engine,
                         tokenizer=TOKENIZER, default_sampling=SamplingConfig(max_tokens=16, stop_token_ids=(END,)))
    return ctx, endpoint.open(ctx)


def client(session, api_key: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=session.base_url, api_key=api_key, max_retries=0, timeout=30)


def trained_runs(row: dict) -> list[list[int]]:
    """The sample's runs of consecutive mask-1 tokens (each one engine output)."""
    response = row["tokens"][len(row["tokens"]) - row["response_length"]:]
    runs, current = [], []
    for token, mask in zip(response.tolist(), row["loss_mask"].tolist()):
        if mask:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


def post(url: str, data: bytes, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_tool_using_chat_trains_the_engines_tokens_and_the_tools_reply_in_order(endpoint):
    engine = TextEngine(["calc(3,4)", "it is 7."])
    ctx, session = open_session(endpoint, engine)
    api = client(session)
    messages = [{"role": "user", "content": "what is 3 + 4?"}]
    first = api.chat.completions.create(model="policy", messages=messages, logprobs=True,
                                        extra_body={"return_token_ids": True})
    choice = first.choices[0]
    assert choice.message.content == "calc(3,4)" and choice.finish_reason == "stop"
    assert first.system_fingerprint == "policy-v5"
    assert choice.token_ids == engine.outputs[0]  # extension: the engine's ids, end of turn included
    assert [p.logprob for p in choice.logprobs.content] == pytest.approx([-0.25 * (i + 1) for i in range(
        len(engine.outputs[0]))])
    messages += [{"role": "assistant", "content": choice.message.content}, {"role": "tool", "content": "7"}]
    second = api.chat.completions.create(model="policy", messages=messages)
    assert second.choices[0].message.content == "it is 7."

    (row,) = ctx.samples()  # one conversation that extended itself: one sample
    prompt = encode(TOKENIZER.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True))
    tool_suffix = engine.prompts[1][len(prompt) + len(engine.outputs[0]):]
    assert TOKENIZER.decode(tool_suffix) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    assert row["tokens"].tolist() == prompt + engine.outputs[0] + tool_suffix + engine.outputs[1]
    assert trained_runs(row) == engine.outputs  # mask 1 exactly on the engine's tokens
    assert row["rollout_log_probs"][row["loss_mask"] == 1].tolist() == pytest.approx(
        [-0.25 * (i + 1) for out in engine.outputs for i in range(len(out))])
    assert second.usage.prompt_tokens == len(engine.prompts[1])
    endpoint.close(session)


def test_a_stop_string_is_cut_from_the_reply_and_the_echoed_history_still_extends_the_sample(endpoint):
    engine = TextEngine(["<think>3 plus 4</think> it is 7...", "done."])
    ctx, session = open_session(endpoint, engine)
    api = client(session)
    messages = [{"role": "user", "content": "what is 3 + 4?"}]
    reply = api.chat.completions.create(model="policy", messages=messages, stop=["</think>"])
    assert reply.choices[0].message.content == "<think>3 plus 4" and reply.choices[0].finish_reason == "stop"
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
    api.chat.completions.create(model="policy", messages=messages)
    (row,) = ctx.samples()  # the cut reply, sent back, is rendered with what the engine generated
    assert trained_runs(row) == engine.outputs
    endpoint.close(session)


def test_n_choices_train_each_generated_token_once_and_a_compaction_is_a_second_sample(endpoint):
    engine = TextEngine(["calc(3,4)", "it is 7.", "seven.", "7"])
    ctx, session = open_session(endpoint, engine)
    api = client(session)
    messages = [{"role": "user", "content": "what is 3 + 4?"}]
    two = api.chat.completions.create(model="policy", messages=messages, n=2, seed=11)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == sum(
        len(o) for o in engine.outputs)
    # Continue the second choice: its fork holds it, so no new sample starts.
    messages += [{"role": "assistant", "content": two.choices[1].message.content}, {"role": "tool", "content": "7"}]
    api.chat.completions.create(model="policy", messages=messages)
    # A compaction: the agent rewrites its history; the rendering no longer extends any branch.
    api.chat.completions.create(model="policy", messages=[{"role": "user", "content": "3 + 4 = ? (summary)"}])

    rows = ctx.samples()
    assert len(rows) == 3  # choice 0, choice 1 + its continuation, the compacted conversation
    trained = [run for row in rows for run in trained_runs(row)]
    assert sorted(map(tuple, trained)) == sorted(map(tuple, engine.outputs))  # every output trained once
    assert sum(int(row["loss_mask"].sum()) for row in rows) == sum(len(o) for o in engine.outputs)
    endpoint.close(session)


def test_token_id_completions_are_token_in_token_out(endpoint):
    engine = TextEngine(["calc(3,4)", "7"])
    ctx, session = open_session(endpoint, engine)
    api = client(session)
    prompt = encode("<|im_start|>user\nwhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    first = api.completions.create(model="policy", prompt=prompt, max_tokens=8, logprobs=0,
                                   extra_body={"return_token_ids": True})
    assert first.choices[0].token_ids == engine.outputs[0] and len(first.choices[0].logprobs.token_logprobs) == len(
        engine.outputs[0])
    tool = encode("\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
    api.completions.create(model="policy", prompt=prompt + engine.outputs[0] + tool, max_tokens=8)
    (row,) = ctx.samples()
    assert row["tokens"].tolist() == prompt + engine.outputs[0] + tool + engine.outputs[1]
    assert trained_runs(row) == engine.outputs
    endpoint.close(session)


def test_refusals_name_the_problem_and_leave_other_sessions_alone(endpoint):
    engine = TextEngine(["fine.", "still fine."], max_model_len=64)
    bystander_ctx, bystander = open_session(endpoint, engine, "q2-r0")
    ctx, session = open_session(endpoint, TextEngine([], max_model_len=64), "q2-r1")
    api = client(session)
    question = [{"role": "user", "content": "hi"}]
    client(bystander).chat.completions.create(model="policy", messages=question)

    with pytest.raises(openai.PermissionDeniedError):  # a wrong token: 403
        client(session, api_key="w" * 32).chat.completions.create(model="policy", messages=question)
    status, body = post(f"{session.base_url}/chat/completions", b"{}", {})  # no token: 401
    assert status == 401 and "Authorization" in body["error"]["message"]
    status, body = post(f"{session.base_url}/chat/completions", b"{not json",
                        {"Authorization": f"Bearer {TOKEN}"})
    assert status == 400 and "not JSON" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="policy", messages=question, frequency_penalty=0.5)
    assert refused.value.body["param"] == "frequency_penalty"
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="policy", messages=question, extra_body={"best_of_luck": 1})
    assert "best_of_luck" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="policy", messages=question, max_tokens=100)  # 64-token engine
    assert refused.value.body["code"] == "context_length_exceeded"
    assert ctx.endpoint.rollout.failure[0] == "too_long"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=session.base_url.replace("q2-r1", "nobody"), api_key=TOKEN,
                      max_retries=0).chat.completions.create(model="policy", messages=question)

    # The bystander's conversation goes on, still one sample.
    client(bystander).chat.completions.create(model="policy", messages=question + [
        {"role": "assistant", "content": "fine."}, {"role": "user", "content": "sure?"}])
    (row,) = bystander_ctx.samples()
    assert trained_runs(row) == engine.outputs and not bystander_ctx.endpoint.rollout.failure
    endpoint.close(bystander)
    endpoint.close(session)
    with pytest.raises(openai.NotFoundError):  # an ended session
        client(bystander).chat.completions.create(model="policy", messages=question)


def test_the_reward_report_ends_the_rollout_once(endpoint):
    _, session = open_session(endpoint, TextEngine([]), "q3-r0")
    assert report_reward(session.base_url, TOKEN, 0.5, {"turns": 2})["reward"] == 0.5
    result = asyncio.run_coroutine_threadsafe(session.rollout.result(), endpoint.loop).result(timeout=30)
    assert result.reward == 0.5 and result.metrics == {"turns": 2.0}
    status, body = post(session.reward_url, b'{"reward": 1.0}', {"Authorization": f"Bearer {TOKEN}"})
    assert status == 409 and "already" in body["error"]["message"]
    status, body = post(session.reward_url.replace("q3-r0", "q3-r9"), b'{"reward": 1.0}',
                        {"Authorization": f"Bearer {TOKEN}"})
    assert status == 404
    endpoint.close(session)


def sync_openai_run(row: dict, base_url: str, api_key: str, report: bool = False):
    """An ordinary OpenAI-client function, as a user writes it (sync, blocking client)."""
    api = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = api.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["question"]}])
    reward = 1.0 if "7" in reply.choices[0].message.content else 0.0
    if report:
        report_reward(base_url, api_key, reward, {"calls": 1})
        return None
    return reward


def test_an_openai_client_function_runs_as_a_group_through_the_endpoint(endpoint):
    for report, replies in ((False, ["it is 7.", "no idea."]), (True, ["7!", "eight."])):
        agent = make_agent(f"{__name__}:sync_openai_run", {"report": report})
        engine = TextEngine(replies)
        contexts = [open_session(endpoint, engine, f"q4-r{m}", member=m)[0] for m in range(2)]
        future = asyncio.run_coroutine_threadsafe(run_group(agent, {"question": "3 + 4?"}, contexts, timeout_s=60),
                                                  endpoint.loop)
        outcome = future.result(timeout=60)
        for ctx in contexts:
            endpoint.close(ctx.endpoint)
        assert outcome.failure is None
        assert sorted(outcome.rewards.values()) == [0.0, 1.0]  # one member's reply holds a 7
        assert len(outcome.samples) == 2 and {s["rollout_id"] for s in outcome.samples} == {"q4-r0", "q4-r1"}
        if report:
            assert outcome.metrics["calls"] == 2.0


def test_the_endpoint_refuses_every_interface():
    with pytest.raises(ConfigError, match="never listens on every interface"):
        listen_address("0.0.0.0")


def test_openai_sampling_fields_map_onto_the_engines_sampling_and_bad_values_name_the_field():
    from vgbs_ray.agents.openai_protocol import ProtocolError, parse_sampling

    default = SamplingConfig(max_tokens=16, temperature=1.0, seed=3, stop_token_ids=(END,))
    sampling, n = parse_sampling({"max_tokens": 5, "temperature": 0.0, "top_p": 0.5, "seed": 9, "stop": "</a>",
                                  "n": 3}, default)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed, sampling.stop, n) == (
        5, 0.0, 0.5, 9, ("</a>",), 3)
    assert sampling.stop_token_ids == (END,)  # the tokenizer's end of turn still ends a reply
    assert parse_sampling({"max_completion_tokens": 7}, default)[0].max_tokens == 7
    assert parse_sampling({}, default) == (default, 1)
    for field, value in (("max_tokens", 0), ("temperature", 3.0), ("top_p", 0), ("seed", -1), ("n", 17),
                         ("stop", ["a", "b", "c", "d", "e"]), ("n", True)):
        with pytest.raises(ProtocolError) as refused:
            parse_sampling({field: value}, default)
        assert refused.value.param == field and refused.value.status == 400
