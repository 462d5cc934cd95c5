"""Packing samples into micro-batches ("bins").

Algorithms (pure, deterministic; sizes in tokens, bins hold sample indices):

first_fit_decreasing(sizes, capacity)
    Samples sorted by size descending (ties: lower index first); each goes into the
    leftmost open bin with room, else a new bin. A sample larger than `capacity` sits alone.
    A max segment tree over bins' remaining room finds the leftmost fitting bin in
    O(log bins), so packing is O(n log n) instead of first-fit's O(n * bins). Unopened
    leaves start at full capacity, so "leftmost leaf with room" is either an open bin or
    the next new one: one descent per sample.

split_to_alignment(bins, sizes, align, capacity)
    Raise the bin count to a multiple of `align` by splitting the heaviest multi-sample bin
    into two token-balanced halves, repeatedly. When too few samples remain to split
    (lone oversize samples, or fewer samples than `align`), merge the lightest bins under
    the cap instead; if that cannot reach a multiple either, split every bin down to one
    sample and append empty *padding* bins up to the next multiple. A padding bin is a
    micro-batch of zero samples and zero weight: the rank that gets it runs an empty
    micro-batch so that every rank and pipeline stage runs the same count. So a step with
    at least one sample can always be laid out: the schedule never stalls on alignment.

static_chunks(num_samples, micro_batch_size, align)
    Contiguous chunks of at most `micro_batch_size` samples, their count a multiple of
    `align` (sizes differ by at most one); padded with empty chunks when there are fewer
    samples than the aligned count.

Invariants: every index in exactly one bin; a bin is empty only as padding, and padding
appears only when the step has fewer samples than bins; a bin over capacity holds one
sample; splitting never raises a bin's tokens; merging keeps the cap.
"""

from __future__ import annotations

import heapq

import numpy as np


def first_fit_decreasing(sizes, capacity: int) -> list[list[int]]:
    """Pack sample indices into bins of at most `capacity` tokens (see module docstring).

    Args:
        sizes: tokens per sample.
        capacity: tokens per bin (> 0).
    Returns:
        Bins in opening order, each a list of sample indices in packing order.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    n = int(sizes.size)
    if n == 0:
        return []
    order = np.argsort(-sizes, kind="stable").tolist()
    clipped_total = int(np.minimum(sizes, capacity).sum())
    oversize = int((sizes > capacity).sum())
    # First fit leaves at most one bin half empty, so bins <= 2 * total / capacity + 1.
    max_bins = min(n, 2 * clipped_total // capacity + 2 + oversize)
    leaves = 1 << max(0, (max_bins - 1).bit_length())
    room = [capacity] * (2 * leaves)
    bins: list[list[int]] = []
    size_list = sizes.tolist()
    num_open = 0
    for index in order:
        size = size_list[index]
        if size > capacity:
            leaf, taken = num_open, capacity  # a new bin that will never take another sample
        else:
            node = 1
            while node < leaves:
                node <<= 1
                if room[node] < size:
                    node += 1
            leaf, taken = node - leaves, size
        if leaf == num_open:
            bins.append([index])
            num_open += 1
        else:
            bins[leaf].append(index)
        # Back up the tree: a parent holds the larger room of its two children; stop where it is unchanged.
        node = leaf + leaves
        best = room[node] - taken
        room[node] = best
        while node > 1:
            sibling = room[node ^ 1]
            if sibling > best:
                best = sibling
            node >>= 1
            if room[node] == best:
                break
            room[node] = best
    return bins


def _halve(members: list[int], sizes: np.ndarray) -> tuple[list[int], list[int]]:
    """Split a bin into two non-empty, token-balanced halves (largest-first greedy)."""
    ordered = sorted(members, key=lambda i: (-int(sizes[i]), i))
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in ordered:
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(i)
        loads[side] += int(sizes[i])
    return halves


def split_to_alignment(bins: list[list[int]], sizes, align: int, capacity: int | None = None) -> list[list[int]]:
    """Make the bin count a positive multiple of `align` (see the module docstring).

    First by splitting the heaviest multi-sample bins into token-balanced halves (up to the
    next multiple). If too few samples can be split off, by merging the two lightest bins
    while they fit `capacity` (down to the previous multiple, never below `align`). If
    neither works, every sample gets its own bin and empty padding bins fill up to the
    next multiple (`count_padding` tells how many). Never raises.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    result = [list(b) for b in bins]
    target = max(align, -(-len(result) // align) * align)
    num_samples = sum(len(b) for b in result)
    if num_samples >= target:
        return _split_up(result, sizes, target)
    lower = len(result) // align * align
    if lower >= align and capacity is not None:
        merged = _merge_down(result, sizes, lower, capacity)
        if merged is not None:
            return merged
    return _split_up(result, sizes, num_samples) + [[] for _ in range(target - num_samples)]


def count_padding(bins) -> int:
    """Empty (padding) bins: micro-batches that carry no sample and no weight."""
    return sum(1 for b in bins if not b)


def _split_up(result: list[list[int]], sizes: np.ndarray, target: int) -> list[list[int]]:
    if len(result) >= target:
        return result
    size_list = sizes.tolist()
    heap = [(-sum(map(size_list.__getitem__, b)), j) for j, b in enumerate(result) if len(b) > 1]
    heapq.heapify(heap)
    while len(result) < target:
        _, i = heapq.heappop(heap)
        first, second = _halve(result[i], sizes)
        result[i] = first
        result.append(second)
        for j in (i, len(result) - 1):
            if len(result[j]) > 1:
                heapq.heappush(heap, (-int(sizes[result[j]].sum()), j))
    return result


def _merge_down(result: list[list[int]], sizes: np.ndarray, target: int, capacity: int) -> list[list[int]] | None:
    heap = [(int(sizes[b].sum()), i) for i, b in enumerate(result)]
    heapq.heapify(heap)
    merged: dict[int, list[int]] = dict(enumerate(result))
    while len(merged) > target:
        (light, i), (second, j) = heapq.heappop(heap), heapq.heappop(heap)
        if light + second > capacity:
            return None
        merged[i] = merged[i] + merged.pop(j)
        heapq.heappush(heap, (light + second, i))
    return [merged[i] for i in sorted(merged)]


def static_chunks(num_samples: int, micro_batch_size: int, align: int) -> list[list[int]]:
    """Contiguous chunks of positions 0..num_samples-1 for the static path.

    The chunk count is the smallest multiple of `align` that keeps every chunk at most
    `micro_batch_size` samples. With fewer samples than that count, each sample is its own
    chunk and empty padding chunks fill up to it.
    """
    fewest = -(-num_samples // micro_batch_size)
    count = max(align, -(-fewest // align) * align)
    if count > num_samples:
        return [[i] for i in range(num_samples)] + [[] for _ in range(count - num_samples)]
    base, extra = divmod(num_samples, count)
    chunks, start = [], 0
    for c in range(count):
        stop = start + base + (1 if c < extra else 0)
        chunks.append(list(range(start, stop)))
        start = stop
    return chunks
