"""The agent endpoint's costs, side by side in one run:

  round trip  milliseconds per request, p50 and p99, through the endpoint (the `openai` AsyncOpenAI
              client -> HTTP -> /v1/completions with a token-id prompt -> the rollout's session ->
              the engine pool) against the same request as a direct `RolloutContext.generate` on the
              same engine pool and prompts; one request at a time, so the difference is the endpoint's.
  sessions    open sessions one endpoint holds: SESSIONS sessions opened together, each sends TURNS
              requests concurrently with all the others (a token-in/token-out multi-turn), counted
              errors and the slowest request.
Tiny random Llama, 1 vLLM engine on 1 core, the endpoint in this process (as in a producer).

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
    tiny_hf_llama(model_dir)
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 << 20,
             log_to_driver=False)
    engines = RolloutEnginePool(EngineConfig(max_model_len=64, max_num_seqs=256), str(model_dir))
    try:
        asyncio.run(measure(PoolClient(engines.client())))
    finally:
        engines.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
