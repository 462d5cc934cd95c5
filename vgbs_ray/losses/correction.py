"""Importance weights for the engine/trainer mismatch (`CorrectionConfig`): TIS, MIS, IcePop.

    correction_weights(config, inputs) -> (weights [R], metrics {name: [R]})

rho = pi_prox / pi_behave per token (`level=token`), or the geometric mean of rho over the token's whole
rollout (`level=rollout`: exp of `LossInputs.rollout_log_ratio`, one weight per rollout). The weights are
constants (no gradient): they change which distribution the loss estimates, not what it differentiates.
"""

from __future__ import annotations

import torch

from vgbs_ray.losses.api import LossInputs
from vgbs_ray.losses.config import CorrectionConfig


def correction_weights(config: CorrectionConfig, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weights of `config.kind` and their metrics (`correction_weight`, and the share of tokens
    `correction_truncated` (tis) or `correction_masked` (mis, icepop))."""
    if config.level == "rollout":
        log_rho = inputs.rollout_log_ratio
    else:
        log_rho = inputs.proximal_log_probs - inputs.behaviour_log_probs
    rho = torch.exp(log_rho.detach())
    low = 0.0 if config.low is None else config.low
    inside = (rho >= low) & (rho <= config.high)
    outside = (~inside).to(rho.dtype)
    if config.kind == "tis":
        weights = rho.clamp(min=low, max=config.high)
        return weights, {"correction_weight": weights, "correction_truncated": outside}
    weights = torch.where(inside, rho, torch.zeros_like(rho))  # mis and icepop: the same mask, icepop two-sided
    return weights, {"correction_weight": weights, "correction_masked": outside}
