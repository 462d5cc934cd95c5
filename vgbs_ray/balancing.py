"""Distributing a step's micro-batches over DP ranks, equal counts per rank.

Modes:
  "none"    strided round-robin: micro-batch j goes to rank j % dp_size.
  "tokens"  balance rank loads measured in tokens.
  "flops"   balance rank loads measured in estimated FLOPs (attention is quadratic).

Balanced modes work in two phases:
1. Whole micro-batches to ranks by largest differencing (Karmarkar-Karp) with equal
   counts: count per rank is exact.
2. Refinement by sample moves and swaps between a heavy rank and a light rank: the one
   whose transferred load is closest to half the gap, while (a) no micro-batch exceeds the
   token cap, (b) no micro-batch becomes empty, (c) a sample over the cap never moves.
   Packing whole bins leaves rank imbalance of a few percent; moving single samples
   closes it to a fraction of a percent at the same micro-batch count.

Invariants: every micro-batch keeps >= 1 sample and <= capacity tokens (a lone oversize
sample excepted); each rank holds exactly len(bins) / dp_size micro-batches; the result is
a deterministic function of the input.
"""

from __future__ import annotations

import heapq

import numpy as np

# Refinement stops once max rank load is within this fraction of the mean...
_TARGET_IMBALANCE = 0.004
# ...or after this many improving moves per rank, or this many fruitless pair searches per
# rank (a step packed to the brim leaves no room to move into: stop looking, not balancing).
_MAX_MOVES_PER_RANK = 40
_MAX_FRUITLESS_PAIRS_PER_RANK = 4
# Swap candidates per heavy sample: this many light samples each side of a target weight.
_SWAP_WINDOW = np.arange(-6, 6)


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
        bins: micro-batches; len(bins) must be a multiple of dp_size.
        tokens: tokens per sample (for the cap).
        weights: cost per sample that "balanced" means (tokens or FLOPs).
        mode: "none", "tokens" or "flops" (the caller picks `weights` to match).
        capacity: token cap per micro-batch, or None (static path: no token cap).
        allow_moves: if False only swaps refine (keeps micro-batch sizes, for static chunks).
    Returns:
        Per rank, its micro-batches (each a list of sample indices, ascending), heaviest first.
    """
    if len(bins) % dp_size:
        raise ValueError(f"{len(bins)} micro-batches cannot be split evenly over {dp_size} ranks")
    if mode == "none":
        assignment = [[bins[j] for j in range(rank, len(bins), dp_size)] for rank in range(dp_size)]
    else:
        assignment = _karmarkar_karp_equal_count(bins, weights, dp_size)
        _refine(assignment, tokens, weights, capacity, allow_moves)
    per_rank = len(bins) // dp_size
    all_weights = _bin_sums([mb for rank_bins in assignment for mb in rank_bins], weights)
    ordered = []
    for rank, rank_bins in enumerate(assignment):
        bin_weights = all_weights[rank * per_rank:(rank + 1) * per_rank]
        # Padding (empty) micro-batches run last.
        order = sorted(range(per_rank), key=lambda j: (-bin_weights[j], min(rank_bins[j], default=len(tokens))))
        ordered.append([sorted(rank_bins[j]) for j in order])
    return ordered


def _bin_sums(bins: list[list[int]], values: np.ndarray) -> list[float]:
    """Sum of `values` over each bin's samples (one vectorised pass)."""
    if not bins:
        return []
    flat = np.fromiter((i for b in bins for i in b), dtype=np.int64)
    which = np.repeat(np.arange(len(bins)), [len(b) for b in bins])
    return np.bincount(which, weights=values[flat], minlength=len(bins)).tolist()


def _karmarkar_karp_equal_count(bins, weights, dp_size):
    """Largest differencing with equal counts: whole bins to ranks, each rank len(bins)/dp_size.

    Bins sorted by weight form groups of dp_size, each a partial solution of dp_size
    one-bin subsets. Repeatedly the two partial solutions with the largest spread merge,
    the heaviest subset of one joining the lightest of the other, so counts stay equal and
    differences cancel. O(B log B) for B bins.
    """
    bin_weights = _bin_sums(bins, weights)
    order = sorted(range(len(bins)), key=lambda j: (-bin_weights[j], j))
    heap = []
    for g in range(0, len(order), dp_size):
        group = [(bin_weights[j], [j]) for j in order[g:g + dp_size]]
        group.sort(key=lambda subset: subset[0])
        heapq.heappush(heap, (-(group[-1][0] - group[0][0]), g, group))
    while len(heap) > 1:
        _, key, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [
            (a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))
        ]
        merged.sort(key=lambda subset: subset[0])
        heapq.heappush(heap, (-(merged[-1][0] - merged[0][0]), key, merged))
    _, _, solution = heap[0]
    return [[list(bins[j]) for j in members] for _, members in solution]


