"""Distributing a step's micro-batches over DP ranks, equal counts per rank.

Modes:
  "none"    strided round-robin: micro-batch j goes to rank j % dp_size.
  "tokens"  balance rank loads measured in tokens.
  "flops"   balance rank loads measured in estimated FLOPs (attention is quadratic).

Balanced modes work in three phases. Micro-batches ("bins") never change rank after the
first; later phases move samples between them.
1. Whole bins to ranks by largest differencing (Karmarkar-Karp) with equal counts: the
   count per rank is exact. This leaves a few percent of imbalance: a lone oversize sample
   makes its rank heavy by its excess over the cap, and alignment splits leave half bins.
2. Paired moves, a few rounds: the k-th heaviest rank over the target moves one sample
   (the one nearest half their gap) into the roomiest bin of the k-th lightest rank, all
   pairs at once. This settles steps whose bins have room in a handful of vectorised rounds.
3. Scans of the heaviest rank, one at a time: its best single move into any rank's
   roomiest bin, or else a batch of swaps with samples of lighter ranks. Swap partners are
   the samples of the light bins that could take the most (min(room, half the gap)); for
   each, heavy samples in two windows: nearest to half the gap, and largest that still
   fits the light bin. The best swap is applied, then more from the same scan while they
   still fit and each receiver stays below the heavy rank's new load. A step packed to the
   brim (FFD's count already aligned) has only a bin's few spare tokens to trade at a
   time; batches make that a few dozen scans instead of hundreds.
   A transfer is scored by the new maximum of the two ranks' loads and must lower the
   heavy rank's. Stops when the heaviest rank is within _TARGET_IMBALANCE of the mean, has
   no improving transfer, or dp_size scans in a row barely lower the maximum (_MIN_GAIN).

Constraints kept by every transfer: no bin exceeds the token cap; no bin becomes empty;
a sample over the cap never moves; an empty (padding) bin stays empty; bins keep their
sample counts unless moves are allowed (static chunks allow only swaps).

Invariants: each rank holds exactly len(bins) / dp_size bins; every sample is in exactly
one bin; the result is a deterministic function of the input.
"""

from __future__ import annotations

import heapq
from itertools import chain

import numpy as np

# Refinement stops once max rank load is within this fraction of the mean...
_TARGET_IMBALANCE = 0.004
# ...or after this many scans per rank, or when the maximum stalls (gains under _MIN_GAIN).
_MAX_SCANS_PER_RANK = 40
_MIN_GAIN = 1e-4
# Rounds of paired moves before scans (each round moves at most one sample per pair).
_PAIRED_ROUNDS = 4
# Swap partners: samples of the light bins with the most potential, this many bins...
_SWAP_BINS = 64
# ...taken in potential order up to this many samples (a packed step's last bins hold many small ones).
_SWAP_PARTNERS = 256
# Heavy candidates per partner: offsets around "half the gap" and below "largest that fits".
_HALF_GAP_WINDOW = np.arange(-2, 2)
_FITS_WINDOW = np.arange(-3, 0)
# Swaps applied per scan at most.
_SWAPS_PER_SCAN = 48


