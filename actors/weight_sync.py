"""Weight sync: the train group publishes policy version v once; every engine pulls and loads it.

    published = publish_weights(group, version)     # blocks only for the export (gather + one store copy)
    loads = engines.update_weights(published)        # returns at once; engines load between requests
    ...                                              # the trainer goes on with the next step
    engines.wait_for_weights(loads)                  # -> one WeightLoad per engine (times, bytes)

Publish: the ranks of DP replica 0 gather the full weights (TP shards joined, PP stages
joined: a collective inside the replica); global rank 0 converts them to Hugging Face names
(`vgbs_ray.hf_mapping`) and returns them as numpy arrays. That return value is the one copy
in the Ray object store; every engine on the node reads it zero-copy (numpy) and copies it
into its own parameters. The trainer never waits for engines: `publish_weights` returns when
the object is sealed, and loading happens in the engines' own processes.

Bytes per sync: the HF state dict in float32 (`num_bytes`), moved once into the store and
once per engine out of it (a local read on the same node, a transfer across nodes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import ray

from actors.train_config import ModelConfig
from vgbs_ray.hf_mapping import megatron_to_hf


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
    """In the engine: copying the weights into its parameters (after any queued requests ran)."""
    num_bytes: int


def hf_weights_from_full(full: dict[str, np.ndarray], model: ModelConfig) -> dict[str, np.ndarray]:
    """Whole-model Megatron parameters (as `RankTrainer.full_parameters` returns them) -> HF-named arrays."""
    import torch

    hf = megatron_to_hf({name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in full.items()},
                        model.weight_layout)
    return {name: tensor.numpy() for name, tensor in hf.items()}


def put_hf_weights(full: dict[str, np.ndarray], model: ModelConfig) -> tuple[ray.ObjectRef, int]:
    """On the train side (global rank 0): HF-named weights into the object store, owned by this
    (long-lived) actor; returns the reference and the bytes stored."""
    hf = hf_weights_from_full(full, model)
    return ray.put(hf), sum(a.nbytes for a in hf.values())


def publish_weights(group, policy_version: int, *, timeout_s: float | None = None) -> PublishedWeights:
    """Export `group`'s current weights as version `policy_version` into the object store (see module doc).

    `group` is a TrainGroup; only DP replica 0 takes part (its TP and PP peers gather together).
    A rank that fails or dies raises `TrainStepError` naming it.
    """
    start = time.perf_counter()
    replica = [(actor, info) for actor, info in zip(group.actors, group.rank_infos) if info.dp_rank == 0]
    timeout_s = group.config.step_timeout_s if timeout_s is None else timeout_s
    results = group._gather([actor.export_hf_weights.remote() for actor, _ in replica],  # noqa: SLF001
                            timeout_s, f"publish weights v{policy_version}")
    ((ref, num_bytes),) = [r for r in results if r is not None]  # global rank 0's
    return PublishedWeights(policy_version=policy_version, ref=ref, num_bytes=num_bytes,
                            publish_time_s=time.perf_counter() - start)
