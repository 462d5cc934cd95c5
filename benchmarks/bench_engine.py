"""Rollout engine throughput vs transformers' generate, and weight sync as a share of a train step.

For two models, the default demo model and a ~20M-parameter one, in one run:
  tokens/s    one RolloutEngine (vLLM CPU, 1 core) vs `transformers` `generate` on the same
              exported checkpoint in this process (1 thread), same prompts, same new-token count
  sync        a TrainGroup (dp=1) step, then publish (trainer-side: gather + one store copy) and
              the engine's in-place load; printed as shares of the step time, with bytes per sync
Medians over REPEATS. Run: .venv/bin/python benchmarks/bench_engine.py
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np
import ray
import torch

from trainer.hf_checkpoint import write_hf_checkpoint
from actors.rollout_engine import EngineConfig, RolloutEnginePool
from trainer.config import LossConfig, ModelConfig, OptimizerConfig, TrainGroupConfig
from actors.train_group import TrainGroup
from actors.weight_sync import publish_weights
from vgbs_ray.agents import SamplingConfig
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.sample import make_rollout
from vgbs_ray.layout.schedule import build_dp_schedule
from vgbs_ray.layout.shard import build_step_shards

MODELS = {
    "demo (default)": ModelConfig(),
    "~20M": ModelConfig(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4,
                        ffn_hidden_size=1408, vocab_size=8192, max_position_embeddings=512),
}
NUM_PROMPTS = 16          # one batch
PROMPT_TOKENS = 16
NEW_TOKENS = 64
ROLLOUTS_PER_STEP = 16    # the train step the sync is compared with
SAMPLE_TOKENS = (64, 256)
REPEATS = 3
SEED = 0


def train_step_shards(model: ModelConfig, rng: np.random.Generator, step: int) -> list:
    samples = []
    for r in range(ROLLOUTS_PER_STEP):
        length = int(rng.integers(*SAMPLE_TOKENS))
        response = length // 2
        samples += make_rollout(f"s{step}-r{r}", [dict(tokens=rng.integers(0, model.vocab_size, length),
                                                       response_length=response, loss_mask=np.ones(response, np.int8))],
                                reward=0.0, advantage=float(rng.normal()))
    schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                 ParallelConfig(dp_size=1), BatchConfig(global_batch_size=ROLLOUTS_PER_STEP,
                                                                        max_tokens_per_gpu=2048))
    return build_step_shards(samples, schedule.steps[0], step)


def hf_generate_tokens_per_s(model_dir: str, prompts: list[list[int]]) -> float:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)  # the engine has one core too
    hf = LlamaForCausalLM.from_pretrained(model_dir).float().eval()
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, top_k=0, pad_token_id=0)
    return (out.shape[1] - ids.shape[1]) * len(prompts) / (time.perf_counter() - start)


def bench(name: str, model: ModelConfig) -> dict:
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, model.vocab_size, PROMPT_TOKENS).tolist() for _ in range(NUM_PROMPTS)]
    config = TrainGroupConfig(model=model, optimizer=OptimizerConfig(kind="adamw"), loss=LossConfig())
    group = TrainGroup(config)
    engines = None
    try:
        v0 = publish_weights(group, 0)
        model_dir = str(write_hf_checkpoint(tempfile.mkdtemp(prefix="bench_engine_"), model,
                                            {k: torch.from_numpy(v) for k, v in ray.get(v0.ref).items()}))
        engines = RolloutEnginePool(EngineConfig(max_model_len=model.max_position_embeddings), model_dir)
        sampling = SamplingConfig(max_tokens=NEW_TOKENS, seed=SEED)
        engines.generate(prompts[:2], sampling)  # warm-up
        engine_tps, hf_tps, steps, publishes, loads, syncs = [], [], [], [], [], []
        for repeat in range(REPEATS):
            start = time.perf_counter()
            gens = engines.generate(prompts, sampling)
            engine_tps.append(sum(len(g.response_token_ids) for g in gens) / (time.perf_counter() - start))
            hf_tps.append(hf_generate_tokens_per_s(model_dir, prompts))
            steps.append(group.train_shards(train_step_shards(model, rng, repeat)).step_time_s)
            start = time.perf_counter()
            published = publish_weights(group, repeat + 1)
            [load] = engines.wait_for_weights(engines.update_weights(published))
            syncs.append(time.perf_counter() - start)
            publishes.append(published.publish_time_s)
            loads.append(load.load_time_s)
        median = statistics.median
        return dict(name=name, params=sum(a.size for a in ray.get(v0.ref).values()), bytes=published.num_bytes,
                    engine_tps=median(engine_tps), hf_tps=median(hf_tps), step_s=median(steps),
                    publish_s=median(publishes), load_s=median(loads), sync_s=median(syncs))
    finally:
        if engines is not None:
            engines.shutdown()
        group.shutdown()


def main() -> None:
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=512 << 20,
             log_to_driver=False)
    try:
        rows = [bench(name, model) for name, model in MODELS.items()]
    finally:
        ray.shutdown()
    print(f"{NUM_PROMPTS} prompts x {NEW_TOKENS} new tokens; train step = {ROLLOUTS_PER_STEP} rollouts of "
          f"{SAMPLE_TOKENS[0]}-{SAMPLE_TOKENS[1]} tokens (AdamW, dp=1); medians of {REPEATS}")
    print(f"{'model':<16}{'params':>10}{'MB/sync':>9}{'engine tok/s':>14}{'HF tok/s':>10}{'ratio':>7}"
          f"{'step s':>8}{'publish':>9}{'load':>8}{'sync s':>8}{'publish/step':>14}{'(publish+load)/step':>21}")
    for r in rows:
        print(f"{r['name']:<16}{r['params'] / 1e6:>9.1f}M{r['bytes'] / 1e6:>9.1f}{r['engine_tps']:>14.0f}"
              f"{r['hf_tps']:>10.0f}{r['engine_tps'] / r['hf_tps']:>7.2f}{r['step_s']:>8.3f}{r['publish_s']:>9.3f}"
              f"{r['load_s']:>8.3f}{r['sync_s']:>8.3f}{r['publish_s'] / r['step_s']:>14.2f}"
              f"{(r['publish_s'] + r['load_s']) / r['step_s']:>21.2f}")


if __name__ == "__main__":
    main()
