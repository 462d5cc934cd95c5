"""Where a step's shards go in the object store: one object per DP rank, or one per node.

A rank's shard is found by `(ObjectRef, index)`: index None means the object is the shard itself;
an integer means the object is a tuple of the shards of its node's ranks (`ShardRef.fetch()` picks
its own). One object per node costs one `ray.put` per node and step instead of one per rank.
"""

from __future__ import annotations

from typing import Sequence

import ray

from vgbs_ray.errors import ConfigError
from vgbs_ray.layout.shard import StepShard


def ranks_by_node(rank_nodes: Sequence[str], dp_size: int) -> list[list[int]]:
    """DP ranks grouped by node, ranks ascending, nodes in order of their first rank. `rank_nodes`: the node of
    each DP rank; raises ConfigError unless it names `dp_size` of them."""
    if len(rank_nodes) != dp_size:
        raise ConfigError(f"rank_nodes names {len(rank_nodes)} nodes, one per DP rank is needed (dp_size={dp_size})")
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def put_shards(shards: Sequence[StepShard], node_ranks: list[list[int]] | None) -> list[tuple[ray.ObjectRef, int | None]]:
    """Put one step's shards (index: DP rank) into the object store, owned by the caller's process.

    node_ranks: the DP ranks of each node (`ranks_by_node`), or None for one object per rank.
    Returns, per DP rank, (ObjectRef, index of its shard in that object or None).
    """
    if node_ranks is None:
        return [(ray.put(shard), None) for shard in shards]
    where: list = [None] * len(shards)
    for ranks in node_ranks:
        ref = ray.put(tuple(shards[rank] for rank in ranks))
        for index, rank in enumerate(ranks):
            where[rank] = (ref, index)
    return where
