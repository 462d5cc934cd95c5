"""Whether the rollout side may precompute the step layout, or the legacy path applies.

Decided once, when a train group registers. Rollout-side scheduling needs the training
backend's full parallel config and no feature that needs train-side ordering (rollout ids are
always there: the data contract requires one on every sample); any step can then be laid out,
partial ones too (empty padding micro-batches fill an alignment real samples cannot reach).
Otherwise the legacy path: an even DP split, micro-batches chosen by each rank with an
all-reduce(MAX) of counts. It stays for train groups that do not advertise a parallel config
(a trainer of one's own that packs its own micro-batches; `register_train_group(...,
advertise_layout=False)`) and for the features named below, whose ordering only the train side
can satisfy; benchmarks/bench_train_step.py measures it against the layout path. The decision
carries its reason so callers can log it.
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


def decide_scheduling(parallel: ParallelConfig | None, *, features: Iterable[str] = ()) -> SchedulingDecision:
    """Pick rollout-side scheduling or the legacy path for a train group, with the reason."""
    if parallel is None:
        return SchedulingDecision(False, "training backend did not advertise its parallel config")
    blocking = sorted(set(features) & TRAIN_SIDE_ORDERING_FEATURES)
    if blocking:
        return SchedulingDecision(False, f"feature(s) {blocking} need train-side ordering")
    return SchedulingDecision(True, f"rollout-side layout for dp={parallel.dp_size}, cp={parallel.cp_size}, "
                              f"vpp={parallel.vpp_size}, mb_group={parallel.microbatch_group_size_per_vp_stage}")
