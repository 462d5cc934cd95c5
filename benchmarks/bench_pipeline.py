"""Step time of Megatron's pipeline schedules on CPU: PP=1 vs PP=2 (1F1B) vs PP=2 x VPP=2 (interleaved).

Each configuration is a real TrainGroup (Ray placement group, gloo, Megatron's schedule, DDP and
optimizer) training the same rollouts, laid out by the scheduler's own code for that group's
parallel config (micro-batch counts aligned to the interleaved group). Printed side by side:
- step time (median over the timed steps, slowest rank) and its ratio to PP=1;
- the schedule's bubble share, (p - 1) / (v * m + p - 1) for p stages, v virtual stages and
  m micro-batches: the fraction of a stage's step spent idle in warm-up and cool-down, the
  part the micro-batch alignment lets interleaving shrink;
- the measured overhead share, 1 - (T_pp1 / p) / T_pp: how far the pipelined step is from an
  even split of the PP=1 work over p stages (bubble plus p2p plus the cores the stages share).

On a 2-core machine the stages of one pipeline share the cores, so PP cannot beat PP=1 here;
the figures show what the schedule costs, not a speed-up. Run: .venv/bin/python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import statistics

import numpy as np
import ray

from trainer.config import ModelConfig, OptimizerConfig, TrainGroupConfig
from actors.train_group import TrainGroup
from vgbs_ray.config import BatchConfig
from vgbs_ray.lr_schedule import LRScheduleConfig
from vgbs_ray.sample import make_rollout
from vgbs_ray.layout.schedule import build_dp_schedule
from vgbs_ray.layout.shard import build_step_shards

GLOBAL_BATCH_SIZE = 16          # rollouts per step
MAX_SIBLINGS = 3                # samples per rollout: 1..3
TOKENS = (32, 256)              # sample length range
MAX_TOKENS_PER_GPU = 512        # micro-batch cap: ~8 micro-batches per step
WARMUP_STEPS = 1
TIMED_STEPS = 5
SEED = 11
MODEL = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
                    vocab_size=256, max_position_embeddings=512)
LAYOUTS = (("PP=1", 1, 1), ("PP=2 1F1B", 2, 1), ("PP=2 x VPP=2", 2, 2))


def window(rng: np.random.Generator, step: int) -> list:
    samples = []
    for r in range(GLOBAL_BATCH_SIZE):
        rows = []
        for _ in range(int(rng.integers(1, MAX_SIBLINGS + 1))):
            length = int(rng.integers(TOKENS[0], TOKENS[1] + 1))
            response = int(rng.integers(length // 2, length))
            rows.append(dict(tokens=rng.integers(0, MODEL.vocab_size, length), response_length=response,
                             loss_mask=np.ones(response, dtype=np.int8),
                             rollout_log_probs=np.full(response, -5.5, dtype=np.float32)))
        samples += make_rollout(f"s{step}-r{r}", rows, reward=float(rng.random()), advantage=float(rng.normal()))
    return samples


def measure(pp_size: int, vpp_size: int, windows: list) -> tuple[float, int]:
    config = TrainGroupConfig(model=MODEL, pp_size=pp_size, vpp_size=vpp_size,
                              optimizer=OptimizerConfig(kind="sgd", lr_schedule=LRScheduleConfig(lr=1e-3)))
    group = TrainGroup(config)
    try:
        times, counts = [], []
        for k, samples in enumerate(windows):
            schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                         group.parallel_config,
                                         BatchConfig(global_batch_size=GLOBAL_BATCH_SIZE,
                                                     max_tokens_per_gpu=MAX_TOKENS_PER_GPU))
            result = group.train_shards(build_step_shards(samples, schedule.steps[0], k))
            if k >= WARMUP_STEPS:
                times.append(result.step_time_s)
                counts.append(result.num_microbatches)
        return statistics.median(times), round(statistics.median(counts))
    finally:
        group.shutdown()


def main() -> None:
    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=256 << 20,
             log_to_driver=False)
    rng = np.random.default_rng(SEED)
    windows = [window(rng, k) for k in range(WARMUP_STEPS + TIMED_STEPS)]
    print(f"model: {MODEL.num_layers} layers, hidden {MODEL.hidden_size}; {GLOBAL_BATCH_SIZE} rollouts/step, "
          f"cap {MAX_TOKENS_PER_GPU} tokens/micro-batch, median of {TIMED_STEPS} steps")
    rows = [(name, pp, vpp, *measure(pp, vpp, windows)) for name, pp, vpp in LAYOUTS]
    base = rows[0][3]
    print(f"{'layout':<14}{'step s':>9}{'vs PP=1':>9}{'micro-b.':>10}{'bubble':>9}{'overhead':>10}")
    for name, pp, vpp, step_s, m in rows:
        bubble = (pp - 1) / (vpp * m + pp - 1)
        overhead = 1 - (base / pp) / step_s
        print(f"{name:<14}{step_s:>9.3f}{step_s / base:>9.2f}{m:>10d}{bubble:>9.1%}{overhead:>10.1%}")
    ray.shutdown()


if __name__ == "__main__":
    main()
