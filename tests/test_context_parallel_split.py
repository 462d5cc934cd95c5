"""vgbs_ray.layout.context_parallel: a micro-batch split over context-parallel ranks loses and repeats nothing.

CP attention itself needs a GPU (benchmarks/gpu_check.sh); here the split is checked with
logits that are a fixed function of the padded position, so each rank's share of the loss can
be computed from its own rows, exactly as the last pipeline stage of a CP rank would.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.train_support import make_samples
from vgbs_ray.layout.context_parallel import local_padded_indices, split_for_context_parallel
from vgbs_ray.metrics import reduce_metric_pairs
from vgbs_ray.layout.microbatch import pack_micro_batch
from vgbs_ray.losses.reduction import micro_batch_policy_loss
from vgbs_ray.layout.shard import single_micro_batch_shard

VOCAB = 128


def _micro_batch(seed: int):
    shard = single_micro_batch_shard(make_samples(seed, 5, max_len=37))
    return pack_micro_batch(shard, list(range(shard.num_samples)))


@pytest.mark.parametrize("cp_size", [2, 4])
def test_every_token_held_once_and_every_response_token_scored_once(cp_size):
    mb = _micro_batch(50 + cp_size)
    lengths = np.diff(mb.cu_seqlens.numpy())
    held = np.concatenate([local_padded_indices(lengths, r, cp_size) for r in range(cp_size)])
    padded_total = int(sum(-(-n // (2 * cp_size)) * 2 * cp_size for n in lengths))
    assert sorted(held.tolist()) == list(range(padded_total))  # a partition of the padded row
    parts = [split_for_context_parallel(mb, r, cp_size) for r in range(cp_size)]
    assert {p.num_tokens for p in parts} == {padded_total // cp_size}  # balanced
    assert sum(int(p.response_lengths.sum()) for p in parts) == int(mb.response_lengths.sum())
    scored = torch.cat([p.targets[0][p.response_logit_index] for p in parts])
    original = mb.targets[0][mb.response_logit_index]
    assert sorted(scored.tolist()) == sorted(original.tolist())
    for p in parts:  # every rank sees whole sequences' boundaries (padded) for TE and RoPE
        assert int(p.cu_seqlens[-1]) == padded_total and p.max_seqlen % (2 * cp_size) == 0


@pytest.mark.parametrize("cp_size", [2, 3])
def test_the_ranks_losses_and_metrics_sum_to_the_unsplit_ones(cp_size):
    mb = _micro_batch(60 + cp_size)
    lengths = np.diff(mb.cu_seqlens.numpy())
    padded = -(-lengths // (2 * cp_size)) * 2 * cp_size
    starts = np.concatenate([[0], np.cumsum(padded)])
    table = torch.randn(int(starts[-1]), VOCAB, generator=torch.Generator().manual_seed(cp_size), dtype=torch.float64)
    to_padded = np.arange(int(lengths.sum())) + np.repeat(starts[:-1] - np.concatenate([[0], np.cumsum(lengths)])[:-1],
                                                          lengths)

    def log_probs(part, rows):
        scores = torch.log_softmax(rows, dim=-1)
        return scores[part.response_logit_index, part.targets[0][part.response_logit_index]]

    full_loss, full_pairs = micro_batch_policy_loss(log_probs(mb, table[to_padded]), mb.old_log_probs, mb,
                                                    num_rollouts=5, clip_eps=0.2)
    losses, pairs = [], []
    for r in range(cp_size):
        part = split_for_context_parallel(mb, r, cp_size)
        rows = table[local_padded_indices(lengths, r, cp_size)]
        loss, part_pairs = micro_batch_policy_loss(log_probs(part, rows), part.old_log_probs, part,
                                                   num_rollouts=5, clip_eps=0.2)
        losses.append(loss)
        pairs.append(part_pairs)
    assert float(sum(losses)) == pytest.approx(float(full_loss), rel=1e-9)
    summed = reduce_metric_pairs(pairs)
    for name, pair in full_pairs.items():
        assert summed[name] == pytest.approx(pair, rel=1e-9, abs=1e-12), name


def test_cp_size_one_is_the_micro_batch_itself_and_a_bad_rank_is_refused():
    mb = _micro_batch(70)
    assert split_for_context_parallel(mb, 0, 1) is mb
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\)"):
        split_for_context_parallel(mb, 2, 2)
