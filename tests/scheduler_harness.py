"""Driving a SchedulerActor from tests: a fake train group that pulls, checks and acks shards."""

from __future__ import annotations

import ray

from vgbs_ray.shard import StepShard

TIMEOUT_S = 60


def call(method, *args, timeout: float = TIMEOUT_S, **kwargs):
    return ray.get(method.remote(*args, **kwargs), timeout=timeout)


def drain(scheduler, dp_size: int, *, first_step: int = 0, ack: bool = True, timeout_s: float = 30) -> list[list[StepShard]]:
    """Pull every step from `first_step` until get_shard says the stream ended (None); ack each."""
    steps, step = [], first_step
    while True:
        refs = [call(scheduler.get_shard, step, rank, timeout_s=timeout_s) for rank in range(dp_size)]
        if refs[0] is None:
            assert all(r is None for r in refs)
            return steps
        shards = [ray.get(r.ref, timeout=TIMEOUT_S) for r in refs]
        assert [s.rank for s in shards] == list(range(dp_size)) and {s.step for s in shards} == {step}
        if ack:
            for rank, shard in enumerate(shards):
                call(scheduler.ack_step, step, rank, {"loss": (float(shard.num_samples), float(shard.num_samples))})
        steps.append(shards)
        step += 1


def rollouts_of(step_shards: list[StepShard]) -> dict:
    """rollout id -> sample count over every rank of one step."""
    counts: dict = {}
    for shard in step_shards:
        for rid in shard.rollout_ids:
            counts[rid] = counts.get(rid, 0) + 1
    return counts
