"""Distributing a step's micro-batches over DP ranks, equal counts per rank.

Modes:
  "none"    strided round-robin: micro-batch j goes to rank j % dp_size.
  "tokens"  balance rank loads measured in tokens.
  "flops"   balance rank loads measured in estimated FLOPs (attention is quadratic).

Balanced modes work in two phases:
1. Whole micro-batches, heaviest first, each to the least-loaded rank that still has a
   free slot (greedy LPT with a cardinality constraint): count per rank is exact.
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
_TARGET_IMBALANCE = 1e-3
# ...or after this many improving moves per rank.
_MAX_MOVES_PER_RANK = 40


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
    per_rank = len(bins) // dp_size
    if mode == "none":
        assignment = [[bins[j] for j in range(rank, len(bins), dp_size)] for rank in range(dp_size)]
    else:
        assignment = _greedy_equal_count(bins, weights, dp_size, per_rank)
        _refine(assignment, tokens, weights, capacity, allow_moves)
    return [
        sorted((sorted(mb) for mb in rank_bins), key=lambda mb: (-float(weights[mb].sum()), mb[0]))
        for rank_bins in assignment
    ]


def _greedy_equal_count(bins, weights, dp_size, per_rank):
    bin_weights = [float(weights[b].sum()) for b in bins]
    order = sorted(range(len(bins)), key=lambda j: (-bin_weights[j], j))
    heap = [(0.0, rank) for rank in range(dp_size)]
    assignment: list[list[list[int]]] = [[] for _ in range(dp_size)]
    for j in order:
        load, rank = heapq.heappop(heap)
        assignment[rank].append(list(bins[j]))
        if len(assignment[rank]) < per_rank:
            heapq.heappush(heap, (load + bin_weights[j], rank))
    return assignment


def _refine(assignment, tokens, weights, capacity, allow_moves):
    """Move or swap single samples from the heaviest rank to lighter ranks (see module docstring)."""
    dp_size = len(assignment)
    if dp_size < 2:
        return
    cap = np.inf if capacity is None else capacity
    loads = np.array([sum(float(weights[mb].sum()) for mb in rank_bins) for rank_bins in assignment])
    mean = loads.mean()
    if mean <= 0:
        return
    for _ in range(_MAX_MOVES_PER_RANK * dp_size):
        heavy = int(np.argmax(loads))
        if loads[heavy] <= mean * (1 + _TARGET_IMBALANCE):
            return
        for light in np.argsort(loads, kind="stable"):
            light = int(light)
            if light == heavy or not _improve_pair(assignment, loads, heavy, light, tokens, weights, cap, allow_moves):
                continue
            break
        else:
            return  # no light rank can take load from the heaviest one


def _flatten(rank_bins, tokens, weights):
    """Per sample of one rank: (sample, bin position, tokens, weight), plus bins' tokens and sizes."""
    samples = [i for mb in rank_bins for i in mb]
    where = np.repeat(np.arange(len(rank_bins)), [len(mb) for mb in rank_bins])
    bin_tokens = np.array([int(tokens[mb].sum()) for mb in rank_bins], dtype=np.int64)
    bin_sizes = np.array([len(mb) for mb in rank_bins])
    return np.array(samples, dtype=np.int64), where, bin_tokens, bin_sizes


def _improve_pair(assignment, loads, heavy, light, tokens, weights, cap, allow_moves) -> bool:
    """Apply the best move or swap from `heavy` to `light`; return whether one improved the pair."""
    gap = loads[heavy] - loads[light]
    h_samples, h_where, h_bin_tokens, h_bin_sizes = _flatten(assignment[heavy], tokens, weights)
    l_samples, l_where, l_bin_tokens, _ = _flatten(assignment[light], tokens, weights)
    h_tokens, h_weights = tokens[h_samples], weights[h_samples]
    l_tokens, l_weights = tokens[l_samples], weights[l_samples]
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
    transfer = h_weights[:, None] - l_weights[None, :]
    token_delta = h_tokens[:, None] - l_tokens[None, :]
    ok = (
        movable_h[:, None]
        & (l_tokens[None, :] <= cap)
        & (transfer > 0)
        & (transfer < gap)
        & (l_bin_tokens[l_where][None, :] + token_delta <= cap)
        & (h_bin_tokens[h_where][:, None] - token_delta <= cap)
    )
    if ok.any():
        score = np.where(ok, np.abs(transfer - gap / 2), np.inf)
        a, b = np.unravel_index(int(np.argmin(score)), score.shape)
        if best is None or score[a, b] < best[0]:
            best = (score[a, b], "swap", int(a), int(b))
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
