"""Weights as byte buckets: how a state dict travels over a collective, as pure functions (torch only).

    plan = plan_buckets(tensors, bucket_bytes=64 << 20, policy_version=5)
    flat = pack_bucket(tensors, plan.buckets[0])        # one uint8 tensor: what is broadcast
    named = unpack_bucket(flat, plan.buckets[0])        # [(name, tensor)], views of `flat`

A bucket is a run of whole tensors laid end to end as bytes, so one bucket may mix dtypes
(float32, bfloat16, ...) and a receiver needs only the plan to cut it up again. Invariants:
every tensor is in exactly one bucket, in the order given; a bucket holds at most
`bucket_bytes` bytes unless one tensor alone is larger (it then has a bucket of its own);
`unpack_bucket(pack_bucket(t, b), b)` gives back `t`'s tensors bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name without the prefix ('float32', 'bfloat16')."""
    offset: int
    """Bytes from the bucket's start."""
    num_bytes: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[TensorSlot, ...]
    num_bytes: int


@dataclass(frozen=True)
class WeightPlan:
    """One policy version's buckets, in send order."""

    policy_version: int
    buckets: tuple[Bucket, ...]

    @property
    def num_bytes(self) -> int:
        return sum(bucket.num_bytes for bucket in self.buckets)


def plan_buckets(tensors: Mapping[str, torch.Tensor], *, bucket_bytes: int, policy_version: int) -> WeightPlan:
    """The buckets for `tensors` (see module docstring); `bucket_bytes` > 0."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets, slots, used = [], [], 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if slots and used + size > bucket_bytes:
            buckets.append(Bucket(tuple(slots), used))
            slots, used = [], 0
        slots.append(TensorSlot(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), used, size))
        used += size
    if slots:
        buckets.append(Bucket(tuple(slots), used))
    return WeightPlan(policy_version, tuple(buckets))


def pack_bucket(tensors: Mapping[str, torch.Tensor], bucket: Bucket, device: str | torch.device = "cpu") -> torch.Tensor:
    """The bucket's tensors as one contiguous uint8 tensor on `device`."""
    flat = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=device)
    for slot in bucket.slots:
        source = tensors[slot.name].detach().contiguous().reshape(-1).view(torch.uint8)
        flat[slot.offset:slot.offset + slot.num_bytes].copy_(source)
    return flat


def unpack_bucket(flat: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every slot: views of `flat` with their dtype and shape (no copy)."""
    return [(slot.name, flat[slot.offset:slot.offset + slot.num_bytes].view(getattr(torch, slot.dtype)).view(slot.shape))
            for slot in bucket.slots]
