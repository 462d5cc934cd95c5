"""A rollout engine's start with vLLM imported under `collector_paused(freeze=True)` (what `RolloutEngine` does,
actors/gc_tuning.py) vs with the collector as Python starts it, in fresh processes, interleaved, so both see the
same machine.

Each round starts two processes (order alternating) that each import vLLM and build the demo model's engine
the way `RolloutEngine.__init__` does (in-process vLLM on CPU, placeholder weights) and report the seconds of the
import and of the build. Printed: per-mode medians and the paused / on ratio.

    .venv/bin/python benchmarks/bench_engine_start.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import contextlib, json, os, sys, time
sys.path.insert(0, {root!r})
from actors.gc_tuning import collector_paused
paused = {paused!r}
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1")
start = time.perf_counter()
with collector_paused(freeze=True) if paused else contextlib.nullcontext():
    from vllm import LLM
imported = time.perf_counter()
from trainer.config import ModelConfig
from trainer.hf_checkpoint import write_hf_config
model = ModelConfig()
directory = write_hf_config({directory!r}, model)
LLM(model=str(directory), skip_tokenizer_init=True, dtype="float32", max_model_len=model.max_position_embeddings,
    distributed_executor_backend="uni", load_format="dummy", kv_cache_memory_bytes=1 << 28, enforce_eager=True,
    enable_chunked_prefill=False, max_num_batched_tokens=2048)
built = time.perf_counter()
print("RESULT " + json.dumps(dict(import_s=imported - start, build_s=built - imported)))
"""


def start_once(paused: bool) -> dict:
    directory = tempfile.mkdtemp(prefix="engine-start-")
    code = CHILD.format(root=ROOT, paused=paused, directory=directory)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    (line,) = [line for line in out.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("load before:", os.getloadavg())
    results: dict[bool, list[dict]] = {True: [], False: []}
    for round_index in range(args.rounds):
        for paused in ((True, False) if round_index % 2 == 0 else (False, True)):
            results[paused].append(start_once(paused))
    print("load after:", os.getloadavg())
    medians = {}
    for paused, runs in results.items():
        medians[paused] = {key: statistics.median(r[key] for r in runs) for key in ("import_s", "build_s")}
        medians[paused]["total_s"] = medians[paused]["import_s"] + medians[paused]["build_s"]
        label = "collector paused" if paused else "collector on    "
        print(f"{label}: import {medians[paused]['import_s']:.2f} s, build {medians[paused]['build_s']:.2f} s "
              f"(medians of {len(runs)})")
    for key in ("import_s", "build_s", "total_s"):
        print(f"paused / on, {key[:-2]}: {medians[True][key] / medians[False][key]:.2f}")


if __name__ == "__main__":
    main()
