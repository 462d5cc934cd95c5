"""The scheduler's own work per sample, in one process and without Ray: what is left of a push
once Ray's calls, serialisation and the object store are taken away.

    python benchmarks/bench_scheduler_work.py [--batches 256]

bench_scheduler.py's payload and step (64-sample pushes of one-sample rollouts in GRPO groups of
8, 1k tokens, the rows unpickled as the actor receives them), through RolloutIntake.ingest, then
each gbs-512 step taken, laid out for dp 8 (`plan_step`: layout and shards, no `ray.put`) and
scheduled and trained in the ledger, against a settled table of 20k earlier rollouts. Prints the
microseconds per sample of each stage, best of --repeats runs; GC is off while timing (the
actor relaxes its thresholds; collections are not what this measures). Single-threaded, so it
is steadier than the actor benchmark; compare runs of the same machine.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time

import numpy as np

from bench_scheduler import BATCH_SAMPLES, DP_SIZE, GBS, MAX_TOKENS_PER_GPU, make_batches  # a sibling script
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.scheduler.intake import IntakeConfig, RolloutIntake
from vgbs_ray.scheduler.ledger import Ledger
from vgbs_ray.scheduler.stepping import plan_step

SETTLED_STEPS = 40  # 20k rollouts already trained: lookups meet a table, not an empty one


def make_pushes(num_batches: int, rng: np.random.Generator) -> list[list[dict]]:
    """bench_scheduler's batches, each unpickled as Ray hands a push's samples to the actor."""
    return [pickle.loads(pickle.dumps(rows, protocol=5)) for rows in make_batches("push", num_batches, rng)]


def settled_ledger() -> Ledger:
    ledger = Ledger()
    for step in range(SETTLED_STEPS):
        ids = [f"old{step}/r{i}" for i in range(GBS)]
        for rid in ids:
            ledger.accept_sample(rid)
        ledger.schedule(ids, step)
        ledger.train_step(step)
    return ledger


def run(pushes: list[list[dict]]) -> dict[str, float]:
    """Seconds per stage over all pushes."""
    ledger = settled_ledger()
    intake = RolloutIntake(IntakeConfig(), ledger)
    batch = BatchConfig(global_batch_size=GBS, max_tokens_per_gpu=MAX_TOKENS_PER_GPU, leftover="drop")
    parallel = ParallelConfig(dp_size=DP_SIZE)
    seconds = dict(ingest=0.0, take=0.0, plan=0.0, ledger=0.0)
    step = SETTLED_STEPS
    for now, rows in enumerate(pushes):
        t0 = time.perf_counter()
        intake.ingest(rows, now=float(now))
        seconds["ingest"] += time.perf_counter() - t0
        while intake.num_ready >= GBS:
            t0 = time.perf_counter()
            rollouts = intake.take_oldest(GBS)
            t1 = time.perf_counter()
            planned = plan_step(rollouts, step=step, parallel=parallel, batch=batch)
            t2 = time.perf_counter()
            ids = [r.rollout_id for r in rollouts]
            ledger.schedule(ids, step)
            intake.settle(ids)
            ledger.train_step(step)
            del planned, rollouts  # the actor drops a step's shards once they are in the object store
            t3 = time.perf_counter()
            seconds["take"] += t1 - t0
            seconds["plan"] += t2 - t1
            seconds["ledger"] += t3 - t2
            step += 1
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=256, help="64-sample pushes per run (8 per step)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pushes = make_pushes(args.batches, np.random.default_rng(0))
    num_samples = args.batches * BATCH_SAMPLES
    gc.disable()
    runs = [run(pushes) for _ in range(args.repeats)]
    gc.enable()
    best = min(runs, key=lambda s: sum(s.values()))
    print(f"== the scheduler's own work, {num_samples} samples ({num_samples // GBS} steps of gbs {GBS}, dp {DP_SIZE}), "
          f"best of {args.repeats}, us per sample")
    for stage, spent in best.items():
        print(f"{stage:<8} {1e6 * spent / num_samples:>7.2f}")
    print(f"{'total':<8} {1e6 * sum(best.values()) / num_samples:>7.2f}   "
          f"(per step: plan {1e3 * best['plan'] / (num_samples // GBS):.2f} ms, "
          f"ledger {1e3 * best['ledger'] / (num_samples // GBS):.2f} ms)")


if __name__ == "__main__":
    main()
