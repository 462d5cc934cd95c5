"""The closed loop at max_staleness 0, 1, 2 side by side: throughput, who waits, what is dropped.

    .venv/bin/python benchmarks/bench_closed_loop.py [--staleness 0 1 2] [--steps 30] [--warm-up 5]

Each configuration is the demo (`python -m jobs.train`'s embedded default: one vLLM CPU engine,
two env producers with 8 groups of 8 in flight each, gbs 64, dp=2) with only the off-policy
section changed: max_staleness 0 trains with on-policy `ppo`, 1 and 2 with `decoupled_ppo`.
They run one after another in this process, on one in-process Ray cluster (`jobs.train.train`).

Printed per configuration (rates and shares over the steps after `--warm-up`, the engine's idle
share over the whole run):
- rollouts trained per second (trained rollouts / wall seconds between step ends);
- trainer idle share: the train group's summed shard waits (StepResult.shard_wait_s) / wall time;
- steps formed before the trainer asked for them (checked at each step's start: no wait at all);
- engine idle share: the engines' time with nothing to generate / their time since start;
- stale drop share: rollouts dropped as `stale` / rollouts finished (accepted whole by the scheduler);
- mean staleness of the trained rollouts (versions behind the step's);
- second-turn share: rollouts that needed a second turn (the long ones) among every rollout the
  producers pushed (filtered groups included) and among the trained ones (whole run);
- the sampled reward's mean over the last 10 steps, and the step at which its 10-step mean first
  reached 0.8 (None within 30 steps: pass `--steps 120` for the learning curve);
- admission refusals, seconds per step, the trainer's summed shard waits and the step loop's
  wall time, over the whole run.
Wall times depend on the machine's load: the header prints it (uptime) before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobs.job_config import load_job_config  # noqa: E402
from jobs.train import init_ray, train  # noqa: E402

LOSS = {0: "ppo"}  # decoupled_ppo otherwise
TARGET, WINDOW = 0.8, 10


def mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def load_average() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def run(max_staleness: int, steps: int, warm_up: int) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench-closed-loop-s{max_staleness}-")
    config = load_job_config(None, [
        f"run.output_dir={out}", f"run.num_steps={steps}", "run.plot=false",
        f"train.loss.off_policy.max_staleness={max_staleness}",
        f"train.loss.policy={LOSS.get(max_staleness, 'decoupled_ppo')}"])
    ended_at, prefetched, at_warm_up = {}, [], {}

    def on_event(event, step, controller):
        if event == "step_started":  # was this step formed before the trainer asks for it?
            prefetched.append(ray.get(controller.scheduler.stats.remote(), timeout=60).steps_emitted > step)
        elif event == "step_trained":
            ended_at[step] = time.monotonic()
            if step == warm_up - 1:
                stats = ray.get(controller.scheduler.stats.remote(), timeout=60)
                at_warm_up.update(finished=stats.ledger.num_rollouts_accepted, stale=stats.stale_dropped_rollouts)

    summary = train(config, os.path.join(out, "steps.jsonl"), on_event)
    from jobs.progress import read_records

    every = read_records(os.path.join(out, "steps.jsonl"))
    records = [r for r in every if r["step"] >= warm_up]
    loop = summary["closed_loop"]
    sampled = [r["sampled_reward"] for r in every]
    wall_s = ended_at[steps - 1] - ended_at[warm_up - 1]
    finished = loop["finished_rollouts"] - at_warm_up["finished"]
    return {
        "rollouts trained / s": sum(r["num_rollouts"] for r in records) / wall_s,
        "trainer idle share": sum(r["shard_wait_s"] for r in records) / wall_s,
        "steps formed before asked": f"{sum(prefetched[warm_up:])}/{len(prefetched[warm_up:])}",
        "engine idle share (run)": loop["engine_idle_share"],
        "stale drop share": (loop["stale_dropped_rollouts"] - at_warm_up["stale"]) / finished,
        "stale drops / finished": f"{loop['stale_dropped_rollouts'] - at_warm_up['stale']}/{finished}",
        "mean staleness": sum(r["staleness_mean"] * r["num_rollouts"] for r in records)
        / sum(r["num_rollouts"] for r in records),
        "turns per pushed rollout (run)": loop["agent_metrics"].get("turns"),
        "sampled reward, last 10": loop["sampled_reward_last10"],
        f"steps to sampled {TARGET}": next((i + 1 for i in range(WINDOW - 1, len(sampled))
                                             if mean(sampled[i - WINDOW + 1:i + 1]) >= TARGET), None),
        "admission refusals (run)": loop["producers"]["not_admitted"],
        "s per step (run)": summary["elapsed_s"] / len(every),
        "trainer waited s (run)": loop["trainer_wait_s_total"],
        "step loop s (run)": summary["elapsed_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-up", type=int, default=5)
    args = parser.parse_args()
    print(f"closed loop (demo config), {args.steps} steps of 64 rollouts, figures over steps {args.warm_up}.."
          f"{args.steps - 1}; {os.cpu_count()} cores, load average {load_average()}", flush=True)
    init_ray(load_job_config(None, []))
    try:
        results = {}
        for staleness in args.staleness:
            started = time.monotonic()
            results[staleness] = run(staleness, args.steps, args.warm_up)
            print(f"max_staleness={staleness}: {time.monotonic() - started:.0f} s", flush=True)
    finally:
        ray.shutdown()
    print(f"load average after: {load_average()}")
    print(f"{'max_staleness':<30}" + "".join(f"{s:>12}" for s in results))
    for key in next(iter(results.values())):
        cells = [results[s][key] for s in results]
        print(f"{key:<30}" + "".join(f"{c:>12.3f}" if isinstance(c, float) else f"{str(c):>12}" for c in cells))


if __name__ == "__main__":
    main()
