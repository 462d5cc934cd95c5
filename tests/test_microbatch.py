"""Pure pieces of the train step: packed micro-batches, the per-rollout loss, the LR schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.train_support import layout_shards, make_samples
from vgbs_ray.errors import ConfigError
from vgbs_ray.lr_schedule import LRScheduleConfig, lr_at
from vgbs_ray.layout.microbatch import pack_micro_batch
from vgbs_ray.losses.reduction import micro_batch_policy_loss, undo_averaging_factor
from vgbs_ray.sample import make_rollout
from vgbs_ray.layout.shard import single_micro_batch_shard


def _shards(samples, dp_size=2, max_tokens=120, balance="tokens"):
    return layout_shards(samples, dp_size=dp_size, max_tokens=max_tokens, balance=balance)


def test_packed_micro_batch_tokens_positions_and_scoring():
    samples = make_samples(0, 6)
    shard = _shards(samples)[1]
    for positions in shard.micro_batch_indices:
        mb = pack_micro_batch(shard, positions)
        offsets = shard.token_offsets()
        expected = np.concatenate([shard.token_ids[offsets[p]:offsets[p + 1]] for p in positions])
        assert mb.tokens[0].tolist() == expected.tolist()
        lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
        assert lengths == shard.total_lengths[positions].tolist() and sum(lengths) == mb.num_tokens
        for start, length in zip(mb.cu_seqlens[:-1].tolist(), lengths):  # positions restart per sequence
            assert mb.position_ids[0, start:start + length].tolist() == list(range(length))
        # each response token is the target of its scoring logit, and the targets are the next tokens
        scored = mb.targets[0][mb.response_logit_index]
        roffs = shard.response_offsets()
        response_tokens = np.concatenate([shard.token_ids[offsets[p + 1] - shard.response_lengths[p]:offsets[p + 1]]
                                          for p in positions])
        assert scored.tolist() == response_tokens.tolist()
        assert mb.loss_weight.tolist() == np.concatenate([shard.loss_mask[roffs[p]:roffs[p + 1]]
                                                          for p in positions]).tolist()
        assert mb.rollout_mask_sums.tolist() == shard.rollout_mask_sums[positions].tolist()


def test_response_without_prompt_token_is_not_scored():
    samples = make_rollout("a", [dict(tokens=np.arange(5), response_length=5, loss_mask=np.ones(5, np.int8))],
                           reward=1.0, advantage=1.0)
    shard = single_micro_batch_shard(samples)
    mb = pack_micro_batch(shard, [0])
    assert mb.loss_weight.tolist() == [0, 1, 1, 1, 1]  # the first token has no logits before it
    assert mb.rollout_mask_sums.tolist() == [5]  # the denominator stays the rollout total


def _loss_with(log_probs_fn, shard, num_rollouts):
    total = 0.0
    pairs_total = {}
    for positions in shard.micro_batch_indices:
        mb = pack_micro_batch(shard, positions)
        new = log_probs_fn(mb)
        loss, pairs = micro_batch_policy_loss(new, mb.old_log_probs, mb, num_rollouts=num_rollouts, clip_eps=0.2)
        total += float(loss)
        for k, (s, c) in pairs.items():
            ps, pc = pairs_total.get(k, (0.0, 0.0))
            pairs_total[k] = (ps + s, pc + c)
    return total, pairs_total


def test_loss_is_mean_over_rollouts_of_token_means_across_ranks():
    samples = make_samples(1, 7)
    # Deterministic "new" log-probs: old + a token-dependent shift, so ratios vary and some clip.
    def new_log_probs(mb):
        return mb.old_log_probs + 0.3 * torch.sin(mb.tokens[0][mb.response_logit_index + 1].double()).float()

    shards = _shards(samples, dp_size=2, max_tokens=90)
    total, pairs = 0.0, {}
    for shard in shards:
        t, p = _loss_with(new_log_probs, shard, shard.num_rollouts)
        total += t
        for k, (s, c) in p.items():
            pairs[k] = (pairs.get(k, (0.0, 0.0))[0] + s, pairs.get(k, (0.0, 0.0))[1] + c)
    # Naive: per rollout, token-weighted mean of the clipped loss; then the mean over rollouts.
    per_rollout = {}
    for s in samples:
        old = s.rollout_log_probs.astype(np.float64)
        resp = s.tokens[s.total_length - s.response_length:]
        new = old + 0.3 * np.sin(resp.astype(np.float64))
        ratio = np.exp(new - old)
        losses = -np.minimum(ratio * s.advantage, np.clip(ratio, 0.8, 1.2) * s.advantage)
        t, c = per_rollout.get(s.rollout_id, (0.0, 0.0))
        per_rollout[s.rollout_id] = (t + float((losses * s.loss_mask).sum()), c + float(s.loss_mask.sum()))
    expected = np.mean([t / max(c, 1) for t, c in per_rollout.values()])
    assert total == pytest.approx(expected, rel=1e-5)
    assert pairs["loss"][1] == pytest.approx(len(per_rollout))  # shares add up to the rollouts
    assert pairs["loss"][0] / pairs["loss"][1] == pytest.approx(expected, rel=1e-5)
    assert pairs["reward"][0] / pairs["reward"][1] == pytest.approx(
        np.mean([next(s.reward for s in samples if s.rollout_id == r) for r in per_rollout]), rel=1e-6)
    assert 0 < pairs["clip_fraction"][0] < pairs["clip_fraction"][1]  # some tokens clip, not all


def test_undo_averaging_factor():
    assert undo_averaging_factor(dp_size=4, num_microbatches=3, grads_averaged_over_dp=True,
                                 loss_averaged_over_microbatches=True) == 12
    assert undo_averaging_factor(dp_size=4, num_microbatches=3, grads_averaged_over_dp=False,
                                 loss_averaged_over_microbatches=False) == 1


def test_lr_schedule_counts_rollouts():
    config = LRScheduleConfig(lr=1.0, min_lr=0.1, warmup_rollouts=24, decay_rollouts=64, style="linear")
    assert lr_at(config, 8) == pytest.approx(8 / 24)
    assert lr_at(config, 24) == pytest.approx(1.0)
    assert lr_at(config, 44) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(config, 1000) == pytest.approx(0.1)
    cosine = LRScheduleConfig(lr=1.0, decay_rollouts=10, style="cosine")
    assert lr_at(cosine, 5) == pytest.approx(0.5)
    assert lr_at(LRScheduleConfig(lr=0.3), 12345) == 0.3
    with pytest.raises(ConfigError, match="decay_rollouts"):
        LRScheduleConfig(style="linear")
