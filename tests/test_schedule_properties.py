"""Property tests: every SPEC invariant of build_dp_schedule on random inputs."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.schedule_invariants import assert_schedule_invariants
from vgbs_ray.models.flops import TransformerFlopsModel
from vgbs_ray.layout.schedule import BatchConfig, ParallelConfig, build_dp_schedule

FLOPS_MODEL = TransformerFlopsModel(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2)


@st.composite
def windows(draw, max_length_over_cap: float = 0.5):
    """A window of samples: rollouts with 1..5 samples, interleaved, lengths up to a multiple of the cap."""
    dp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    vpp = draw(st.sampled_from([1, 1, 2]))
    group = draw(st.sampled_from([1, 2, 3])) if vpp > 1 else 1
    parallel = ParallelConfig(dp_size=dp, cp_size=draw(st.sampled_from([1, 2])), vpp_size=vpp,
                              microbatch_group_size_per_vp_stage=group)
    gbs = draw(st.integers(parallel.microbatch_alignment, 3 * parallel.microbatch_alignment + 5))
    cap = draw(st.integers(64, 2048))
    batch = BatchConfig(
        global_batch_size=gbs,
        max_tokens_per_gpu=cap,
        balance=draw(st.sampled_from(["none", "tokens", "flops"])),
        leftover=draw(st.sampled_from(["drop", "partial", "carry"])),
        flops_model=FLOPS_MODEL,
    )
    num_rollouts = draw(st.integers(0, 4 * gbs))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    rollout_ids = [f"r{r}" for r in range(num_rollouts) for _ in range(int(rng.integers(1, 6)))]
    rng.shuffle(rollout_ids)
    limit = max(1, int(max_length_over_cap * cap * parallel.cp_size))
    lengths = rng.integers(1, limit + 1, len(rollout_ids))
    return lengths, rollout_ids, parallel, batch


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows())
def test_layout_invariants_hold_on_random_windows(window):
    lengths, rollout_ids, parallel, batch = window
    schedule = build_dp_schedule(lengths, rollout_ids, parallel, batch)
    assert_schedule_invariants(schedule, lengths, rollout_ids, parallel, batch)
    num_rollouts = len(set(rollout_ids))
    assert len([s for s in schedule.steps if s.num_rollouts == batch.global_batch_size]) == num_rollouts // batch.global_batch_size


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows(max_length_over_cap=2.0))
def test_oversize_samples_sit_alone_or_the_step_is_padded(window):
    """With samples up to twice the cap, lone oversize samples may neither split nor merge into
    an aligned count; then the step is padded with empty micro-batches, and every invariant holds."""
    lengths, rollout_ids, parallel, batch = window
    schedule = build_dp_schedule(lengths, rollout_ids, parallel, batch)
    assert_schedule_invariants(schedule, lengths, rollout_ids, parallel, batch)


@settings(max_examples=40, deadline=None)
@given(windows())
def test_same_input_gives_same_layout(window):
    lengths, rollout_ids, parallel, batch = window
    first = build_dp_schedule(lengths, rollout_ids, parallel, batch)
    second = build_dp_schedule(list(lengths), list(rollout_ids), parallel, batch)
    assert first == second


@settings(max_examples=60, deadline=None)
@given(
    dp=st.sampled_from([1, 2, 4]),
    micro_batch_size=st.integers(1, 4),
    steps=st.integers(1, 3),
    extra=st.integers(0, 7),
    seed=st.integers(0, 2**31),
)
def test_static_path_invariants_with_one_sample_rollouts(dp, micro_batch_size, steps, extra, seed):
    parallel = ParallelConfig(dp_size=dp)
    gbs = dp * micro_batch_size * 2
    batch = BatchConfig(global_batch_size=gbs, micro_batch_size=micro_batch_size, balance="tokens", leftover="partial")
    rng = np.random.default_rng(seed)
    rollout_ids = list(range(gbs * steps + extra))
    lengths = rng.integers(1, 500, len(rollout_ids))
    schedule = build_dp_schedule(lengths, rollout_ids, parallel, batch)
    assert_schedule_invariants(schedule, lengths, rollout_ids, parallel, batch)
    for k in range(steps):
        assert schedule.num_microbatches[k] == gbs // (dp * micro_batch_size)
