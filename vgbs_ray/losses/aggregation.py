"""How token terms become the step loss: per-sample denominators and one step divisor.

    step loss = sum over samples s of  sum_t(term_t * mask_t) / denominator_s  /  divisor

Both come from counts made once on the rollout side over the *whole* step (`vgbs_ray.losses.normalisers`), so
the sum of every micro-batch's share over every DP, CP and PP rank is the same number whatever the split:
the reduction is exact by construction, with no collective beyond the gradients' own.

    mode                 denominator_s                      divisor          what it is
    rollout_token_mean   mask tokens of s's whole rollout   rollouts         mean over rollouts of each rollout's token mean (default)
    sample_token_mean    mask tokens of s                   samples          mean over samples of each sample's token mean
    step_token_mean      1                                  step mask tokens token mean over the whole step (DAPO's token-level sum)
    prompt_token_mean    mask tokens of s's prompt group    groups           mean over prompts of each group's token mean
    rollout_token_sum    a constant C                       rollouts         mean over rollouts of token sum / C (Dr. GRPO)

A zero denominator (a rollout with no trained token) counts as 1: its numerator is 0 too.
"""

from __future__ import annotations

import torch

from vgbs_ray.layout.microbatch import PackedMicroBatch


def sample_denominators(aggregation: str, micro_batch: PackedMicroBatch,
                        constant_tokens: int | None = None) -> tuple[torch.Tensor, float]:
    """([num_samples] float64 denominators, the step divisor) of `aggregation` for `micro_batch`."""
    mb, totals = micro_batch, micro_batch.step_totals
    if totals is None:
        raise ValueError("a micro-batch without step totals (a padding micro-batch) has nothing to aggregate")
    if aggregation == "rollout_token_mean":
        return mb.rollout_mask_sums.to(torch.float64), float(totals.num_rollouts)
    if aggregation == "sample_token_mean":
        return mb.sample_mask_sums.to(torch.float64), float(totals.num_samples)
    if aggregation == "step_token_mean":
        return torch.ones(mb.num_samples, dtype=torch.float64), float(max(totals.mask_tokens, 1))
    if aggregation == "prompt_token_mean":
        return mb.group_mask_sums.to(torch.float64), float(totals.num_groups)
    if aggregation == "rollout_token_sum":
        return torch.full((mb.num_samples,), float(constant_tokens), dtype=torch.float64), float(totals.num_rollouts)
    raise ValueError(f"unknown aggregation {aggregation!r}")
