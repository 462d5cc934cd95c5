"""The whole job on a long-tail agentic workload: admission by a count of groups vs by the engines' tokens, and
an all-short control, back to back in one process.

    .venv/bin/python benchmarks/bench_long_tail_job.py [--steps 30] [--budget 2048]

Each run is `--preset long_tail` (examples/long_tail_agent.py: 79% one-token episodes, 16% 2-4 turns of 4 tokens,
5% 8-16 turns of 8 tokens; one vLLM CPU engine, gbs 64, staleness 1, decoupled PPO) with:
- count: the producers' groups in flight bound the work (the default);
- tokens: `scheduler.admission_token_budget=--budget` on top (vgbs_ray/scheduler/token_budget.py);
- control: every episode one short turn (`rollout.agent_kwargs.all_short=true`), count admission.
Printed per run, over the steps after the first 5: trained rollouts/s; the trainer's idle share (its summed shard
waits over the step loop's time); the engine's mean requests per vLLM step (how full continuous batching kept it)
and idle share; rollouts dropped as stale and abandoned (their tokens thrown away) over those finished; the long
episodes' share of pushed rollouts (agent metric `long`); admission refusals (by tokens). The machine's load
(uptime) is printed before and after: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobs.job_config import load_job_config  # noqa: E402
from jobs.train import init_ray, train  # noqa: E402


def run(name: str, steps: int, extra: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix=f"long-tail-{name}-")
    config = load_job_config(None, [f"run.output_dir={out}", f"run.num_steps={steps}", "run.plot=false",
                                    "run.loggers=[jsonl]", *extra], preset="long_tail")
    ends: list[float] = []
    summary = train(config, os.path.join(out, "steps.jsonl"),
                    on_event=lambda event, step, _: ends.append(time.monotonic()) if event == "step_trained" else None)
    loop = summary["closed_loop"]
    engine = loop["engines"][0]
    warm = min(5, len(ends) - 2)
    rate = 64 * (len(ends) - 1 - warm) / (ends[-1] - ends[warm])
    finished = loop["finished_rollouts"] or 1
    return {"run": name, "rollouts/s": rate, "trainer idle": loop["trainer_idle_share"],
            "requests/step": engine["requests_per_step"], "engine idle": engine["idle_share"],
            "stale drops": loop["stale_dropped_rollouts"] / finished,
            "abandoned": loop["producers"]["abandoned_rollouts"] / finished,
            "long share": loop["agent_metrics"].get("long", 0.0),
            "refusals": loop["producers"]["not_admitted"], "token refusals": loop.get("admission_token_refusals", "-")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--budget", type=int, default=2048, help="scheduler.admission_token_budget of the tokens run")
    args = parser.parse_args()
    print("load before:", os.getloadavg())
    init_ray(load_job_config(None, [], preset="long_tail"))
    rows = [run("count", args.steps, []),
            run("tokens", args.steps, [f"scheduler.admission_token_budget={args.budget}"]),
            run("control", args.steps, ["rollout.agent_kwargs={all_short: true}"])]
    print("load after:", os.getloadavg())
    keys = list(rows[0])
    print(" | ".join(f"{k:>14}" for k in keys))
    for row in rows:
        print(" | ".join(f"{row[k]:>14.3f}" if isinstance(row[k], float) else f"{row[k]!s:>14}" for k in keys))


if __name__ == "__main__":
    main()
