"""StepShard: what one DP rank trains in one step, as flat numpy arrays.

A shard is built once on the rollout side and put into the Ray object store; numpy arrays
come back zero-copy on `ray.get`. It carries its own normalisers (`rollout_mask_sums` over
the whole rollout, across ranks; `num_rollouts` of the whole step) so a train worker never
recounts anything.

Flat layout: samples appear in execution order (the rank's partition). `token_ids` holds
every sample's tokens back to back (`total_lengths` each); `loss_mask` and
`rollout_log_probs` hold every sample's response tokens back to back
(`response_lengths` each). `micro_batch_indices` are positions into the shard's samples;
None means the legacy path (the rank chooses its own micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from vgbs_ray.errors import RolloutValidationError
from vgbs_ray.normalisers import rollout_mask_sums as compute_rollout_mask_sums
from vgbs_ray.sample import Sample
from vgbs_ray.schedule import StepLayout


@dataclass(frozen=True)
class StepShard:
    step: int
    rank: int
    dp_size: int
    num_rollouts: int
    """Rollouts in the whole step (all ranks): the loss divisor."""
    num_microbatches: int | None
    """Micro-batches this rank runs (the same on every rank); None on the legacy path."""
    micro_batch_indices: list[list[int]] | None
    """Per micro-batch, positions into this shard's samples; None on the legacy path."""
    token_ids: np.ndarray
    total_lengths: np.ndarray
    response_lengths: np.ndarray
    loss_mask: np.ndarray
    """int8 0/1 (validated on intake): a byte per response token, a quarter of a float's object-store copy."""
    advantages: np.ndarray
    rewards: np.ndarray
    rollout_mask_sums: np.ndarray
    """Per sample: loss-mask tokens over its whole rollout (int64)."""
    rollout_ids: list
    rollout_log_probs: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return int(self.total_lengths.size)

    @property
    def has_layout(self) -> bool:
        return self.micro_batch_indices is not None

    @property
    def num_tokens(self) -> int:
        return int(self.total_lengths.sum())

    def token_offsets(self) -> np.ndarray:
        """Start of each sample in `token_ids`, plus the end (len num_samples + 1)."""
        return np.concatenate([[0], np.cumsum(self.total_lengths)])

    def response_offsets(self) -> np.ndarray:
        """Start of each sample in `loss_mask`, plus the end (len num_samples + 1)."""
        return np.concatenate([[0], np.cumsum(self.response_lengths)])


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    """Concatenate and convert in one pass (concatenate-then-astype copies the step's data twice)."""
    return np.concatenate(arrays, dtype=dtype, casting="unsafe")


def _stack(samples: Sequence[Sample], step: int, rank: int, dp_size: int, num_rollouts: int,
           mask_sums: np.ndarray, micro_batch_indices) -> StepShard:
    for s in samples:
        if s.advantage is None:
            raise RolloutValidationError(
                s.rollout_id, "missing_advantage",
                "sample has no advantage; the producer or the scheduler's group normalisation must set one",
                sample_index=s.sample_index,
            )
    with_log_probs = [s.rollout_log_probs is not None for s in samples]
    log_probs = None
    if samples and all(with_log_probs):
        log_probs = _concat([s.rollout_log_probs for s in samples], np.float32)
    empty_i = np.zeros(0, dtype=np.int64)
    return StepShard(
        step=step,
        rank=rank,
        dp_size=dp_size,
        num_rollouts=num_rollouts,
        num_microbatches=None if micro_batch_indices is None else len(micro_batch_indices),
        micro_batch_indices=micro_batch_indices,
        token_ids=_concat([s.tokens for s in samples], np.int64) if samples else empty_i,
        total_lengths=np.array([s.total_length for s in samples], dtype=np.int64),
        response_lengths=np.array([s.response_length for s in samples], dtype=np.int64),
        loss_mask=_concat([s.loss_mask for s in samples], np.int8) if samples else np.zeros(0, dtype=np.int8),
        advantages=np.array([s.advantage for s in samples], dtype=np.float32),
        rewards=np.array([s.reward for s in samples], dtype=np.float32),
        rollout_mask_sums=np.asarray(mask_sums, dtype=np.int64),
        rollout_ids=[s.rollout_id for s in samples],
        rollout_log_probs=log_probs,
    )


def build_step_shards(samples: Sequence[Sample], layout: StepLayout, step: int) -> list[StepShard]:
    """One shard per DP rank for a laid-out step.

    `layout`'s global sample indices index into `samples`, which must hold every sample of
    the step's rollouts (the rollout mask sums are taken over them, across ranks).
    """
    step_indices = layout.sample_indices
    step_mask_sums = compute_rollout_mask_sums(
        [samples[i].rollout_id for i in step_indices], [samples[i].loss_mask for i in step_indices]
    )
    mask_sum_of = dict(zip(step_indices, step_mask_sums.tolist()))
    shards = []
    dp_size = len(layout.rank_micro_batches)
    for rank in range(dp_size):
        partition = layout.partition(rank)
        shards.append(_stack(
            [samples[i] for i in partition], step, rank, dp_size, layout.num_rollouts,
            [mask_sum_of[i] for i in partition], layout.micro_batch_indices(rank),
        ))
    return shards


def build_legacy_shards(samples: Sequence[Sample], step: int, dp_size: int) -> list[StepShard]:
    """The legacy path: an even strided DP split of whole rollouts' samples, no layout.

    Each rank picks its own micro-batches and agrees on their count with all-reduce(MAX).
    The per-rollout normalisers are still precomputed here.
    """
    mask_sums = compute_rollout_mask_sums([s.rollout_id for s in samples], [s.loss_mask for s in samples])
    num_rollouts = len({s.rollout_id for s in samples})
    return [
        _stack(list(samples[rank::dp_size]), step, rank, dp_size, num_rollouts, mask_sums[rank::dp_size], None)
        for rank in range(dp_size)
    ]
