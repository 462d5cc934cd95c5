"""Megatron-Core 0.16.1 on a machine without CUDA: the one place its CUDA literals are redirected.

    activate()   # idempotent; does nothing when CUDA is available

Megatron's pipeline schedule, DDP and optimizer allocate a few bookkeeping tensors with a
hard-coded `device="cuda"` / `torch.cuda.current_device()` (`_PATCHED_MODULES` below lists them). On a
CPU-only machine, and only there, the name `torch` inside exactly those modules is rebound to
`_CpuTorch`, a proxy that forwards everything to the real torch except that a CUDA device
argument becomes the CPU and `torch.cuda.current_device()` / `synchronize()` are CPU no-ops.
Nothing global changes: `torch` itself, and every other module, are untouched. The MoE router
(`moe/router.py`) moves its weight with `torch.cuda.current_device()`, and the gather over tensor-parallel
ranks its token dispatcher calls (`tensor_parallel/mappings.py`) allocates there, directly and through the
global memory buffer (which `mappings` gets a CPU stand-in for): both are redirected the same way;
`moe_utils.te_general_gemm`, defined only when Transformer Engine imports, is set to None. The alltoall
token dispatcher (expert parallelism: token counts differ between ranks) makes a CUDA stream for its
device-to-host copies of the split sizes; it gets one stand-in stream whose waits are no-ops, and those
split sizes as numpy arrays (what it makes of CUDA tensors) instead of tensors, which `all_to_all_single`
does not take. Two functions
that assert CUDA tensors (`clip_grad_by_total_norm_fp32`, the l2-norm kernel behind the grad
norm) are replaced by CPU equivalents, in the modules that imported them by name.

Invariants (tests/test_megatron_cpu_redirects.py): after `activate()` on CPU the patched modules'
CUDA literals allocate on CPU, the real `torch` still refuses CUDA, and the grad norm and
clipping equal a plain torch computation. With CUDA present `activate()` returns False and
patches nothing (the GPU path runs Megatron unmodified).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch

_PATCHED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.transformer.moe.router",
    "megatron.core.tensor_parallel.mappings",  # the MoE allgather dispatcher's gather over TP allocates on CUDA
    "megatron.core.transformer.moe.token_dispatcher",  # the alltoall dispatcher (EP) copies counts on a CUDA stream
)
_FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like",
                        "empty_like", "full_like"})
_active = False


def _cpu_device(device):
    """Any CUDA device spec (string, torch.device, ordinal) becomes the CPU; others pass through."""
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _CpuStream:
    """A CUDA stream (and its events) on the CPU: work is already in order, so every wait is a no-op."""

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None) -> "_CpuStream":
        return self

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


class _CpuCuda:
    """`torch.cuda` as the patched modules see it: a current device that is the CPU, one CPU "stream"."""

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args, **kwargs):
        return None

    @staticmethod
    def Stream(*args, **kwargs):  # noqa: N802 - torch.cuda's name
        return _CPU_STREAM

    @staticmethod
    def current_stream(*args, **kwargs):
        return _CPU_STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """The real `torch` with CUDA device arguments of tensor factories mapped to the CPU."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def on_cpu(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return attr(*args, **kwargs)

        return on_cpu


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for `amp_C.multi_tensor_l2norm` on CPU: the l2 norm of all tensors together (fp32)."""
    squares = [t.detach().float().pow(2).sum() for tensors in tensor_lists for t in tensors]
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    return total.reshape(1), None


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's clip (scale every grad by max_norm / (total_norm + 1e-6) when below 1), without its CUDA assert."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.mul_(clip_coeff)


def _split_sizes_on_cpu(tensor, as_numpy=False, record_stream=False):
    """`moe_utils.maybe_move_tensor_to_cpu` for tensors already on the CPU: the alltoall dispatcher's split
    sizes come back as numpy when asked (Megatron converts only CUDA tensors, and `all_to_all_single` takes a
    sequence of ints, which a numpy array is and a tensor is not)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


class _CpuMemoryBuffer:
    """What `tensor_parallel.mappings` asks of Megatron's global memory buffer, on the CPU (its `get_tensor`
    allocates with `torch.cuda.current_device()`); a fresh tensor per call, no reuse."""

    @staticmethod
    def get_tensor(tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype)


def activate() -> bool:
    """Redirect the CUDA literals (see module docstring) when CUDA is absent; True if active."""
    global _active
    if torch.cuda.is_available():
        return False
    if _active:
        return True
    proxy = _CpuTorch()
    modules = {name: importlib.import_module(name) for name in _PATCHED_MODULES}
    for module in modules.values():
        module.torch = proxy
    clip_grads = modules["megatron.core.optimizer.clip_grads"]
    clip_grads.l2_norm_impl = _l2_norm
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    modules["megatron.core.optimizer.optimizer"].clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    # moe_utils binds `te_general_gemm` only when Transformer Engine imports, then reads it unconditionally in the
    # router's gating; None selects its plain torch.mm branch.
    modules["megatron.core.tensor_parallel.mappings"].get_global_memory_buffer = _CpuMemoryBuffer
    modules["megatron.core.transformer.moe.token_dispatcher"].maybe_move_tensor_to_cpu = _split_sizes_on_cpu
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _active = True
    return True


# -- rotary position embeddings (RoPE) ---------------------------------------------------
# `RotaryEmbedding.get_emb` moves a CPU `inv_freq` to `torch.cuda.current_device()` at the first
# forward pass (0.16.1, no flag avoids it). The fix is per model instance: its RotaryEmbedding
# gets a subclass whose `get_emb` is the same computation without that move. No library global
# changes; the GPU path (CUDA present) keeps Megatron's class.


@functools.cache
def _cpu_rotary_embedding_class():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class CpuRotaryEmbedding(RotaryEmbedding):
        """Megatron's RotaryEmbedding with `inv_freq` kept where it is (the CPU)."""

        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim / 2]
            if self.rotary_interleaved:  # channel pairs (0, 1), (2, 3), ...
                emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
            else:  # rotate-half (Llama / HF): first half and second half share a frequency
                emb = torch.cat((freqs, freqs), dim=-1)
            return emb[:, None, None, :]  # [s, 1, 1, dim]

    return CpuRotaryEmbedding


def make_rotary_embedding_cpu_safe(model: torch.nn.Module) -> bool:
    """Give every RotaryEmbedding inside `model` the CPU `get_emb`; True if any changed.

    Does nothing when CUDA is available. Idempotent.
    """
    if torch.cuda.is_available():
        return False
    cpu_class = _cpu_rotary_embedding_class()
    megatron_class = cpu_class.__bases__[0]
    changed = False
    for module in model.modules():
        if type(module) is megatron_class:  # exactly Megatron's class (YaRN etc. have their own get_emb)
            module.__class__ = cpu_class
            changed = True
    return changed
