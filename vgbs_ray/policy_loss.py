"""The per-rollout PPO loss of one micro-batch, and its (sum, count) metrics.

    micro_batch_policy_loss(log_probs, old_log_probs, micro_batch, num_rollouts, clip_eps)
        -> (loss to backpropagate, metric pairs)

The loss of a micro-batch is

    sum over its samples of  sum_t(ppo_t * w_t) / max(rollout_mask_sum, 1)   /  num_rollouts

with w_t the loss weight (mask) and `num_rollouts` the whole step's rollout count. Summed
over every micro-batch of every DP rank (gradient accumulation, then an all-reduce SUM of
gradients) this is the mean over the step's rollouts of each rollout's token-weighted mean,
whatever the DP size, the micro-batch split or the packing. A framework that *averages*
gradients over DP ranks or micro-batches must multiply back (`undo_averaging_factor`).

Metrics (pairs of sum and count, see `vgbs_ray.metrics`):
  loss, reward   per rollout: each sample adds its value times its *share* of its rollout
                 (its mask tokens / the rollout's), so the counts add up to the rollouts
                 over all ranks and the reduced value is a mean over rollouts.
  clip_fraction, ratio, approx_kl   per response token (mask-weighted).
"""

from __future__ import annotations

import torch

from vgbs_ray.loss import clipped_policy_loss, per_sample_masked_sums, sum_of_sample_contributions, token_advantages
from vgbs_ray.metrics import MetricPairs, add_metric
from vgbs_ray.microbatch import PackedMicroBatch

METRIC_NAMES = ("loss", "reward", "clip_fraction", "ratio", "approx_kl")
"""Every metric a micro-batch reports, in a fixed order (ranks all-reduce them as one vector)."""


def undo_averaging_factor(*, dp_size: int, num_microbatches: int, grads_averaged_over_dp: bool,
                          loss_averaged_over_microbatches: bool) -> float:
    """What to multiply the per-rollout loss by so a framework's averaging becomes a sum."""
    factor = 1.0
    if grads_averaged_over_dp:
        factor *= dp_size
    if loss_averaged_over_microbatches:
        factor *= num_microbatches
    return factor


def micro_batch_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    micro_batch: PackedMicroBatch,
    *,
    num_rollouts: int,
    clip_eps: float,
) -> tuple[torch.Tensor, MetricPairs]:
    """The micro-batch's share of the step loss (see module docstring) and its metric pairs.

    `log_probs` and `old_log_probs` are flat over the micro-batch's response tokens.
    """
    if num_rollouts <= 0:
        raise ValueError(f"num_rollouts must be > 0, got {num_rollouts}")
    mb = micro_batch
    device, dtype = log_probs.device, log_probs.dtype
    response_lengths = mb.response_lengths.to(device)
    mask_sums = mb.rollout_mask_sums.to(device)
    weight = mb.loss_weight.to(device=device, dtype=dtype)
    advantages = token_advantages(mb.advantages.to(device=device, dtype=dtype), response_lengths)
    old_log_probs = old_log_probs.to(device=device, dtype=dtype).detach()
    token_losses, clipped = clipped_policy_loss(log_probs, old_log_probs, advantages, clip_eps)
    total = sum_of_sample_contributions(token_losses, response_lengths, weight, mask_sums)
    loss = total / num_rollouts

    with torch.no_grad():
        weight64 = weight.to(torch.float64)
        shares = per_sample_masked_sums(torch.ones_like(weight64), response_lengths, weight64) \
            / mask_sums.to(torch.float64).clamp(min=1)
        log_ratio = (log_probs - old_log_probs).detach()
        pairs: MetricPairs = {}
        add_metric(pairs, "loss", float(total), float(shares.sum()))
        add_metric(pairs, "reward", float((mb.rewards.to(device, torch.float64) * shares).sum()), float(shares.sum()))
        token_count = float(weight.sum())
        add_metric(pairs, "clip_fraction", float((clipped * weight).sum()), token_count)
        add_metric(pairs, "ratio", float((torch.exp(log_ratio) * weight).sum()), token_count)
        add_metric(pairs, "approx_kl", float((-log_ratio * weight).sum()), token_count)
    return loss, pairs
