"""Packed micro-batches from a StepShard: the tensors one forward/backward runs on.

    pack_micro_batch(shard, positions) -> PackedMicroBatch

Packing (THD): the micro-batch's samples are laid back to back in one row of T tokens, in
the order `positions` gives; `cu_seqlens` marks each sequence's start, position ids restart
at 0 in each sequence, and attention is block-diagonal causal (a token sees only earlier
tokens of its own sequence). Nothing is padded.

Scoring: logits at packed position p predict the token at p + 1, so the response token at
packed position j is scored by the logits at j - 1. `response_logit_index[k]` is that index
for the k-th response token of the micro-batch (response tokens back to back in sample
order, the layout of `vgbs_ray.losses.accounting`). A sample whose response starts at its first token has
no logits for that token: it is not scorable, its numerator weight is 0 (`loss_weight`),
while its rollout denominator stays the precomputed `rollout_mask_sums` (the known edge:
only numerators change).

Invariants (tests/test_microbatch.py): the tokens are exactly the samples' tokens in order;
sum of sequence lengths == T; the k-th response token is `tokens[response_logit_index[k] + 1]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from vgbs_ray.losses.normalisers import StepTotals
from vgbs_ray.layout.shard import StepShard


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch of one rank, packed as a single THD row (see module docstring)."""

    positions: np.ndarray
    """Positions of its samples in the shard, in packing order."""
    tokens: torch.Tensor
    """[1, T] int64."""
    position_ids: torch.Tensor
    """[1, T] int64, restarting at 0 in each sequence."""
    targets: torch.Tensor
    """[1, T] int64: the next token (0 at each sequence's last position, never scored)."""
    cu_seqlens: torch.Tensor
    """[num_samples + 1] int32 sequence boundaries."""
    max_seqlen: int
    response_logit_index: torch.Tensor
    """[R] int64: the logit position that scores each response token."""
    response_lengths: torch.Tensor
    """[num_samples] int64."""
    loss_weight: torch.Tensor
    """[R] float32: the loss mask, 0 where a token is not scorable."""
    advantages: torch.Tensor
    """[num_samples] float32."""
    rewards: torch.Tensor
    """[num_samples] float32."""
    rollout_mask_sums: torch.Tensor
    """[num_samples] int64: the per-rollout denominators, precomputed on the rollout side."""
    old_log_probs: torch.Tensor | None
    """[R] float32 rollout log-probs from the shard, or None (recompute before the update)."""
    rollout_indices: torch.Tensor
    """[num_samples] int64: each sample's rollout index in the whole step (the same on every rank)."""
    sample_mask_sums: torch.Tensor
    """[num_samples] int64: loss-mask tokens of each whole sample (before any context-parallel split)."""
    group_mask_sums: torch.Tensor
    """[num_samples] int64: loss-mask tokens over each sample's whole prompt group."""
    step_totals: StepTotals | None
    """The whole step's counts (`vgbs_ray.losses.normalisers.StepTotals`); None on a padding micro-batch."""

    @property
    def num_samples(self) -> int:
        return int(self.positions.size)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])


def _concat(arrays: Sequence[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)


def pack_micro_batch(shard: StepShard, positions: Sequence[int]) -> PackedMicroBatch:
    """Pack the shard's samples at `positions` (in that order) into one THD micro-batch.

    Complexity: O(tokens of the micro-batch).
    """
    positions = np.asarray(positions, dtype=np.int64)
    token_offsets = shard.token_offsets()
    response_offsets = shard.response_offsets()
    lengths = shard.total_lengths[positions]
    response_lengths = shard.response_lengths[positions]
    token_parts, position_parts, target_parts, logit_parts, weight_parts, log_prob_parts = [], [], [], [], [], []
    sample_mask_sums = []
    start = 0
    for p, length, response_length in zip(positions.tolist(), lengths.tolist(), response_lengths.tolist()):
        tokens = shard.token_ids[token_offsets[p]:token_offsets[p + 1]]
        token_parts.append(tokens)
        position_parts.append(np.arange(length, dtype=np.int64))
        target_parts.append(np.append(tokens[1:], 0))
        # Response token at sequence position j is scored by the logits at j - 1.
        in_sequence = np.arange(length - response_length, length, dtype=np.int64)
        scorable = in_sequence >= 1
        logit_parts.append(start + np.maximum(in_sequence - 1, 0))
        mask = shard.loss_mask[response_offsets[p]:response_offsets[p + 1]]
        weight_parts.append(mask * scorable)
        sample_mask_sums.append(int(np.count_nonzero(mask)))
        if shard.rollout_log_probs is not None:
            log_prob_parts.append(shard.rollout_log_probs[response_offsets[p]:response_offsets[p + 1]])
        start += length
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return PackedMicroBatch(
        positions=positions,
        tokens=torch.from_numpy(_concat(token_parts, np.int64)).unsqueeze(0),
        position_ids=torch.from_numpy(_concat(position_parts, np.int64)).unsqueeze(0),
        targets=torch.from_numpy(_concat(target_parts, np.int64)).unsqueeze(0),
        cu_seqlens=torch.from_numpy(cu_seqlens),
        max_seqlen=int(lengths.max()) if lengths.size else 0,
        response_logit_index=torch.from_numpy(_concat(logit_parts, np.int64)),
        response_lengths=torch.from_numpy(response_lengths.astype(np.int64)),
        loss_weight=torch.from_numpy(_concat(weight_parts, np.float32)),
        advantages=torch.from_numpy(shard.advantages[positions].astype(np.float32)),
        rewards=torch.from_numpy(shard.rewards[positions].astype(np.float32)),
        rollout_mask_sums=torch.from_numpy(shard.rollout_mask_sums[positions].astype(np.int64)),
        old_log_probs=(None if shard.rollout_log_probs is None
                       else torch.from_numpy(_concat(log_prob_parts, np.float32))),
        rollout_indices=torch.from_numpy(shard.rollout_indices[positions].astype(np.int64)),
        sample_mask_sums=torch.tensor(sample_mask_sums, dtype=torch.int64),
        group_mask_sums=torch.from_numpy(shard.group_mask_sums[positions].astype(np.int64)),
        step_totals=shard.step_totals,
    )
