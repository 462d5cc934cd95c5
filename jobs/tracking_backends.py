"""The experiment trackers a run can log to: TensorBoard, Weights & Biases, MLflow.

Each is one small class behind the `Logger` protocol, with its own frozen config (the
`run.tensorboard`, `run.wandb`, `run.mlflow` sections). Each imports its library only in
`open` (so a run that does not name it never imports it, and an install without the extra
fails only that logger), and is only ever called from its one worker thread (jobs/tracking.py).

Resume: `open` gets the ids this output directory's earlier run stored (`RunStart.ids`) and
continues that run: TensorBoard writes a new event file into the same directory; W&B
re-initialises the same run id (`resume="allow"`; offline, each start is its own
`offline-run-*` directory with that id, and `wandb sync` puts them into one run); MLflow logs into
the same run id again. Steps continue: the tracker only ever hands a step number once
(jobs/tracking.py), so no logger sees a step twice.
"""

from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from vgbs_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig:
    log_dir: str | None = None
    """Event files go here (default <run.output_dir>/tensorboard): `tensorboard --logdir <it>`. A fresh run
    (run.resume=false) removes the event files an earlier run left directly in it, as it replaces steps.jsonl."""


WANDB_MODES = ("offline", "online")


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    mode: str = "offline"
    """"offline": write <dir>/wandb/offline-run-* with no network (upload later: `wandb sync <that dir>`);
    "online": stream to the W&B server (needs `wandb login` or WANDB_API_KEY)."""
    entity: str | None = None
    """W&B entity (user or team); None: your default entity."""
    dir: str | None = None
    """Where W&B puts its wandb/ folder (default run.output_dir)."""

    def __post_init__(self):
        if self.mode not in WANDB_MODES:
            raise ConfigError(f"run.wandb.mode must be one of {list(WANDB_MODES)}, got {self.mode!r}")


@dataclass(frozen=True, kw_only=True)
class MlflowConfig:
    tracking_uri: str | None = None
    """Default file:<run.output_dir>/mlruns (MLflow's local file store: `mlflow ui --backend-store-uri <it>`);
    or a tracking server (http://host:5000). The experiment is run.project."""


@dataclass
class RunStart:
    """What a logger opens with: the run's names, where it starts, and its stored ids."""

    project: str
    run_name: str | None
    output_dir: str
    first_step: int
    resumed: bool
    ids: dict
    """What this logger stored (`save_ids`) in the run being resumed; {} for a fresh run."""
    save_ids: Callable[[dict], None] = field(repr=False, default=lambda ids: None)
    """Store this logger's ids in the output directory, for a later resume."""


class Logger(Protocol):
    name: str

    def open(self, start: RunStart) -> None: ...

    def log_config(self, config: dict, flat: dict[str, str | int | float | bool]) -> None: ...

    def log_metrics(self, step: int, values: dict[str, float]) -> None: ...

    def log_summary(self, summary: dict, flat: dict[str, str | int | float | bool]) -> None: ...

    def close(self, failed: bool) -> None: ...


def _json_block(value: dict) -> str:
    return "```\n" + json.dumps(value, indent=1, default=str) + "\n```"


class TensorBoardLogger:
    """Scalars per step; the config as hparams (the HParams tab) and as text; the summary as text."""

    name = "tensorboard"

    def __init__(self, config: TensorBoardConfig, output_dir: str):
        self.log_dir = config.log_dir or os.path.join(output_dir, "tensorboard")
        self._writer = None

    def open(self, start: RunStart) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        os.makedirs(self.log_dir, exist_ok=True)
        if not start.resumed:
            for old in glob.glob(os.path.join(self.log_dir, "events.out.tfevents.*")):
                os.remove(old)
        self._start = start
        self._writer = EventFileWriter(self.log_dir)

    def _add(self, step: int, summary) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def log_config(self, config: dict, flat: dict) -> None:
        from tensorboard.plugins.hparams import summary_v2 as hparams
        from tensorboard.plugins.text import summary_v2 as text

        step = self._start.first_step
        if not self._start.resumed:  # one hparams session per TensorBoard run
            self._add(step, hparams.hparams_pb(flat, trial_id=self._start.run_name))
        title = "config" if not self._start.resumed else f"config (resumed at step {step})"
        self._add(step, text.text_pb(title, _json_block(config)))
        self._writer.flush()

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(step, Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()]))
        self._writer.flush()

    def log_summary(self, summary: dict, flat: dict) -> None:
        from tensorboard.plugins.text import summary_v2 as text

        self._add(self._start.first_step, text.text_pb("summary", _json_block(summary)))
        self._writer.flush()

    def close(self, failed: bool) -> None:
        if self._writer is not None:
            self._writer.close()