def distribute(
    bins: list[list[int]],
    tokens: np.ndarray,
    weights: np.ndarray,
    dp_size: int,
    *,
    mode: str,
    capacity: int | None,
    allow_moves: bool = True,
) -> list[list[list[int]]]:
    """Assign `bins` (lists of sample indices) to `dp_size` ranks.

    Args:
        bins: micro-batches; len(bins) must be a multiple of dp_size. Empty bins are
            padding: they stay empty.
        tokens: tokens per sample (for the cap).
        weights: cost per sample that "balanced" means (tokens or FLOPs); both grow with tokens.
        mode: "none", "tokens" or "flops" (the caller picks `weights` to match).
        capacity: token cap per micro-batch, or None (static path: no token cap).
        allow_moves: if False only swaps refine (keeps micro-batch sizes, for static chunks).
    Returns:
        Per rank, its micro-batches (each a list of sample indices, ascending), heaviest
        first, padding last.
    Complexity: O(n log n) for n samples, plus O(n + dp_size + _SWAP_PARTNERS) vector work
    per scan, at most _MAX_SCANS_PER_RANK * dp_size scans.
    """
    if len(bins) % dp_size:
        raise ValueError(f"{len(bins)} micro-batches cannot be split evenly over {dp_size} ranks")
    if not bins:
        return [[] for _ in range(dp_size)]
    weights = np.asarray(weights, dtype=np.float64)
    sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    flat = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=int(sizes.sum()))
    which = np.repeat(np.arange(len(bins)), sizes)
    per_rank = len(bins) // dp_size
    if mode == "none":
        rank_bins = np.arange(len(bins)).reshape(per_rank, dp_size).T
    else:
        bin_weights = np.bincount(which, weights=weights[flat], minlength=len(bins))
        rank_bins = _karmarkar_karp_equal_count(bin_weights, dp_size)
    # Renumber bins so that rank r holds bins r * per_rank ... (r + 1) * per_rank - 1.
    slot = np.empty(len(bins), dtype=np.int64)
    slot[rank_bins.ravel()] = np.arange(len(bins))
    sample_bin = np.full(weights.size, -1, dtype=np.int64)
    sample_bin[flat] = slot[which]
    if mode != "none" and dp_size > 1:
        members = [list(bins[j]) for j in rank_bins.ravel().tolist()]
        _refine(_Layout(sample_bin, members, per_rank, tokens, weights, capacity), allow_moves)
    return _ordered(sample_bin, len(bins), per_rank, weights)


