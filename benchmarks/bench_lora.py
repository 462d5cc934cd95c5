"""LoRA against full weights, side by side: weight-sync bytes and time, trainer step time and peak memory.

    .venv/bin/python benchmarks/bench_lora.py [--quick]     # --quick: the demo model only

For each model (the demo's, ~20M and ~150M parameters; float32, one train rank each, in-process Ray) two train
groups, one training every weight (AdamW) and one training rank-8 adapters on all seven projections (AdamW), and
one vLLM CPU engine each (the LoRA one with `enable_lora`). Per way, medians over `ROUNDS`:

  sync_MB     bytes one weight sync moves per engine (LoRA: the adapter alone, after the first sync)
  trainer_s   what the trainer is blocked for by a sync (gather, convert, one object-store copy)
  ready_s     from the sync's start until the engine holds the version (its load finished)
  step_s      one optimizer step on the same window of rollouts
  peak_MB     the train rank's peak resident memory over its training steps (before any sync)
  state_MB    what training holds beyond the weights: Megatron DDP's gradient buffers and the optimizer's state

Ratios are LoRA / full. Figures and the machine: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_weight_sync import MODELS, ROUNDS  # noqa: E402 - the same three models (this script's directory)
ROLLOUTS, TOKENS = 16, (32, 160)


def window(vocab_size: int, step: int) -> list:
    from vgbs_ray.sample import make_rollout

    rng = np.random.default_rng(step)
    samples = []
    for r in range(ROLLOUTS):
        length = int(rng.integers(*TOKENS))
        response = length // 2
        samples += make_rollout(f"s{step}-r{r}", [dict(tokens=rng.integers(0, vocab_size, length),
                                                       response_length=response,
                                                       loss_mask=np.ones(response, dtype=np.int8))],
                                reward=float(rng.random()), advantage=float(rng.normal()))
    return samples


def shards(samples: list) -> list:
    from vgbs_ray.config import BatchConfig, ParallelConfig
    from vgbs_ray.layout.schedule import build_dp_schedule
    from vgbs_ray.layout.shard import build_step_shards

    schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                 ParallelConfig(dp_size=1), BatchConfig(global_batch_size=ROLLOUTS,
                                                                        max_tokens_per_gpu=1024))
    return build_step_shards(samples, schedule.steps[0], 0)


def peak_rss_mb(actor) -> float:
    import ray

    def read(_self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    return ray.get(actor.__ray_call__.remote(read), timeout=60)


def train_state_mb(actor) -> float:
    """What training holds beyond the model's weights: Megatron DDP's gradient buffers and the optimizer's state."""
    import ray

    def read(self) -> float:
        import torch

        megatron = self.trainer.megatron
        grads = sum(buffer.grad_data.numel() * buffer.grad_data.element_size()
                    for chunk in megatron.chunks for buffer in chunk.buffers)
        parts = [part for optimizer in megatron.optimizers.values()
                 for part in getattr(optimizer, "chained_optimizers", [optimizer])]
        state = sum(value.numel() * value.element_size() for part in parts
                    for per_param in part.optimizer.state.values()
                    for value in per_param.values() if isinstance(value, torch.Tensor) and value.dim() > 0)
        return (grads + state) / 1e6

    return ray.get(actor.__ray_call__.remote(read), timeout=60)


def measure(name: str, fields: dict, model_dir: str, lora) -> dict:
    from actors.rollout_engine import EngineConfig, RolloutEnginePool
    from trainer.config import LossConfig, ModelConfig, OptimizerConfig, TrainGroupConfig
    from actors.train_group import TrainGroup
    from actors.weight_sync import publish_weights

    model = ModelConfig(**fields, max_position_embeddings=256)
    group = TrainGroup(TrainGroupConfig(dp_size=1, model=model, lora=lora, optimizer=OptimizerConfig(kind="adamw"),
                                        loss=LossConfig(policy="ppo")))
    engines = None
    try:
        steps = []
        for step in range(ROUNDS):  # training first: the peak below is the training's, not a sync's copies
            started = time.perf_counter()
            group.train_shards(shards(window(model.vocab_size, step)))
            steps.append(time.perf_counter() - started)
        peak = peak_rss_mb(group.actors[0])
        state = train_state_mb(group.actors[0])
        first = publish_weights(group, 0)  # with LoRA: base + adapter, the job's first sync
        engines = RolloutEnginePool(EngineConfig(num_engines=1, max_model_len=256, startup_timeout_s=900,
                                                 lora_adapters=(("policy", lora),) if lora else (),
                                                 call_timeout_s=900), model_dir, policy_version=0)
        engines.wait_for_weights(engines.update_weights(first))
        syncs = []
        for version in range(1, ROUNDS + 1):
            started = time.perf_counter()
            published = publish_weights(group, version, include_base=lora is None)
            trainer_s = time.perf_counter() - started
            (load,) = engines.wait_for_weights(engines.update_weights(published))
            syncs.append((trainer_s, time.perf_counter() - started, load.num_bytes))
        return dict(sync_MB=syncs[0][2] / 1e6, trainer_s=statistics.median(s[0] for s in syncs),
                    ready_s=statistics.median(s[1] for s in syncs), step_s=statistics.median(steps),
                    peak_MB=peak, state_MB=state, first_sync_MB=first.num_bytes / 1e6)
    finally:
        if engines is not None:
            engines.shutdown()
        group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the demo model only")
    args = parser.parse_args()
    import ray

    from trainer.hf_checkpoint import write_hf_config
    from trainer.config import ModelConfig
    from vgbs_ray.models.lora import LoraConfig

    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=2 << 30, log_to_driver=False)
    rows = []
    try:
        for name, fields in list(MODELS.items())[:1 if args.quick else None]:
            model_dir = str(write_hf_config(Path(tempfile.mkdtemp()) / name.strip("~"), ModelConfig(**fields)))
            full = measure(name, fields, model_dir, None)
            adapter = measure(name, fields, model_dir, LoraConfig(rank=8, alpha=16))
            rows.append((name, full, adapter))
    finally:
        ray.shutdown()
    keys = ("sync_MB", "trainer_s", "ready_s", "step_s", "peak_MB", "state_MB")
    print(f"{'model':>6} {'way':>5} " + " ".join(f"{k:>10}" for k in keys) + f" {'first_sync_MB':>14}")
    for name, full, adapter in rows:
        for way, row in (("full", full), ("lora", adapter)):
            print(f"{name:>6} {way:>5} " + " ".join(f"{row[k]:>10.3f}" for k in keys) + f" {row['first_sync_MB']:>14.2f}")
        print(f"{name:>6} {'x':>5} " + " ".join(f"{adapter[k] / full[k]:>10.3f}" for k in keys))


if __name__ == "__main__":
    main()
