"""What a resumed job does with a checkpoint's scheduler state, as pure functions (no Ray).

- `dataset_prompts_to_resend`: the Ray Data source has no cursor (the scheduler reads its rows,
  the driver never sees them), so a resumed job sends again only the dataset prompts the
  checkpoint does not hold whole; a rollout of those it already holds is rejected by rule.
- `ledger_record`: every rollout's state in a checkpoint as JSON (the checkpoint's ledger.json).

Both read a `SchedulerState` (vgbs_ray/scheduler_state.py): settled ids (trained with their step,
dropped with their reason) and the intake's untrained rollouts (ready, waiting for their group,
partly received).
"""

from __future__ import annotations

from collections import Counter

from vgbs_ray.scheduler_state import SchedulerState
from vgbs_ray.settled_ids import SettledIds


def dataset_prompts_to_resend(state: SchedulerState, prompt_rollout_ids: dict[int, list]) -> list[int]:
    """The dataset prompts a resumed job sends again: every prompt one of whose rollouts the
    checkpoint does not hold whole (unknown, or partly received). `prompt_rollout_ids`: prompt ->
    its rollout ids. A prompt whose rollouts are all settled, buffered or waiting for their group
    is skipped (sending it again would only be rejected)."""
    settled = SettledIds.from_bytes(state.settled) if state.settled else SettledIds()
    whole = {rid for part in (state.intake.ready, state.intake.waiting) for rid, _ in part}
    return [prompt for prompt, ids in prompt_rollout_ids.items()
            if not all(rid in whole or rid in settled for rid in ids)]


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
