"""Through a live SchedulerActor: random tiny token caps and alignments (steps that real samples
cannot align get padding micro-batches). Every complete rollout trains or is dropped with a
reason, the ledger closes, and no flush times out."""

from __future__ import annotations

import ray
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from vgbs_ray.scheduler.types import SchedulerConfig
from actors.scheduler_actor import create_scheduler
from tests.rollout_factory import sample_row
from tests.scheduler_harness import call, drain
from vgbs_ray.config import BatchConfig, ParallelConfig


# No shrinking: each example starts an actor; a failure prints its example and seed as drawn.
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    dp=st.sampled_from([1, 2, 3, 4]), extra_rollouts=st.integers(0, 3), cap=st.integers(8, 80),
    leftover=st.sampled_from(["partial", "drop", "carry"]), num_rollouts=st.integers(1, 20),
    seed=st.integers(0, 2**16), vpp=st.sampled_from([1, 2]),
)
def test_every_rollout_trains_or_is_dropped_and_no_flush_times_out(ray_session, dp, extra_rollouts, cap, leftover,
                                                                      num_rollouts, seed, vpp):
    import numpy as np

    rng = np.random.default_rng(seed)
    parallel = ParallelConfig(dp_size=dp, vpp_size=vpp, microbatch_group_size_per_vp_stage=2 if vpp > 1 else 1)
    gbs = parallel.microbatch_alignment + extra_rollouts  # the smallest gbs registration accepts, and more
    scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(global_batch_size=gbs, max_tokens_per_gpu=cap,
                                                                   leftover=leftover)), name=f"stall-{seed}")
    try:
        call(scheduler.register_train_group, parallel)
        rows, sizes = [], {}
        for r in range(num_rollouts):
            size = int(rng.integers(1, 4))
            sizes[f"r{r}"] = size
            for i in range(size):  # lengths up to twice the cap: lone oversize samples are common
                length = int(rng.integers(4, 2 * cap))
                rows.append(sample_row(f"r{r}", i, size=size, length=length, response=min(3, length)))
        rng.shuffle(rows)
        result = call(scheduler.submit, rows)
        assert result.accepted == len(rows) and not result.rejected
        call(scheduler.flush, timeout_s=60)                  # mid-run flush: never times out
        end = call(scheduler.end_of_input, timeout_s=60)
        steps = drain(scheduler, dp, timeout_s=30)
        stats = call(scheduler.stats, include_rollouts=True, check_ledger=True)
        assert stats.failure is None
        trained = {rid for shards in steps for shard in shards for rid in shard.rollout_ids}
        states = stats.rollout_states
        assert set(states) == set(sizes)
        for rid, (state, _, reason) in states.items():
            assert (state == "trained") == (rid in trained), (rid, state)
            assert state in ("trained", "dropped") and (state == "trained" or reason), (rid, state, reason)
        if leftover == "partial":
            assert not end.dropped and trained == set(sizes)  # padding: nothing is too small to train
        for shards in steps:
            assert len({s.num_microbatches for s in shards}) == 1  # lockstep, padding included
            assert (shards[0].num_microbatches * dp) % parallel.microbatch_alignment == 0
    finally:
        ray.kill(scheduler)
