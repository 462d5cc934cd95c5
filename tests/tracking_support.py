"""Read back what the trackers wrote, with each library's own reader where it has one: TensorBoard's
event accumulator, MLflow's client on the file store; W&B has no public reader of an offline run,
so its run file (a LevelDB-style log of `wandb_internal_pb2.Record` protos) is read here."""

from __future__ import annotations

import glob
import json
import os
import struct
from collections import defaultdict


def tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file in `log_dir`, in file order (duplicates kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        accumulator = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0}, purge_orphaned_data=False)
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            series[tag] += [(event.step, event.value) for event in accumulator.Scalars(tag)]
    return dict(series)


def _plugin_content(accumulator, plugin: str) -> dict:
    try:
        return accumulator.PluginTagToContent(plugin)
    except KeyError:  # nothing of that plugin in this event file
        return {}


def tensorboard_texts(log_dir: str) -> dict[str, list[str]]:
    """text tag -> the texts logged under it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    texts: dict = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        accumulator = EventAccumulator(path, size_guidance={"tensors": 0})
        accumulator.Reload()
        for tag in _plugin_content(accumulator, "text"):
            for event in accumulator.Tensors(tag):
                texts[tag].append(tensor_util.make_ndarray(event.tensor_proto).item().decode())
    return dict(texts)


def tensorboard_hparams(log_dir: str) -> dict:
    """The hparams of the run's session start (the HParams tab)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    found = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        accumulator = EventAccumulator(path, size_guidance={"tensors": 0})
        accumulator.Reload()
        for tag, content in _plugin_content(accumulator, "hparams").items():
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.HasField("session_start_info"):
                for key, value in data.session_start_info.hparams.items():
                    found[key] = getattr(value, value.WhichOneof("kind"))
    return found


BLOCK = 32768
HEADER = 7  # ":W&B", magic 0xBEE1, version


def _wandb_chunks(path: str):
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def wandb_offline_runs(wandb_dir: str) -> list[dict]:
    """Each offline-run-* directory under `wandb_dir` (oldest first): its run id, config, history rows
    (`_step` and the logged keys, values decoded) and summary updates."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for run_dir in sorted(glob.glob(os.path.join(wandb_dir, "offline-run-*"))):
        (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
        run = {"dir": run_dir, "id": None, "config": {}, "history": [], "summary": {}}
        for chunk in _wandb_chunks(path):
            record = wandb_internal_pb2.Record.FromString(chunk)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.history.item})
            elif kind == "summary":
                run["summary"].update({item.key: json.loads(item.value_json) for item in record.summary.update
                                       if item.key})
        runs.append(run)
    return runs


def mlflow_run(tracking_uri: str, run_id: str):
    """(run, {metric key: [(step, value)] sorted by step}) from MLflow's client."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
               for key in run.data.metrics}
    return run, history
