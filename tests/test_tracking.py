"""Experiment tracking without a job: which steps the trackers get (the final history, each once),
a failing logger (said once, the others go on), the metric vocabulary, and each real backend
(TensorBoard, W&B offline, MLflow file store) written, resumed and read back with its own reader.
The job end to end with all three is tests/test_tracking_job.py."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from jobs.metric_names import BY_NAME, RAY_GAUGES, VOCABULARY, counter_values, markdown_table, step_values
from jobs.progress import StepLine
from jobs.tracking import Tracker, flatten, plain
from jobs.tracking_backends import (MlflowConfig, MlflowLogger, RunStart, TensorBoardConfig, TensorBoardLogger,
                                    WandbConfig, WandbLogger)
from tests.tracking_support import mlflow_run, tensorboard_hparams, tensorboard_scalars, wandb_offline_runs

ROOT = Path(__file__).resolve().parents[1]


def line(step: int, rollouts: int = 8, **extra) -> StepLine:
    return StepLine(step=step, num_rollouts=rollouts, num_samples=rollouts + 2, microbatches_per_rank=2,
                    num_tokens=100 * rollouts, loss=-0.01 * step, reward=0.5, step_time_s=0.3, lr=1e-3,
                    partial=rollouts < 8, shard_wait_s=0.1, **extra)


class Recording:
    """A logger that records every call (its thread is the only caller)."""

    def __init__(self, name="recording", fail_on: str | None = None):
        self.name, self.fail_on = name, fail_on
        self.calls: list = []

    def _record(self, method, *args):
        if method == self.fail_on:
            raise OSError("No space left on device")
        self.calls.append((method, *args))

    def open(self, start):
        self._record("open", start)

    def log_config(self, config, flat):
        self._record("log_config", config)

    def log_metrics(self, step, values):
        self._record("log_metrics", step, values)

    def log_summary(self, summary, flat):
        self._record("log_summary", summary)

    def close(self, failed):
        self._record("close", failed)

    def steps(self):
        return [(call[1], call[2]) for call in self.calls if call[0] == "log_metrics"]


def start(first_step=0, resumed=False) -> RunStart:
    return RunStart(project="p", run_name="r", output_dir="unused", first_step=first_step, resumed=resumed, ids={})


def test_trackers_get_each_step_once_when_a_checkpoint_holds_it_and_a_replay_replaces_the_undone_one():
    logger = Recording()
    tracker = Tracker([logger], start())
    tracker.on_step(line(0), final_before=0)
    tracker.on_step(line(1), final_before=2, counters={"drops/stale": 1.0})  # checkpoint 2 holds steps 0, 1
    tracker.on_step(line(2), final_before=2)
    tracker.on_step(line(3, rollouts=5), final_before=2)  # undone by a recovery back to step 2 ...
    tracker.on_step(line(2, rollouts=7), final_before=2)  # ... which trains 2 again
    tracker.on_step(line(3, rollouts=6), final_before=4, counters={"drops/stale": 3.0})
    tracker.on_step(line(4), final_before=4)
    tracker.on_step(line(5), final_before=4)  # undone, and the run ends before it trains again
    tracker.finish([line(0), line(1), line(2, rollouts=7), line(3, rollouts=6), line(4)], {"steps": 5},
                   counters={"drops/stale": 4.0})
    tracker.close()
    steps = logger.steps()
    assert [step for step, _ in steps] == [0, 1, 2, 3, 4]
    assert [values["step/rollouts"] for _, values in steps] == [8, 8, 7, 6, 8]
    assert [values.get("drops/stale") for _, values in steps] == [None, 1.0, None, 3.0, 4.0]
    assert [call[0] for call in logger.calls] == ["open", *["log_metrics"] * 5, "log_summary", "close"]
    assert logger.calls[-1] == ("close", False)


def test_a_resumed_tracker_starts_at_its_checkpoint_and_never_logs_an_earlier_step():
    logger = Recording()
    tracker = Tracker([logger], start(first_step=4, resumed=True))
    tracker.on_step(line(4), final_before=4)
    tracker.finish([line(4), line(5)], {})
    tracker.close()
    assert [step for step, _ in logger.steps()] == [4, 5]
    assert logger.calls[0][1].first_step == 4 and logger.calls[0][1].resumed


def test_a_failing_logger_is_reported_once_and_the_others_and_the_caller_go_on(caplog):
    failing, healthy = Recording("broken", fail_on="log_metrics"), Recording("healthy")
    tracker = Tracker([failing, healthy], start())
    with caplog.at_level(logging.ERROR, logger="vgbs.tracking"):
        for step in range(6):
            tracker.on_step(line(step), final_before=step + 1)  # every step final at once
        tracker.finish([line(s) for s in range(6)], {"steps": 6})
        tracker.close()
    said = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(said) == 1 and "No space left on device" in said[0] and "training goes on" in said[0]
    assert [step for step, _ in healthy.steps()] == list(range(6)) and healthy.calls[-1] == ("close", False)
    assert [call[0] for call in failing.calls] == ["open"]  # nothing called after the failure, close included
    status = tracker.status()
    assert status["healthy"] == "ok" and status["broken"].startswith("failed (log_metrics: OSError")


def test_a_logger_that_fails_to_open_takes_nothing_down():
    tracker = Tracker([Recording("absent", fail_on="open")], start())
    tracker.on_step(line(0), final_before=1)
    tracker.close(failed=True)
    assert tracker.status()["absent"].startswith("failed (open:")


def test_the_vocabulary_names_every_step_field_once_with_valid_distinct_ray_names():
    names = [metric.name for metric in VOCABULARY]
    assert len(set(names)) == len(names)
    fields = {f.name for f in dataclasses.fields(StepLine)}
    used = [metric.field for metric in VOCABULARY if metric.field]
    assert set(used) <= fields and len(set(used)) == len(used)
    # Every numeric measurement of a step has a name (step is the x axis).
    assert fields - set(used) == {"step"}
    ray = [metric.ray_name for metric in RAY_GAUGES]
    assert len(set(ray)) == len(ray) and all(re.fullmatch(r"vgbs_job_[a-zA-Z0-9_]+", n) for n in ray)
    values = step_values(line(3, rollouts=5, policy_version=3, log_prob_mismatch=float("nan"),
                              loss_metrics={"clip_fraction": 0.25, "is_weight": float("nan")}))
    assert values["loss/clip_fraction"] == 0.25 and "loss/is_weight" not in values  # the loss's own, NaN left out
    assert values["step/rollouts"] == 5 and values["step/partial"] == 1.0 and values["policy/version"] == 3
    assert values["share/trainer_idle"] == pytest.approx(0.1 / 0.4)
    assert "logprob/mismatch" not in values and "reward/sampled" not in values  # NaN, None: not measured
    counters = counter_values(dropped_by_reason={"stale": 2}, rejected_samples_by_rule={"mask_length": 1},
                              refused_admissions=4, recoveries=1)
    assert counters == {"drops/stale": 2.0, "rejections/mask_length": 1.0, "admission/refusals": 4.0,
                        "run/recoveries": 1.0}
    assert {name.split("/")[0] for name in counters} | {"drops", "rejections"} <= {n.split("/")[0] for n in BY_NAME}


def test_docs_metrics_md_shows_the_vocabulary_table():
    assert markdown_table() in (ROOT / "docs" / "metrics.md").read_text()


def test_config_flattening_keeps_every_leaf_as_a_scalar():
    from jobs.job_config import load_job_config

    config = plain(load_job_config(None, ["preset=synthetic", "run.loggers=[jsonl,tensorboard]"]))
    flat = flatten(config)
    assert flat["run.loggers"] == '["jsonl", "tensorboard"]' and flat["scheduler.batch.global_batch_size"] == 8
    assert all(isinstance(v, (bool, int, float, str)) for v in flat.values())


def run_backends(out: Path, first_step: int, steps: range, resumed: bool, ids_from=None):
    from jobs.tracking import RunIds

    loggers = [TensorBoardLogger(TensorBoardConfig(), str(out)), WandbLogger(WandbConfig(), str(out)),
               MlflowLogger(MlflowConfig(), str(out))]
    run_start = RunStart(project="vgbs-test", run_name="backends", output_dir=str(out), first_step=first_step,
                         resumed=resumed, ids={})
    tracker = Tracker(loggers, run_start, RunIds(str(out), fresh=not resumed))
    tracker.log_config({"run": {"num_steps": 6, "resume": resumed}, "scheduler": {"gbs": 8}})
    lines = [line(s, rollouts=s + 1) for s in steps]
    for ln in lines:
        tracker.on_step(ln, final_before=ln.step + 1)
    tracker.finish(lines, {"steps": len(lines)})
    tracker.close()
    assert tracker.status() == {"tensorboard": "ok", "wandb": "ok", "mlflow": "ok"}
    return loggers


def test_each_backend_writes_resumes_the_same_run_and_reads_back_without_duplicate_steps(tmp_path):
    import json

    run_backends(tmp_path, 0, range(0, 3), resumed=False)
    ids = json.loads((tmp_path / "tracking.json").read_text())
    run_backends(tmp_path, 3, range(3, 6), resumed=True)
    assert json.loads((tmp_path / "tracking.json").read_text()) == ids  # the same runs continued

    expected = [(s, float(s + 1)) for s in range(6)]
    assert tensorboard_scalars(str(tmp_path / "tensorboard"))["step/rollouts"] == expected
    assert tensorboard_hparams(str(tmp_path / "tensorboard"))["scheduler.gbs"] == 8

    runs = wandb_offline_runs(str(tmp_path / "wandb"))
    assert [r["id"] for r in runs] == [ids["wandb"]["id"]] * 2
    assert [(row["_step"], row["step/rollouts"]) for r in runs for row in r["history"]] == expected
    assert runs[0]["config"]["scheduler"] == {"gbs": 8} and runs[1]["config"]["run"]["resume"] is True
    assert runs[1]["summary"]["steps"] == 3

    run, history = mlflow_run(ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"])
    assert history["step/rollouts"] == expected
    assert run.data.params["scheduler.gbs"] == "8" and run.data.params["run.resume"] == "False"  # write-once
    assert run.data.tags["summary.steps"] == "3" and run.info.status == "FINISHED"

    # A fresh run in the same directory starts new runs (and clears TensorBoard's old event files).
    run_backends(tmp_path, 0, range(0, 2), resumed=False)
    fresh = json.loads((tmp_path / "tracking.json").read_text())
    assert fresh["wandb"]["id"] != ids["wandb"]["id"] and fresh["mlflow"]["run_id"] != ids["mlflow"]["run_id"]
    assert tensorboard_scalars(str(tmp_path / "tensorboard"))["step/rollouts"] == expected[:2]
