"""Rendezvous: torch.distributed, then Megatron's parallel groups, both with a timeout.

Rank 0 picks a free TCP port on its node and publishes `host:port`; every rank then joins
the default group with `init_method=tcp://host:port` (a peer that never joins fails the
others after `timeout_s`, it does not hang), and Megatron builds its TP / PP / CP / DP
groups (DP derived: world / (tp * pp * cp)) with the same timeout. Megatron's rank order puts
TP peers on consecutive ranks (then CP, DP, PP), so a PACK placement keeps them on one node.

Megatron-Core warns at import time, once per importing module and each time with its own
text, that Transformer Engine and Apex are missing; `quiet_megatron_fallback_warnings`
(called before a rank first imports Megatron) folds those into one line per process.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import logging
import socket
import warnings

import torch
import torch.distributed as dist

from trainer.config import RankInfo

log = logging.getLogger(__name__)

# Start of the texts of Megatron-Core 0.16's import-time fallback warnings (optimizer,
# clip_grads, FSDP mixed precision, norm backends, layer specs: six per rank on CPU).
_FALLBACK_WARNING_TEXT = r"(Transformer Engine and Apex are|Apex is) not installed"


@functools.cache  # once per process, however many times a rank sets up
def quiet_megatron_fallback_warnings() -> None:
    """Replace Megatron's per-module "Transformer Engine / Apex not installed" warnings with one line.

    Must run before the process first imports `megatron.core` (the warnings fire at import).
    Only those warnings are filtered; any other Megatron warning still shows.
    """
    warnings.filterwarnings("ignore", message=_FALLBACK_WARNING_TEXT, category=UserWarning)
    missing = [name for name in ("transformer_engine", "apex") if importlib.util.find_spec(name) is None]
    if missing:
        log.warning("%s not installed: Megatron-Core uses its local fallbacks (torch norms and optimizers, "
                    "local multi-tensor kernels)", " and ".join(missing))


def find_free_port() -> int:
    """A TCP port that was free a moment ago on this host (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def init_distributed(*, rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
                     timeout_s: float, tp_size: int, pp_size: int, cp_size: int, vpp_size: int = 1,
                     ep_size: int = 1) -> RankInfo:
    """Join the process group and initialise Megatron's parallel state; returns this rank's place."""
    from megatron.core import parallel_state

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vpp_size if vpp_size > 1 else None,
        context_parallel_size=cp_size,
        expert_model_parallel_size=ep_size,
        # A float is fine: Megatron only builds a timedelta from it.
        distributed_timeout_minutes=timeout_s / 60.0,
    )
    return RankInfo(
        rank=rank,
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        pp_size=pp_size,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=ep_size,
    )


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
