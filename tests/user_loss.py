"""A policy loss as a user writes one, outside the package (tests/test_job_end_to_end.py trains with it by
import path: `train.loss.policy=tests.user_loss:make_loss`). Only the public API: vgbs_ray.losses."""

from __future__ import annotations

import torch

from vgbs_ray.losses import LossInputs, LossOutput, PolicyLoss


def make_loss(clip_eps: float = 0.2, temperature: float = 1.0) -> PolicyLoss:
    """PPO-clip with a temperature on the ratio's log, and the share of tokens whose ratio moved up."""
    def compute(inputs: LossInputs) -> LossOutput:
        ratio = torch.exp((inputs.log_probs - inputs.old_log_probs) / temperature)
        advantages = inputs.advantages
        terms = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
        return LossOutput(terms, {"ratio_above_one": (ratio > 1).to(ratio.dtype)})

    return PolicyLoss(name="user_ppo", compute=compute, aggregation="sample_token_mean")
