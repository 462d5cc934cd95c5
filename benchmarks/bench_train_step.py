"""Train-step time on 2 gloo ranks (CPU): balanced layouts vs strided, rollout-side vs rank-side packing.

One TrainGroup (dp=2, Megatron GPTModel on CPU, real Ray placement group) trains the same
windows of skewed-length rollouts with four plans:
  strided   rollout-side layout, micro-batches dealt round-robin (balance="none")
  tokens    rollout-side layout, balanced on tokens
  flops     rollout-side layout, balanced on estimated FLOPs
  legacy    what a trainer without rollout-side layouts runs (the project had this path until it was
            removed, issue 42): an even strided sample split, each rank packs its own samples, and
            the ranks pad to the largest count (an all-reduce(MAX) there; laid out here as those
            padded micro-batches, the same compute without the tiny collective)
Step time is the slowest rank's (the DP all-reduce makes everyone wait for it), median over
the timed steps; the plans take turns on each window so background load hits all alike. Run: .venv/bin/python benchmarks/bench_train_step.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import ray

from trainer.config import ModelConfig, TrainGroupConfig
from actors.train_group import TrainGroup
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.models.flops import TransformerFlopsModel
from vgbs_ray.sample import make_rollout
from vgbs_ray.layout.packing import first_fit_decreasing
from vgbs_ray.layout.schedule import StepLayout, build_dp_schedule
from vgbs_ray.layout.shard import build_step_shards

DP_SIZE = 2
GLOBAL_BATCH_SIZE = 16          # rollouts per step
MAX_SIBLINGS = 3                # samples per rollout: 1..3
SHORT_TOKENS = (16, 96)         # 75% of samples
LONG_TOKENS = (600, 1000)       # 25% of samples: the skew
LONG_FRACTION = 0.25
MAX_TOKENS_PER_GPU = 1024       # micro-batch cap (every plan alike)
WARMUP_STEPS = 1
TIMED_STEPS = 8
SEED = 7
MODEL = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=256, max_position_embeddings=1024)
FLOPS = TransformerFlopsModel(num_layers=MODEL.num_layers, hidden_size=MODEL.hidden_size,
                              num_attention_heads=MODEL.num_attention_heads, vocab_size=MODEL.vocab_size)


def window(rng: np.random.Generator, step: int) -> list:
    samples = []
    for r in range(GLOBAL_BATCH_SIZE):
        rows = []
        for _ in range(int(rng.integers(1, MAX_SIBLINGS + 1))):
            low, high = LONG_TOKENS if rng.random() < LONG_FRACTION else SHORT_TOKENS
            length = int(rng.integers(low, high + 1))
            response = int(rng.integers(length // 2, length))
            rows.append(dict(tokens=rng.integers(0, MODEL.vocab_size, length), response_length=response,
                             loss_mask=np.ones(response, dtype=np.int8)))
        samples += make_rollout(f"s{step}-r{r}", rows, reward=float(rng.random()), advantage=float(rng.normal()))
    return samples


def shards_for(plan: str, samples: list, step: int) -> list:
    if plan == "legacy":
        return build_step_shards(samples, rank_side_packing(samples), step)
    batch = BatchConfig(global_batch_size=GLOBAL_BATCH_SIZE, max_tokens_per_gpu=MAX_TOKENS_PER_GPU,
                        balance="none" if plan == "strided" else plan, flops_model=FLOPS)
    schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                 ParallelConfig(dp_size=DP_SIZE), batch)
    return build_step_shards(samples, schedule.steps[0], step)


def rank_side_packing(samples: list) -> StepLayout:
    """The baseline: rank r gets samples r, r + DP_SIZE, ...; packs them first-fit-decreasing under the cap; every
    rank pads with empty micro-batches to the largest count (what the all-reduce(MAX) agreed on)."""
    ranks = []
    for rank in range(DP_SIZE):
        indices = list(range(rank, len(samples), DP_SIZE))
        lengths = np.array([samples[i].total_length for i in indices], dtype=np.int64)
        ranks.append([tuple(indices[j] for j in mb) for mb in first_fit_decreasing(lengths, MAX_TOKENS_PER_GPU)])
    count = max(map(len, ranks))
    return StepLayout(rollout_ids=tuple(dict.fromkeys(s.rollout_id for s in samples)),
                      rank_micro_batches=tuple(tuple(mbs + [()] * (count - len(mbs))) for mbs in ranks))


def _max_over_mean(values: list[int]) -> float:
    return max(values) / (sum(values) / len(values))


def main() -> None:
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    rng = np.random.default_rng(SEED)
    windows = [window(rng, k) for k in range(WARMUP_STEPS + TIMED_STEPS)]
    tokens = [s.total_length for w in windows for s in w]
    print(f"dp={DP_SIZE}, gbs={GLOBAL_BATCH_SIZE} rollouts, {len(tokens) / len(windows):.0f} samples and "
          f"{sum(tokens) / len(windows):.0f} tokens per step (lengths {min(tokens)}..{max(tokens)}), "
          f"cap {MAX_TOKENS_PER_GPU} tokens, model {MODEL.num_layers}x{MODEL.hidden_size}")
    group = TrainGroup(TrainGroupConfig(model=MODEL, dp_size=DP_SIZE))
    try:
        initial = group.state_dict()
        plans = ("strided", "tokens", "flops", "legacy")
        times: dict[str, list[float]] = {}
        walls: dict[str, list[float]] = {}
        token_skew: dict[str, list[float]] = {}
        attention_skew: dict[str, list[float]] = {}
        # Plans take turns on each window (machine noise hits all alike); every step starts
        # from the same weights, so only the plan differs.
        for k, samples in enumerate(windows):
            for plan in plans:
                shards = shards_for(plan, samples, k)
                group.load_state_dict(initial)
                start = time.perf_counter()
                result = group.train_shards(shards)
                wall = time.perf_counter() - start
                if k >= WARMUP_STEPS:
                    times.setdefault(plan, []).append(result.step_time_s)
                    walls.setdefault(plan, []).append(wall)
                    token_skew.setdefault(plan, []).append(_max_over_mean([s.num_tokens for s in shards]))
                    attention_skew.setdefault(plan, []).append(
                        _max_over_mean([int((s.total_lengths ** 2).sum()) for s in shards]))
        median = {p: statistics.median(times[p]) for p in plans}
        print(f"\n{'plan':<9}{'step s':>9}{'wall s':>9}{'vs strided':>12}{'vs tokens':>11}"
              f"{'rank tokens max/mean':>22}{'rank sum L^2 max/mean':>23}")
        for p in plans:
            print(f"{p:<9}{median[p]:>9.3f}{statistics.median(walls[p]):>9.3f}"
                  f"{median[p] / median['strided']:>12.2f}{median[p] / median['tokens']:>11.2f}"
                  f"{statistics.median(token_skew[p]):>22.2f}{statistics.median(attention_skew[p]):>23.2f}")
        print(f"\nbalanced vs strided: tokens {median['strided'] / median['tokens']:.2f}x, "
              f"flops {median['strided'] / median['flops']:.2f}x faster")
        print(f"precomputed (tokens) vs rank-side packing padded to the MAX: {median['legacy'] / median['tokens']:.2f}x faster")
    finally:
        group.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
