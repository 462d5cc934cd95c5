"""A checkpoint's scheduler state as JSON, a pure function (no Ray).

- `ledger_record`: every rollout's state in a checkpoint as JSON (the checkpoint's ledger.json).

It reads a `SchedulerState` (vgbs_ray/scheduler/state.py): settled ids (trained with their step,
dropped with their reason) and the intake's untrained rollouts (ready, waiting for their group,
partly received).
"""

from __future__ import annotations

from collections import Counter

from vgbs_ray.scheduler.state import SchedulerState
from vgbs_ray.scheduler.settled_ids import SettledIds


def ledger_record(state: SchedulerState) -> dict:
    """Every rollout's state in a checkpoint, as JSON: id -> [state, step, reason]; and the counts."""
    rollouts: dict[str, list] = {}
    if state.settled:
        for rid, (kind, step, reason) in SettledIds.from_bytes(state.settled):
            rollouts[str(rid)] = [kind, step, reason]
    for rid in state.intake.rollout_ids:
        rollouts[str(rid)] = ["buffered", None, None]
    by_state = Counter(value[0] for value in rollouts.values())
    return {
        "summary": {"next_step": state.next_step, "rollouts_by_state": dict(by_state),
                    "dropped_by_reason": dict(state.dropped_by_reason),
                    "rejected_samples_by_rule": dict(state.rejected_samples_by_rule)},
        "rollouts": rollouts,
    }
