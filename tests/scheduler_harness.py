"""Driving a SchedulerActor from tests: a fake train group that pulls, checks and acks shards."""

from __future__ import annotations

import time

import ray

from tests.rollout_factory import rollout_rows

from vgbs_ray.layout.shard import StepShard

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
        shards = [r.fetch(timeout_s=TIMEOUT_S) for r in refs]
        assert [s.rank for s in shards] == list(range(dp_size)) and {s.step for s in shards} == {step}
        if ack:  # one call for every rank, as a train group's driver acks
            call(scheduler.ack_ranks, step, {rank: {"loss": (float(shard.num_samples), float(shard.num_samples))}
                                              for rank, shard in enumerate(shards)})
        steps.append(shards)
        step += 1


def rollouts_of(step_shards: list[StepShard]) -> dict:
    """rollout id -> sample count over every rank of one step."""
    counts: dict = {}
    for shard in step_shards:
        for rid in shard.rollout_ids:
            counts[rid] = counts.get(rid, 0) + 1
    return counts


# Ray pickles these by module reference: they live here, importable by workers as tests.scheduler_harness.
class Producer:
    """A fully-async producer: finds the scheduler by name, pushes siblings in separate calls."""

    def run(self, scheduler_name: str, num_rollouts: int) -> list:
        scheduler = ray.get_actor(scheduler_name)
        pending = [r for i in range(num_rollouts) for r in rollout_rows(f"p{i}", 2)]
        pending = pending[0::2] + pending[1::2]  # every rollout's second sample comes much later
        completed = []
        while pending:
            batch, pending = pending[:3], pending[3:]
            result = ray.get(scheduler.submit.remote(batch), timeout=60)
            assert not result.rejected, result.rejected
            pending = [batch[i] for i in result.deferred] + pending  # backpressure: resubmit exactly those
            if result.deferred:
                time.sleep(result.retry_after_s)
            completed += result.completed_rollouts
            time.sleep(0.05)
        return completed


class Pusher:
    """A producer that pushes one-sample rollouts s0, s1, ... in chunks, as fast as the scheduler takes them."""

    def run(self, scheduler_name: str, num_rollouts: int, chunk: int) -> int:
        scheduler = ray.get_actor(scheduler_name)
        rows = [r for i in range(num_rollouts) for r in rollout_rows(f"s{i}", 1)]
        for start in range(0, len(rows), chunk):
            result = ray.get(scheduler.submit.remote(rows[start:start + chunk]), timeout=120)
            assert result.accepted == len(rows[start:start + chunk]), result
        return len(rows)


class SimulatedRanks:
    """Many train ranks in one asyncio actor: plain async callers of get_shard / ack_ranks, no Megatron.

    Each (dp_rank, tp_rank) parks one get_shard per step, as a TrainActor does; TP rank 0 of each
    DP rank fetches the shard, checks it is its own, and acks (one ack per DP rank).
    """

    async def run(self, scheduler_name: str, ranks: list[tuple[int, int]], num_steps: int, timeout_s: float) -> dict:
        import asyncio

        scheduler = ray.get_actor(scheduler_name)
        delivered: dict[int, int] = {}

        async def one_rank(dp_rank: int, tp_rank: int) -> None:
            for step in range(num_steps):
                ref = await scheduler.get_shard.remote(step, dp_rank, timeout_s=timeout_s)
                assert ref.step == step and ref.rank == dp_rank, (ref.step, ref.rank, step, dp_rank)
                delivered[step] = delivered.get(step, 0) + 1
                if tp_rank == 0:
                    shard = await ref.ref
                    assert shard.rank == dp_rank and shard.step == step
                    await scheduler.ack_ranks.remote(step, {dp_rank: {"samples": (float(shard.num_samples), 1.0)}})
                else:  # a TP peer trains the same shard; it never acks
                    await ref.ref

        await asyncio.gather(*(one_rank(dp, tp) for dp, tp in ranks))
        return delivered
