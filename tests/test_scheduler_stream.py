"""One SchedulerActor fed at once by a Ray Data stream (rows in the order Ray Data yields them) and a
pushing producer actor; then its per-step rollout count is scraped from the node's metrics endpoint."""

from __future__ import annotations

import re
import time
import urllib.request

import numpy as np
import pytest
import ray

from vgbs_ray.scheduler.types import SchedulerConfig
from actors.scheduler_actor import create_scheduler
from tests.rollout_factory import rollout_rows
from tests.scheduler_harness import Producer, call, drain, rollouts_of
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.scheduler.intake import IntakeConfig

NAME = "sched-stream"
NUM_BLOCKS = 8


def dataset_rows() -> list[dict]:
    two = [rollout_rows(f"d{i}", 2) for i in range(8)]
    rows = [r[0] for r in two] + [r[1] for r in two]  # siblings far apart, in different blocks
    rows += [r for i, reward in enumerate([0.0, 1.0, 1.0, 0.0]) for r in rollout_rows(
        f"g{i}", 1, reward=reward, advantage=None, group=("q0", 4))]
    rows += [r for i in range(2) for r in rollout_rows(f"u{i}", 1, reward=0.5, advantage=None, group=("q1", 2))]
    for seq, row in enumerate(rows):
        row["seq"] = seq
    return rows


@pytest.fixture(scope="module")
def stream_run(ray_session):
    scheduler = create_scheduler(SchedulerConfig(
        batch=BatchConfig(global_batch_size=8, max_tokens_per_gpu=64, leftover="partial"),
        intake=IntakeConfig(max_buffered_samples=24, drop_uniform_groups=True)), name=NAME)
    call(scheduler.register_train_group, ParallelConfig(dp_size=2))
    producer = ray.remote(num_cpus=0)(Producer).remote()
    pushed = producer.run.remote(NAME, 14)
    ds = ray.data.from_items(dataset_rows(), override_num_blocks=NUM_BLOCKS)
    call(scheduler.consume_dataset, ds)  # returns at once; rows flow in while the producer pushes
    pushed_ids = ray.get(pushed, timeout=120)
    ray.kill(producer)  # shards are owned by the scheduler, not by whoever sent the data
    flush = call(scheduler.end_of_input, timeout=180)
    steps = drain(scheduler, 2)
    stats = call(scheduler.stats, include_rollouts=True, check_ledger=True)
    yield scheduler, pushed_ids, flush, steps, stats
    ray.kill(scheduler)


def test_pushes_and_dataset_feed_one_scheduler(stream_run):
    _, pushed_ids, flush, steps, stats = stream_run
    assert sorted(pushed_ids) == sorted(f"p{i}" for i in range(14))
    assert not stats.dataset_errors
    # 14 pushed + 8 two-sample + 4 grouped rollouts = 26 -> [8, 8, 8, 2]; the uniform group q1 is dropped
    assert [s[0].num_rollouts for s in steps] == [8, 8, 8, 2]
    assert sorted(flush.dropped) == [] and stats.ledger.dropped_by_reason == {"uniform_group_reward": 2}
    seen = set()
    for shards in steps:
        counts = rollouts_of(shards)
        assert not seen & set(counts)
        seen |= set(counts)
        assert all(n == (1 if rid[0] == "g" else 2) for rid, n in counts.items())  # siblings never split
    assert seen == {f"p{i}" for i in range(14)} | {f"d{i}" for i in range(8)} | {f"g{i}" for i in range(4)}
    states = stats.rollout_states
    assert {states[f"u{i}"] for i in range(2)} == {("dropped", None, "uniform_group_reward")}
    assert all(states[rid][0] == "trained" for rid in seen)


def test_group_advantages_reach_the_shards(stream_run):
    _, _, _, steps, _ = stream_run
    advantage = {}
    for shards in steps:
        for shard in shards:
            for rid, a in zip(shard.rollout_ids, shard.advantages):
                advantage.setdefault(rid, set()).add(round(float(a), 5))
    expected = (np.array([0.0, 1.0, 1.0, 0.0]) - 0.5) / (0.5 + 1e-6)
    assert [advantage[f"g{i}"] for i in range(4)] == [{round(float(e), 5)} for e in expected]
    assert advantage["p0"] == {0.5}  # producer-set advantages are kept


def test_metrics_endpoint_shows_per_step_rollouts(stream_run):
    *_, stats = stream_run
    port = ray.nodes()[0]["MetricsExportPort"]
    pattern = re.compile(r'^ray_vgbs_scheduler_(step_rollouts|rollouts_scheduled_total)\{[^}]*scheduler="%s"[^}]*\} ([0-9.e+]+)$' % NAME,
                         re.M)
    found: dict = {}
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = {name: float(value) for name, value in pattern.findall(text)}
        if found.get("rollouts_scheduled_total") == 26:
            break
        time.sleep(1.0)
    assert found.get("step_rollouts") == stats.recent_steps[-1].num_rollouts == 2, found
    assert found.get("rollouts_scheduled_total") == 26, found
