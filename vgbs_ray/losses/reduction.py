"""The project's reduction of a policy loss over one micro-batch, and its (sum, count) metrics.

    micro_batch_loss(loss, log_probs, micro_batch, behaviour_log_probs=, proximal_log_probs=, ...)
        -> (the micro-batch's share of the step loss, metric pairs)
    micro_batch_policy_loss(log_probs, old_log_probs, micro_batch, num_rollouts, clip_eps)
        -> the same for plain PPO at the default aggregation: the reference the tests hold the others to

`loss` is a `vgbs_ray.losses.loading.ResolvedLoss`: a policy loss (built-in or a user's, the
`vgbs_ray.losses` API) returns per-token terms; this module masks them, applies the importance
correction, and aggregates:

    share = sum over its samples s of  sum_t(term_t * mask_t) / denominator_s   /  divisor

with the aggregation's denominators and divisor (`vgbs_ray.losses.aggregation`; by default a
rollout's mask tokens over all its samples, and the step's rollouts). Every one is counted on the
rollout side over the whole step, so summed over every micro-batch of every DP rank (gradient
accumulation, then an all-reduce SUM of gradients) the shares are the step loss whatever the DP
size, the micro-batch split or the packing. A framework that *averages* gradients over DP ranks or
micro-batches must multiply back (`undo_averaging_factor`).

Metrics (pairs of sum and count, see `vgbs_ray.metrics`):
  loss, reward   per rollout: each sample adds its value times its *share* of its rollout
                 (its mask tokens / the rollout's), so the counts add up to the rollouts
                 over all ranks; the reduced `loss` is the step loss, `reward` a mean over rollouts.
  ratio, approx_kl, log_prob_mismatch   per trained token: pi / pi_old and its KL estimate against
                 the loss's anchor; |log pi_prox - log pi_behave| (count 0 without behaviour log-probs).
  the loss's own (`LossOutput.metrics`: clip_fraction, is_weight, ...) and the correction's
                 (correction_weight, correction_truncated / correction_masked), per trained token.

Importance weights change numerators only: the denominators and the divisor stay exactly the
aggregation's (not a self-normalised mean).
"""

from __future__ import annotations

import torch

from vgbs_ray.losses.accounting import clipped_policy_loss, per_sample_masked_sums, sum_of_sample_contributions, token_advantages
from vgbs_ray.losses.aggregation import sample_denominators
from vgbs_ray.losses.api import LossInputs
from vgbs_ray.losses.correction import correction_weights
from vgbs_ray.losses.loading import ResolvedLoss, check_loss_output
from vgbs_ray.metrics import MetricPairs, add_metric
from vgbs_ray.layout.microbatch import PackedMicroBatch

METRIC_NAMES = ("loss", "reward", "clip_fraction", "ratio", "approx_kl")
"""Every metric `micro_batch_policy_loss` reports."""


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
        pairs = _accounting_metrics(mb, total, weight, response_lengths, mask_sums,
                                    (log_probs - old_log_probs).detach(), device)
        add_metric(pairs, "clip_fraction", float((clipped * weight).sum()), float(weight.sum()))
    return loss, pairs


