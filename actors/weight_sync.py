"""Weight sync: the train group publishes policy version v once; every engine pulls and loads it.

Two transports (`WeightSyncConfig.transport`; figures and the default's reasons: docs/models.md):

- `object_store` (below): one copy into the Ray object store, every engine reads it.
- `collective`: trainer rank 0 broadcasts the weights in byte buckets over a process group of its
  own with the engines (actors/weight_channel.py: gloo, or NCCL when each side has a GPU of its own),
  optionally cast to bfloat16 (half the bytes); each engine receives on a thread of its own and
  loads between batches, as for the object store. `open_weight_channel` once per train group,
  then `send_weights(group, v)` per step: the trainer is blocked for the gather and the send.

    published = publish_weights(group, version)     # blocks only for the export (gather + one store copy)
    loads = engines.update_weights(published)        # returns at once; engines load between requests
    ...                                              # the trainer goes on with the next step
    engines.wait_for_weights(loads)                  # -> one WeightLoad per engine (times, bytes)

Publish: the ranks of DP replica 0 gather the full weights (TP shards joined, PP stages
joined, and with expert parallelism the experts of its EP peers: a collective inside that first replica); global rank 0 converts them to Hugging Face names
(`vgbs_ray.models.hf_mapping`) and returns them as numpy arrays. That return value is the one copy
in the Ray object store; every engine on the node reads it zero-copy (numpy) and copies it
into its own parameters. The trainer never waits for engines: `publish_weights` returns when
the object is sealed, and loading happens in the engines' own processes.

Bytes per sync: the HF state dict in float32 (`num_bytes`), moved once into the store and
once per engine out of it (a local read on the same node, a transfer across nodes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import ray

from trainer.config import ModelConfig
from vgbs_ray.errors import ConfigError, VgbsError


class WeightChannelError(VgbsError, RuntimeError):
    """Trainer rank 0 could not send a version over the weight channel (actors/weight_channel.py): a receiving
    engine died or left. The engine's failure, not the trainer's: the channel is replaced, the ranks go on."""


@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    """How each policy version reaches the engines (see module docstring)."""

    transport: Literal["object_store", "collective"] = "object_store"
    dtype: Literal["float32", "bfloat16"] = "float32"
    """What the weights travel as; bfloat16 (half the bytes) needs transport=collective (numpy, which the object
    store path uses, has no bfloat16). The engine casts them to its own dtype when it loads them."""
    bucket_mb: float = 64.0
    """Collective: the most MiB broadcast at once (a larger tensor goes alone)."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """Collective: gloo (CPU tensors; works anywhere) or nccl (trainer rank 0 and every engine on a GPU of its
    own: NCCL refuses two ranks on one GPU; not yet run on a GPU)."""
    timeout_s: float = 300.0
    """Collective: how long opening the channel, or one send, may wait for the other side."""

    def __post_init__(self):
        if self.transport not in ("object_store", "collective"):
            raise ConfigError(f"weight_sync.transport must be object_store or collective, got {self.transport!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"weight_sync.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.dtype == "bfloat16" and self.transport != "collective":
            raise ConfigError("weight_sync.dtype=bfloat16 needs weight_sync.transport=collective (the object store "
                              "path holds numpy arrays, which have no bfloat16)")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"weight_sync.backend must be gloo or nccl, got {self.backend!r}")
        if self.bucket_mb <= 0 or self.timeout_s <= 0:
            raise ConfigError(f"weight_sync.bucket_mb and timeout_s must be > 0, got {self.bucket_mb}, {self.timeout_s}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * (1 << 20))


@dataclass(frozen=True)
class PublishedWeights:
    """Policy version `policy_version` in the object store (HF names -> float32 numpy arrays)."""

    policy_version: int
    ref: ray.ObjectRef
    num_bytes: int
    publish_time_s: float
    """Export on the train side: gather, convert, one copy into the object store."""


@dataclass(frozen=True)
class WeightLoad:
    """One engine's load of one published version."""

    engine: str
    policy_version: int
    load_time_s: float
    """In the engine, between two of its steps: copying the weights into its parameters and resetting its
    cache. The pause of its requests in flight (they emit nothing meanwhile, then go on)."""
    num_bytes: int
    requests_in_flight: int = 0
    """Requests running when it was applied (they went on under the new weights)."""


