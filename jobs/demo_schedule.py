"""Schedule demo: lay out a window of synthetic agentic rollouts and print the layout.

    python -m jobs.demo_schedule

Rollouts yield 1..6 samples with lognormal lengths, arriving interleaved (completion
order). 40 rollouts with gbs=16 give two full steps and a partial step of 8.
"""

from __future__ import annotations

import numpy as np

from vgbs_ray.schedule import BatchConfig, ParallelConfig, build_dp_schedule

NUM_ROLLOUTS = 40
SEED = 0


def synthetic_window(num_rollouts: int, seed: int) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    rollout_ids = []
    for r in range(num_rollouts):
        siblings = int(rng.integers(2, 7)) if rng.random() < 0.4 else 1
        rollout_ids += [f"rollout-{r}"] * siblings
    rng.shuffle(rollout_ids)  # completion order interleaves siblings
    lengths = np.clip(rng.lognormal(7.5, 0.7, len(rollout_ids)), 64, 12000).astype(np.int64)
    return lengths, rollout_ids


def main() -> None:
    lengths, rollout_ids = synthetic_window(NUM_ROLLOUTS, SEED)
    parallel = ParallelConfig(dp_size=4)
    batch = BatchConfig(global_batch_size=16, max_tokens_per_gpu=8192, balance="tokens", leftover="partial")
    schedule = build_dp_schedule(lengths, rollout_ids, parallel, batch)
    print(f"{len(lengths)} samples from {NUM_ROLLOUTS} rollouts, {parallel}, {batch}")
    for k, step in enumerate(schedule.steps):
        rank_tokens = [int(lengths[step.partition(r)].sum()) for r in range(parallel.dp_size)]
        print(
            f"step {k}: rollouts={step.num_rollouts} samples={len(step.sample_indices)} "
            f"micro-batches/rank={step.num_microbatches} rank tokens={rank_tokens} "
            f"max/mean={max(rank_tokens) / np.mean(rank_tokens):.4f}"
        )
        for r in range(parallel.dp_size):
            mb_tokens = [int(lengths[list(mb)].sum()) for mb in step.rank_micro_batches[r]]
            print(f"  rank {r}: micro-batch tokens {mb_tokens}")
    print(f"leftover rollouts: {list(schedule.leftover_rollout_ids)}")


if __name__ == "__main__":
    main()
