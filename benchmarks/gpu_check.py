"""GPU check: Megatron's schedule, DDP and optimizer over NCCL against the CPU path (gloo), same update.

NOT RUN IN THIS REPOSITORY'S CI: it needs a GPU. `benchmarks/gpu_check.sh` runs it.

The model is Qwen3-shaped (`MODEL`: QK-norm, head_dim 64 independent of hidden / heads, tied embeddings).

1. `--mode cpu` (CUDA hidden): one gloo rank builds the model from its seed, saves the initial
   weights, trains STEPS fixed-rollout steps (SGD, no clipping, float32) and saves the update.
2. `--mode gpu`: `world` NCCL ranks (one per GPU; DP=1, or CP=2 with two GPUs) load those initial
   weights, train the same steps, and compare: relative difference of the updates < 1e-3.
   Transformer Engine attention is used when installed (the model picks its TE spec on GPU).
   Then the same in bf16 (Megatron's fp32 main parameters and gradients): its relative difference
   to the float32 update is printed, not gated (bf16 parameters round each update; no bar measured yet).
Prints one line per comparison and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 2
NUM_ROLLOUTS = 12
MAX_TOKENS = 160
TOLERANCE = 1e-3


def _shards(step: int, cp_size: int):
    from tests.train_support import make_samples
    from vgbs_ray.config import BatchConfig, ParallelConfig
    from vgbs_ray.layout.schedule import build_dp_schedule
    from vgbs_ray.layout.shard import build_step_shards

    samples = make_samples(100 + step, NUM_ROLLOUTS, id_prefix=f"s{step}-")
    schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                 ParallelConfig(dp_size=1, cp_size=cp_size),
                                 BatchConfig(global_batch_size=NUM_ROLLOUTS, max_tokens_per_gpu=MAX_TOKENS))
    return build_step_shards(samples, schedule.steps[0], step)


def _model(dtype: str = "float32"):
    from trainer.config import ModelConfig

    return ModelConfig(family="qwen3", hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=64,
                       tie_word_embeddings=True, params_dtype=dtype)


def _config(backend: str, cp_size: int, dtype: str = "float32", lora: bool = False):
    from tests.train_support import sgd_config
    from vgbs_ray.models.lora import LoraConfig

    return sgd_config(lr=1.0, backend=backend, cp_size=cp_size, model=_model(dtype),
                      lora=LoraConfig(rank=8, alpha=16) if lora else None)


def _weights(trainer, lora: bool) -> dict:
    """What a step updates: the whole model, or with LoRA the adapters (the base with them, to start alike)."""
    return {**trainer.full_parameters(), **trainer.full_parameters(adapters=True)} if lora else trainer.full_parameters()


def _train(rank: int, world: int, port: int, backend: str, cp_size: int, initial: str | None, out: str,
           dtype: str = "float32", lora: bool = False) -> None:
    import torch

    from trainer.distributed import init_distributed
    from trainer.rank_trainer import RankTrainer

    torch.set_num_threads(1)
    info = init_distributed(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                            backend=backend, timeout_s=120, tp_size=1, pp_size=1, cp_size=cp_size)
    trainer = RankTrainer(_config(backend, cp_size, dtype, lora), info)
    if initial is None:
        np.savez(out + ".initial.npz", **_weights(trainer, lora))
    else:
        trainer.load_full_parameters(dict(np.load(initial)))
    before = _weights(trainer, lora)
    losses = [trainer.train_shard(_shards(k, cp_size)[0]).metrics.get("loss", (0.0, 0.0)) for k in range(STEPS)]
    after = _weights(trainer, lora)
    if rank == 0:
        np.savez(out, **{k: after[k].astype(np.float64) - before[k].astype(np.float64) for k in before})
        print(f"{backend} cp={cp_size} {dtype}: loss pairs per step {losses}")


def _spawn(world: int, backend: str, cp_size: int, initial: str | None, out: str, dtype: str = "float32",
           lora: bool = False) -> None:
    from trainer.distributed import find_free_port

    port = find_free_port()
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_train, args=(r, world, port, backend, cp_size, initial, out, dtype, lora))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"{backend} rank failed with exit code {p.exitcode}")


def _relative(a: dict, b: dict) -> float:
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a)
    return (num / sum(float((a[k] ** 2).sum()) for k in a)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("cpu", "gpu"), required=True)
    parser.add_argument("--dir", default="/tmp/vgbs-gpu-check")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    cpu_out = os.path.join(args.dir, "cpu_update.npz")
    lora_out = os.path.join(args.dir, "cpu_lora_update.npz")
    if args.mode == "cpu":
        _spawn(1, "gloo", 1, None, cpu_out)
        _spawn(1, "gloo", 1, None, lora_out, lora=True)
        return
    import torch

    from trainer.model import transformer_engine_available

    assert torch.cuda.is_available(), "--mode gpu needs CUDA"
    print(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; "
          f"Transformer Engine: {transformer_engine_available()}")
    expected = dict(np.load(cpu_out))
    failed = False
    checks = [(1, 1)] + ([(2, 2)] if torch.cuda.device_count() >= 2 and transformer_engine_available() else [])
    for world, cp_size in checks:
        out = os.path.join(args.dir, f"gpu_cp{cp_size}_update.npz")
        _spawn(world, "nccl", cp_size, cpu_out + ".initial.npz", out)
        rel = _relative(expected, dict(np.load(out)))
        ok = rel < TOLERANCE
        failed |= not ok
        print(f"NCCL dp=1 cp={cp_size} vs CPU gloo: relative update difference {rel:.2e} "
              f"({'OK' if ok else 'MISMATCH'}, tolerance {TOLERANCE:g})")
    if len(checks) == 1:
        print("CP=2: skipped (needs 2 GPUs and Transformer Engine)")
    gpu_lora_out = os.path.join(args.dir, "gpu_lora_update.npz")  # LoRA: the adapters' update, local layers on GPU
    _spawn(1, "nccl", 1, lora_out + ".initial.npz", gpu_lora_out, lora=True)
    rel = _relative(dict(np.load(lora_out)), dict(np.load(gpu_lora_out)))
    failed |= rel >= TOLERANCE
    print(f"NCCL LoRA dp=1 vs CPU gloo: relative update difference {rel:.2e} "
          f"({'OK' if rel < TOLERANCE else 'MISMATCH'}, tolerance {TOLERANCE:g})")
    bf16_out = os.path.join(args.dir, "gpu_bf16_update.npz")
    _spawn(1, "nccl", 1, cpu_out + ".initial.npz", bf16_out, dtype="bfloat16")
    print(f"NCCL dp=1 bf16 vs CPU gloo float32: relative update difference "
          f"{_relative(expected, dict(np.load(bf16_out))):.2e} (reported, not gated)")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
