"""The run's metric vocabulary: one name per quantity, shared by every place a number goes.

A name is `section/quantity`, with the unit in it where it is not a plain count (`_s` seconds;
`share/` a fraction in [0, 1]). TensorBoard and W&B group charts by the section before the
slash. The same table says, for each name:

- the StepLine field it is read from (what the step line prints and `steps.jsonl` stores: those
  keep their field names; this table is the one mapping between the two),
- whether the driver exports it as a Ray gauge: the Ray name is derived from it (`ray_name`),
  `vgbs_job_` + the name with every character outside [a-zA-Z0-9_] as `_`
  (`time/weight_sync_s` -> `vgbs_job_time_weight_sync_s`).

Per-step values come from one trained step's line (`step_values`). Counters (`counter_values`)
are cumulative since the run's first step (a resumed run continues the counts its checkpoint
holds): the scheduler's ledger (drops by reason, rejected samples by rule), refused admissions,
and the job's recovered failures; they are read where the driver already has the scheduler's
stats (each checkpoint), never with an extra call on the step path. docs/metrics.md prints this
table (`markdown_table`); a test checks the two agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class MetricName:
    name: str
    unit: str
    help: str
    field: str | None = None
    """The StepLine / steps.jsonl field it is read from; None for derived values and counters."""
    ray: bool = False
    """Exported by the driver as a Ray gauge of the last trained step (jobs/job_metrics.py)."""
    source: str = "step"
    """"step": one trained step's line; "loss": one of the line's `loss_metrics`, by name; "counter": cumulative,
    sampled at each checkpoint."""

    @property
    def ray_name(self) -> str:
        return ray_name(self.name)


def ray_name(name: str) -> str:
    """The Ray metric name of a vocabulary name (Ray allows [a-zA-Z0-9_])."""
    return "vgbs_job_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


STEP = "step"
"""The x axis of every series: the run's global step (resumed runs continue it)."""

VOCABULARY: tuple[MetricName, ...] = (
    MetricName("step/rollouts", "rollouts", "rollouts trained in the step (gbs for a full step, fewer for a partial one)",
               "num_rollouts", ray=True),
    MetricName("step/samples", "samples", "training samples of those rollouts (a rollout yields 1..N)", "num_samples"),
    MetricName("step/tokens", "tokens", "tokens (prompt + response) of the step's samples", "num_tokens"),
    MetricName("step/partial", "0/1", "1 for a partial step (fewer rollouts than gbs), 0 for a full one", "partial"),
    MetricName("step/microbatches_per_rank", "micro-batches", "micro-batches each DP rank ran",
               "microbatches_per_rank"),
    MetricName("train/loss", "loss", "the step's loss: mean over its rollouts of each rollout's token mean", "loss"),
    MetricName("train/lr", "lr", "learning rate of the step", "lr"),
    MetricName("reward/trained", "reward", "mean reward of the step's rollouts", "reward", ray=True),
    MetricName("reward/sampled", "reward", "closed loop: mean reward of every rollout pushed since the previous step, "
               "groups the dynamic-sampling filter dropped included", "sampled_reward"),
    MetricName("policy/version", "versions", "closed loop: the policy version the step trained (optimizer steps before "
               "it); it publishes version + 1", "policy_version", ray=True),
    MetricName("staleness/mean", "versions", "mean over the step's rollouts of policy version - oldest version that "
               "generated it", "staleness_mean", ray=True),
    MetricName("staleness/max", "versions", "largest staleness in the step", "staleness_max", ray=True),
    MetricName("logprob/mismatch", "nats/token", "closed loop: mean |trainer - engine| log-prob per response token",
               "log_prob_mismatch", ray=True),
    MetricName("loss/<metric>", "per trained token", "the policy loss's own metrics and its correction's, each a mean "
               "over the step's trained tokens: clip_fraction, ratio, approx_kl, is_weight, is_truncated, "
               "sequence_ratio, correction_weight, correction_truncated / correction_masked (docs/losses.md)",
               "loss_metrics", source="loss"),
    MetricName("time/step_s", "s", "the slowest rank's train time of the step (shard wait excluded)", "step_time_s"),
    MetricName("time/weight_sync_s", "s", "closed loop: trainer-side seconds to publish the step's weights",
               "weight_sync_s", ray=True),
    MetricName("time/engine_load_s", "s", "closed loop: the slowest engine's load of the newest version whose load "
               "had finished by the step's end", "engine_load_s"),
    MetricName("time/trainer_wait_s", "s", "seconds the train group waited for the step's shards", "shard_wait_s",
               ray=True),
    MetricName("share/trainer_idle", "fraction", "shard wait / (shard wait + train time) of the step"),
    MetricName("share/engine_idle", "fraction", "closed loop: share of the engines' time since start with no request "
               "(read every 10 steps)", "engine_idle_share", ray=True),
    MetricName("drops/<reason>", "rollouts", "rollouts dropped, by reason (cumulative)", source="counter"),
    MetricName("rejections/<rule>", "samples", "samples rejected, by the rule they broke (cumulative)", source="counter"),
    MetricName("admission/refusals", "groups", "groups admission control refused (cumulative; a producer asks again)",
               source="counter"),
    MetricName("run/recoveries", "failures", "actors recovered in this job: train groups, schedulers, producers, engines (cumulative)",
               source="counter"),
)
BY_NAME = {metric.name: metric for metric in VOCABULARY}
RAY_GAUGES = tuple(metric for metric in VOCABULARY if metric.ray)


