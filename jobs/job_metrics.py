"""The driver's Ray metrics: what the closed loop does per step, next to the scheduler's own.

The SchedulerActor exports what it forms (`actors/scheduler_metrics.py`: rollouts per step,
buffer, drops by reason, staleness of the step it formed). The job's driver exports what only it
sees: the trained step's reward, the policy version it trained, how long the weight sync took,
how long the trainer waited for its shard, and how much of the engines' time went idle. Each is a
gauge of the last step, named from the run's metric vocabulary (jobs/metric_names.py: the
entries marked `ray`), tagged with the run's output directory, on every node's metrics export
port (Prometheus text, prefix `ray_`), e.g. `ray_vgbs_job_policy_version{run="runs/latest"} 12.0`.
`docs/grafana/vgbs-dashboard.json` plots these and the scheduler's series.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge

from jobs.metric_names import RAY_GAUGES, STEP, ray_name

TAGS = ("run",)

GAUGES = {ray_name(STEP): "Index of the last trained step",
          **{metric.ray_name: f"{metric.help} ({metric.unit}; last trained step)" for metric in RAY_GAUGES}}
RECOVERIES = "vgbs_job_recoveries_total"
"""Counter: actors the job recovered, tagged `actor` = train_group | scheduler | producer | engine."""
METRIC_NAMES = (*GAUGES, RECOVERIES)
"""Every series this module exports (the dashboard test checks its panels against these)."""


class JobMetrics:
    """Gauges of the last trained step; a name missing from a step's values (not measured) is not set."""

    def __init__(self, run: str):
        self._tags = {"run": run}
        self._gauges = {name: Gauge(name, description=text, tag_keys=TAGS) for name, text in GAUGES.items()}
        self._recoveries = Counter(RECOVERIES, description="Actors the job recovered (cumulative), by what died",
                                   tag_keys=(*TAGS, "actor"))

    def on_recovery(self, actor: str) -> None:
        """One more recovered `actor` (train_group, scheduler, producer, engine); thread-safe (Ray's metrics are)."""
        self._recoveries.inc(1.0, tags={**self._tags, "actor": actor})

    def on_step(self, step: int, values: dict[str, float]) -> None:
        """`values`: vocabulary name -> value (`jobs.metric_names.step_values`); names without a gauge are skipped."""
        self._set(ray_name(STEP), step)
        for name, value in values.items():
            self._set(ray_name(name), value)

    def _set(self, name: str, value: float) -> None:
        gauge = self._gauges.get(name)
        if gauge is not None and value is not None and value == value:  # NaN: not measured this step
            gauge.set(float(value), tags=self._tags)
