"""Whether the rollout side may precompute the step layout, or the legacy path applies.

Rollout-side scheduling needs the training backend's full parallel config, at least one
step's worth of rollouts, and no feature that needs train-side ordering (rollout ids are
always there: the data contract requires one on every sample). Otherwise the legacy path: an even DP split, micro-batches chosen by each rank
with an all-reduce(MAX) of counts. The decision carries its reason so callers can log it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from vgbs_ray.config import ParallelConfig

# Features whose ordering constraints only the train side can satisfy.
TRAIN_SIDE_ORDERING_FEATURES = frozenset({"multi_adapter", "multimodal"})


@dataclass(frozen=True)
class SchedulingDecision:
    rollout_side: bool
    reason: str


def decide_scheduling(
    parallel: ParallelConfig | None,
    *,
    num_rollouts: int,
    global_batch_size: int,
    features: Iterable[str] = (),
) -> SchedulingDecision:
    """Pick rollout-side scheduling or the legacy path, with the reason."""
    if parallel is None:
        return SchedulingDecision(False, "training backend did not advertise its parallel config")
    if num_rollouts < global_batch_size:
        return SchedulingDecision(
            False, f"only {num_rollouts} rollouts, fewer than one step (global_batch_size={global_batch_size})"
        )
    blocking = sorted(set(features) & TRAIN_SIDE_ORDERING_FEATURES)
    if blocking:
        return SchedulingDecision(False, f"feature(s) {blocking} need train-side ordering")
    return SchedulingDecision(True, f"rollout-side layout for dp={parallel.dp_size}, cp={parallel.cp_size}, "
                              f"vpp={parallel.vpp_size}, mb_group={parallel.microbatch_group_size_per_vp_stage}")
