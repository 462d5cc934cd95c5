"""Where one DP rank's shard of a step lives in the object store (what `get_shard` / `get_step` return)."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from vgbs_ray.layout.shard import StepShard


@dataclass(frozen=True)
class ShardRef:
    """Where rank `rank`'s shard of step `step` lives: `shard_ref.fetch()` -> StepShard.

    `ref` holds the shard itself (`index` None), or, when the train group registered its ranks'
    nodes, a tuple of the shards of every DP rank on this rank's node, this rank's at `index`
    (one object per node and step). The ObjectRef is owned by the scheduler (it outlives any
    producer); nested in this dataclass, Ray hands it over as a reference instead of resolving it.
    """

    step: int
    rank: int
    ref: ray.ObjectRef
    num_rollouts: int
    index: int | None = None

    def fetch(self, timeout_s: float | None = None) -> StepShard:
        """This rank's StepShard (zero-copy arrays from the node's object store)."""
        value = ray.get(self.ref, timeout=timeout_s)
        return value if self.index is None else value[self.index]
