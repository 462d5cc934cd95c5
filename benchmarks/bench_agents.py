"""The agent API's costs, side by side in one run:

  session     ChatSession's cost per turn (render the template, tokenize the new suffix) against the
              naive way (render and tokenize the whole conversation every turn), at 2, 8 and 32 turns,
              on a byte-level BPE chat tokenizer made in code; the engine is scripted (no model), so
              this is the rendering alone. Median microseconds per turn, and the ratio.
  producer    seconds per rollout through a started AgentProducer (admission, RolloutContext, session,
              batching, push to a SchedulerActor) against calling the same vLLM engine pool directly
              with the same prompts in the same groups; tiny random Llama, 1 engine on 1 core.

Run: .venv/bin/python benchmarks/bench_agents.py
"""

from __future__ import annotations

import asyncio
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.agent_support import ScriptedEngine, bpe_chat_tokenizer  # noqa: E402
from vgbs_ray.agents import RolloutContext, SamplingConfig  # noqa: E402

TURNS = (2, 8, 32)
REPEATS = 5
GROUPS, GROUP_SIZE, GROUPS_IN_FLIGHT = 32, 8, 4
PROMPT_TOKENS, NEW_TOKENS = 16, 8


def session_us_per_turn(tokenizer, turns: int) -> tuple[float, float]:
    reply = tokenizer.encode("it is 7.", add_special_tokens=False) + [tokenizer.eos_token_id]
    sampling = SamplingConfig(max_tokens=16, stop_token_ids=(tokenizer.eos_token_id,))

    def incremental() -> float:
        ctx = RolloutContext(rollout_id="r", group_id="g", member=0, group_size=1,
                             engine_generate=ScriptedEngine([reply] * turns), tokenizer=tokenizer)
        chat = ctx.chat([{"role": "user", "content": "what is 3 + 4?"}])
        started = time.perf_counter()
        for _ in range(turns):
            asyncio.run(chat.generate(sampling))
            chat.messages.append({"role": "tool", "content": "calc(3,4) = 7"})
        return (time.perf_counter() - started) / turns

    def rerender() -> float:
        messages = [{"role": "user", "content": "what is 3 + 4?"}]
        started = time.perf_counter()
        for _ in range(turns):
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            messages += [{"role": "assistant", "content": tokenizer.decode(reply[:-1])},
                         {"role": "tool", "content": "calc(3,4) = 7"}]
        return (time.perf_counter() - started) / turns

    # asyncio.run's own set-up is part of neither way: subtract an empty loop's.
    loop_s = statistics.median(_time(lambda: asyncio.run(asyncio.sleep(0))) for _ in range(20))
    return (1e6 * (statistics.median(incremental() for _ in range(REPEATS)) - loop_s),
            1e6 * statistics.median(rerender() for _ in range(REPEATS)))


def _time(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def make_token_agent():
    async def agent(row, ctx):
        session = ctx.token_session(row["prompt"])
        await session.generate(SamplingConfig(max_tokens=NEW_TOKENS, temperature=1.0))
        return float(ctx.member)

    return agent


def producer_vs_direct() -> tuple[float, float]:
    import ray

    from actors.agent_producer import AgentProducer, PromptSpec
    from vgbs_ray.producer_core import AgentProducerConfig
    from actors.rollout_engine import EngineConfig, RolloutEnginePool
    from vgbs_ray.scheduler.types import SchedulerConfig
    from actors.scheduler_actor import create_scheduler
    from tests.hf_support import tiny_hf_llama
    from vgbs_ray.config import BatchConfig

    model_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench_agents_"))
    tiny_hf_llama(model_dir)
    rows = [{"prompt": [(7 * g + i) % 90 + 1 for i in range(PROMPT_TOKENS)]} for g in range(GROUPS)]
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 << 20,
             log_to_driver=False)
    engines = RolloutEnginePool(EngineConfig(max_model_len=64), str(model_dir))
    client = engines.client()
    try:
        async def direct() -> float:
            started = time.perf_counter()
            queue = list(rows)

            async def worker():
                while queue:
                    row = queue.pop()
                    await client.generate([row["prompt"]] * GROUP_SIZE,
                                          [SamplingConfig(max_tokens=NEW_TOKENS, seed=m) for m in range(GROUP_SIZE)])

            await asyncio.gather(*[worker() for _ in range(GROUPS_IN_FLIGHT)])
            return (time.perf_counter() - started) / (GROUPS * GROUP_SIZE)

        asyncio.run(direct())  # warm-up
        direct_s = statistics.median(asyncio.run(direct()) for _ in range(3))

        produced = []
        for repeat in range(3):
            scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(global_batch_size=GROUP_SIZE,
                                                                           max_tokens_per_gpu=512)),
                                         name=f"bench-agents-{repeat}")
            config = AgentProducerConfig(agent="benchmarks.bench_agents:make_token_agent", group_size=GROUP_SIZE,
                                         groups_in_flight=GROUPS_IN_FLIGHT)
            producer = ray.remote(num_cpus=0)(AgentProducer).remote(0, config, scheduler, client, PromptSpec(rows=rows))
            ray.get(producer.report.remote(), timeout=120)  # started: its imports and set-up are not timed
            started = time.perf_counter()
            report = ray.get(producer.run.remote(), timeout=600)
            produced.append((time.perf_counter() - started) / report.rollouts)
            ray.kill(producer)
            ray.kill(scheduler)
        return statistics.median(produced), direct_s
    finally:
        engines.shutdown()
        ray.shutdown()


def main() -> None:
    tokenizer = bpe_chat_tokenizer()
    print("session rendering, us per turn (median of %d):" % REPEATS)
    print(f"{'turns':>6} {'incremental':>12} {'re-render':>10} {'ratio':>6}")
    for turns in TURNS:
        incremental, rerender = session_us_per_turn(tokenizer, turns)
        print(f"{turns:>6} {incremental:>12.0f} {rerender:>10.0f} {rerender / incremental:>6.2f}")
    producer_s, direct_s = producer_vs_direct()
    print(f"\nper rollout ({GROUPS} groups of {GROUP_SIZE}, {GROUPS_IN_FLIGHT} in flight, {NEW_TOKENS} new tokens):")
    print(f"  AgentProducer -> scheduler {1e3 * producer_s:.2f} ms | engine pool directly {1e3 * direct_s:.2f} ms "
          f"| ratio {producer_s / direct_s:.2f}")


if __name__ == "__main__":
    main()
