"""Ray metrics of the SchedulerActor (`ray.util.metrics`), tagged with the scheduler's name.

They appear on every node's metrics export port (Prometheus text, prefix `ray_`), e.g.
`ray_vgbs_scheduler_step_rollouts{scheduler="vgbs-scheduler"} 24.0`. Per-step values are
gauges of the last emitted step (one series, not one per step) plus counters of totals.

Writes are buffered: the `on_*` calls (per push, per step) only add to plain counts and keep
the latest gauge values; `publish()` records them (the actor calls it every METRICS_PUBLISH_S and
on rare events). One Ray metric write cost the event loop 0.1-0.2 ms in the push benchmark, what
ingesting five to ten samples costs, and the export to Prometheus is periodic anyway.
"""

from __future__ import annotations

import asyncio
from collections import Counter as Counts

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
        self.step_microbatches = g("vgbs_scheduler_step_microbatches", "Micro-batches per rank in the last emitted step")
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
        self.tokens_in_use = g("vgbs_scheduler_admission_tokens_in_use",
                               "Token budget in use: rollouts in flight x expected tokens per rollout (admission_token_budget)")
        self.token_refusals = g("vgbs_scheduler_admission_token_refusals",
                                "Groups refused by the token budget since start")
        self.latency = Histogram("vgbs_scheduler_scheduling_latency_s", description="Step formable -> all shards in the object store",
                                 boundaries=LATENCY_BOUNDARIES_S, tag_keys=TAGS)
        self._increments: Counts = Counts()   # (Counter, extra tag or None) -> not yet recorded
        self._gauge_values: dict = {}         # Gauge -> latest value, not yet recorded
        self._latencies: list[float] = []     # scheduling latencies, not yet observed

    def publish(self) -> None:
        """Record everything buffered since the last call."""
        for (counter, extra), value in self._increments.items():
            counter.inc(value, tags=self._tags if extra is None else {**self._tags, extra[0]: extra[1]})
        for gauge, value in self._gauge_values.items():
            gauge.set(value, tags=self._tags)
        for latency in self._latencies:
            self.latency.observe(latency, tags=self._tags)
        self._increments.clear()
        self._gauge_values.clear()
        self._latencies.clear()

    def on_submit(self, accepted: int, rejected_rules, deferred: int) -> None:
        increments = self._increments
        if accepted:
            increments[self.samples_accepted, None] += accepted
        if deferred:
            increments[self.samples_deferred, None] += deferred
        for rule in rejected_rules:
            increments[self.rejected, ("rule", str(rule))] += 1

    def on_drop(self, reason: str, count: int = 1) -> None:
        if count:
            self._increments[self.dropped, ("reason", reason)] += count

    def on_step(self, record) -> None:
        self._gauge_values.update({
            self.step: record.step, self.step_rollouts: record.num_rollouts, self.step_samples: record.num_samples,
            self.step_microbatches: record.microbatches_per_rank[0] or 0, self.step_tokens: record.num_tokens,
        })
        self._increments[self.rollouts_scheduled, None] += record.num_rollouts
        self._latencies.append(record.scheduling_latency_s)
        if record.staleness_max is not None:  # steps of unversioned rollouts leave the last value
            self._gauge_values.update({self.staleness_mean: record.staleness_mean, self.staleness_max: record.staleness_max})

    def on_stale_drop(self, count: int) -> None:
        if count:
            self._increments[self.stale_dropped, None] += count

    def publish_state(self, core) -> None:
        """Set the gauges of `core`'s state (a vgbs_ray.scheduler.core.SchedulerCore), then `publish()`."""
        self._gauge_values.update({
            self.buffered_rollouts: core.intake.num_buffered_rollouts, self.buffered_samples: core.intake.buffered_samples,
            self.steps_in_flight: core.next_step - core.steps_trained, self.policy_version: core.next_step,
        })
        if core.tokens is not None:
            self._gauge_values.update({self.tokens_in_use: core.tokens.tokens_in_use,
                                       self.token_refusals: core.tokens.refusals})
        self.publish()

    async def publish_every(self, core, seconds: float) -> None:
        """`publish_state(core)` every `seconds`, until cancelled: pushes, steps and acks only buffer theirs."""
        while True:
            self.publish_state(core)
            await asyncio.sleep(seconds)
