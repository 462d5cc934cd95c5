"""Balancing (vgbs_ray/layout/balancing.py): the constraints every transfer keeps, and the balance it reaches
on a step packed to the brim."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.schedule_invariants import assert_schedule_invariants
from vgbs_ray.layout import balancing
from vgbs_ray.layout.balancing import distribute
from vgbs_ray.models.flops import TransformerFlopsModel
from vgbs_ray.layout.packing import first_fit_decreasing, split_to_alignment
from vgbs_ray.layout.schedule import BatchConfig, ParallelConfig, build_dp_schedule

FLOPS_MODEL = TransformerFlopsModel(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2)
# The 7B-class model of benchmarks/bench_schedule.py.
BENCH_FLOPS_MODEL = TransformerFlopsModel(
    num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
    ffn_hidden_size=14336, gated_mlp=True, vocab_size=128256,
)


@st.composite
def packed_steps(draw, modes=("none", "tokens", "flops")):
    """FFD bins of random lengths (some over the cap), aligned to dp, plus empty padding bins."""
    dp = draw(st.sampled_from([2, 3, 4, 8]))
    capacity = draw(st.integers(64, 1024))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    lengths = rng.integers(1, int(capacity * draw(st.sampled_from([0.3, 1.0, 1.5]))) + 1, draw(st.integers(dp, 300)))
    bins = split_to_alignment(first_fit_decreasing(lengths, capacity), lengths, dp, capacity)
    bins += [[] for _ in range(dp * draw(st.integers(0, 2)))]
    mode = draw(st.sampled_from(modes))
    weights = FLOPS_MODEL.sequence_flops(lengths) if mode == "flops" else lengths.astype(np.float64)
    return bins, lengths, weights, dp, mode, capacity


@settings(max_examples=150, deadline=None)
@given(packed_steps())
def test_distribute_keeps_counts_cap_padding_and_lone_oversize_samples(step):
    bins, lengths, weights, dp, mode, capacity = step
    ranks = distribute([list(b) for b in bins], lengths, weights, dp, mode=mode, capacity=capacity)
    assert len(ranks) == dp and all(len(rank) == len(bins) // dp for rank in ranks)
    placed = [i for rank in ranks for mb in rank for i in mb]
    assert sorted(placed) == list(range(lengths.size))
    out = [mb for rank in ranks for mb in rank]
    # Padding stays padding (and runs last on its rank); no real micro-batch empties.
    assert sum(1 for mb in out if not mb) == sum(1 for b in bins if not b)
    for rank in ranks:
        assert all(mb for mb in rank[:len(rank) - sum(1 for mb in rank if not mb)])
    for mb in out:
        assert mb == sorted(mb)
        assert lengths[mb].sum() <= capacity or len(mb) == 1
    # A sample over the cap never moves: it is alone, as FFD left it.
    for i in np.flatnonzero(lengths > capacity):
        assert [int(i)] in out
    assert ranks == distribute([list(b) for b in bins], lengths, weights, dp, mode=mode, capacity=capacity)


@settings(max_examples=150, deadline=None)
@given(packed_steps(modes=("tokens", "flops")))
def test_every_scan_that_reports_a_transfer_lowers_the_heavy_rank(step):
    """Phase 3's contract (a scan's first transfer must lower the heaviest rank's load); a scan
    that reported success without one would let refinement spin to its scan limit."""
    bins, lengths, weights, dp, mode, capacity = step
    scan = balancing._scan

    def checked(layout, heavy, allow_moves):
        before = layout.loads[heavy]
        transferred = scan(layout, heavy, allow_moves)
        assert not transferred or layout.loads[heavy] < before
        return transferred

    balancing._scan = checked
    try:
        distribute([list(b) for b in bins], lengths, weights, dp, mode=mode, capacity=capacity)
    finally:
        balancing._scan = scan


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([2, 4]), st.integers(1, 4))
def test_swaps_only_keep_every_micro_batch_size(seed, dp, micro_batch_size):
    """The static path (no token cap, allow_moves=False) may swap samples but never resize chunks."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4000, dp * micro_batch_size * int(rng.integers(1, 6)))
    chunks = [list(range(s, s + micro_batch_size)) for s in range(0, lengths.size, micro_batch_size)]
    ranks = distribute(chunks, lengths, lengths.astype(np.float64), dp, mode="tokens", capacity=None, allow_moves=False)
    assert all(len(mb) == micro_batch_size for rank in ranks for mb in rank)
    assert sorted(i for rank in ranks for mb in rank for i in mb) == list(range(lengths.size))


def brim_full_window():
    """The first step of benchmarks/bench_schedule.py's 36k-sample dp=64 window (seed 0):
    agentic rollouts, 40% with 2-6 samples, lognormal lengths, in completion order."""
    rng = np.random.default_rng(0)
    num_rollouts = 4 * 4096
    siblings = np.where(rng.random(num_rollouts) < 0.4, rng.integers(2, 7, num_rollouts), 1)
    rollout_ids = np.repeat(np.arange(num_rollouts), siblings)
    finish = rollout_ids + rng.exponential(3.0, rollout_ids.size)
    rollout_ids = rollout_ids[np.argsort(finish, kind="stable")]
    lengths = np.clip(rng.lognormal(np.log(2000), 0.7, rollout_ids.size), 32, 32768).astype(np.int64)
    _, first_seen = np.unique(rollout_ids, return_index=True)
    first_step = rollout_ids[np.sort(first_seen)][:4096]
    in_step = np.isin(rollout_ids, first_step)
    return lengths[in_step], rollout_ids[in_step].tolist()


def test_brim_full_step_is_balanced_within_one_percent():
    """FFD packs this step's 9,073 samples into 1,408 micro-batches, already a multiple of
    dp=64, nearly all full, 11 of them one sample over the cap: no spare micro-batch and
    little room to move samples into. Whole-bin assignment left rank tokens 1.0105 x the mean
    (issue 8); sample transfers must bring tokens within 1.01 and FLOPs within 1.02."""
    lengths, rollout_ids = brim_full_window()
    capacity, dp = 16384, 64
    assert lengths.size == 9073 and int((lengths > capacity).sum()) == 11
    assert len(first_fit_decreasing(lengths, capacity)) == 1408
    parallel = ParallelConfig(dp_size=dp)
    flops = BENCH_FLOPS_MODEL.sequence_flops(lengths)
    for balance, cost, bound in (("tokens", lengths, 1.01), ("flops", flops, 1.02)):
        batch = BatchConfig(global_batch_size=4096, max_tokens_per_gpu=capacity, balance=balance,
                            flops_model=BENCH_FLOPS_MODEL, leftover="drop")
        schedule = build_dp_schedule(lengths, rollout_ids, parallel, batch)
        assert_schedule_invariants(schedule, lengths, rollout_ids, parallel, batch)
        assert schedule.num_microbatches == [1408 // dp]
        loads = [cost[partition].sum() for partition in schedule.partitions]
        assert max(loads) / np.mean(loads) <= bound, balance
