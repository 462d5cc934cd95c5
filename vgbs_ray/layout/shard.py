"""StepShard: what one DP rank trains in one step, as flat numpy arrays.

A shard is built once on the rollout side and put into the Ray object store; numpy arrays
come back zero-copy on `ray.get`. It carries its own normalisers (`rollout_mask_sums` over
the whole rollout and `group_mask_sums` over the whole prompt group, across ranks; the step's
totals, `num_rollouts` among them) so a train worker never recounts anything.

Flat layout: samples appear in execution order (the rank's partition). `token_ids` holds
every sample's tokens back to back (`total_lengths` each); `loss_mask` and
`rollout_log_probs` hold every sample's response tokens back to back
(`response_lengths` each). `micro_batch_indices` are positions into the shard's samples, the
micro-batches the rank runs in that order (laid out on the rollout side, `vgbs_ray.layout.schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from vgbs_ray.errors import RolloutValidationError
from vgbs_ray.losses.normalisers import StepTotals, step_normalisers
from vgbs_ray.sample import Sample
from vgbs_ray.layout.schedule import StepLayout


@dataclass(frozen=True)
class StepShard:
    step: int
    rank: int
    dp_size: int
    num_rollouts: int
    """Rollouts in the whole step (all ranks): the loss divisor."""
    num_microbatches: int
    """Micro-batches this rank runs (the same on every rank)."""
    micro_batch_indices: list[list[int]]
    """Per micro-batch, positions into this shard's samples (an empty one: a padding micro-batch)."""
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
    rollout_indices: np.ndarray
    """Per sample: its rollout's index in the whole step (int64), the same on every rank."""
    group_mask_sums: np.ndarray
    """Per sample: loss-mask tokens over its whole prompt group (int64)."""
    step_totals: StepTotals
    """The whole step's rollouts, samples, groups and mask tokens: the aggregations' divisors."""
    rollout_log_probs: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return int(self.total_lengths.size)

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
    return np.concatenate(arrays, dtype=dtype, casting="unsafe") if arrays else np.zeros(0, dtype=dtype)


def _shards(partitions: list[list[Sample]], step: int, num_rollouts: int,
            micro_batch_indices: list[list[list[int]]]) -> list[StepShard]:
    """One shard per rank from each rank's samples, in execution order; together the partitions
    hold every sample of the step's rollouts (the rollout mask sums are taken over all of them).

    Each array is built once for the whole step, ranks back to back, and a rank's shard holds
    views of its range: one numpy call and allocation per array and step instead of one per
    rank. Pickling a view writes only its own bytes, so a shard put alone stays its rank's size.
    `rollout_log_probs` is None unless every sample of the step carries them (a rank without
    samples then gets an empty array), so all ranks of a step agree on whether they have
    behaviour log-probs: a loss's pre-pass all-reduce (GSPO's rollout ratio) runs on all or none.
    """
    ordered = [s for partition in partitions for s in partition]
    for s in ordered:
        if s.advantage is None:
            raise RolloutValidationError(
                s.rollout_id, "missing_advantage",
                "sample has no advantage; the producer or the scheduler's group normalisation must set one",
                sample_index=s.sample_index,
            )
    total_lengths = np.array([s.total_length for s in ordered], dtype=np.int64)
    response_lengths = np.array([s.response_length for s in ordered], dtype=np.int64)
    token_ids = _concat([s.tokens for s in ordered], np.int64)
    loss_mask = _concat([s.loss_mask for s in ordered], np.int8)
    log_probs = None
    if ordered and all(s.rollout_log_probs is not None for s in ordered):
        log_probs = _concat([s.rollout_log_probs for s in ordered], np.float32)
    advantages = np.array([s.advantage for s in ordered], dtype=np.float32)
    rewards = np.array([s.reward for s in ordered], dtype=np.float32)
    normalisers = step_normalisers([s.rollout_id for s in ordered], [s.group_id for s in ordered],
                                   [s.loss_mask for s in ordered], num_rollouts)
    starts = np.cumsum([0, *map(len, partitions)]).tolist()  # rank r's samples: starts[r]:starts[r + 1]
    token_at = np.concatenate([[0], np.cumsum(total_lengths)]).tolist()
    response_at = np.concatenate([[0], np.cumsum(response_lengths)]).tolist()
    dp_size = len(partitions)
    shards = []
    for rank, partition in enumerate(partitions):
        a, b = starts[rank], starts[rank + 1]
        t0, t1, r0, r1 = token_at[a], token_at[b], response_at[a], response_at[b]
        rank_micro_batches = micro_batch_indices[rank]
        shards.append(StepShard(
            step=step,
            rank=rank,
            dp_size=dp_size,
            num_rollouts=num_rollouts,
            num_microbatches=len(rank_micro_batches),
            micro_batch_indices=rank_micro_batches,
            token_ids=token_ids[t0:t1],
            total_lengths=total_lengths[a:b],
            response_lengths=response_lengths[a:b],
            loss_mask=loss_mask[r0:r1],
            advantages=advantages[a:b],
            rewards=rewards[a:b],
            rollout_mask_sums=normalisers.rollout_mask_sums[a:b],
            rollout_ids=[s.rollout_id for s in partition],
            rollout_indices=normalisers.rollout_indices[a:b],
            group_mask_sums=normalisers.group_mask_sums[a:b],
            step_totals=normalisers.totals,
            rollout_log_probs=None if log_probs is None else log_probs[r0:r1],
        ))
    return shards


def single_micro_batch_shard(samples: Sequence[Sample], step: int = 0) -> StepShard:
    """One rank's shard holding `samples` (whole rollouts) as one micro-batch, in the order given: for a
    trainer of one rank without a scheduler (pure-torch benchmarks, hand-computed loss tests)."""
    layout = StepLayout(rollout_ids=tuple(dict.fromkeys(s.rollout_id for s in samples)),
                        rank_micro_batches=((tuple(range(len(samples))),),))
    return build_step_shards(samples, layout, step)[0]


def build_step_shards(samples: Sequence[Sample], layout: StepLayout, step: int) -> list[StepShard]:
    """One shard per DP rank for a laid-out step.

    `layout`'s global sample indices index into `samples`, which must hold every sample of
    the step's rollouts (the rollout mask sums are taken over them, across ranks).
    """
    dp_size = len(layout.rank_micro_batches)
    return _shards([[samples[i] for i in layout.partition(rank)] for rank in range(dp_size)], step,
                   layout.num_rollouts, [layout.micro_batch_indices(rank) for rank in range(dp_size)])

