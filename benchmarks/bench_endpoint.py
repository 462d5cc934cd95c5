"""The agent endpoint's costs, side by side in one run:

  round trip  milliseconds per request, p50 and p99, through the endpoint (the `openai` AsyncOpenAI
              client -> HTTP -> /v1/completions with a token-id prompt -> the rollout's session ->
              the engine pool) against the same request as a direct `RolloutContext.generate` on the
              same engine pool and prompts; one request at a time, so the difference is the endpoint's.
  sessions    open sessions one endpoint holds: SESSIONS sessions opened together, each sends TURNS
              requests concurrently with all the others (a token-in/token-out multi-turn), counted
              errors and the slowest request.
  added       the endpoint's added latency over a direct `ChatSession.generate`, for plain chat, chat with
              `tools` (vLLM's hermes parser on every reply) and streamed chat, at 1, 64 and 1,000 concurrent
              sessions: per request, its latency minus the time it spent awaiting the engine pool (measured
              around the engine call, so the engine's batching and queueing drop out), p50 over the requests;
              "added" is that figure through the endpoint minus the same for the direct session. The HTTP
              client (httpx) runs in the same process and event loop, so its own cost is counted in.
Tiny random Llama (vocabulary 400, the byte-level BPE chat tokenizer of tests/agent_support.py), 1 vLLM
engine on 1 core, the endpoint in this process (as in a producer).

Run: .venv/bin/python benchmarks/bench_endpoint.py
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from vgbs_ray.agents import RolloutContext, SamplingConfig  # noqa: E402

CALLS = 200
SESSIONS, TURNS = 1000, 2
PROMPT_TOKENS, NEW_TOKENS = 16, 4
TOKEN = "bench-token-0123456789abcdef"


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def measure(client) -> None:
    import httpx
    import openai

    from actors.agent_endpoint import AgentEndpoint

    sampling = SamplingConfig(max_tokens=NEW_TOKENS, temperature=1.0)
    endpoint = AgentEndpoint(host="127.0.0.1", token=TOKEN)
    await endpoint.start()

    def context(name: str) -> RolloutContext:
        return RolloutContext(rollout_id=name, group_id=name, member=0, group_size=1, engine_generate=client.generate1,
                              default_sampling=sampling)

    prompts = [[(7 * i + k) % 90 + 1 for k in range(PROMPT_TOKENS)] for i in range(CALLS)]
    direct, through = [], []
    for round_ in range(2):  # the first round warms both paths up; the second is reported
        direct.clear()
        through.clear()
        for i, prompt in enumerate(prompts):
            started = time.perf_counter()
            await context(f"d{round_}-{i}").generate(prompt, sampling)
            direct.append(time.perf_counter() - started)
            session = endpoint.open(context(f"e{round_}-{i}"))
            api = openai.AsyncOpenAI(base_url=session.base_url, api_key=TOKEN, max_retries=0)
            started = time.perf_counter()
            await api.completions.create(model="policy", prompt=prompt, max_tokens=NEW_TOKENS)
            through.append(time.perf_counter() - started)
            endpoint.close(session)
            await api.close()
    print(f"round trip, ms per request ({CALLS} requests, {PROMPT_TOKENS} prompt + {NEW_TOKENS} new tokens):")
    print(f"{'':>14} {'p50':>8} {'p99':>8}")
    for name, values in (("direct", direct), ("endpoint", through)):
        print(f"{name:>14} {1e3 * percentile(values, 0.5):>8.2f} {1e3 * percentile(values, 0.99):>8.2f}")
    print(f"{'ratio':>14} {percentile(through, 0.5) / percentile(direct, 0.5):>8.2f} "
          f"{percentile(through, 0.99) / percentile(direct, 0.99):>8.2f}")

    sessions = [endpoint.open(context(f"s{i}")) for i in range(SESSIONS)]
    errors, slowest = [], 0.0
    limits = httpx.Limits(max_connections=SESSIONS, max_keepalive_connections=SESSIONS)
    async with httpx.AsyncClient(limits=limits, timeout=600, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        async def converse(i: int, session) -> None:
            nonlocal slowest
            prompt = [(i + k) % 90 + 1 for k in range(PROMPT_TOKENS)]
            for _ in range(TURNS):
                started = time.perf_counter()
                answer = await http.post(f"{session.base_url}/completions",
                                         json={"prompt": prompt, "max_tokens": NEW_TOKENS, "return_token_ids": True})
                slowest = max(slowest, time.perf_counter() - started)
                if answer.status_code != 200:
                    errors.append(answer.status_code)
                    return
                prompt = prompt + answer.json()["choices"][0]["token_ids"] + [5]

        started = time.perf_counter()
        await asyncio.gather(*[converse(i, s) for i, s in enumerate(sessions)])
        elapsed = time.perf_counter() - started
    held = endpoint.open_sessions
    one_sample = sum(len(s.rollout.context.samples()) == 1 for s in sessions)
    print(f"\nsessions: {held} open at once, {SESSIONS * TURNS} requests ({TURNS} turns each) in {elapsed:.1f} s; "
          f"errors {len(errors)}; slowest request {slowest:.1f} s; sessions with one token-exact sample "
          f"{one_sample}/{SESSIONS}")
    await endpoint.stop()
    await added_latency(client)


CALC = {"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
LEVELS = (1, 64, 1000)
SEQUENTIAL = 200
"""Requests at concurrency 1 (one after another); at the other levels, one request per session, all at once."""


async def added_latency(client) -> None:
    import httpx

    from actors.agent_endpoint import AgentEndpoint
    from tests.agent_support import bpe_chat_tokenizer

    tokenizer = bpe_chat_tokenizer()
    sampling = SamplingConfig(max_tokens=NEW_TOKENS, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    endpoint = AgentEndpoint(host="127.0.0.1", token=TOKEN, tool_parser="hermes")
    await endpoint.start()
    engine_s: dict[str, float] = {}

    def context(name: str) -> RolloutContext:
        async def timed(token_ids, request_sampling):
            started = time.perf_counter()
            try:
                return await client.generate1(token_ids, request_sampling)
            finally:
                engine_s[name] = engine_s.get(name, 0.0) + time.perf_counter() - started
        return RolloutContext(rollout_id=name, group_id=name, member=0, group_size=1, engine_generate=timed,
                              tokenizer=tokenizer, default_sampling=sampling)

    def messages(i: int) -> list[dict]:
        return [{"role": "user", "content": f"what is {i % 20} + {(7 * i) % 20}?"}]

    limits = httpx.Limits(max_connections=max(LEVELS), max_keepalive_connections=max(LEVELS))
    async with httpx.AsyncClient(limits=limits, timeout=600, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        async def one(mode: str, name: str, i: int) -> float:
            ctx = context(name)
            started = time.perf_counter()
            if mode == "direct":
                await ctx.chat(messages(i)).generate()
            else:
                session = endpoint.open(ctx)
                body = {"model": "policy", "messages": messages(i), "max_tokens": NEW_TOKENS}
                if mode == "tools":
                    body["tools"] = [CALC]
                if mode == "stream":
                    body["stream"] = True
                answer = await http.post(f"{session.base_url}/chat/completions", json=body)
                answer.read()
                assert answer.status_code == 200, answer.text
                endpoint.close(session)
            return time.perf_counter() - started - engine_s[name]

        await asyncio.gather(*[one(mode, f"warm-{mode}-{i}", i) for mode in ("direct", "plain", "tools", "stream")
                               for i in range(8)])  # vLLM's parser imported, connections open
        print(f"\nadded latency over a direct ChatSession.generate, ms (p50 of latency minus engine time; "
              f"{NEW_TOKENS} new tokens):")
        print(f"{'sessions':>9} {'direct':>8} {'plain':>8} {'tools':>8} {'stream':>8}   added: {'plain':>6} "
              f"{'tools':>6} {'stream':>6}")
        for level in LEVELS:
            p50 = {}
            for mode in ("direct", "plain", "tools", "stream"):
                if level == 1:
                    residuals = [await one(mode, f"{mode}-{level}-{i}", i) for i in range(SEQUENTIAL)]
                else:
                    residuals = await asyncio.gather(*[one(mode, f"{mode}-{level}-{i}", i) for i in range(level)])
                p50[mode] = 1e3 * percentile(list(residuals), 0.5)
            added = {mode: p50[mode] - p50["direct"] for mode in ("plain", "tools", "stream")}
            print(f"{level:>9} {p50['direct']:>8.2f} {p50['plain']:>8.2f} {p50['tools']:>8.2f} {p50['stream']:>8.2f}"
                  f"          {added['plain']:>6.2f} {added['tools']:>6.2f} {added['stream']:>6.2f}", flush=True)
    print(f"tool-call outcomes over the run: {dict(sorted(endpoint.outcomes.items()))}")
    await endpoint.stop()


class PoolClient:
    """`engine_generate` for a RolloutContext: one request per call to the engine pool."""

    def __init__(self, pool):
        self.pool = pool

    async def generate1(self, token_ids, sampling):
        (generation,) = await self.pool.generate([list(token_ids)], [sampling])
        return generation


def main() -> None:
    import ray

    from actors.rollout_engine import EngineConfig, RolloutEnginePool
    from tests.hf_support import tiny_hf_llama

    model_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench_endpoint_"))
    tiny_hf_llama(model_dir, vocab_size=400)  # the chat tokenizer's 400 tokens
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 << 20,
             log_to_driver=False)
    engines = RolloutEnginePool(EngineConfig(max_model_len=128, max_num_seqs=256), str(model_dir))
    try:
        asyncio.run(measure(PoolClient(engines.client())))
    finally:
        engines.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