def _trainer_idle_share(line) -> float | None:
    wait, train = line.shard_wait_s, line.step_time_s
    if wait is None or train is None or wait + train <= 0:
        return None
    return wait / (wait + train)


DERIVED: dict[str, Callable] = {"share/trainer_idle": _trainer_idle_share}


def step_values(line) -> dict[str, float]:
    """The vocabulary's per-step values of one StepLine: name -> float; a value not measured in
    this run (None, NaN) is left out, so no sink records a made-up zero."""
    values = {}
    for metric in VOCABULARY:
        if metric.source != "step":
            continue
        value = getattr(line, metric.field) if metric.field is not None else DERIVED[metric.name](line)
        if value is None or isinstance(value, str):
            continue
        value = float(value)
        if value == value:
            values[metric.name] = value
    for name, value in (getattr(line, "loss_metrics", None) or {}).items():
        if value == value:
            values[f"loss/{name}"] = float(value)
    return values


def counter_values(*, dropped_by_reason: dict, rejected_samples_by_rule: dict, refused_admissions: int,
                   recoveries: int) -> dict[str, float]:
    """The cumulative counters, named: drops/<reason>, rejections/<rule>, admission/refusals, run/recoveries."""
    values = {f"drops/{reason}": float(count) for reason, count in sorted(dropped_by_reason.items())}
    values.update({f"rejections/{rule}": float(count) for rule, count in sorted(rejected_samples_by_rule.items())})
    values["admission/refusals"] = float(refused_admissions)
    values["run/recoveries"] = float(recoveries)
    return values


def counters_from_stats(stats, recoveries: int) -> dict[str, float]:
    """`counter_values` of a SchedulerStats (vgbs_ray/scheduler/types.py) and the job's recovery count."""
    return counter_values(dropped_by_reason=stats.ledger.dropped_by_reason,
                          rejected_samples_by_rule=stats.ledger.rejected_samples_by_rule,
                          refused_admissions=stats.refused_admissions, recoveries=recoveries)


SCHEDULER_SERIES = {
    "step/samples": "vgbs_scheduler_step_samples", "step/tokens": "vgbs_scheduler_step_tokens",
    "step/microbatches_per_rank": "vgbs_scheduler_step_microbatches",
    "drops/<reason>": 'vgbs_scheduler_dropped_rollouts_total{reason}',
    "rejections/<rule>": 'vgbs_scheduler_rejected_samples_total{rule}',
}
"""Quantities the SchedulerActor already exports under its own names (of the step it formed)."""


def markdown_table() -> str:
    """The vocabulary as docs/metrics.md shows it."""
    rows = ["| name | unit | what | steps.jsonl field | Ray metric (prefix `ray_`) |", "| --- | --- | --- | --- | --- |"]
    for metric in VOCABULARY:
        field = f"`{metric.field}`" if metric.field else ("derived" if metric.source == "step" else "-")
        ray = f"`{metric.ray_name}`" if metric.ray else (f"`{SCHEDULER_SERIES[metric.name]}` (scheduler)"
                                                         if metric.name in SCHEDULER_SERIES else "-")
        what = metric.help.replace("|", "\\|")  # a table cell
        rows.append(f"| `{metric.name}` | {metric.unit} | {what} | {field} | {ray} |")
    return "\n".join(rows)