def _refine(assignment, tokens, weights, capacity, allow_moves):
    """Move or swap single samples from the heaviest rank to lighter ranks (see module docstring)."""
    dp_size = len(assignment)
    if dp_size < 2:
        return
    cap = np.inf if capacity is None else capacity
    per_rank = len(assignment[0])
    loads = np.add.reduceat(_bin_sums([mb for rank_bins in assignment for mb in rank_bins], weights),
                            np.arange(0, dp_size * per_rank, per_rank))
    mean = loads.mean()
    if mean <= 0:
        return
    views: dict[int, _RankView] = {}

    def view(rank: int) -> _RankView:
        if rank not in views:
            views[rank] = _RankView(assignment[rank], tokens, weights)
        return views[rank]

    # A pair that found no improving transfer stays hopeless until one of its ranks changes.
    hopeless: set[tuple[int, int]] = set()
    fruitless_budget = _MAX_FRUITLESS_PAIRS_PER_RANK * dp_size
    for _ in range(_MAX_MOVES_PER_RANK * dp_size):
        heavy = int(np.argmax(loads))
        if loads[heavy] <= mean * (1 + _TARGET_IMBALANCE):
            return
        for light in np.argsort(loads, kind="stable").tolist():
            if light == heavy or (heavy, light) in hopeless:
                continue
            if _improve_pair(assignment, loads, heavy, light, view(heavy), view(light), weights, cap, allow_moves):
                views.pop(heavy), views.pop(light)
                hopeless = {pair for pair in hopeless if heavy not in pair and light not in pair}
                break
            hopeless.add((heavy, light))
            fruitless_budget -= 1
            if fruitless_budget <= 0:
                return
        else:
            return  # no rank can take load from the heaviest one


class _RankView:
    """One rank's samples as flat arrays: sample ids, their bin, tokens, weights; bins' tokens and sizes."""

    def __init__(self, rank_bins, tokens, weights):
        self.samples = np.fromiter((i for mb in rank_bins for i in mb), dtype=np.int64)
        self.where = np.repeat(np.arange(len(rank_bins)), [len(mb) for mb in rank_bins])
        self.tokens = tokens[self.samples]
        self.weights = weights[self.samples]
        self.bin_tokens = np.bincount(self.where, weights=self.tokens, minlength=len(rank_bins))
        self.bin_sizes = np.bincount(self.where, minlength=len(rank_bins))
        self.by_weight = np.argsort(self.weights, kind="stable")
        self.sorted_weights = self.weights[self.by_weight]


def _improve_pair(assignment, loads, heavy, light, h: _RankView, l: _RankView, weights, cap, allow_moves) -> bool:
    """Apply the best move or swap from `heavy` to `light`; return whether one improved the pair."""
    gap = loads[heavy] - loads[light]
    h_tokens, h_weights, h_where, h_bin_tokens = h.tokens, h.weights, h.where, h.bin_tokens
    l_tokens, l_weights, l_where, l_bin_tokens = l.tokens, l.weights, l.where, l.bin_tokens
    h_samples, l_samples, h_bin_sizes = h.samples, l.samples, h.bin_sizes
    movable_h = h_tokens <= cap  # a lone oversize sample stays where it is

    best = None  # (distance of transfer from gap/2, kind, heavy position, light position or bin)
    if allow_moves:
        # Move sample a of heavy into the light bin with the most room.
        room = cap - l_bin_tokens
        target_bin = int(np.argmax(room))
        ok = movable_h & (h_bin_sizes[h_where] > 1) & (h_tokens <= room[target_bin]) & (h_weights < gap)
        if ok.any():
            score = np.where(ok, np.abs(h_weights - gap / 2), np.inf)
            a = int(np.argmin(score))
            best = (score[a], "move", a, target_bin)
    # Swap a (heavy) with b (light): transfer w_a - w_b in (0, gap), both bins stay under the cap.
    # Not all |H| x |L| pairs: for each a, the light samples nearest in weight to two targets,
    # half the gap (the best transfer) and the room of the roomiest light bin (the largest
    # transfer a nearly full rank can still take).
    if l_weights.size:
        order, sorted_weights = l.by_weight, l.sorted_weights
        widest = min(gap / 2, float(np.max(cap - l_bin_tokens))) if np.isfinite(cap) else gap / 2
        targets = np.concatenate([h_weights[:, None] - gap / 2, h_weights[:, None] - widest], axis=1)
        nearest = np.searchsorted(sorted_weights, targets)[:, :, None] + _SWAP_WINDOW[None, None, :]
        b_index = order[np.clip(nearest, 0, l_weights.size - 1)].reshape(h_weights.size, -1)
        transfer = h_weights[:, None] - l_weights[b_index]
        token_delta = h_tokens[:, None] - l_tokens[b_index]
        ok = (
            movable_h[:, None]
            & (l_tokens[b_index] <= cap)
            & (transfer > 0)
            & (transfer < gap)
            & (l_bin_tokens[l_where[b_index]] + token_delta <= cap)
            & (h_bin_tokens[h_where][:, None] - token_delta <= cap)
        )
        if ok.any():
            score = np.where(ok, np.abs(transfer - gap / 2), np.inf)
            a, k = np.unravel_index(int(np.argmin(score)), score.shape)
            if best is None or score[a, k] < best[0]:
                best = (score[a, k], "swap", int(a), int(b_index[a, k]))
    if best is None:
        return False

    _, kind, a, other = best
    sample_a, bin_a = int(h_samples[a]), int(h_where[a])
    assignment[heavy][bin_a].remove(sample_a)
    if kind == "move":
        assignment[light][other].append(sample_a)
        moved = float(weights[sample_a])
    else:
        sample_b, bin_b = int(l_samples[other]), int(l_where[other])
        assignment[light][bin_b].remove(sample_b)
        assignment[light][bin_b].append(sample_a)
        assignment[heavy][bin_a].append(sample_b)
        moved = float(weights[sample_a] - weights[sample_b])
    loads[heavy] -= moved
    loads[light] += moved
    return True
