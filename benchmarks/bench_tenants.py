"""Two multi-LoRA tenants in one job against the same two tenants as two separate LoRA jobs, on the same cores.

    .venv/bin/python benchmarks/bench_tenants.py [--steps N]

Tenant `a` runs the digit agent, tenant `b` the same question asked four times per rollout (four samples per
rollout); each trains N steps of 32 rollouts with a rank-8 adapter. The separate jobs run one after the other
(each its own engines and train group, like two users' jobs queued on one machine); the multi-tenant job runs
both over one base, one train group and one engine pool. Per way: wall time (start-up included), the step loop's
time, and rollouts/s per tenant and in total over the wall time. The ratio is multi-tenant / separate.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TENANTS = {"a": {}, "b": {"agent": "tests.agent_support:make_repeated_agent", "agent_kwargs": {"samples": 4}}}
BATCH = 32


def run(items: list[str]) -> tuple[dict, float]:
    from jobs.train import main

    out = tempfile.mkdtemp()
    started = time.perf_counter()
    args = [a for item in [f"run.output_dir={out}", "run.plot=false", "run.loggers=[jsonl]", *items]
            for a in ("--set", item)]
    assert main(args) == 0
    return json.loads((Path(out) / "summary.json").read_text()), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=1 << 30, log_to_driver=False)
    try:
        separate = {}
        for name, extra in TENANTS.items():
            items = [f"run.num_steps={args.steps}", f"scheduler.batch.global_batch_size={BATCH}", "train.lora.rank=8"]
            if extra:
                items += [f"rollout.agent={extra['agent']}", f"rollout.agent_kwargs={json.dumps(extra['agent_kwargs'])}"]
            summary, wall = run(items)
            separate[name] = (summary["rollouts_trained"], summary["elapsed_s"], wall)
        tenants = ", ".join("{" + f"name: {name}, num_steps: {args.steps}, global_batch_size: {BATCH}"
                            + (f", agent: '{extra['agent']}', agent_kwargs: {json.dumps(extra['agent_kwargs'])}"
                               if extra else "") + "}" for name, extra in TENANTS.items())
        summary, wall = run([f"tenants=[{tenants}]"])
    finally:
        ray.shutdown()
    separate_wall = sum(w for _, _, w in separate.values())
    separate_loop = sum(e for _, e, _ in separate.values())
    print(f"{'way':>13} {'wall_s':>8} {'loop_s':>8} " + " ".join(f"{'r/s ' + n:>8}" for n in TENANTS) + f" {'r/s all':>8}")
    rollouts = {name: r for name, (r, _, _) in separate.items()}
    print(f"{'separate':>13} {separate_wall:>8.1f} {separate_loop:>8.1f} "
          + " ".join(f"{rollouts[n] / separate_wall:>8.2f}" for n in TENANTS)
          + f" {sum(rollouts.values()) / separate_wall:>8.2f}")
    multi = {name: t["rollouts_trained"] for name, t in summary["tenants"].items()}
    print(f"{'multi-tenant':>13} {wall:>8.1f} {summary['elapsed_s']:>8.1f} "
          + " ".join(f"{multi[n] / wall:>8.2f}" for n in TENANTS) + f" {sum(multi.values()) / wall:>8.2f}")
    print(f"{'x':>13} {wall / separate_wall:>8.2f} {summary['elapsed_s'] / separate_loop:>8.2f} "
          + " ".join(f"{(multi[n] / wall) / (rollouts[n] / separate_wall):>8.2f}" for n in TENANTS)
          + f" {(sum(multi.values()) / wall) / (sum(rollouts.values()) / separate_wall):>8.2f}")
    print("per tenant (multi):", {n: {k: t[k] for k in ("steps", "trainer_time_share", "engine_token_share",
                                                          "samples_per_rollout")}
                                  for n, t in summary["tenants"].items()})


if __name__ == "__main__":
    main()
