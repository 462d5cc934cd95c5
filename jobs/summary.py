"""The run's summary and its parts, from what the step loop and the watches recorded (pure reporting).

    line = step_line(result, record)                          # one trained step's line (jobs/progress.py)
    summary = {**summarize(stats, lines, elapsed_s, controller), "producers": producers_outcome(watches)}
    summary["closed_loop"] = closed_loop_summary(lines, reports, rollouts, stats=stats, elapsed_s=elapsed_s,
                                                 engine_replacements=engine_watch.replacements)

Fields and units are listed in docs/metrics.md; `jobs/train.py` writes the dict to summary.json.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jobs.progress import StepLine

if TYPE_CHECKING:  # annotations only: reporting imports no actors
    from jobs.rollout_source import RolloutSource
    from jobs.producer_watch import ProducerWatch
    from jobs.controller import RunController


def engine_summaries(usage) -> list[dict]:
    """Per live engine: idle share, mean requests per vLLM step (how full continuous batching kept it), weight loads
    (of them, applied with requests in flight), the prefix cache's hit rate (prompt tokens reused) and the KV cache's
    size in tokens."""
    return [{"engine": u.engine, "idle_share": round(u.idle_share, 3), "requests_per_step": round(u.requests_per_step, 2),
             "weight_loads": u.weight_loads, "in_flight_loads": u.in_flight_loads, "kv_cache_tokens": u.kv_cache_tokens,
             "prefix_cache_hit_rate": None if u.prefix_cache_hit_rate is None else round(u.prefix_cache_hit_rate, 3)}
            for u in usage]


def step_line(result, record) -> StepLine:
    return StepLine(
        step=result.step, num_rollouts=result.num_rollouts, num_samples=record.num_samples,
        microbatches_per_rank=record.microbatches_per_rank[0], num_tokens=record.num_tokens,
        loss=result.metrics.get("loss", float("nan")), reward=result.metrics.get("reward", float("nan")),
        step_time_s=result.step_time_s, lr=result.lr, partial=record.partial,
        # The scheduler's staleness figures, where its records carry them.
        staleness_mean=record.staleness_mean, staleness_max=record.staleness_max,
        log_prob_mismatch=result.metrics.get("log_prob_mismatch"), shard_wait_s=result.shard_wait_s,
        loss_metrics={name: value for name, value in result.metrics.items() if name not in _LINE_METRICS},
    )


_LINE_METRICS = ("loss", "reward", "log_prob_mismatch")
"""The trainer's metrics a StepLine has a field for; the rest are the loss's own (`StepLine.loss_metrics`)."""


def input_failure(summary: dict, num_steps: int | None) -> str | None:
    """Why a run that ended without a raised error still failed, or None: every producer failed, or some failed
    and the run trained fewer steps than asked (its input died, as opposed to input that ended by design)."""
    producers, steps = summary["producers"], summary["steps"]
    if not producers["failed"]:
        return None
    if producers["finished"] + producers["stopped"] == 0:
        return (f"every producer failed ({producers['failed']}, after {len(producers['restarts'])} restarts): the run "
                f"trained {steps} steps; the producers' errors are in the log above")
    if num_steps is not None and steps < num_steps:
        return (f"{producers['failed']} producer(s) failed and the run trained {steps} of run.num_steps={num_steps} "
                "steps: its input died before the run ended; the producers' errors are in the log above")
    return None


def producers_outcome(watches: list[ProducerWatch]) -> dict:
    """How the producers ended, summed over every producer watch of the run (one per scheduler it had)."""
    outcomes = [watch.outcome() for watch in watches]
    total = {key: sum(o[key] for o in outcomes) for key in ("finished", "stopped", "failed", "abandoned_rollouts")}
    return {**total, "input_closed": outcomes[-1]["input_closed"],
            "restarts": [r for o in outcomes for r in o["restarts"]]}


def summarize(stats, trained: list[StepLine], elapsed_s: float, controller: RunController | None = None) -> dict:
    """The run's summary: rollouts per step, what the ledger says became of every rollout, throughput,
    and each recovered failure (what it cost)."""
    rollouts = sum(line.num_rollouts for line in trained)
    return {
        "steps": len(trained),
        "rollouts_per_step": [line.num_rollouts for line in trained],
        "samples_per_step": [line.num_samples for line in trained],
        "rollouts_trained": rollouts,
        "rollouts_by_state": stats.ledger.rollouts_by_state,
        "dropped_by_reason": stats.ledger.dropped_by_reason,
        "rejected_samples_by_rule": stats.ledger.rejected_samples_by_rule,
        "incomplete_rollouts": len(stats.incomplete_rollouts),
        "consumed_rollouts": controller.consumed_rollouts if controller is not None else None,
        "recoveries": [dataclasses.asdict(r) for r in controller.recoveries] if controller is not None else [],
        "elapsed_s": round(elapsed_s, 2),
        "rollouts_per_s": round(rollouts / elapsed_s, 3) if elapsed_s > 0 else None,
    }


def closed_loop_summary(trained: list[StepLine], reports: list, loop: RolloutSource, *, stats=None,
                        elapsed_s: float | None = None, engine_replacements: list | None = None) -> dict:
    """The closed loop's part of the summary: reward curve ends, staleness, sync times, producer counts,
    groups the agents lost by reason, the agents' own metrics (producer figures count this run's producers
    only: a resumed run's ledger figures include the earlier run, these do not), and how the overlap went
    (`overlap_summary`, when the scheduler's `stats` and the step loop's `elapsed_s` are given)."""
    def mean(values):
        values = [v for v in values if v is not None and v == v]
        return round(sum(values) / len(values), 4) if values else None

    sampled = [line.sampled_reward for line in trained]
    metric_means, metric_rollouts = agent_metrics(reports)
    counts = {key: sum(getattr(r, key) for r in reports)
              for key in ("groups", "rollouts", "samples", "deferred_retries", "rejected_samples",
                          "abandoned_rollouts", "not_admitted", "skipped_known_groups", "endpoint_refused",
                          "endpoint_after_end")}
    failed: dict[str, int] = {}
    for report in reports:
        for reason, groups in report.failed_groups.items():
            failed[reason] = failed.get(reason, 0) + groups
    return {
        "sampled_reward_first10": mean(sampled[:10]), "sampled_reward_last10": mean(sampled[-10:]),
        "trained_reward_first10": mean([line.reward for line in trained[:10]]),
        "trained_reward_last10": mean([line.reward for line in trained[-10:]]),
        "staleness_mean": mean([line.staleness_mean for line in trained]),
        "staleness_max": max((line.staleness_max for line in trained if line.staleness_max is not None), default=None),
        "weight_sync_s_mean": mean([line.weight_sync_s for line in trained]),
        "trainer_wait_s_total": round(sum(line.shard_wait_s or 0.0 for line in trained), 2),
        "engine_load_s_mean": mean([seconds for _, seconds in loop.load_times_s]),
        # the first load carries the whole model; later ones, with LoRA, the adapter alone
        "engine_load_mb_first": round(loop.load_bytes[0][1] / 1e6, 3) if loop.load_bytes else None,
        "engine_load_mb_last": round(loop.load_bytes[-1][1] / 1e6, 3) if loop.load_bytes else None,
        "engine_idle_share": round(loop.engine_idle_share(), 3),
        "engines": engine_summaries(loop.engines.utilization()) if loop.engines is not None else [],
        "restored_versions": loop.restored_versions,
        "weight_channel_failures": loop.channel_failures,
        "engine_replacements": list(engine_replacements or []),
        "producers": counts,
        "failed_groups": failed,
        "agent_metrics": metric_means,
        "agent_metric_rollouts": metric_rollouts,
        "endpoint_outcomes": endpoint_outcomes(reports),
        "engine_wait_s": round(sum(r.engine_wait_s for r in reports), 2),
        "producer_idle_s": round(sum(r.idle_s for r in reports), 2),
        **(overlap_summary(trained, stats, elapsed_s) if stats is not None else {}),
    }


def agent_metrics(reports: list) -> tuple[dict, dict]:
    """({name: mean over the pushed rollouts that reported it}, {name: how many did}), over every producer: a
    metric some rollouts omit is averaged over the others, never counted as 0 for them."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for report in reports:
        for name, mean in report.agent_metrics.items():
            count = report.agent_metric_counts.get(name, 0)
            sums[name] = sums.get(name, 0.0) + mean * count
            counts[name] = counts.get(name, 0) + count
    return {name: round(sums[name] / counts[name], 4) for name in sums if counts[name]}, counts


