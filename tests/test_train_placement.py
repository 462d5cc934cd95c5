"""The train group on a simulated multi-node Ray cluster (`ray.cluster_utils.Cluster`, nodes on this machine).

A head without CPUs (the driver's node) and two worker nodes of 2 CPUs each: every rank runs
on a worker node, so the rendezvous (rank 0's host:port) and every collective cross nodes.
- SPREAD puts the DP ranks on different nodes, and their step equals one in-process rank's;
  removing a node mid-run fails the next step with the documented `TrainStepError` naming
  the rank that was on it.
- PACK (dp=2 x tp=2 on 2-CPU nodes) keeps each DP replica's TP peers on one node.

The module stops the session's in-process Ray for its own cluster and restarts it afterwards.
"""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.train_group import TrainGroup, TrainStepError
from tests.ray_support import start_local_ray
from tests.train_support import (assert_same_update, inprocess_trainer, layout_shards, make_samples, sgd_config,
                                 update_between)

pytestmark = pytest.mark.slow


def _shards(samples, dp_size, step=0):
    return layout_shards(samples, dp_size=dp_size, max_tokens=120, step=step)


@pytest.fixture(scope="module")
def two_node_cluster():
    restart = ray.is_initialized()
    if restart:  # this module needs its own (multi-node) cluster
        ray.shutdown()
    # The GCS declares a node dead after `health_check_failure_threshold` failed checks `health_check_period_ms`
    # apart (Ray's defaults: 5 x 3 s). A removed node's check fails at once (connection refused); a live but busy
    # raylet's fails only past `health_check_timeout_ms` (10 s, kept): checks 0.5 s apart find the removed node dead
    # ~12 s sooner, and a live one no sooner.
    fast_node_death = {"health_check_period_ms": 500}
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False,
                                                                object_store_memory=128 << 20,
                                                                _system_config=fast_node_death))
    workers = [cluster.add_node(num_cpus=2, object_store_memory=128 << 20) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()
    if restart:  # as tests/conftest.py's session fixture started it
        start_local_ray()


def test_spread_dp_ranks_train_across_nodes_and_a_removed_node_fails_the_next_step(two_node_cluster):
    cluster, workers = two_node_cluster
    samples = make_samples(40, 8)
    reference = inprocess_trainer(sgd_config())
    initial = reference.full_parameters()
    reference.train_shard(_shards(samples, 1)[0])
    expected = update_between(initial, reference.full_parameters())

    group = TrainGroup(sgd_config(dp_size=2, placement_strategy="SPREAD", collective_timeout_s=20))
    try:
        nodes = group.node_ids()
        worker_ids = {w.node_id for w in workers}
        assert len(set(nodes)) == 2 and set(nodes) <= worker_ids  # one DP rank per worker node
        group.load_full_parameters(initial)
        group.train_shards(_shards(samples, 2))  # rendezvous and gradient all-reduce across nodes
        assert_same_update(expected, update_between(initial, group.full_parameters()))

        rank1_node = next(w for w in workers if w.node_id == nodes[1])
        cluster.remove_node(rank1_node, allow_graceful=False)
        with pytest.raises(TrainStepError, match="rank 1 died"):
            group.train_shards(_shards(samples, 2, step=1))
    finally:
        group.shutdown()


def test_pack_keeps_tp_peers_on_one_node(two_node_cluster):
    cluster, workers = two_node_cluster
    workers.append(cluster.add_node(num_cpus=2, object_store_memory=128 << 20))  # in place of a removed node
    cluster.wait_for_nodes()
    group = TrainGroup(sgd_config(dp_size=2, tp_size=2, placement_strategy="PACK"))
    try:
        nodes = group.node_ids()
        infos = group.rank_infos
        by_replica: dict[int, set] = {}
        for info, node in zip(infos, nodes):
            by_replica.setdefault(info.dp_rank, set()).add(node)
        assert all(len(replica_nodes) == 1 for replica_nodes in by_replica.values()), by_replica
        assert len(set(nodes)) == 2  # 4 ranks on 2-CPU nodes: the group spans two of them
        result = group.train_shards(_shards(make_samples(41, 8), 2))
        assert result.metric_pairs["loss"][1] == pytest.approx(8)  # every rollout counted once
    finally:
        group.shutdown()
