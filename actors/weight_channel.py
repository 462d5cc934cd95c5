"""A weight channel: a process group of its own from trainer rank 0 to the rollout engines.

    channel = WeightChannel("10.0.0.5:29611", rank=0, world_size=3)   # trainer rank 0: the sender
    channel.send(hf_tensors, policy_version=4, bucket_bytes=64 << 20)
    channel = WeightChannel("10.0.0.5:29611", rank=1, world_size=3)   # engine 0 (engine i: rank i + 1)
    version, named_tensors = channel.receive()                        # blocks until rank 0 sends

Why a group of its own: trainer rank 0 already belongs to the train group's default process
group, and an in-process vLLM engine holds one too (world size 1). This group is made directly
from a `TCPStore` that rank 0 hosts (`torch.distributed.ProcessGroupGloo`, or `ProcessGroupNCCL`
with tensors on the GPU), so it touches neither. Rank 0 hosts the store: every rank must open the
channel at about the same time (each blocks until all joined, up to `timeout_s`).

One send is: a header (policy version, plan length), the plan (`vgbs_ray.weight_buckets.WeightPlan`,
pickled), then every bucket, each one broadcast from rank 0. A receiver allocates each bucket
as it comes and returns views of them. `close()` on rank 0 sends a header with version -1: the
receivers' `receive` then returns None. A dead peer makes the pending call raise; on rank 0 a send that
fails is a `WeightChannelError` (a receiver is gone: the engine's failure, not the trainer's), and the channel
is done: a new one replaces it. A receiver applies a version only once every bucket of it came, so a send cut
short leaves no receiver with a mix of two versions.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from actors.weight_sync import WeightChannelError
from vgbs_ray.weight_buckets import WeightPlan, pack_bucket, plan_buckets, unpack_bucket

_CLOSED = -1


class WeightChannel:
    """See module docstring. `backend`: "gloo" (CPU tensors) or "nccl" (tensors on this process's GPU)."""

    def __init__(self, address: str, *, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight channel backend must be gloo or nccl, got {backend!r}")
        host, port = address.rsplit(":", 1)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
        self._store = dist.PrefixStore("vgbs-weights", store)  # the store must outlive the group
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
            self.device = torch.device("cpu")
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world_size = rank, world_size

    def send(self, tensors: Mapping[str, torch.Tensor], *, policy_version: int, bucket_bytes: int) -> int:
        """Rank 0: every tensor to every receiver, bucket by bucket; returns the bytes of weights sent."""
        plan = plan_buckets(tensors, bucket_bytes=bucket_bytes, policy_version=policy_version)
        encoded = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8)
        try:
            self._broadcast(torch.tensor([policy_version, encoded.numel()], dtype=torch.int64))
            self._broadcast(encoded)
            for bucket in plan.buckets:
                self._broadcast(pack_bucket(tensors, bucket, self.device))
        except RuntimeError as error:  # gloo and NCCL report a lost peer as RuntimeError (DistBackendError)
            raise WeightChannelError(f"policy version {policy_version} could not be sent over the weight channel "
                                     f"(a receiving engine died or left): {error}") from error
        return plan.num_bytes

    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """A receiver: the next version's (policy version, [(name, tensor)]), or None once rank 0 closed."""
        header = self._broadcast(torch.zeros(2, dtype=torch.int64))
        version, plan_length = (int(v) for v in header.tolist())
        if version == _CLOSED:
            return None
        plan: WeightPlan = pickle.loads(self._broadcast(torch.empty(plan_length, dtype=torch.uint8)).numpy().tobytes())
        named = []
        for bucket in plan.buckets:
            named += unpack_bucket(self._broadcast(torch.empty(bucket.num_bytes, dtype=torch.uint8, device=self.device)),
                                   bucket)
        return version, named

    def close(self) -> None:
        """Rank 0: tell the receivers no more versions come."""
        if self.rank == 0:
            self._broadcast(torch.tensor([_CLOSED, 0], dtype=torch.int64))

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        # Headers and plans are small CPU tensors; over NCCL they travel on the GPU like the buckets.
        moved = tensor.to(self.device)
        self._group.broadcast([moved], dist.BroadcastOptions()).wait()
        return moved.cpu() if tensor.device.type == "cpu" and moved.device.type != "cpu" else moved
