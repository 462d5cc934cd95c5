"""Per-rollout loss accounting.

A rollout that produced N samples must weigh as much as one that produced 1. Each sample
carries the loss-mask token total of its *whole* rollout (`rollout_mask_sums`), computed
once on the rollout side, and contributes

    sum_t(x_t * mask_t) / max(rollout_mask_sum, 1)

Summed over siblings wherever they landed (micro-batches, DP or CP ranks), the existing
gradient all-reduce rebuilds exactly one token-weighted mean per rollout; dividing the
step's total by num_rollouts gives the mean over rollouts. With one sample per rollout this
is the classic per-sample token mean.

Layout of flat tensors: per-token values and masks are the response tokens of every sample
concatenated in sample order (lengths `response_lengths`).
"""

from __future__ import annotations

import torch

from vgbs_ray.losses.normalisers import rollout_mask_sums  # noqa: F401 - re-exported: the loss's denominators


def per_sample_masked_sums(values: torch.Tensor, response_lengths: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum_t(x_t * mask_t) for each sample; `values` and `loss_mask` are flat over response tokens."""
    lengths = torch.as_tensor(response_lengths, dtype=torch.long, device=values.device)
    sample_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
    sums = torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device)
    return sums.index_add(0, sample_of_token, values * loss_mask.to(values.dtype))


def sum_of_sample_contributions(
    values: torch.Tensor,
    response_lengths: torch.Tensor,
    loss_mask: torch.Tensor,
    denominators: torch.Tensor,
) -> torch.Tensor:
    """Sum over samples of sum_t(x_t * mask_t) / max(denominator, 1) (a scalar, differentiable).

    With denominators = rollout_mask_sums the result, summed over all micro-batches and
    ranks of a step, is the sum over rollouts of each rollout's token-weighted mean.
    """
    sums = per_sample_masked_sums(values, response_lengths, loss_mask)
    denominators = torch.as_tensor(denominators, device=values.device).to(values.dtype).clamp(min=1)
    return (sums / denominators).sum()


def token_advantages(advantages: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sample to each of its response tokens (flat)."""
    lengths = torch.as_tensor(response_lengths, dtype=torch.long, device=advantages.device)
    return torch.repeat_interleave(advantages, lengths)


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (flat tensors); returns (token losses, clipped 0/1 per token).

    loss_t = -min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t) with r_t = exp(logp - old_logp).
    """
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    losses = -torch.minimum(unclipped, clipped)
    return losses, (clipped < unclipped).to(log_probs.dtype)
