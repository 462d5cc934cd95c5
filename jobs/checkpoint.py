"""Job checkpoints at step boundaries: train state, the scheduler's ledger, the step counter.

Layout: <output_dir>/checkpoints/step_000004/ holds the train group's files (model,
optimizer, LR-schedule position; one per model-parallel shard), ledger.json (every rollout
id's state and the ledger summary) and job.json ({"next_step": 4}). The `latest` file
names the newest complete checkpoint; it is replaced only after everything else is written,
so a crash mid-save leaves the previous checkpoint current.

On resume, the train state and the step counter come back; producers then start fresh
rollout ids (tagged with the step they start at), so the old ledger is kept as the record
of what was trained, not reloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ray


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def save_job_state(output_dir: str, next_step: int, group, scheduler) -> str:
    path = os.path.join(checkpoint_root(output_dir), f"step_{next_step:06d}")
    os.makedirs(path, exist_ok=True)
    group.save_checkpoint(path)
    stats = ray.get(scheduler.stats.remote(include_rollouts=True), timeout=60)
    ledger = {
        "summary": dataclasses.asdict(stats.ledger),
        "rollouts": {str(rid): list(state) for rid, state in (stats.rollout_states or {}).items()},
    }
    _write_json(os.path.join(path, "ledger.json"), ledger)
    _write_json(os.path.join(path, "job.json"), {"next_step": next_step})
    _write_text(os.path.join(checkpoint_root(output_dir), "latest"), os.path.basename(path))
    return path


def latest_checkpoint(output_dir: str) -> str | None:
    marker = os.path.join(checkpoint_root(output_dir), "latest")
    if not os.path.exists(marker):
        return None
    with open(marker) as handle:
        return os.path.join(checkpoint_root(output_dir), handle.read().strip())


def checkpoint_next_step(path: str) -> int:
    """The step a checkpoint continues at (it holds every step before it)."""
    with open(os.path.join(path, "job.json")) as handle:
        return int(json.load(handle)["next_step"])


def load_job_state(path: str, group) -> dict:
    """Restore the train group from `path`; returns job.json (with next_step)."""
    group.load_checkpoint(path)
    with open(os.path.join(path, "job.json")) as handle:
        return json.load(handle)


def _write_json(path: str, value) -> None:
    _write_text(path, json.dumps(value, indent=1, default=str))


def _write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)
