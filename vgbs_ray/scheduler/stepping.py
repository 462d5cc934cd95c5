"""Turning a step's ready rollouts into per-rank shards, and the leftover policy.

    planned = plan_step(rollouts, step=k, parallel=parallel, batch=...)   # parallel: the registered train group's
    action = leftover_action(batch.leftover, end_of_input=False)

`plan_step` is pure: it lays the step out with `layout_step` over the rollouts' samples in
first-ready order and builds one `StepShard` per DP rank, each with the micro-batches its rank
runs (the same count on every rank, so no rank agrees on anything at train time). Invariants:
every sample of the given rollouts is on exactly one rank; every shard carries the step's true
`num_rollouts`; siblings share the step. Any non-empty step can be planned: a step with fewer
samples than micro-batches gets empty padding micro-batches, so a step never stalls on alignment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from vgbs_ray.config import BatchConfig, ParallelConfig, LeftoverPolicy
from vgbs_ray.errors import ScheduleError
from vgbs_ray.scheduler.intake import ReadyRollout
from vgbs_ray.layout.schedule import layout_step
from vgbs_ray.layout.shard import StepShard, build_step_shards

LeftoverAction = Literal["partial", "drop", "keep"]


@dataclass(frozen=True)
class PlannedStep:
    shards: list[StepShard]
    num_samples: int
    num_tokens: int
    num_microbatches: int
    """Micro-batches per rank (the same on every rank)."""
    num_padding_microbatches: int
    """Empty micro-batches over all ranks."""


def plan_step(
    rollouts: Sequence[ReadyRollout],
    *,
    step: int,
    parallel: ParallelConfig,
    batch: BatchConfig,
) -> PlannedStep:
    """Lay out one step and build its shards (see module docstring). Pure; O(n log n) in samples."""
    if not rollouts:
        raise ScheduleError("a step needs at least one rollout")
    samples = [s for r in rollouts for s in r.samples]
    ids = tuple(r.rollout_id for r in rollouts)
    lengths = np.array([s.total_length for s in samples], dtype=np.int64)
    layout = layout_step(ids, range(len(samples)), lengths, parallel, batch)
    return PlannedStep(
        shards=build_step_shards(samples, layout, step),
        num_samples=len(samples),
        num_tokens=int(lengths.sum()),
        num_microbatches=layout.num_microbatches,
        num_padding_microbatches=layout.num_padding_microbatches,
    )


def leftover_action(policy: LeftoverPolicy, *, end_of_input: bool) -> LeftoverAction:
    """What a flush does with fewer than gbs ready rollouts.

    "partial" -> train them as one smaller step; "drop" -> drop them (reason "leftover");
    "carry" -> keep them for the next step, except at end of input, where no next step
    comes, so they are dropped (reason "carried_at_end_of_input").
    """
    if policy == "partial":
        return "partial"
    if policy == "drop" or end_of_input:
        return "drop"
    return "keep"


def leftover_drop_reason(policy: LeftoverPolicy) -> str:
    return "leftover" if policy == "drop" else "carried_at_end_of_input"