def _ordered(sample_bin: np.ndarray, num_bins: int, per_rank: int, weights: np.ndarray) -> list[list[list[int]]]:
    """Each rank's bins heaviest first (ties: lowest sample first; empty padding bins last),
    each bin's samples ascending. Sorts integer keys over all samples and all bins at once."""
    num_samples = sample_bin.size
    placed = np.flatnonzero(sample_bin >= 0)
    key = np.sort(sample_bin[placed] * num_samples + placed)
    flat, bin_of = key % num_samples, key // num_samples
    sizes = np.bincount(bin_of, minlength=num_bins)
    starts = np.cumsum(sizes) - sizes
    first_sample = np.full(num_bins, num_samples)  # padding bins: after every sample
    first_sample[sizes > 0] = flat[starts[sizes > 0]]
    bin_weights = np.bincount(bin_of, weights=weights[flat], minlength=num_bins)
    # Stable sorts, least significant key first: first sample, then weight descending, then rank.
    bin_order = np.argsort(first_sample, kind="stable")
    bin_order = bin_order[np.argsort(-bin_weights[bin_order], kind="stable")]
    bin_order = bin_order[np.argsort(bin_order // per_rank, kind="stable")].tolist()
    samples, starts, sizes = flat.tolist(), starts.tolist(), sizes.tolist()
    return [[samples[starts[j]:starts[j] + sizes[j]] for j in bin_order[r:r + per_rank]]
            for r in range(0, num_bins, per_rank)]


def _karmarkar_karp_equal_count(bin_weights: np.ndarray, dp_size: int) -> np.ndarray:
    """Largest differencing with equal counts: whole bins to ranks, each rank B / dp_size.

    Bins sorted by weight form groups of dp_size, each a partial solution of dp_size
    one-bin subsets. Repeatedly the two partial solutions with the largest spread merge,
    the heaviest subset of one joining the lightest of the other, so counts stay equal and
    differences cancel. O(B log B) for B bins. Returns bin ids, shape (dp_size, B / dp_size).
    """
    order = np.argsort(-bin_weights, kind="stable")
    heap = []
    for g in range(0, order.size, dp_size):
        members = order[g:g + dp_size]
        members = members[np.argsort(bin_weights[members], kind="stable")][:, None]
        loads = bin_weights[members[:, 0]]
        heapq.heappush(heap, (-(loads[-1] - loads[0]), g, loads, members))
    while len(heap) > 1:
        _, key, first_loads, first = heapq.heappop(heap)
        _, _, second_loads, second = heapq.heappop(heap)
        loads = first_loads + second_loads[::-1]
        members = np.concatenate([first, second[::-1]], axis=1)
        by_load = np.argsort(loads, kind="stable")
        heapq.heappush(heap, (-(loads[by_load[-1]] - loads[by_load[0]]), key, loads[by_load], members[by_load]))
    return heap[0][3]


class _Layout:
    """A step under refinement. Bin j belongs to rank j // per_rank for good; `members[j]`
    (lists) and `sample_bin` (array) say which samples it holds, kept in step by `move`."""

    def __init__(self, sample_bin, members, per_rank, tokens, weights, capacity):
        self.sample_bin, self.members, self.per_rank = sample_bin, members, per_rank
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.weights = weights
        self.cap = np.inf if capacity is None else float(capacity)
        placed = np.flatnonzero(sample_bin >= 0)
        bin_of = sample_bin[placed]
        self.bin_tokens = np.bincount(bin_of, weights=self.tokens[placed], minlength=len(members))
        self.bin_sizes = np.bincount(bin_of, minlength=len(members))
        self.loads = np.bincount(bin_of // per_rank, weights=weights[placed], minlength=len(members) // per_rank)

    def rank_samples(self, rank: int) -> np.ndarray:
        first = rank * self.per_rank
        return np.flatnonzero((self.sample_bin >= first) & (self.sample_bin < first + self.per_rank))

    def rank_matrix(self) -> np.ndarray:
        """Samples of every rank as rows padded with -1, shape (dp_size, most samples on a rank)."""
        placed = np.flatnonzero(self.sample_bin >= 0)
        ranks = self.sample_bin[placed] // self.per_rank
        order = np.argsort(ranks, kind="stable")
        counts = np.bincount(ranks, minlength=self.loads.size)
        ranks = ranks[order]
        matrix = np.full((self.loads.size, int(counts.max())), -1, dtype=np.int64)
        matrix[ranks, np.arange(order.size) - (np.cumsum(counts) - counts)[ranks]] = placed[order]
        return matrix

    def bin_room(self) -> np.ndarray:
        """Tokens each bin can still take; padding (empty) bins take nothing."""
        return np.where(self.bin_sizes > 0, self.cap - self.bin_tokens, -np.inf)

    def move(self, sample: int, to_bin: int) -> None:
        from_bin = int(self.sample_bin[sample])
        self.members[from_bin].remove(sample)
        self.members[to_bin].append(sample)
        self.sample_bin[sample] = to_bin
        self.bin_tokens[from_bin] -= self.tokens[sample]
        self.bin_tokens[to_bin] += self.tokens[sample]
        self.bin_sizes[from_bin] -= 1
        self.bin_sizes[to_bin] += 1
        self.loads[from_bin // self.per_rank] -= self.weights[sample]
        self.loads[to_bin // self.per_rank] += self.weights[sample]

    def swap(self, a: int, b: int) -> None:
        a_bin, b_bin = int(self.sample_bin[a]), int(self.sample_bin[b])
        self.move(a, b_bin)
        self.move(b, a_bin)


def _refine(layout: _Layout, allow_moves: bool) -> None:
    """Phases 2 and 3 of the module docstring."""
    loads = layout.loads
    if loads.mean() <= 0:
        return
    limit = loads.mean() * (1 + _TARGET_IMBALANCE)
    if allow_moves:
        for _ in range(_PAIRED_ROUNDS):
            if loads.max() <= limit or not _paired_moves(layout, limit):
                break
    # Scans until the target, a dead end, or dp_size scans in a row that lower the maximum
    # by less than _MIN_GAIN of the mean (many ranks inching down by a few tokens each).
    lowest_max, stalled = loads.max(), 0
    for _ in range(_MAX_SCANS_PER_RANK * loads.size):
        heavy = int(np.argmax(loads))
        if loads[heavy] <= limit or not _scan(layout, heavy, allow_moves):
            return
        if loads.max() < lowest_max - _MIN_GAIN * loads.mean():
            lowest_max, stalled = loads.max(), 0
        else:
            stalled += 1
            if stalled >= loads.size:
                return


def _paired_moves(layout: _Layout, limit: float) -> bool:
    """One round of phase 2; returns whether any sample moved."""
    loads, per_rank = layout.loads, layout.per_rank
    by_load = np.argsort(loads, kind="stable")
    num_pairs = min(int((loads > limit).sum()), loads.size // 2)
    heavy, light = by_load[::-1][:num_pairs], by_load[:num_pairs]
    samples = layout.rank_matrix()[heavy]
    present = samples >= 0
    samples = np.where(present, samples, 0)
    room = layout.bin_room().reshape(-1, per_rank)[light]
    to_bins = np.argmax(room, axis=1)
    gap = (loads[heavy] - loads[light])[:, None]
    sample_tokens, sample_weights = layout.tokens[samples], layout.weights[samples]
    ok = (
        present
        & (sample_tokens <= layout.cap)  # a lone oversize sample stays where it is
        & (layout.bin_sizes[layout.sample_bin[samples]] > 1)  # no bin becomes empty
        & (sample_tokens <= room[np.arange(num_pairs), to_bins][:, None])
        & (sample_weights < gap)
    )
    score = np.where(ok, np.abs(sample_weights - gap / 2), np.inf)
    pick = np.argmin(score, axis=1)
    pairs = np.flatnonzero(np.isfinite(score[np.arange(num_pairs), pick])).tolist()
    for k in pairs:
        layout.move(int(samples[k, pick[k]]), int(light[k]) * per_rank + int(to_bins[k]))
    return bool(pairs)


def _scan(layout: _Layout, heavy: int, allow_moves: bool) -> bool:
    """One scan of phase 3: the best move out of `heavy`, or a batch of swaps.
    Returns False if no transfer lowers the heavy rank's load."""
    loads, cap = layout.loads, layout.cap
    h = layout.rank_samples(heavy)
    h_tokens, h_weights, h_bins = layout.tokens[h], layout.weights[h], layout.sample_bin[h]
    movable = h_tokens <= cap  # a lone oversize sample stays where it is
    room = layout.bin_room()
    a_pos, b, swap_scores, transfers = _swap_options(layout, room, heavy, h_tokens, h_weights, movable, room[h_bins])
    best_swap = swap_scores[0] if swap_scores.size else np.inf
    if allow_moves:
        a, to_bin, move_score = _best_move(layout, room, h_weights, h_tokens, movable & (layout.bin_sizes[h_bins] > 1), heavy)
        if move_score < min(best_swap, loads[heavy]):
            layout.move(int(h[a]), to_bin)
            return True
    if not best_swap < loads[heavy]:
        return False
    # The best swap, then more of this scan's, each heavy sample at most once (its best),
    # while each still fits the cap and its receiver stays below the heavy rank's new load.
    rows = np.sort(np.unique(a_pos, return_index=True)[1])[:_SWAPS_PER_SCAN]
    per_rank, tokens, bin_tokens, sample_bin = layout.per_rank, layout.tokens, layout.bin_tokens, layout.sample_bin
    layout.swap(int(h[a_pos[0]]), int(b[0]))  # rows[0] == 0: checked by its score
    for a, other, transfer in zip(h[a_pos[rows[1:]]].tolist(), b[rows[1:]].tolist(), transfers[rows[1:]].tolist()):
        a_bin, b_bin = int(sample_bin[a]), int(sample_bin[other])
        token_delta = int(tokens[a]) - int(tokens[other])
        if (bin_tokens[b_bin] + token_delta <= cap and bin_tokens[a_bin] - token_delta <= cap
                and loads[b_bin // per_rank] + transfer <= loads[heavy] - transfer):
            layout.swap(a, other)
    return True


def _best_move(layout, room, h_weights, h_tokens, movable, heavy):
    """(position in heavy, bin, new pair maximum) of the best single move out of `heavy`.

    For each sample the best receiver is the lightest rank whose roomiest bin fits it:
    ranks sorted by that room, a running minimum of their loads answers every sample with
    one binary search.
    """
    loads, per_rank = layout.loads, layout.per_rank
    rank_room = room.reshape(-1, per_rank)
    roomiest = np.argmax(rank_room, axis=1)
    by_room = np.argsort(-rank_room[np.arange(loads.size), roomiest], kind="stable")
    sorted_room, sorted_loads = rank_room[by_room, roomiest[by_room]], loads[by_room]
    running_min = np.minimum.accumulate(sorted_loads)
    where_min = np.maximum.accumulate(np.where(sorted_loads == running_min, np.arange(loads.size), 0))
    fits = np.searchsorted(-sorted_room, -h_tokens, side="right")  # how many ranks have room for it
    lightest = np.maximum(fits - 1, 0)
    score = np.maximum(loads[heavy] - h_weights, running_min[lightest] + h_weights)
    score = np.where(movable & (fits > 0), score, np.inf)
    a = int(np.argmin(score))
    rank = int(by_room[where_min[lightest[a]]])
    return a, rank * per_rank + int(roomiest[rank]), score[a]


def _swap_options(layout, room, heavy, h_tokens, h_weights, movable, heavy_room):
    """Swaps out of `heavy`, best first, one per light partner b (with its best heavy a).

    Returns positions of a in heavy, b, new pair maxima, and load transfers w_a - w_b.
    Partners: the samples of the _SWAP_BINS bins of lighter ranks with the most potential,
    min(room, half the rank's gap to `heavy`), up to _SWAP_PARTNERS samples. Heavy
    candidates for each b: nearest in weight to w_b + half the gap (the best transfer) and
    the largest in tokens that still fits b's bin (the most a full bin can take).
    """
    loads, per_rank = layout.loads, layout.per_rank
    none = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    gap = np.repeat(loads[heavy] - loads, per_rank)
    potential = np.where((gap > 0) & (room > 0), np.minimum(room, gap / 2), 0.0)
    bins = np.flatnonzero(potential > 0)
    if bins.size > _SWAP_BINS:
        bins = np.sort(bins[np.argpartition(-potential[bins], _SWAP_BINS)[:_SWAP_BINS]])
    positions = np.flatnonzero(movable)
    if not bins.size or not positions.size:
        return none
    bins = bins[np.argsort(-potential[bins], kind="stable")]
    enough = int(np.searchsorted(np.cumsum(layout.bin_sizes[bins]), _SWAP_PARTNERS)) + 1
    b = np.fromiter(chain.from_iterable(layout.members[j] for j in bins[:enough].tolist()), dtype=np.int64)
    b_tokens, b_weights, b_bins = layout.tokens[b], layout.weights[b], layout.sample_bin[b]
    by_weight = positions[np.argsort(h_weights[positions], kind="stable")]
    by_tokens = positions[np.argsort(h_tokens[positions], kind="stable")]
    half_gap = np.searchsorted(h_weights[by_weight], b_weights + gap[b_bins] / 2)[:, None] + _HALF_GAP_WINDOW
    fits = np.searchsorted(h_tokens[by_tokens], b_tokens + room[b_bins], side="right")[:, None] + _FITS_WINDOW
    last = positions.size - 1
    a = np.concatenate([by_weight[np.clip(half_gap, 0, last)], by_tokens[np.clip(fits, 0, last)]], axis=1)
    transfer = h_weights[a] - b_weights[:, None]
    token_delta = h_tokens[a] - b_tokens[:, None]
    ok = (
        (transfer > 0)
        & (token_delta <= room[b_bins][:, None])
        & (-token_delta <= heavy_room[a])
        & (b_tokens <= layout.cap)[:, None]  # a lone oversize sample stays where it is
    )
    score = np.where(ok, np.maximum(loads[heavy] - transfer, loads[b_bins // per_rank][:, None] + transfer), np.inf)
    best = np.argmin(score, axis=1)
    row_scores = score[np.arange(b.size), best]
    order = np.argsort(row_scores, kind="stable")
    order = order[np.isfinite(row_scores[order])]
    return a[order, best[order]], b[order], row_scores[order], transfer[order, best[order]]
