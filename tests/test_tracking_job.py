"""The job with all three trackers on (TensorBoard, W&B offline, MLflow file store), then resumed.

A short synthetic run (in this process's Ray) stops at run.num_steps=3; the resumed run trains
the rest. After each, every tracker is read back with its own reader (tests/tracking_support.py)
and compared with the job's step records: the per-step series (rollouts per step) equal the final
history of steps.jsonl, each step exactly once, the resumed run in the same tracker run (same W&B
id, same MLflow run, same TensorBoard directory), the job's config logged as hyperparameters, the
summary logged, the cumulative counters equal the summary's. Slow: two short runs (~1 min).
"""

from __future__ import annotations

import json

import pytest

from jobs.job_config import load_job_config
from jobs.progress import read_records
from jobs.train import train
from tests.resume_support import names_free, synthetic_producers
from tests.tracking_support import (mlflow_run, tensorboard_hparams, tensorboard_scalars, tensorboard_texts,
                                    wandb_offline_runs)

pytestmark = pytest.mark.slow

GBS = 4
# 2 producers, 14 prompts x 2 rollouts = 28 rollouts, less the groups with a malformed member (prompt 0's
# among them: a rejection by rule from the start, a counter the trackers get): ~6 steps of 4.
RUN = [
    *synthetic_producers(), "rollout.num_producers=2", "rollout.num_prompts=14", "rollout.group_size=2",
    "rollout.prompts_kwargs.uniform_group_fraction=0", "rollout.prompts_kwargs.bad_rollout_fraction=0.2",
    "rollout.agent_kwargs.max_delay_s=0.05", f"scheduler.batch.global_batch_size={GBS}", "run.checkpoint_every=2",
    "run.plot=false", "run.loggers=[console,jsonl,tensorboard,wandb,mlflow]", "run.run_name=tracking-test",
]


def run_job(out, *extra) -> dict:
    config = load_job_config(None, [*RUN, f"run.output_dir={out}", *extra])
    names_free()
    return train(config, str(out / "steps.jsonl"))


def final_history(records: list[dict]) -> list[tuple[int, float]]:
    """(step, rollouts) of each step's last record (steps.jsonl keeps every attempt in time order)."""
    last = {r["step"]: float(r["num_rollouts"]) for r in records}
    return sorted(last.items())


def check_trackers(out, summary: dict, expected: list[tuple[int, float]], starts: int) -> tuple[dict, list]:
    assert summary["loggers"] == {"tensorboard": "ok", "wandb": "ok", "mlflow": "ok"}
    ids = json.loads((out / "tracking.json").read_text())

    tensorboard = tensorboard_scalars(str(out / "tensorboard"))
    assert tensorboard["step/rollouts"] == expected  # each step once, in order, across both event files
    assert tensorboard_hparams(str(out / "tensorboard"))["scheduler.batch.global_batch_size"] == GBS
    assert json.loads(tensorboard_texts(str(out / "tensorboard"))["summary"][-1].strip("`\n"))["steps"] == \
        summary["steps"]

    runs = wandb_offline_runs(str(out / "wandb"))
    assert len(runs) == starts and {r["id"] for r in runs} == {ids["wandb"]["id"]}
    assert [(row["_step"], row["step/rollouts"]) for r in runs for row in r["history"]] == expected
    assert runs[-1]["config"]["scheduler"]["batch"]["global_batch_size"] == GBS
    assert runs[-1]["config"]["run"]["resume"] is (starts > 1)
    assert runs[-1]["summary"]["rollouts_trained"] == summary["rollouts_trained"]

    run, history = mlflow_run(ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"])
    assert history["step/rollouts"] == expected and run.info.status == "FINISHED"
    assert run.data.params["scheduler.batch.global_batch_size"] == str(GBS)
    assert run.data.tags["summary.steps"] == str(summary["steps"])
    return ids, runs


def test_a_job_logs_to_tensorboard_wandb_and_mlflow_and_a_resumed_run_continues_each(ray_session, tmp_path):
    out = tmp_path / "run"
    first = run_job(out, "run.num_steps=3")
    records = read_records(out / "steps.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and first["steps"] == 3
    ids, runs = check_trackers(out, first, final_history(records), starts=1)
    # The cumulative counters reach the trackers with the last step: the summary's, from the same ledger.
    rejected = first["rejected_samples_by_rule"]["token_range"]
    assert rejected >= 1 and runs[0]["history"][-1]["rejections/token_range"] == rejected
    _, history = mlflow_run(ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"])
    assert history["rejections/token_range"][-1] == (2, rejected)
    assert history["step/partial"] == [(0, 0.0), (1, 0.0), (2, 0.0)]

    second = run_job(out, "run.resume=true", "run.num_steps=50")
    records = read_records(out / "steps.jsonl")
    assert second["steps"] >= 2 and records[-1]["step"] >= 4  # it trained the rest of the input
    ids_after, _ = check_trackers(out, second, final_history(records), starts=2)
    assert ids_after == ids  # the same W&B and MLflow runs continued
