"""One context-parallel rank's share of a packed micro-batch (THD, load-balanced causal split).

    split_for_context_parallel(micro_batch, cp_rank, cp_size) -> PackedMicroBatch

With context parallelism a micro-batch's tokens are split over `cp_size` ranks; Megatron's
CP attention for packed sequences (Transformer Engine) and its THD rotary embedding expect
every sequence cut into 2 * cp_size equal chunks, rank r holding chunks r and 2*cp_size-1-r
(causal attention costs the same on every rank). So:

1. each sequence is padded at its end to a multiple of 2 * cp_size (pad token 0, never
   scored; causal attention means a pad never changes a real token's output);
2. the rank keeps its two chunks of every sequence, in sequence order; `cu_seqlens` and
   `max_seqlen` stay those of the whole padded row (what TE and RoPE divide by cp_size);
3. a response token is scored where its logit position lands: the rank keeps exactly the
   response tokens whose scoring position it holds, with their targets, weights and old
   log-probs, in the original order; per-sample fields (advantages, rewards, mask sums,
   rollout indices) stay whole, since the per-rollout loss is a sum over tokens.

Invariants (tests/test_context_parallel_split.py): over the cp ranks every real token is held
exactly once and every response token scored exactly once; `targets[response_logit_index]`
is the scored token; the ranks' losses and metric pairs sum to the unsplit micro-batch's.
"""

from __future__ import annotations

import numpy as np
import torch

from vgbs_ray.layout.microbatch import PackedMicroBatch


def _padded_layout(lengths: np.ndarray, cp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Padded lengths (multiples of 2 * cp_size) and their starts in the padded row (len n + 1)."""
    unit = 2 * cp_size
    padded = -(-lengths // unit) * unit
    return padded, np.concatenate([[0], np.cumsum(padded)])


def local_padded_indices(lengths: np.ndarray, cp_rank: int, cp_size: int) -> np.ndarray:
    """Positions in the padded row this rank holds: chunks r and 2*cp_size-1-r of each sequence."""
    padded, starts = _padded_layout(np.asarray(lengths, dtype=np.int64), cp_size)
    parts = []
    for start, length in zip(starts[:-1].tolist(), padded.tolist()):
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(np.arange(start + c * chunk, start + (c + 1) * chunk, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def split_for_context_parallel(mb: PackedMicroBatch, cp_rank: int, cp_size: int) -> PackedMicroBatch:
    """This rank's share of `mb` (see module docstring). Complexity: O(tokens of the micro-batch)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if cp_size == 1:
        return mb
    bounds = mb.cu_seqlens.numpy().astype(np.int64)
    lengths = np.diff(bounds)
    padded, padded_starts = _padded_layout(lengths, cp_size)
    # where each unpadded position of the row lands in the padded row
    shift = np.repeat(padded_starts[:-1] - bounds[:-1], lengths)
    to_padded = np.arange(int(bounds[-1]), dtype=np.int64) + shift

    def pad(row: torch.Tensor, fill_positions: bool) -> np.ndarray:
        out = np.zeros(int(padded_starts[-1]), dtype=np.int64)
        if fill_positions:  # positions keep counting through a sequence's padding
            out = np.concatenate([np.arange(n, dtype=np.int64) for n in padded.tolist()]) if padded.size else out
        out[to_padded] = row[0].numpy()
        return out

    local = local_padded_indices(lengths, cp_rank, cp_size)
    local_of_padded = np.full(int(padded_starts[-1]), -1, dtype=np.int64)
    local_of_padded[local] = np.arange(local.size, dtype=np.int64)
    scored_at = local_of_padded[to_padded[mb.response_logit_index.numpy()]]
    mine = scored_at >= 0
    sample_of_response = np.repeat(np.arange(lengths.size), mb.response_lengths.numpy())
    counts = np.bincount(sample_of_response[mine], minlength=lengths.size)
    keep = torch.from_numpy(mine)
    row = lambda values: torch.from_numpy(values[local]).unsqueeze(0)  # noqa: E731
    return PackedMicroBatch(
        positions=mb.positions,
        tokens=row(pad(mb.tokens, False)),
        position_ids=row(pad(mb.position_ids, True)),
        targets=row(pad(mb.targets, False)),
        cu_seqlens=torch.from_numpy(padded_starts.astype(np.int32)),
        max_seqlen=int(padded.max()) if padded.size else 0,
        response_logit_index=torch.from_numpy(scored_at[mine]),
        response_lengths=torch.from_numpy(counts.astype(np.int64)),
        loss_weight=mb.loss_weight[keep],
        advantages=mb.advantages,
        rewards=mb.rewards,
        rollout_mask_sums=mb.rollout_mask_sums,
        old_log_probs=None if mb.old_log_probs is None else mb.old_log_probs[keep],
        rollout_indices=mb.rollout_indices,
        sample_mask_sums=mb.sample_mask_sums,
        group_mask_sums=mb.group_mask_sums,
        step_totals=mb.step_totals,
    )
