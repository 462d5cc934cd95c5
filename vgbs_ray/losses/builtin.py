"""The built-in policy losses, each a factory returning a `PolicyLoss` (the same API a user's loss uses).

Every loss here returns per-token terms; the aggregation (how token terms become the step loss) is
the project's, named by `PolicyLoss.aggregation` (docs/losses.md has the formulas and citations).
r_t = exp(log pi(t) - log pi_old(t)) with pi_old the loss's anchor; A_t the token's advantage.

    ppo            -min(r A, clip(r, 1-eps, 1+eps_high) A), optional dual clip      rollout_token_mean
    decoupled_ppo  ppo against the proximal policy, times min(pi_prox/pi_behave, C)  rollout_token_mean
    gspo           ppo on the sequence ratio s = exp(mean log r) over the rollout     rollout_token_mean
                   (level=rollout: every sample of it) or the sample (level=sample)  (sample_token_mean)
    cispo          -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi                       step_token_mean
    dr_grpo        ppo, each rollout's token sum / a constant, mean-centred A        rollout_token_sum
    dapo           ppo with clip-higher (eps_low 0.2, eps_high 0.28)                  step_token_mean
"""

from __future__ import annotations

import torch

from vgbs_ray.errors import ConfigError
from vgbs_ray.losses.api import ANCHORS, SEQUENCE_LEVELS, LossInputs, LossOutput, PolicyLoss


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, *, eps_low: float, eps_high: float,
                      dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token, as a loss: -min(r A, clip(r, 1-eps_low, 1+eps_high) A).

    With `dual_clip` c > 1, a negative-advantage token's loss is also capped at -c A (Ye et al. 2020):
    an unbounded ratio cannot push one token's loss without limit. Metrics: `clip_fraction` (the clipped
    branch is the smaller one), and `dual_clip_fraction` with a dual clip.
    """
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    losses = -torch.minimum(unclipped, clipped)
    metrics = {"clip_fraction": (clipped < unclipped).to(ratio.dtype)}
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (losses > cap)
        losses = torch.where(dual, cap, losses)
        metrics["dual_clip_fraction"] = dual.to(ratio.dtype)
    return losses, metrics


def _check_clip(name: str, **bounds) -> None:
    for key, value in bounds.items():
        if value is not None and not 0 < value < 1:
            raise ConfigError(f"train.loss.policy={name!r}: policy_kwargs.{key} must be in (0, 1), got {value}")


def _check_anchor(name: str, anchor: str) -> None:
    if anchor not in ANCHORS:
        raise ConfigError(f"train.loss.policy={name!r}: policy_kwargs.anchor={anchor!r} is unknown; pick one of {ANCHORS}")


def _ppo_like(name: str, *, clip_eps: float, clip_eps_high: float | None, dual_clip: float | None, anchor: str,
              aggregation: str, **declared) -> PolicyLoss:
    _check_clip(name, clip_eps=clip_eps, clip_eps_high=clip_eps_high)
    _check_anchor(name, anchor)
    if dual_clip is not None and not dual_clip > 1:
        raise ConfigError(f"train.loss.policy={name!r}: policy_kwargs.dual_clip must be > 1 or null, got {dual_clip}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    def compute(inputs: LossInputs) -> LossOutput:
        ratio = torch.exp(inputs.log_probs - inputs.old_log_probs)
        losses, metrics = clipped_surrogate(ratio, inputs.advantages, eps_low=clip_eps, eps_high=eps_high,
                                            dual_clip=dual_clip)
        return LossOutput(losses, metrics)

    return PolicyLoss(name=name, compute=compute, anchor=anchor, aggregation=aggregation, **declared)


def ppo(clip_eps: float = 0.2, clip_eps_high: float | None = None, dual_clip: float | None = None,
        anchor: str = "behaviour") -> PolicyLoss:
    """PPO-clip per token (Schulman et al. 2017); `clip_eps_high` clips the upper side apart (DAPO's
    clip-higher), `dual_clip` caps negative-advantage losses. Anchored on the behaviour policy it is exact
    on-policy and uncorrected off-policy (staleness > 0 needs a correction or an explicit opt-in)."""
    return _ppo_like("ppo", clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip, anchor=anchor,
                     aggregation="rollout_token_mean")


def decoupled_ppo(clip_eps: float = 0.2, is_weight_cap: float = 2.0) -> PolicyLoss:
    """Decoupled PPO (Hilton et al. 2022; AReaL): the ratio pi / pi_prox is clipped against the step-start
    (proximal) policy, and each token's term is weighted by w = min(pi_prox / pi_behave, C), a constant
    (no gradient). Clipping bounds each update around the weights it starts from however old the behaviour
    policy; the truncated weight corrects the sampling distribution."""
    _check_clip("decoupled_ppo", clip_eps=clip_eps)
    if not is_weight_cap >= 1:
        raise ConfigError(f"train.loss.policy='decoupled_ppo': policy_kwargs.is_weight_cap must be >= 1 (a cap "
                          f"below 1 down-weights on-policy tokens), got {is_weight_cap}")

    def compute(inputs: LossInputs) -> LossOutput:
        ratio = torch.exp(inputs.log_probs - inputs.proximal_log_probs)
        losses, metrics = clipped_surrogate(ratio, inputs.advantages, eps_low=clip_eps, eps_high=clip_eps)
        raw = torch.exp(inputs.proximal_log_probs - inputs.behaviour_log_probs)
        weights = raw.clamp(max=is_weight_cap)
        metrics.update(is_weight=weights, is_truncated=(raw > is_weight_cap).to(ratio.dtype))
        return LossOutput(losses * weights, metrics)

    return PolicyLoss(name="decoupled_ppo", compute=compute, anchor="proximal", needs_behaviour_log_probs=True,
                      corrects_staleness=True)


def gspo(clip_eps: float = 3e-4, clip_eps_high: float = 4e-4, level: str = "rollout",
         anchor: str = "behaviour") -> PolicyLoss:
    """GSPO (Zheng et al. 2025): PPO's clip on the sequence ratio s = exp(mean_t log r_t), the geometric mean
    of the token ratios. `level=rollout` takes the mean over every masked token of the whole rollout, all its
    samples wherever they train (the trainer's pre-pass forms it, `LossInputs.rollout_log_ratio`), and
    aggregates rollout_token_mean: one clipped term per rollout. `level=sample` is the per-sample variant
    (sample_token_mean). Token form: s_t = sg(s) * pi(t) / sg(pi(t)) has the value s and the gradient
    s * grad log pi(t), so the token mean over the rollout has exactly GSPO's gradient."""
    _check_clip("gspo", clip_eps=clip_eps, clip_eps_high=clip_eps_high)
    _check_anchor("gspo", anchor)
    if level not in SEQUENCE_LEVELS:
        raise ConfigError(f"train.loss.policy='gspo': policy_kwargs.level={level!r} is unknown; pick one of "
                          f"{SEQUENCE_LEVELS}")

    def compute(inputs: LossInputs) -> LossOutput:
        # log pi_step_start - log pi_old, averaged over the sequence: 0 when the anchor is the step start.
        sequence = inputs.rollout_log_ratio if level == "rollout" else inputs.sample_log_ratio
        if anchor == "proximal" or sequence is None:
            sequence = torch.zeros_like(inputs.log_probs)
        ratio = torch.exp(sequence + inputs.log_probs - inputs.log_probs.detach())
        losses, metrics = clipped_surrogate(ratio, inputs.advantages, eps_low=clip_eps, eps_high=clip_eps_high)
        metrics["sequence_ratio"] = ratio.detach()
        return LossOutput(losses, metrics)

    return PolicyLoss(name=f"gspo_{level}", compute=compute, anchor=anchor, sequence_log_ratio=level,
                      aggregation="rollout_token_mean" if level == "rollout" else "sample_token_mean")


def cispo(clip_eps_low: float | None = None, clip_eps_high: float = 0.28) -> PolicyLoss:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi per token, r against the
    behaviour policy: every token keeps a gradient (none is clipped away), its IS weight is truncated.
    eps_low None: no lower bound (the paper's setting). Token-level aggregation over the step."""
    _check_clip("cispo", clip_eps_low=clip_eps_low)
    if not clip_eps_high > 0:
        raise ConfigError(f"train.loss.policy='cispo': policy_kwargs.clip_eps_high must be > 0, got {clip_eps_high}")
    low = 0.0 if clip_eps_low is None else 1.0 - clip_eps_low

    def compute(inputs: LossInputs) -> LossOutput:
        ratio = torch.exp(inputs.log_probs.detach() - inputs.old_log_probs)
        weights = ratio.clamp(min=low, max=1.0 + clip_eps_high)
        truncated = ((ratio > 1.0 + clip_eps_high) | (ratio < low)).to(ratio.dtype)
        losses = -weights * inputs.advantages * inputs.log_probs
        return LossOutput(losses, {"is_weight": weights, "clip_fraction": truncated})

    return PolicyLoss(name="cispo", compute=compute, aggregation="step_token_mean", corrects_staleness=True)


def dr_grpo(max_response_tokens: int | None = None, clip_eps: float = 0.2, anchor: str = "behaviour") -> PolicyLoss:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): PPO-clip terms, each rollout's
    token sum divided by one constant (the generation budget) instead of its length, and group advantages
    only mean-centred (no std division: the job sets scheduler.intake.advantage_std=false)."""
    if isinstance(max_response_tokens, bool) or not isinstance(max_response_tokens, int) or max_response_tokens <= 0:
        raise ConfigError("train.loss.policy='dr_grpo' divides each rollout's token sum by the generation budget: "
                          "set policy_kwargs.max_response_tokens to an int > 0 (e.g. rollout.sampling.max_tokens), "
                          f"got {max_response_tokens!r}")
    return _ppo_like("dr_grpo", clip_eps=clip_eps, clip_eps_high=None, dual_clip=None, anchor=anchor,
                     aggregation="rollout_token_sum", constant_tokens=max_response_tokens,
                     scale_advantages_by_std=False)


def dapo(clip_eps_low: float = 0.2, clip_eps_high: float = 0.28, anchor: str = "behaviour") -> PolicyLoss:
    """DAPO's loss (Yu et al. 2025): PPO-clip with clip-higher (a wider upper bound keeps exploration) and
    the token-level sum over the whole step divided by its token count (long responses weigh per token)."""
    return _ppo_like("dapo", clip_eps=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip=None, anchor=anchor,
                     aggregation="step_token_mean")
