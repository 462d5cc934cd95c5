"""Packing: the segment-tree FFD is exactly first-fit-decreasing; alignment and static chunks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgbs_ray.errors import ScheduleError
from vgbs_ray.packing import first_fit_decreasing, split_to_alignment, static_chunks


def reference_first_fit_decreasing(sizes, capacity):
    """The textbook O(n * bins) version."""
    bins, loads = [], []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])
    return bins


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 500), max_size=200), st.integers(1, 400))
def test_segment_tree_ffd_equals_reference(sizes, capacity):
    assert first_fit_decreasing(sizes, capacity) == reference_first_fit_decreasing(sizes, capacity)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=120), st.integers(50, 400), st.sampled_from([1, 2, 3, 4, 8]))
def test_alignment_split_keeps_cap_and_coverage(sizes, capacity, align):
    bins = first_fit_decreasing(sizes, capacity)
    try:
        aligned = split_to_alignment(bins, sizes, align, capacity)
    except ScheduleError:
        # Only when splitting runs out of samples and merging would break the cap.
        assert len(sizes) < -(-len(bins) // align) * align
        loads = sorted(sum(sizes[i] for i in b) for b in bins)
        assert len(bins) < align or loads[0] + loads[1] > capacity
        return
    assert len(aligned) % align == 0 and len(aligned) >= align
    assert sorted(i for b in aligned for i in b) == list(range(len(sizes)))
    assert all(b for b in aligned)
    for b in aligned:
        assert sum(sizes[i] for i in b) <= capacity or len(b) == 1
    # Splitting only adds micro-batches up to the next multiple.
    assert len(aligned) - len(bins) < align


def test_alignment_splits_the_heaviest_bins_into_balanced_halves():
    sizes = [40, 40, 30, 30, 5, 5]
    aligned = split_to_alignment([[0, 1], [2, 3], [4, 5]], sizes, align=4, capacity=100)
    assert sorted(sorted(sizes[i] for i in b) for b in aligned) == [[5, 5], [30, 30], [40], [40]]


def test_lone_oversize_samples_merge_the_light_bins_instead():
    # Three oversize samples and two small ones: 5 bins, no multi-sample bin to split;
    # dp=2 -> merge the two small bins into one -> 4.
    sizes = [500, 500, 500, 10, 20]
    aligned = split_to_alignment([[0], [1], [2], [3], [4]], sizes, align=2, capacity=100)
    assert sorted(map(sorted, aligned)) == [[0], [1], [2], [3, 4]]
    with pytest.raises(ScheduleError, match="max_tokens_per_gpu"):
        split_to_alignment([[0], [1], [2]], [500, 500, 500], align=2, capacity=100)


def test_fewer_samples_than_alignment_fails_clearly():
    with pytest.raises(ScheduleError, match="multiple of dp_size"):
        split_to_alignment([[0, 1, 2]], [1, 1, 1], align=4, capacity=10)


@pytest.mark.parametrize("num_samples, mbs, align", [(8, 2, 4), (10, 3, 2), (7, 1, 7), (12, 5, 2)])
def test_static_chunks(num_samples, mbs, align):
    chunks = static_chunks(num_samples, mbs, align)
    assert len(chunks) % align == 0
    assert [i for c in chunks for i in c] == list(range(num_samples))
    assert all(1 <= len(c) <= mbs for c in chunks)
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


def test_static_chunks_that_cannot_align_name_the_fix():
    with pytest.raises(ScheduleError, match="max_tokens_per_gpu"):
        static_chunks(5, 1, 4)


def test_ffd_packs_a_large_step_within_the_first_fit_bound():
    """20k samples: each placed once, and no more bins than first fit allows (at most one half-empty bin)."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 4000, 20000)
    bins = first_fit_decreasing(sizes, 16384)
    assert sum(len(b) for b in bins) == 20000
    assert len(bins) <= 2 * sizes.sum() // 16384 + 1
