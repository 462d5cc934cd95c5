"""The per-rollout PPO loss of one micro-batch, and its (sum, count) metrics.

    micro_batch_policy_loss(log_probs, old_log_probs, micro_batch, num_rollouts, clip_eps)
        -> (loss to backpropagate, metric pairs)
    micro_batch_loss(config, log_probs, micro_batch, num_rollouts, behaviour_log_probs, proximal_log_probs)
        -> the same, with the off-policy choice of `OffPolicyConfig` (ppo or decoupled PPO)

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
  is_weight, is_truncated, log_prob_mismatch   per response token (`micro_batch_loss` only):
                 the importance weight, the share of weights cut at the cap, and
                 |log pi_prox - log pi_behave| (the train/inference mismatch; count 0 when
                 either side is missing).

Off-policy correction changes numerators only: decoupled PPO multiplies each token's term
by its importance weight, while the denominators (`rollout_mask_sums`) and the division by
`num_rollouts` stay exactly those of the on-policy loss (not a self-normalised mean).
"""

from __future__ import annotations

import torch

from vgbs_ray.loss import clipped_policy_loss, per_sample_masked_sums, sum_of_sample_contributions, token_advantages
from vgbs_ray.metrics import MetricPairs, add_metric
from vgbs_ray.microbatch import PackedMicroBatch
from vgbs_ray.off_policy import OffPolicyConfig

METRIC_NAMES = ("loss", "reward", "clip_fraction", "ratio", "approx_kl")
"""Every metric a micro-batch reports, in a fixed order (ranks all-reduce them as one vector)."""
OFF_POLICY_METRIC_NAMES = METRIC_NAMES + ("is_weight", "is_truncated", "log_prob_mismatch")
"""Every metric `micro_batch_loss` reports, in a fixed order."""


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
        pairs = _accounting_metrics(mb, total, weight, response_lengths, mask_sums, clipped,
                                    (log_probs - old_log_probs).detach(), device)
    return loss, pairs


def decoupled_ppo_token_losses(
    log_probs: torch.Tensor,
    proximal_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float,
    is_weight_cap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoupled PPO per token (flat tensors): (token losses, clipped 0/1, IS weights, truncated 0/1).

    loss_t = w_t * ppo_t, with ppo_t the clipped surrogate of r_t = pi / pi_prox and
    w_t = min(pi_prox / pi_behave, C), a constant (no gradient flows through it). Clipping
    against the proximal policy bounds each update around the weights it starts from, however
    old the behaviour policy; the weight corrects the sampling distribution, truncated at C
    so one unlikely token cannot dominate.
    """
    proximal_log_probs = proximal_log_probs.detach()
    losses, clipped = clipped_policy_loss(log_probs, proximal_log_probs, advantages, clip_eps)
    raw = torch.exp(proximal_log_probs - behaviour_log_probs.detach())
    weights = raw.clamp(max=is_weight_cap)
    return losses * weights, clipped, weights, (raw > is_weight_cap).to(log_probs.dtype)


def micro_batch_loss(
    config: OffPolicyConfig,
    log_probs: torch.Tensor,
    micro_batch: PackedMicroBatch,
    *,
    num_rollouts: int,
    behaviour_log_probs: torch.Tensor | None,
    proximal_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MetricPairs]:
    """The micro-batch's share of the step loss under `config.policy_loss`, and its metric pairs.

    All tensors are flat over the micro-batch's response tokens. `behaviour_log_probs`: the
    engine's log-probs at sampling time (the shard's `rollout_log_probs`); `proximal_log_probs`:
    the policy at step start (before any update of this step): a no-grad forward pass, or, when
    this forward runs on the step-start weights (one update per step), `log_probs.detach()`.
      ppo            old = behaviour (or proximal when behaviour is None); returns exactly
                     what `micro_batch_policy_loss` returns, plus the extra metrics.
      decoupled_ppo  needs both (`config.needs_proximal_log_probs`); see
                     `decoupled_ppo_token_losses`.
    Denominators and the division by `num_rollouts` are the same in both (numerators only).
    """
    if num_rollouts <= 0:
        raise ValueError(f"num_rollouts must be > 0, got {num_rollouts}")
    mb = micro_batch
    device, dtype = log_probs.device, log_probs.dtype

    def flat(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values.to(device=device, dtype=dtype).detach()

    behaviour, proximal = flat(behaviour_log_probs), flat(proximal_log_probs)
    response_lengths = mb.response_lengths.to(device)
    mask_sums = mb.rollout_mask_sums.to(device)
    weight = mb.loss_weight.to(device=device, dtype=dtype)
    advantages = token_advantages(mb.advantages.to(device=device, dtype=dtype), response_lengths)
    if config.policy_loss == "decoupled_ppo":
        if behaviour is None or proximal is None:
            missing = "behaviour log-probs (the samples' rollout_log_probs)" if behaviour is None \
                else "proximal log-probs (a forward pass at step start)"
            raise ValueError(f"policy_loss='decoupled_ppo' needs {missing} for the micro-batch of shard "
                             f"positions {mb.positions.tolist()}; producers must send rollout_log_probs")
        anchor = proximal
        token_losses, clipped, is_weights, truncated = decoupled_ppo_token_losses(
            log_probs, proximal, behaviour, advantages, clip_eps=config.clip_eps, is_weight_cap=config.is_weight_cap)
    else:
        anchor = behaviour if behaviour is not None else proximal
        if anchor is None:
            raise ValueError("policy_loss='ppo' needs behaviour or proximal log-probs as the old policy")
        token_losses, clipped = clipped_policy_loss(log_probs, anchor, advantages, config.clip_eps)
        is_weights, truncated = torch.ones_like(token_losses), torch.zeros_like(token_losses)
    total = sum_of_sample_contributions(token_losses, response_lengths, weight, mask_sums)
    loss = total / num_rollouts

    with torch.no_grad():
        pairs = _accounting_metrics(mb, total, weight, response_lengths, mask_sums, clipped,
                                    (log_probs - anchor).detach(), device)
        token_count = float(weight.sum())
        add_metric(pairs, "is_weight", float((is_weights * weight).sum()), token_count)
        add_metric(pairs, "is_truncated", float((truncated * weight).sum()), token_count)
        if behaviour is not None and proximal is not None:
            add_metric(pairs, "log_prob_mismatch", float(((proximal - behaviour).abs() * weight).sum()), token_count)
        else:
            add_metric(pairs, "log_prob_mismatch", 0.0, 0.0)
    return loss, pairs


def _accounting_metrics(mb: PackedMicroBatch, total: torch.Tensor, weight: torch.Tensor, response_lengths,
                        mask_sums, clipped: torch.Tensor, log_ratio: torch.Tensor, device) -> MetricPairs:
    """The `METRIC_NAMES` pairs (see module docstring), exactly as `micro_batch_policy_loss` reports them."""
    weight64 = weight.to(torch.float64)
    shares = per_sample_masked_sums(torch.ones_like(weight64), response_lengths, weight64) \
        / mask_sums.to(torch.float64).clamp(min=1)
    pairs: MetricPairs = {}
    add_metric(pairs, "loss", float(total), float(shares.sum()))
    add_metric(pairs, "reward", float((mb.rewards.to(device, torch.float64) * shares).sum()), float(shares.sum()))
    token_count = float(weight.sum())
    add_metric(pairs, "clip_fraction", float((clipped * weight).sum()), token_count)
    add_metric(pairs, "ratio", float((torch.exp(log_ratio) * weight).sum()), token_count)
    add_metric(pairs, "approx_kl", float((-log_ratio * weight).sum()), token_count)
    return pairs
