"""Weight sync, the object store against the collective channel, side by side for three model sizes.

    .venv/bin/python benchmarks/bench_weight_sync.py [--quick]     # --quick: the demo model only

For each model (the demo's, ~20M and ~150M parameters; float32, one train rank, one vLLM CPU
engine, in-process Ray) and each way (object store float32; collective float32; collective
bfloat16), `ROUNDS` syncs of the same weights, and per way the median of:

  trainer_s  what the trainer is blocked for (gather, convert, store copy or send)
  ready_s    from the sync's start until the engine holds the version (its load finished)
  bytes      weights moved per engine

Ratios are against the object store. The engine is idle, so ready_s is the transport plus the
load itself (what a busy engine adds, waiting for its batch to end, is the same for both).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROUNDS = 3
MODELS = {
    "demo": dict(vocab_size=17),
    "~20M": dict(num_layers=6, hidden_size=512, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=1376,
                 vocab_size=4000),
    "~150M": dict(num_layers=10, hidden_size=1024, num_attention_heads=16, num_query_groups=16,
                  ffn_hidden_size=2816, vocab_size=16000),
}


def measure(name: str, fields: dict) -> list[tuple]:
    import ray
    import torch

    from trainer.hf_checkpoint import write_hf_checkpoint
    from actors.rollout_engine import EngineConfig, RolloutEnginePool
    from trainer.config import ModelConfig, OptimizerConfig, TrainGroupConfig
    from actors.train_group import TrainGroup
    from actors.weight_sync import WeightSyncConfig, open_weight_channel, publish_weights, send_weights

    model = ModelConfig(**fields)
    group = TrainGroup(TrainGroupConfig(dp_size=1, model=model, optimizer=OptimizerConfig(kind="sgd")))
    engines = None
    rows = []
    try:
        v0 = publish_weights(group, 0)
        params = sum(array.size for array in ray.get(v0.ref).values())
        model_dir = write_hf_checkpoint(Path(tempfile.mkdtemp()) / "v0", model,
                                        {k: torch.from_numpy(v.copy()) for k, v in ray.get(v0.ref).items()})
        engines = RolloutEnginePool(EngineConfig(num_engines=1, max_model_len=model.max_position_embeddings,
                                                 startup_timeout_s=900, call_timeout_s=900), str(model_dir))
        version = 0
        store = []
        for _ in range(ROUNDS):
            version += 1
            started = time.perf_counter()
            published = publish_weights(group, version)
            trainer_s = time.perf_counter() - started
            (load,) = engines.wait_for_weights(engines.update_weights(published))
            store.append((trainer_s, time.perf_counter() - started, load.num_bytes))
        rows.append((name, params, "object_store float32", store))
        for dtype in ("float32", "bfloat16"):
            config = WeightSyncConfig(transport="collective", dtype=dtype, timeout_s=900)
            if dtype == "float32":
                open_weight_channel(group, engines, config)
            runs = []
            for _ in range(ROUNDS):
                version += 1
                started = time.perf_counter()
                send_weights(group, version, config)
                trainer_s = time.perf_counter() - started
                (load,) = ray.get(engines.weight_loads(version), timeout=900)
                runs.append((trainer_s, time.perf_counter() - started, load.num_bytes))
            rows.append((name, params, f"collective {dtype}", runs))
    finally:
        if engines is not None:
            engines.shutdown()
        group.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the demo model only")
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=2 << 30, log_to_driver=False)
    try:
        rows = []
        for name, fields in list(MODELS.items())[:1 if args.quick else None]:
            rows += measure(name, fields)
    finally:
        ray.shutdown()
    print(f"{'model':>6} {'params':>11} {'way':>22} {'trainer_s':>10} {'ready_s':>9} {'MB':>8} "
          f"{'trainer x':>9} {'ready x':>8} {'bytes x':>8}")
    baseline = {}
    for name, params, way, runs in rows:
        trainer = statistics.median(r[0] for r in runs)
        ready = statistics.median(r[1] for r in runs)
        size = runs[0][2]
        if way.startswith("object_store"):
            baseline[name] = (trainer, ready, size)
        base = baseline[name]
        print(f"{name:>6} {params:>11,} {way:>22} {trainer:>10.3f} {ready:>9.3f} {size / 1e6:>8.1f} "
              f"{trainer / base[0]:>9.2f} {ready / base[1]:>8.2f} {size / base[2]:>8.2f}")


if __name__ == "__main__":
    main()
