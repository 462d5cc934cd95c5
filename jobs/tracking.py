"""Experiment tracking: the run's steps, config and summary fanned out to the loggers in run.loggers.

    tracker = Tracker.start(config, first_step=k, resumed=True)   # opens each logger, logs the config
    tracker.on_step(line, final_before=controller.checkpointed_step, counters=...)   # per trained step
    tracker.finish(trained_lines, summary)                         # what is left, then the summary
    tracker.close(failed=False)                                    # flush and close every logger (bounded)

`console` (the step line) and `jsonl` (steps.jsonl, every attempt of a step in time order) are the
step loop's own and on by default; `tensorboard`, `wandb` and `mlflow` are the trackers here.

Which steps a tracker gets: exactly the run's final history, each step number once. A step
trained after the latest checkpoint can still be undone (an in-job recovery rewinds to the
checkpoint and trains those steps again; a resume after a killed driver restarts there), so a
step is handed to the trackers once a checkpoint holds it (`final_before`, i.e. every
run.checkpoint_every steps), and at the end of the run (the final history). A replayed step
replaces the undone one before either happens. A resumed run starts at its checkpoint's step,
which every earlier step is below: the trackers' series continue, with no step twice. The cost:
the trackers lag the step line by up to run.checkpoint_every steps (Ray metrics and the step line
are live). Steps a killed driver had checkpointed but not yet handed over are missing from the
trackers (steps.jsonl has them).

Never blocking, never breaking training: each logger has one worker thread with a bounded queue;
the step loop only puts into it (`put_nowait`; a full queue drops that record and says so once).
A logger that raises (no network for W&B online, a full disk, a missing extra) is reported once
(log and `status()`, which the summary carries) and disabled; the run and the other loggers go on.
`close` waits at most CLOSE_TIMEOUT_S per logger.

Run ids live in <output_dir>/tracking.json (W&B id, MLflow run id), so a resume continues the same
run in each logger; a fresh run replaces the file (new runs).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import queue
import threading
from typing import Iterable

from jobs.metric_names import step_values
from jobs.tracking_backends import BACKENDS, Logger, RunStart

log = logging.getLogger("vgbs.tracking")

LOCAL_LOGGERS = ("console", "jsonl")
LOGGER_NAMES = LOCAL_LOGGERS + tuple(BACKENDS)
QUEUE_SIZE = 1024
"""Records a logger may fall behind by before the step loop drops (never waits for) new ones."""
CLOSE_TIMEOUT_S = 60.0
IDS_FILE = "tracking.json"


def plain(value):
    """A config or summary value as JSON-able data (dataclasses, enums, tuples unpacked)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def flatten(value: dict, prefix: str = "") -> dict[str, str | int | float | bool]:
    """Nested dicts as dotted keys; lists and None as JSON text (what hparams and params take)."""
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat.update(flatten(item, f"{prefix}{key}."))
        elif isinstance(item, (bool, int, float, str)):
            flat[f"{prefix}{key}"] = item
        else:
            flat[f"{prefix}{key}"] = json.dumps(item)
    return flat


class RunIds:
    """<output_dir>/tracking.json: each logger's ids, written whole on every change (atomic)."""

    def __init__(self, output_dir: str, fresh: bool):
        self.path = os.path.join(output_dir, IDS_FILE)
        self._lock = threading.Lock()
        self._ids: dict = {}
        if not fresh and os.path.exists(self.path):
            with open(self.path) as handle:
                self._ids = json.load(handle)

    def of(self, logger: str) -> dict:
        with self._lock:
            return dict(self._ids.get(logger, {}))

    def save(self, logger: str, ids: dict) -> None:
        with self._lock:
            self._ids[logger] = dict(ids)
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as handle:
                json.dump(self._ids, handle, indent=1)
            os.replace(tmp, self.path)


_CLOSE = object()


