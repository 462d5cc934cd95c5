"""Metrics as (sum, count) pairs, reduced count-weighted.

A rank's mean over its samples is meaningless next to another rank's mean over a different
number of samples; averaging those means over-weights small shards. Every metric therefore
leaves a micro-batch or rank as `(sum, count)`; reduction adds sums and counts separately,
and the value is total sum / total count.
"""

from __future__ import annotations

from typing import Iterable, Mapping

MetricPairs = dict[str, tuple[float, float]]


def add_metric(pairs: MetricPairs, name: str, total: float, count: float) -> None:
    """Accumulate `total` over `count` units into pairs[name] in place."""
    previous_sum, previous_count = pairs.get(name, (0.0, 0.0))
    pairs[name] = (previous_sum + float(total), previous_count + float(count))


def reduce_metric_pairs(parts: Iterable[Mapping[str, tuple[float, float]]]) -> MetricPairs:
    """Sum the (sum, count) pairs of several micro-batches or ranks, per metric name."""
    reduced: MetricPairs = {}
    for part in parts:
        for name, (total, count) in part.items():
            add_metric(reduced, name, total, count)
    return reduced


def metric_values(pairs: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """Count-weighted value of each metric: total sum / total count (0 for an empty count)."""
    return {name: (total / count if count else 0.0) for name, (total, count) in pairs.items()}
