"""The rollout engine on a long-tail agentic workload: continuous batching vs batch at a time, side by side.

A long-tail workload of the kind issue 38 measured: CLIENTS agents run episodes concurrently, each turn one
request whose prompt is the episode so far (zero think time: a turn's reply starts the next request at once),\nepisodes back to back for DURATION seconds; what finished by then is counted.
  long tail  79% of episodes one 2-token turn, 16% 2-4 turns of 8 tokens, 5% 8-16 turns of 12 tokens
             (these hold most of the generated tokens)
  control    every episode one 2-token turn
Two engines on the same vLLM instance, one after the other, same seeds:
  continuous  the project's `RolloutEngine` (vLLM's step loop: requests join and leave the batch at each step;
              weight loads between two steps with requests in flight)
  batch       what the engine did before: every queued call run as one `LLM.generate` batch, a weight
              load only between batches (`BatchAtATimeEngine` below: that old loop, kept here as the baseline)
A weight load of the same weights every LOAD_EVERY_S seconds in both, as a training job's syncs.

Printed per engine and workload: generated tokens/s, episodes/s, the short (2-token) requests' latency
p50/p90, mean requests in the engine per vLLM step (continuous only: the honest utilisation), and per load
the pause (the load itself) and the wait (from the load's call to its end: the batch engine waits for the
running batch). Then the ratios: continuous / batch throughput on the long tail, and each engine's short
latency on the long tail over the all-short control.

Run: .venv/bin/python benchmarks/bench_long_tail.py [--duration-s 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
# As in an engine actor of num_cpus_per_engine=1 (Ray sets OMP_NUM_THREADS so): vLLM's CPU attention checks that the
# thread count it planned with is the one it runs with, and the engine thread would otherwise see another.
os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"})

from actors.rollout_engine import EngineConfig, RolloutEngine, _answer  # noqa: E402
from vgbs_ray.agents import SamplingConfig  # noqa: E402

CLIENTS = 64
LOAD_EVERY_S = 1.0
MAX_MODEL_LEN = 256


class BatchAtATimeEngine(RolloutEngine):
    """The engine before continuous batching: the calls queued together run as one `LLM.generate` batch (it
    lasts as long as its longest request), and a weight load waits for the running batch."""

    def _serve(self) -> None:
        import queue

        from vllm import SamplingParams

        while True:
            waited = time.perf_counter()
            calls = [self._calls.get()]
            started = time.perf_counter()
            self._idle_s += started - waited
            while calls[-1].kind == "generate":
                try:
                    calls.append(self._calls.get_nowait())
                except queue.Empty:
                    break
            update = calls.pop() if calls[-1].kind == "update" else None
            if calls:
                prompts, params, owners = [], [], []
                for call in calls:
                    call_prompts, samplings = call.payload
                    call.results = [None] * len(call_prompts)
                    for index, (prompt, sampling) in enumerate(zip(call_prompts, samplings)):
                        params.append(SamplingParams(max_tokens=sampling.max_tokens, seed=sampling.seed, logprobs=0,
                                                     ignore_eos=True, detokenize=False))
                        prompts.append({"prompt_token_ids": prompt.tolist()})
                        owners.append((call, index))
                for (call, index), output in zip(owners, self.llm.generate(prompts, params, use_tqdm=False)):
                    call.results[index] = self._generation(output)
                self._engine_steps += 1
                for call in calls:
                    _answer(call, call.results)
            if update is not None:
                self._apply_update(update)
            self._busy_s += time.perf_counter() - started


def episode_turns(rng: random.Random, long_tail: bool) -> list[int]:
    """Tokens to generate in each turn of one episode."""
    if not long_tail:
        return [2]
    draw = rng.random()
    if draw < 0.79:
        return [2]
    if draw < 0.95:
        return [8] * rng.randint(2, 4)
    return [12] * rng.randint(8, 16)


async def run_workload(engine: RolloutEngine, weights: dict, *, long_tail: bool, duration_s: float, seed: int) -> dict:
    """CLIENTS clients run episodes back to back for `duration_s`; what finished by then is counted."""
    rng = random.Random(seed)
    short_latency, generated, episodes, numbers = [], 0, 0, iter(range(1 << 30))
    deadline = time.perf_counter() + duration_s
    stop = asyncio.Event()

    async def client() -> None:
        nonlocal generated, episodes
        while time.perf_counter() < deadline:
            number, plan = next(numbers), episode_turns(rng, long_tail)
            context = [1 + (number % 100), 2, 3, 4, 5, 6, 7, 8]
            for turn, tokens in enumerate(plan):
                started = time.perf_counter()
                [generation] = await engine.generate([context], SamplingConfig(max_tokens=tokens, seed=number * 31 + turn))
                if time.perf_counter() > deadline:
                    return
                if tokens == 2:
                    short_latency.append(time.perf_counter() - started)
                generated += len(generation.response_token_ids)
                context = context + generation.response_token_ids.tolist() + [9]
            episodes += 1

    async def loader() -> list[tuple[float, float]]:
        loads, version = [], engine.policy_version
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=LOAD_EVERY_S)
            except asyncio.TimeoutError:
                version += 1
                called = time.perf_counter()
                load = await engine.update_weights(version, weights)
                loads.append((load.load_time_s, time.perf_counter() - called))
        return loads

    before = engine.utilization()
    load_task = asyncio.ensure_future(loader())
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    stop.set()
    loads = await load_task
    after = engine.utilization()
    steps = after.engine_steps - before.engine_steps
    short_latency.sort()
    return {
        "tokens_per_s": generated / duration_s, "episodes_per_s": episodes / duration_s,
        "short_p50_ms": 1e3 * short_latency[len(short_latency) // 2],
        "short_p90_ms": 1e3 * short_latency[int(0.9 * (len(short_latency) - 1))],
        "requests_per_step": (after.request_steps - before.request_steps) / steps if steps else float("nan"),
        "load_pause_ms": [1e3 * p for p, _ in loads], "load_wait_ms": [1e3 * w for _, w in loads],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=8.0, help="seconds per engine and workload")
    args = parser.parse_args()

    import torch

    from trainer.hf_checkpoint import export_hf_weights, write_hf_checkpoint
    from trainer.model import build_gpt_model
    from trainer.config import ModelConfig
    from tests.train_support import ensure_single_process_group

    torch.manual_seed(0)
    model = ModelConfig(seed=3)
    ensure_single_process_group()
    hf_weights = export_hf_weights(build_gpt_model(model), model)
    model_dir = str(write_hf_checkpoint(tempfile.mkdtemp(prefix="bench-long-tail-"), model, hf_weights))
    weights = {name: tensor.numpy() for name, tensor in hf_weights.items()}
    config = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=CLIENTS)
    results = {}
    for name, cls in (("continuous", RolloutEngine), ("batch", BatchAtATimeEngine)):
        engine = cls(config, model_dir, name=name)
        for workload in ("long tail", "control"):
            results[name, workload] = asyncio.run(run_workload(engine, weights, long_tail=workload == "long tail",
                                                               duration_s=args.duration_s, seed=1))
        del engine

    print(f"{CLIENTS} concurrent clients, {args.duration_s:.0f} s per run, a load every {LOAD_EVERY_S} s; "
          f"model {model.hidden_size}x{model.num_layers}, 1 engine on this machine's cores")
    print(f"{'engine':<11} {'workload':<10} {'tok/s':>7} {'ep/s':>6} {'short p50':>10} {'short p90':>10} "
          f"{'req/step':>9} {'pause p50/max ms':>17} {'load wait p50/max ms':>21}")
    for (name, workload), r in results.items():
        pause, wait = r["load_pause_ms"] or [float("nan")], r["load_wait_ms"] or [float("nan")]
        print(f"{name:<11} {workload:<10} {r['tokens_per_s']:7.0f} {r['episodes_per_s']:6.1f} "
              f"{r['short_p50_ms']:8.1f}ms {r['short_p90_ms']:8.1f}ms {r['requests_per_step']:9.1f} "
              f"{statistics.median(pause):8.1f}/{max(pause):<8.1f} {statistics.median(wait):10.1f}/{max(wait):<10.1f}")
    c, b = results["continuous", "long tail"], results["batch", "long tail"]
    print(f"long tail, continuous / batch: tokens/s {c['tokens_per_s'] / b['tokens_per_s']:.2f}x, episodes/s "
          f"{c['episodes_per_s'] / b['episodes_per_s']:.2f}x, short p50 latency {c['short_p50_ms'] / b['short_p50_ms']:.2f}x")
    for name in ("continuous", "batch"):
        tail, control = results[name, "long tail"], results[name, "control"]
        print(f"{name}: short-request latency, long tail / all-short control: p50 "
              f"{tail['short_p50_ms'] / control['short_p50_ms']:.2f}x, p90 {tail['short_p90_ms'] / control['short_p90_ms']:.2f}x")


if __name__ == "__main__":
    main()