def hf_tensors_from_full(full: dict[str, np.ndarray], model: ModelConfig, dtype=None,
                         adapters: dict[str, np.ndarray] | None = None) -> dict:
    """Whole-model Megatron parameters (as `RankTrainer.full_parameters` returns them) -> HF-named torch
    tensors, cast to `dtype` when given (e.g. torch.bfloat16: half the bytes of a float32 sync). With LoRA,
    `full` may be empty (the base did not change) and `adapters` are added as `<adapter>/<PEFT name>`
    (`vgbs_ray.models.lora.sync_key`)."""
    import torch  # here, not at the top: producers import this module (via actors.rollout_engine) and need no torch

    from vgbs_ray.models.hf_mapping import megatron_to_hf
    from vgbs_ray.models.lora import sync_key

    hf = megatron_to_hf({name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in full.items()},
                        model.weight_layout) if full else {}
    hf.update({sync_key(name): torch.from_numpy(np.ascontiguousarray(a)) for name, a in (adapters or {}).items()})
    return hf if dtype is None else {name: tensor.to(dtype) for name, tensor in hf.items()}


def put_hf_weights(full: dict[str, np.ndarray], model: ModelConfig,
                   adapters: dict[str, np.ndarray] | None = None) -> tuple[ray.ObjectRef, int]:
    """On the train side (global rank 0): HF-named float32 numpy arrays (and PEFT-named adapters) into the object
    store, owned by this (long-lived) actor; returns the reference and the bytes stored."""
    hf = {name: tensor.numpy() for name, tensor in hf_tensors_from_full(full, model, adapters=adapters).items()}
    return ray.put(hf), sum(a.nbytes for a in hf.values())


def publish_weights(group, policy_version: int, *, timeout_s: float | None = None,
                    include_base: bool = True, adapter: str | None = None) -> PublishedWeights:
    """Export `group`'s current weights as version `policy_version` into the object store (see module doc).
    With LoRA they are the adapters (multi-LoRA: tenant `adapter`'s alone), and the frozen base too when
    `include_base`.

    `group` is a TrainGroup; only the first replica takes part (DP replica 0's TP and PP peers, and with expert
    parallelism its EP peers, gather together: `RankInfo.in_first_replica`).
    A rank that fails or dies raises `TrainStepError` naming it.
    """
    start = time.perf_counter()
    replica = [(actor, info) for actor, info in zip(group.actors, group.rank_infos) if info.in_first_replica]
    timeout_s = group.config.step_timeout_s if timeout_s is None else timeout_s
    results = group._gather([actor.export_hf_weights.remote(include_base, adapter) for actor, _ in replica],  # noqa: SLF001
                            timeout_s, f"publish weights v{policy_version}")
    ((ref, num_bytes),) = [r for r in results if r is not None]  # global rank 0's
    return PublishedWeights(policy_version=policy_version, ref=ref, num_bytes=num_bytes,
                            publish_time_s=time.perf_counter() - start)


@dataclass(frozen=True)
class SentWeights:
    """Policy version `policy_version` broadcast over the weight channel."""

    policy_version: int
    num_bytes: int
    send_time_s: float
    """What the trainer was blocked for: gather, convert, send (the driver's wall time)."""


def open_weight_channel(group, engines, config: WeightSyncConfig) -> None:
    """Connect trainer rank 0 of `group` (a TrainGroup) and every engine of `engines` (a RolloutEnginePool);
    again after a recovery replaced the group."""
    rank0 = group.actors[0]
    host, port = ray.get(rank0.address.remote(), timeout=config.timeout_s)
    address = f"{host}:{port}"
    if config.backend == "nccl" and not (group.config.on_gpu and engines.config.on_gpu):
        raise ConfigError("weight_sync.backend=nccl needs the train group and the engines on GPUs; use gloo")
    joins = engines.open_weight_channel(address, config.backend, config.timeout_s)
    joins.append(rank0.open_weight_channel.remote(address, len(engines.engines) + 1, config.backend,
                                                  config.timeout_s))
    ray.get(joins, timeout=config.timeout_s + 30)


def send_weights(group, policy_version: int, config: WeightSyncConfig, *, include_base: bool = True,
                 adapter: str | None = None) -> SentWeights:
    """Gather `group`'s weights on the first replica and broadcast them from rank 0 as `policy_version` (with
    LoRA: the adapters, and the base too when `include_base`). A rank that fails or dies raises `TrainStepError`
    naming it; a receiving engine that is gone, `WeightChannelError`."""
    start = time.perf_counter()
    replica = [actor for actor, info in zip(group.actors, group.rank_infos) if info.in_first_replica]
    try:
        results = group._gather([actor.send_weights.remote(policy_version, config.bucket_bytes,  # noqa: SLF001
                                                           config.dtype, include_base, adapter)
                                 for actor in replica], config.timeout_s, f"send weights v{policy_version}")
    except Exception as error:  # TrainStepError, from the rank's RayTaskError
        cause = getattr(error.__cause__, "cause", None)  # the rank's own exception, when it raised one
        if isinstance(cause, WeightChannelError):
            raise cause from error  # an engine's failure: the ranks are fine
        raise
    ((num_bytes, _),) = [r for r in results if r is not None]
    return SentWeights(policy_version, num_bytes, time.perf_counter() - start)