def new_wandb_id() -> str:
    """8 lowercase letters and digits, the shape of W&B's own run ids."""
    import secrets
    import string

    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbLogger:
    """A W&B run: config, history (step = the run's global step), summary."""

    name = "wandb"

    def __init__(self, config: WandbConfig, output_dir: str):
        self.config = config
        self.dir = config.dir or output_dir
        self._run = None

    def open(self, start: RunStart) -> None:
        import wandb

        run_id = start.ids.get("id") if start.resumed else None
        run_id = run_id or new_wandb_id()
        start.save_ids({"id": run_id})  # before init: a run that dies during it still resumes this id
        os.makedirs(self.dir, exist_ok=True)
        # console="off": the job's stdout stays the job's (its log has the step lines); no git or code
        # capture (a run directory is not a repository).
        settings = wandb.Settings(console="off", disable_git=True, save_code=False, silent=True)
        self._run = wandb.init(project=start.project, entity=self.config.entity, name=start.run_name, id=run_id,
                               resume="allow", mode=self.config.mode, dir=self.dir, reinit="create_new",
                               settings=settings)

    def log_config(self, config: dict, flat: dict) -> None:
        self._run.config.update(config, allow_val_change=True)  # a resume changes run.resume, maybe num_steps

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def log_summary(self, summary: dict, flat: dict) -> None:
        self._run.summary.update(summary)

    def close(self, failed: bool) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)


MLFLOW_BATCH = 100
"""MLflow takes at most 100 params (and 1,000 metrics) per log_batch."""


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri and not uri.startswith(("sqlite:", "databricks"))


class MlflowLogger:
    """An MLflow run in experiment run.project: params (the flat config), metrics per step, the summary
    as tags and a JSON artifact."""

    name = "mlflow"

    def __init__(self, config: MlflowConfig, output_dir: str):
        self.tracking_uri = config.tracking_uri or "file:" + os.path.abspath(os.path.join(output_dir, "mlruns"))
        self._client, self._run_id = None, None

    def open(self, start: RunStart) -> None:
        if _is_file_store(self.tracking_uri):
            # MLflow 3 refuses the file store unless asked for it: it is what `mlflow ui` reads without a database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._start = start
        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        run_id = start.ids.get("run_id") if start.resumed else None
        if run_id is not None:
            try:
                client.update_run(run_id, status="RUNNING")
            except MlflowException:
                run_id = None  # the store lost it: a new run (the tracker said it resumes; this says it did not)
        if run_id is None:
            experiment = client.get_experiment_by_name(start.project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(start.project))
            run_id = client.create_run(experiment_id, run_name=start.run_name).info.run_id
        self._run_id = run_id
        start.save_ids({"run_id": run_id, "tracking_uri": self.tracking_uri})

    def log_config(self, config: dict, flat: dict) -> None:
        from mlflow.entities import Param

        # Params are write-once: a resumed run adds only keys the run does not have yet (its changed
        # values, e.g. run.resume, are in the config artifact of that start).
        present = self._client.get_run(self._run_id).data.params
        params = [Param(key, str(value)[:6000]) for key, value in flat.items() if key not in present]
        for i in range(0, len(params), MLFLOW_BATCH):
            self._client.log_batch(self._run_id, params=params[i:i + MLFLOW_BATCH])
        self._client.log_dict(self._run_id, config, f"config_step_{self._start.first_step:06d}.json")

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(key, value, now_ms, step) for key, value in values.items()])

    def log_summary(self, summary: dict, flat: dict) -> None:
        from mlflow.entities import RunTag

        self._client.log_dict(self._run_id, summary, "summary.json")
        tags = [RunTag(f"summary.{key}", str(value)[:5000]) for key, value in flat.items()]
        for i in range(0, len(tags), MLFLOW_BATCH):
            self._client.log_batch(self._run_id, tags=tags[i:i + MLFLOW_BATCH])

    def close(self, failed: bool) -> None:
        if self._run_id is not None:
            self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")


BACKENDS = {"tensorboard": (TensorBoardLogger, "tensorboard"), "wandb": (WandbLogger, "wandb"),
            "mlflow": (MlflowLogger, "mlflow")}
"""run.loggers name -> (class, the RunConfig field holding its config)."""
