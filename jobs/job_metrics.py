"""The driver's Ray metrics: what the closed loop does per step, next to the scheduler's own.

The SchedulerActor exports what it forms (`actors/scheduler_metrics.py`: rollouts per step,
buffer, drops by reason, staleness of the step it formed). The job's driver exports what only it
sees: the trained step's reward, the policy version it published, how long the weight sync took,
how long the trainer waited for its shard, and how much of the engines' time went idle. Each is a
gauge of the last step, tagged with the run's output directory, on every node's metrics export
port (Prometheus text, prefix `ray_`), e.g. `ray_vgbs_job_policy_version{run="runs/latest"} 12.0`.
`docs/grafana/vgbs-dashboard.json` plots these and the scheduler's series.
"""

from __future__ import annotations

from ray.util.metrics import Gauge

TAGS = ("run",)

STEP_GAUGES = {
    "vgbs_job_step": "Index of the last trained step",
    "vgbs_job_step_rollouts": "Rollouts trained in the last step",
    "vgbs_job_reward": "Mean reward of the last step's rollouts",
    "vgbs_job_policy_version": "Policy version published after the last step (optimizer steps taken)",
    "vgbs_job_weight_sync_s": "Seconds to gather and publish the last step's weights",
    "vgbs_job_trainer_idle_s": "Seconds the trainer waited for the last step's shards",
    "vgbs_job_staleness_mean": "Mean staleness (versions) of the last step's rollouts",
    "vgbs_job_staleness_max": "Largest staleness (versions) in the last step",
    "vgbs_job_log_prob_mismatch": "Mean |trainer - engine| log-prob of the last step's response tokens",
}
ENGINE_GAUGES = {
    "vgbs_job_engine_idle_share": "Share of the rollout engines' time spent waiting for requests (since start)",
}
METRIC_NAMES = tuple(STEP_GAUGES) + tuple(ENGINE_GAUGES)
"""Every series this module exports (the dashboard test checks its panels against these)."""


class JobMetrics:
    """Gauges of the last trained step; `None` values (not measured in this run) are not set."""

    def __init__(self, run: str):
        self._tags = {"run": run}
        self._gauges = {name: Gauge(name, description=text, tag_keys=TAGS)
                        for name, text in {**STEP_GAUGES, **ENGINE_GAUGES}.items()}

    def on_step(self, *, step: int, num_rollouts: int, reward: float, policy_version: int | None = None,
                weight_sync_s: float | None = None, trainer_idle_s: float | None = None,
                staleness_mean: float | None = None, staleness_max: float | None = None,
                log_prob_mismatch: float | None = None) -> None:
        values = {"vgbs_job_step": step, "vgbs_job_step_rollouts": num_rollouts, "vgbs_job_reward": reward,
                  "vgbs_job_policy_version": policy_version, "vgbs_job_weight_sync_s": weight_sync_s,
                  "vgbs_job_trainer_idle_s": trainer_idle_s, "vgbs_job_staleness_mean": staleness_mean,
                  "vgbs_job_staleness_max": staleness_max, "vgbs_job_log_prob_mismatch": log_prob_mismatch}
        self._set(values)

    def on_engines(self, idle_share: float) -> None:
        self._set({"vgbs_job_engine_idle_share": idle_share})

    def _set(self, values: dict) -> None:
        for name, value in values.items():
            if value is not None and value == value:  # NaN: not measured this step
                self._gauges[name].set(float(value), tags=self._tags)
