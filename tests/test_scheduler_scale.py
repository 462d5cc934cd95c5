"""A thousand ranks on one SchedulerActor: dp=256 x tp=4 simulated ranks park 1,024 get_shard calls at
once while a producer pushes and the driver reads records; no deadlock, every shard delivered once."""

from __future__ import annotations

import pytest
import ray

from vgbs_ray.scheduler.types import SchedulerConfig
from actors.scheduler_actor import create_scheduler
from tests.scheduler_harness import Pusher, SimulatedRanks, call
from vgbs_ray.config import BatchConfig, ParallelConfig

NAME = "sched-scale"
DP, TP, STEPS, GBS = 256, 4, 3, 512
POOLS = 4


@pytest.mark.slow
def test_1024_parked_pulls_while_pushing_and_acking(ray_session):
    scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(global_batch_size=GBS, max_tokens_per_gpu=64)),
                                 name=NAME)
    try:
        call(scheduler.register_train_group, ParallelConfig(dp_size=DP))
        ranks = [(dp, tp) for dp in range(DP) for tp in range(TP)]
        pools = [ray.remote(num_cpus=0, max_concurrency=2000)(SimulatedRanks).remote() for _ in range(POOLS)]
        running = [pool.run.remote(NAME, ranks[i::POOLS], STEPS, 300) for i, pool in enumerate(pools)]
        # The driver parks one pull per step too (before any step exists), then reads the records.
        driver_pulls = [scheduler.get_shard.remote(step, 0, timeout_s=300) for step in range(STEPS)]
        pusher = ray.remote(num_cpus=0)(Pusher).remote()
        pushed = ray.get(pusher.run.remote(NAME, GBS * STEPS, 64), timeout=300)
        assert pushed == GBS * STEPS
        ray.get(driver_pulls, timeout=330)
        records = [call(scheduler.step_record, step) for step in range(STEPS)]
        delivered = ray.get(running, timeout=600)
        totals = {step: sum(d.get(step, 0) for d in delivered) for step in range(STEPS)}
        assert totals == {step: DP * TP for step in range(STEPS)}  # every rank, every step, once
        stats = call(scheduler.stats, check_ledger=True)
        assert stats.steps_trained == STEPS and stats.ledger.rollouts_by_state["trained"] == GBS * STEPS
        assert all(r.num_rollouts == GBS and len(r.samples_per_rank) == DP for r in records)
        record = call(scheduler.step_record, 0)
        assert record.trained and record.metrics["samples"] == (float(GBS), float(DP))
        assert stats.failure is None
    finally:
        ray.kill(scheduler)
