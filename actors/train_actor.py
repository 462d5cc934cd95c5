"""TrainActor: one rank of the train group, a thin Ray shell around `RankTrainer`.

Created cheaply (no Megatron import) on its placement-group bundle; `setup` joins
torch.distributed and Megatron's groups and builds the model, so every rank imports
Megatron in parallel. A step either comes as a shard (`train_shard`) or as the ShardRef the
SchedulerActor gave the group's driver for this DP rank (`train_step`): the rank pulls its
shard from the object store and trains it; the lead rank of each DP replica (TP/CP rank 0 of
the last pipeline stage) returns its replica's metric pairs, which the driver acks.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray
import torch

from actors.gc_tuning import collector_paused
from actors.shard_ref import ShardRef
from trainer.config import RankInfo, RankStepResult, TrainGroupConfig
from vgbs_ray.layout.shard import StepShard

log = logging.getLogger(__name__)

# The scheduler's RPCs get this much on top of the configured waits (scheduling, pickling).
_RPC_MARGIN_S = 30.0


class TrainActor:
    """One rank (see module docstring). Made remote by `train_actor_class`."""

    def __init__(self, config: TrainGroupConfig, rank: int):
        torch.set_num_threads(1)  # 2-core machines; many ranks share them
        self.config = config
        self.rank = rank
        self.info: RankInfo | None = None
        self.trainer = None
        self._weight_channel = None

    def node_id(self) -> str:
        """The Ray node this rank runs on (placement checks)."""
        return ray.get_runtime_context().get_node_id()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (asked of rank 0: the rendezvous address)."""
        from trainer.distributed import find_free_port

        return ray.util.get_node_ip_address(), find_free_port()

    def setup(self, master_addr: str, master_port: int) -> RankInfo:
        from trainer.distributed import init_distributed, quiet_megatron_fallback_warnings

        quiet_megatron_fallback_warnings()  # before the first Megatron import: its warnings fire at import
        with collector_paused(freeze=True):  # ~0.8x of Megatron's import (actors/gc_tuning.py)
            from trainer.rank_trainer import RankTrainer

        c = self.config
        self.info = init_distributed(rank=self.rank, world_size=c.world_size, master_addr=master_addr,
                                     master_port=master_port, backend=c.backend, timeout_s=c.collective_timeout_s,
                                     tp_size=c.tp_size, pp_size=c.pp_size, cp_size=c.cp_size,
                                     vpp_size=c.vpp_size, ep_size=c.ep_size)
        self.trainer = RankTrainer(c, self.info)
        return self.info

    def train_shard(self, shard: StepShard, adapter: str | None = None) -> RankStepResult:
        return self.trainer.train_shard(shard, adapter)

    def train_step(self, shard_ref: ShardRef, timeout_s: float, adapter: str | None = None) -> RankStepResult:
        """Pull this DP rank's shard from the object store (its ShardRef comes from the group's driver,
        which asks the scheduler for every rank's at once) and train it (multi-LoRA: as tenant `adapter`'s
        step). The driver acks the step."""
        shard = shard_ref.fetch(timeout_s=timeout_s + _RPC_MARGIN_S)
        return self.trainer.train_shard(shard, adapter)

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)

    def save_checkpoint(self, path: str) -> str | None:
        """One file per model-parallel shard (and expert share), written by the first replica's ranks (DP replicas
        are identical)."""
        if not self.info.in_first_replica:
            return None
        target = Path(path) / _checkpoint_name(self.info)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        torch.save(self.trainer.state_dict(), tmp)
        os.replace(tmp, target)  # a crash mid-save never leaves a half file under the real name
        return str(target)

    def load_checkpoint(self, path: str) -> None:
        target = Path(path) / _checkpoint_name(self.info)
        if not target.exists():
            raise FileNotFoundError(f"rank {self.rank}: no checkpoint file {target} (saved with other tp/pp sizes?)")
        self.trainer.load_state_dict(torch.load(target, map_location="cpu", weights_only=False))

    def full_parameters(self) -> dict:
        return self.trainer.full_parameters()

    def save_adapter(self, directory: str, adapter: str) -> str | None:
        """LoRA: adapter `adapter` as PEFT files in `directory`, written by global rank 0; the first replica's
        ranks must all call it (they gather the adapter together). Returns the directory on rank 0."""
        from vgbs_ray.models.lora import base_model_name, save_peft_adapter

        if not self.info.in_first_replica:
            return None
        tensors = self.trainer.full_parameters(adapters=True, adapter=adapter)
        if self.rank != 0:
            return None
        return save_peft_adapter(directory, tensors, self.config.adapters[adapter].lora,
                                 base_model_name(self.config.model))

    def load_full_parameters(self, full: dict) -> None:
        self.trainer.load_full_parameters(full)

    def export_hf_weights(self, include_base: bool = True, adapter: str | None = None):
        """Weight sync (actors/weight_sync.py): on global rank 0, (object ref of the HF-named weights,
        bytes), owned by this actor; None on other ranks. Every rank of the first replica must call it
        (`RankInfo.in_first_replica`: they gather the whole model together)."""
        from actors.weight_sync import put_hf_weights

        base, adapters = self._policy_weights(include_base, adapter)
        return put_hf_weights(base, self.config.model, adapters) if self.rank == 0 else None

    def _policy_weights(self, include_base: bool, adapter: str | None) -> tuple[dict, dict | None]:
        """(base, adapters) as the engines need them: without LoRA the whole model and no adapters; with LoRA the
        adapters (one tenant's when `adapter` names it), and the frozen base only when asked (a collective over the
        first replica, like the export)."""
        if not self.config.adapters:
            return self.trainer.full_parameters(), None
        base = self.trainer.full_parameters() if include_base else {}
        return base, self.trainer.full_parameters(adapters=True, adapter=adapter)

    def open_weight_channel(self, address: str, world_size: int, backend: str, timeout_s: float) -> None:
        """Rank 0: host the weight channel to the engines (actors/weight_channel.py); blocks until they joined."""
        from actors.weight_channel import WeightChannel

        if self._weight_channel is not None:  # reopened with a replaced engine: the old peers are gone
            try:
                self._weight_channel.close()
            except Exception as error:  # noqa: BLE001 - a dead peer may break the close
                log.info("rank 0: closing the previous weight channel: %r", error)
        self._weight_channel = WeightChannel(address, rank=0, world_size=world_size, backend=backend,
                                             timeout_s=timeout_s)

    def send_weights(self, policy_version: int, bucket_bytes: int, dtype: str, include_base: bool = True,
                     adapter: str | None = None) -> tuple[int, float] | None:
        """Weight sync over the channel: on global rank 0 (bytes sent, seconds), None on the other ranks of the
        first replica, which must call it too (they gather the full weights together)."""
        import time

        from actors.weight_sync import hf_tensors_from_full

        base, adapters = self._policy_weights(include_base, adapter)
        if self.rank != 0:
            return None
        started = time.perf_counter()
        tensors = hf_tensors_from_full(base, self.config.model, dtype=getattr(torch, dtype), adapters=adapters)
        sent = self._weight_channel.send(tensors, policy_version=policy_version, bucket_bytes=bucket_bytes)
        return sent, time.perf_counter() - started

    def shutdown(self) -> None:
        from trainer.distributed import destroy_distributed

        if self._weight_channel is not None:
            try:
                self._weight_channel.close()
            except Exception as error:  # noqa: BLE001 - the engines may be gone already
                log.info("rank 0: closing the weight channel: %r", error)

        destroy_distributed()


def _checkpoint_name(info: RankInfo) -> str:
    experts = f"_ep{info.ep_rank:03d}" if info.ep_size > 1 else ""
    return f"model_tp{info.tp_rank:02d}_pp{info.pp_rank:03d}{experts}.pt"


def train_actor_class(*, num_cpus: float, num_gpus: float):
    """The remote TrainActor class with its resources (one factory; every actor is made here)."""
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)(TrainActor)
