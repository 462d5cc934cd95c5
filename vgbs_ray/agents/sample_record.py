"""An opt-in record of what a producer pushed, one JSON line per rollout: what a user checks their agent against.

    record = SampleRecord("runs/latest/samples/producer-0.jsonl")
    record.write(samples)        # the sample dicts of pushed rollouts (the push API's)

Each line: {"rollout_id", "group_id", "reward", "samples": [{"token_ids", "loss_mask", "response_length",
"policy_versions": [min, max]}]}: the ids as the model saw them, the mask (1 = generated and trained), and the
policy versions that sampled them. Which of those rollouts a step trained is in the checkpoint's ledger.json
(state `trained`, its step). Lines are appended and flushed per push, so a killed run keeps what it wrote.
"""

from __future__ import annotations

import json
import os

import numpy as np


class SampleRecord:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._file = open(path, "a")

    def write(self, samples: list[dict]) -> None:
        rollouts: dict = {}
        for sample in sorted(samples, key=lambda s: (str(s["rollout_id"]), s.get("sample_index", 0))):
            rollout = rollouts.setdefault(sample["rollout_id"], {
                "rollout_id": sample["rollout_id"], "group_id": sample.get("group_id"),
                "reward": float(sample["reward"]), "samples": []})
            rollout["samples"].append({
                "token_ids": [int(t) for t in sample["tokens"]], "loss_mask": [int(m) for m in sample["loss_mask"]],
                "response_length": int(sample["response_length"]),
                "policy_versions": [sample.get("policy_version_min"), sample.get("policy_version_max")],
                "policy_version_runs": (None if sample.get("policy_version_runs") is None
                                        else np.asarray(sample["policy_version_runs"]).tolist())})
        for rollout in rollouts.values():
            self._file.write(json.dumps(rollout, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
