"""Ray metrics of the SchedulerActor (`ray.util.metrics`), tagged with the scheduler's name.

They appear on every node's metrics export port (Prometheus text, prefix `ray_`), e.g.
`ray_vgbs_scheduler_step_rollouts{scheduler="vgbs-scheduler"} 24.0`. Per-step values are
gauges of the last emitted step (one series, not one per step) plus counters of totals.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

TAGS = ("scheduler",)
LATENCY_BOUNDARIES_S = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]


class SchedulerMetrics:
    def __init__(self, name: str):
        self._tags = {"scheduler": name}
        g = lambda n, d: Gauge(n, description=d, tag_keys=TAGS)  # noqa: E731
        self.step = g("vgbs_scheduler_step", "Index of the last emitted step")
        self.step_rollouts = g("vgbs_scheduler_step_rollouts", "Rollouts in the last emitted step")
        self.step_samples = g("vgbs_scheduler_step_samples", "Samples in the last emitted step")
        self.step_microbatches = g("vgbs_scheduler_step_microbatches", "Micro-batches per rank in the last emitted step (0: legacy)")
        self.step_tokens = g("vgbs_scheduler_step_tokens", "Tokens in the last emitted step")
        self.buffered_rollouts = g("vgbs_scheduler_buffered_rollouts", "Rollouts buffered (open, waiting, ready)")
        self.buffered_samples = g("vgbs_scheduler_buffered_samples", "Samples buffered")
        self.steps_in_flight = g("vgbs_scheduler_steps_in_flight", "Steps emitted but not yet acknowledged by every rank")
        self.rollouts_scheduled = Counter("vgbs_scheduler_rollouts_scheduled_total", description="Rollouts scheduled", tag_keys=TAGS)
        self.samples_accepted = Counter("vgbs_scheduler_samples_accepted_total", description="Samples accepted", tag_keys=TAGS)
        self.samples_deferred = Counter("vgbs_scheduler_samples_deferred_total", description="Samples deferred by backpressure", tag_keys=TAGS)
        self.dropped = Counter("vgbs_scheduler_dropped_rollouts_total", description="Rollouts dropped, by reason",
                               tag_keys=TAGS + ("reason",))
        self.rejected = Counter("vgbs_scheduler_rejected_samples_total", description="Samples rejected, by rule",
                                tag_keys=TAGS + ("rule",))
        self.staleness_mean = g("vgbs_scheduler_step_staleness_mean", "Mean staleness (policy versions) of the last step's versioned rollouts")
        self.staleness_max = g("vgbs_scheduler_step_staleness_max", "Max staleness (policy versions) of the last step's versioned rollouts")
        self.policy_version = g("vgbs_scheduler_policy_version", "The policy version the next step trains (= steps emitted)")
        self.stale_dropped = Counter("vgbs_scheduler_stale_dropped_rollouts_total",
                                     description="Rollouts dropped as too stale to train (max_staleness)", tag_keys=TAGS)
        self.latency = Histogram("vgbs_scheduler_scheduling_latency_s", description="Step formable -> all shards in the object store",
                                 boundaries=LATENCY_BOUNDARIES_S, tag_keys=TAGS)

    def on_submit(self, accepted: int, rejected_rules, deferred: int) -> None:
        if accepted:
            self.samples_accepted.inc(accepted, tags=self._tags)
        if deferred:
            self.samples_deferred.inc(deferred, tags=self._tags)
        for rule in rejected_rules:
            self.rejected.inc(1, tags={**self._tags, "rule": str(rule)})

    def on_drop(self, reason: str, count: int = 1) -> None:
        if count:
            self.dropped.inc(count, tags={**self._tags, "reason": reason})

    def on_step(self, record) -> None:
        self.step.set(record.step, tags=self._tags)
        self.step_rollouts.set(record.num_rollouts, tags=self._tags)
        self.step_samples.set(record.num_samples, tags=self._tags)
        self.step_microbatches.set(record.microbatches_per_rank[0] or 0, tags=self._tags)
        self.step_tokens.set(record.num_tokens, tags=self._tags)
        self.rollouts_scheduled.inc(record.num_rollouts, tags=self._tags)
        self.latency.observe(record.scheduling_latency_s, tags=self._tags)
        if record.staleness_max is not None:  # steps of unversioned rollouts leave the last value
            self.staleness_mean.set(record.staleness_mean, tags=self._tags)
            self.staleness_max.set(record.staleness_max, tags=self._tags)

    def on_stale_drop(self, count: int) -> None:
        if count:
            self.stale_dropped.inc(count, tags=self._tags)

    def on_policy_version(self, version: int) -> None:
        self.policy_version.set(version, tags=self._tags)

    def on_buffer(self, rollouts: int, samples: int, steps_in_flight: int) -> None:
        self.buffered_rollouts.set(rollouts, tags=self._tags)
        self.buffered_samples.set(samples, tags=self._tags)
        self.steps_in_flight.set(steps_in_flight, tags=self._tags)
