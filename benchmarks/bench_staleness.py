"""What the staleness rules cost and buy, on a timing model of the closed loop (no Ray, no model).

    .venv/bin/python benchmarks/bench_staleness.py [--steps 300] [--seeds 3]

`tests/staleness_sim.py` models producers (a fifth of the rollouts run 4x longer), the
scheduler and a trainer whose step takes about as long as a short rollout; the rules under
test are the real ones from `vgbs_ray.scheduler.staleness`. For max_staleness 0, 1, 2 and three rule
sets, printed side by side: the share of finished rollouts dropped as stale, the long
rollouts' share among trained rollouts over their share among started ones (1.0 = no
starvation), the trainer's idle share, and rollouts trained per unit of model time.

  full            `StalenessWindow`: admission + last-chance wait + oldest-first fill (the design)
  admission_only  admission; steps fill in arrival order and never wait
  none            no admission, no wait: producers run flat out, the step check drops what is stale
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the model

from tests.staleness_sim import RULE_SETS, SimConfig, simulate  # noqa: E402

BASE = dict(gbs=16, group_size=4, concurrency=32, long_fraction=0.2, short_s=1.0, long_s=4.0, train_s=1.0, sync_s=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print(f"model: {BASE}, {args.steps} steps, mean of {args.seeds} seeds")
    print(f"{'max_staleness':>13} {'rules':>15} {'stale drops':>12} {'long share trained/started':>27} "
          f"{'trainer idle':>13} {'rollouts/s':>11}")
    for max_staleness in (0, 1, 2):
        for rules in RULE_SETS:
            runs = [simulate(SimConfig(**BASE, rules=rules, max_staleness=max_staleness, num_steps=args.steps, seed=seed))
                    for seed in range(args.seeds)]
            drops = statistics.fmean(r.stale_drop_rate() for r in runs)
            share = statistics.fmean(r.long_share(r.trained) / r.long_share(r.started) for r in runs)
            idle = statistics.fmean(r.trainer_idle_share() for r in runs)
            rate = statistics.fmean(len(r.trained) / r.wall_s for r in runs)
            print(f"{max_staleness:>13} {rules:>15} {drops:12.3f} {share:27.2f} {idle:13.2f} {rate:11.2f}")


if __name__ == "__main__":
    main()
