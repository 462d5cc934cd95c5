#!/usr/bin/env bash
# GPU check: Megatron schedule + DDP + optimizer over NCCL vs the CPU path, same update (a Qwen3-shaped
# model; a LoRA step too: the adapters on Megatron's local layers on the GPU; then bf16, reported). The
# weight channel's NCCL backend (docs/models.md) needs a GPU per side, so this one-GPU check does not run it.
# Needs one GPU (two, with Transformer Engine, for the CP=2 check) and a CUDA build of torch: the
# project pins the CPU wheel, so point PYTHON at an environment with the project installed over a
# CUDA torch (same megatron-core 0.16.1). From the repository root:
#   PYTHON=/path/to/cuda-env/bin/python bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=${VGBS_GPU_CHECK_DIR:-/tmp/vgbs-gpu-check}
# 1. the CPU reference with CUDA hidden (megatron_cpu_compat active), 2. the NCCL ranks
CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/gpu_check.py --mode cpu --dir "$DIR"
"$PY" benchmarks/gpu_check.py --mode gpu --dir "$DIR"