class _Worker(threading.Thread):
    """One logger's thread: calls it in queue order; the first error disables it (said once)."""

    def __init__(self, logger: Logger):
        super().__init__(name=f"tracking-{logger.name}", daemon=True)
        self.logger = logger
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
        self.error: str | None = None
        self.dropped = 0
        self.failed_run = False

    def put(self, method: str, *args) -> None:
        if self.error is not None:
            return
        try:
            self.queue.put_nowait((method, args))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("logger %s is %d records behind: dropping new ones (training goes on)",
                            self.logger.name, QUEUE_SIZE)

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is _CLOSE:
                self._call("close", (self.failed_run,))
                return
            method, args = item
            self._call(method, args)

    def _call(self, method: str, args: tuple) -> None:
        if self.error is not None:
            return
        try:
            getattr(self.logger, method)(*args)
        except Exception as error:  # noqa: BLE001 - a logger never stops the run: said once, then off
            self.error = f"{method}: {type(error).__name__}: {error}"
            log.error("logger %s failed (%s); it is off for the rest of the run, training goes on",
                      self.logger.name, self.error)

    def close(self, failed: bool, timeout_s: float) -> None:
        self.failed_run = failed
        try:
            self.queue.put(_CLOSE, timeout=timeout_s)
        except queue.Full:
            pass
        self.join(timeout_s)
        if self.is_alive():
            log.error("logger %s did not finish within %.0f s; leaving it", self.logger.name, timeout_s)


class Tracker:
    """The trackers of one run (see module docstring)."""

    def __init__(self, loggers: Iterable[Logger], start: RunStart, ids: RunIds | None = None):
        self._workers = [_Worker(logger) for logger in loggers]
        self._pending: dict = {}   # step -> line, trained but not yet in a checkpoint
        self._next_step = start.first_step  # every step below it was handed over (or precedes this run)
        self._closed = False
        for worker in self._workers:
            name = worker.logger.name
            worker_start = dataclasses.replace(
                start, ids=ids.of(name) if ids is not None else {},
                save_ids=(lambda saved, name=name: ids.save(name, saved)) if ids is not None else start.save_ids)
            worker.put("open", worker_start)
            worker.start()

    @classmethod
    def start(cls, config, *, first_step: int, resumed: bool) -> "Tracker":
        """The trackers config.run.loggers names, opened, with the job's whole config logged once."""
        run = config.run
        loggers = [BACKENDS[name][0](getattr(run, BACKENDS[name][1]), run.output_dir)
                   for name in run.loggers if name in BACKENDS]
        start = RunStart(project=run.project, run_name=run.run_name, output_dir=run.output_dir,
                         first_step=first_step, resumed=resumed, ids={})
        tracker = cls(loggers, start, RunIds(run.output_dir, fresh=not resumed) if loggers else None)
        tracker.log_config(plain(config))
        return tracker

    @property
    def active(self) -> bool:
        return bool(self._workers)

    def log_config(self, config: dict) -> None:
        self._put("log_config", config, flatten(config))

    def on_step(self, line, *, final_before: int, counters: dict[str, float] | None = None) -> None:
        """A trained step's line (a replay replaces an undone one of the same number); hands over every
        pending step below `final_before` (the step the latest checkpoint continues at), the last of
        them with `counters` (cumulative, read at that checkpoint)."""
        if not self._workers:
            return
        self._pending[line.step] = line
        if final_before > self._next_step:
            self._hand_over([s for s in sorted(self._pending) if s < final_before], counters)
            self._next_step = final_before

    def finish(self, trained: list, summary: dict, counters: dict[str, float] | None = None) -> None:
        """The end of a run: the final history's steps not handed over yet, then the summary."""
        if not self._workers:
            return
        self._pending = {line.step: line for line in trained if line.step >= self._next_step}
        if self._pending:
            last = max(self._pending)
            self._hand_over(sorted(self._pending), counters)
            self._next_step = last + 1
        elif counters:
            self._put("log_metrics", self._next_step - 1, counters)
        summary = plain(summary)
        self._put("log_summary", summary, flatten(summary))

    def _hand_over(self, steps: list[int], counters: dict[str, float] | None) -> None:
        for i, step in enumerate(steps):
            values = step_values(self._pending.pop(step))
            if counters and i == len(steps) - 1:
                values.update(counters)
            self._put("log_metrics", step, values)

    def _put(self, method: str, *args) -> None:
        for worker in self._workers:
            worker.put(method, *args)

    def close(self, failed: bool = False, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Flush and close every logger (each waited for at most `timeout_s`); idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.close(failed, timeout_s)

    def status(self) -> dict[str, str]:
        """Each tracker's state: "ok", or why it went off (for the summary)."""
        result = {}
        for worker in self._workers:
            state = "ok" if worker.error is None else f"failed ({worker.error})"
            if worker.dropped:
                state += f"; {worker.dropped} records dropped (queue full)"
            result[worker.logger.name] = state
        return result
