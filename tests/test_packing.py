"""Packing: the segment-tree FFD is exactly first-fit-decreasing; alignment and static chunks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgbs_ray.layout.packing import count_padding, first_fit_decreasing, split_to_alignment, static_chunks


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
    aligned = split_to_alignment(bins, sizes, align, capacity)
    assert len(aligned) % align == 0 and len(aligned) >= align
    assert sorted(i for b in aligned for i in b) == list(range(len(sizes)))
    for b in aligned:
        assert sum(sizes[i] for i in b) <= capacity or len(b) == 1
    padding = count_padding(aligned)
    if padding:
        # Only when splitting runs out of samples and merging would break the cap: then
        # every sample sits alone and the padding fills up to the next multiple.
        assert len(sizes) < -(-len(bins) // align) * align
        assert all(len(b) == 1 for b in aligned if b) and len(aligned) - padding == len(sizes)
        assert len(aligned) == max(align, -(-len(bins) // align) * align)
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


def test_three_oversize_samples_on_two_ranks_get_one_padding_micro_batch():
    """The wedge of issue 8: nothing splits, nothing merges under the cap -> pad, never fail."""
    aligned = split_to_alignment([[0], [1], [2]], [60, 60, 60], align=2, capacity=100)
    assert sorted(map(sorted, aligned)) == [[], [0], [1], [2]] and count_padding(aligned) == 1


def test_fewer_samples_than_alignment_pad_after_splitting_every_sample_off():
    aligned = split_to_alignment([[0, 1, 2]], [1, 1, 1], align=4, capacity=10)
    assert sorted(map(sorted, aligned)) == [[], [0], [1], [2]]


@pytest.mark.parametrize("num_samples, mbs, align", [(8, 2, 4), (10, 3, 2), (7, 1, 7), (12, 5, 2)])
def test_static_chunks(num_samples, mbs, align):
    chunks = static_chunks(num_samples, mbs, align)
    assert len(chunks) % align == 0
    assert [i for c in chunks for i in c] == list(range(num_samples))
    assert all(1 <= len(c) <= mbs for c in chunks)
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


def test_static_chunks_with_fewer_samples_than_the_aligned_count_are_padded():
    assert static_chunks(5, 1, 4) == [[0], [1], [2], [3], [4], [], [], []]
    assert static_chunks(1, 2, 2) == [[0], []]


def test_ffd_packs_a_large_step_within_the_first_fit_bound():
    """20k samples: each placed once, and no more bins than first fit allows (at most one half-empty bin)."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 4000, 20000)
    bins = first_fit_decreasing(sizes, 16384)
    assert sum(len(b) for b in bins) == 20000
    assert len(bins) <= 2 * sizes.sum() // 16384 + 1