def endpoint_outcomes(reports: list) -> dict:
    """The endpoint's tool-call parse outcomes and new samples, summed over every producer."""
    total: dict[str, int] = {}
    for report in reports:
        for name, count in report.endpoint_outcomes.items():
            total[name] = total.get(name, 0) + count
    return total


def overlap_summary(trained: list[StepLine], stats, elapsed_s: float | None) -> dict:
    """Did sampling overlap training, and at what cost (shares are fractions in [0, 1]):

    - trainer_idle_share: the train group's summed shard waits over the step loop's wall time;
    - finished_rollouts: rollouts the scheduler accepted whole (trained, dropped for any reason
      or still buffered; `incomplete_rollout` drops excluded); stale_drop_share: the ones dropped
      as too stale (`stale`) over them;
    - with a token budget: the groups it refused and its final expectation of a rollout's tokens.
    """
    drops = stats.ledger.dropped_by_reason
    finished = stats.ledger.num_rollouts_accepted - drops.get("incomplete_rollout", 0)
    wait_s = sum(line.shard_wait_s or 0.0 for line in trained)
    return {
        "trainer_idle_share": round(wait_s / elapsed_s, 3) if elapsed_s else None,
        "finished_rollouts": finished,
        "stale_dropped_rollouts": drops.get("stale", 0),
        "stale_drop_share": round(drops.get("stale", 0) / finished, 4) if finished else None,
        # admission by tokens (scheduler.admission_token_budget): groups it refused, its final expectation
        **({"admission_token_budget": stats.token_budget, "admission_token_refusals": stats.token_refusals,
            "admission_tokens_per_rollout": round(stats.tokens_per_rollout, 1)}
           if stats.tokens_per_rollout is not None else {}),
    }