def micro_batch_loss(
    loss: ResolvedLoss,
    log_probs: torch.Tensor,
    micro_batch: PackedMicroBatch,
    *,
    behaviour_log_probs: torch.Tensor | None,
    proximal_log_probs: torch.Tensor | None = None,
    rollout_log_ratio: torch.Tensor | None = None,
    sample_log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MetricPairs]:
    """The micro-batch's share of the step loss under `loss` (policy, aggregation, correction), and its
    metric pairs.

    All tensors are flat over the micro-batch's response tokens. `behaviour_log_probs`: the engine's
    log-probs at sampling time (the shard's `rollout_log_probs`), or None; `proximal_log_probs`: the policy
    at step start (a no-grad forward pass, or, since a step takes one optimizer update, `log_probs.detach()`,
    the default). `rollout_log_ratio` / `sample_log_ratio`: per token, the mean of log pi_prox - log pi_behave
    over its whole rollout / sample, formed by the trainer's pre-pass across micro-batches and ranks; when
    not given they are formed from this micro-batch alone, which is refused for a rollout whose tokens are
    not all here (`loss.needs_rollout_log_ratio`).

    share = sum over samples s of sum_t(term_t * mask_t) / denominator_s / divisor   (`vgbs_ray.losses.aggregation`)
    """
    mb = micro_batch
    device, dtype = log_probs.device, log_probs.dtype

    def flat(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values.to(device=device, dtype=dtype).detach()

    behaviour = flat(behaviour_log_probs)
    proximal = log_probs.detach() if proximal_log_probs is None else flat(proximal_log_probs)
    if loss.needs_behaviour_log_probs and behaviour is None:
        raise ValueError(f"policy loss {loss.name!r} (correction {loss.correction.kind!r}) needs behaviour log-probs "
                         f"(the samples' rollout_log_probs) for the micro-batch of shard positions "
                         f"{mb.positions.tolist()}; producers must send rollout_log_probs")
    response_lengths = mb.response_lengths.to(device)
    sample_of_token = torch.repeat_interleave(torch.arange(mb.num_samples, device=device), response_lengths)
    weight = mb.loss_weight.to(device=device, dtype=dtype)
    if behaviour is not None:
        mismatch = (proximal - behaviour) * weight
        if sample_log_ratio is None:
            sample_log_ratio = _mean_by(mismatch, weight, sample_of_token, mb.num_samples)
        if rollout_log_ratio is None and loss.needs_rollout_log_ratio:
            rollout_log_ratio = _rollout_log_ratio_of_whole_rollouts(mb, mismatch, weight, sample_of_token)
    inputs = LossInputs(
        log_probs=log_probs,
        old_log_probs=behaviour if loss.policy.anchor == "behaviour" and behaviour is not None else proximal,
        proximal_log_probs=proximal, behaviour_log_probs=behaviour,
        advantages=token_advantages(mb.advantages.to(device=device, dtype=dtype), response_lengths),
        mask=weight, sample_of_token=sample_of_token,
        rollout_of_token=mb.rollout_indices.to(device)[sample_of_token],
        rollout_token_counts=mb.rollout_mask_sums.to(device)[sample_of_token], versions=None,
        rollout_log_ratio=flat(rollout_log_ratio), sample_log_ratio=flat(sample_log_ratio))
    output = loss.policy.compute(inputs)
    check_loss_output(output, weight.numel(), loss.name)
    token_losses, token_metrics = output.token_losses, dict(output.metrics)
    if loss.correction.enabled:
        weights, correction_metrics = correction_weights(loss.correction, inputs)
        token_losses = token_losses * weights
        token_metrics.update(correction_metrics)
    # A value on an untrained token never reaches the loss, even a non-finite one (0 * inf is nan).
    token_losses = torch.where(weight > 0, token_losses, torch.zeros_like(token_losses))
    denominators, divisor = sample_denominators(loss.policy.aggregation, mb, loss.policy.constant_tokens)
    total = sum_of_sample_contributions(token_losses, response_lengths, weight, denominators.to(device))
    share = total / divisor

    with torch.no_grad():
        # The `loss` pair counts rollout shares (they sum to num_rollouts over the step), so its value is the
        # step loss whatever the aggregation: sum of shares = total * num_rollouts / divisor over num_rollouts.
        scaled = total * (mb.step_totals.num_rollouts / divisor)
        pairs = _accounting_metrics(mb, scaled, weight, response_lengths, mb.rollout_mask_sums.to(device),
                                    (log_probs - inputs.old_log_probs).detach(), device)
        token_count = float(weight.sum())
        for name, values in token_metrics.items():
            add_metric(pairs, name, float((values.detach().to(dtype) * weight).sum()), token_count)
        if behaviour is not None:
            add_metric(pairs, "log_prob_mismatch", float(((proximal - behaviour).abs() * weight).sum()), token_count)
        else:
            add_metric(pairs, "log_prob_mismatch", 0.0, 0.0)
    return share, pairs


def _mean_by(values: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Per token, the weighted mean of `values` (already weighted) over the tokens sharing its `index`."""
    sums = torch.zeros(size, dtype=torch.float64, device=values.device).index_add(0, index, values.to(torch.float64))
    counts = torch.zeros(size, dtype=torch.float64, device=values.device).index_add(0, index, weight.to(torch.float64))
    return (sums / counts.clamp(min=1))[index].to(values.dtype)


def _rollout_log_ratio_of_whole_rollouts(mb: PackedMicroBatch, mismatch: torch.Tensor, weight: torch.Tensor,
                                         sample_of_token: torch.Tensor) -> torch.Tensor:
    """The rollout log-ratio from this micro-batch alone: exact only when it holds every trained token of each
    of its rollouts (its samples' mask sums add up to the rollouts' mask sums); refused otherwise."""
    rollouts = mb.rollout_indices.to(mismatch.device)
    local, inverse = torch.unique(rollouts, return_inverse=True)
    here = torch.zeros(local.numel(), dtype=torch.int64).index_add(0, inverse.cpu(), mb.sample_mask_sums)
    whole = torch.zeros(local.numel(), dtype=torch.int64).scatter(0, inverse.cpu(), mb.rollout_mask_sums)
    if not bool((here == whole).all()):
        missing = local[(here != whole).to(local.device)].tolist()
        raise ValueError(f"the rollout-level log-ratio of rollouts {missing} (step indices) needs their samples in other "
                         "micro-batches or ranks: the trainer's pre-pass must pass rollout_log_ratio")
    return _mean_by(mismatch, weight, inverse.to(mismatch.device)[sample_of_token], local.numel())


def _accounting_metrics(mb: PackedMicroBatch, total: torch.Tensor, weight: torch.Tensor, response_lengths,
                        mask_sums, log_ratio: torch.Tensor, device) -> MetricPairs:
    """The `METRIC_NAMES` pairs (see module docstring), exactly as `micro_batch_policy_loss` reports them."""
    weight64 = weight.to(torch.float64)
    shares = per_sample_masked_sums(torch.ones_like(weight64), response_lengths, weight64) \
        / mask_sums.to(torch.float64).clamp(min=1)
    pairs: MetricPairs = {}
    add_metric(pairs, "loss", float(total), float(shares.sum()))
    add_metric(pairs, "reward", float((mb.rewards.to(device, torch.float64) * shares).sum()), float(shares.sum()))
    token_count = float(weight.sum())
    add_metric(pairs, "ratio", float((torch.exp(log_ratio) * weight).sum()), token_count)
    add_metric(pairs, "approx_kl", float((-log_ratio * weight).sum()), token_count)
    return pairs
