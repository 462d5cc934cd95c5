"""The policy-loss interface: what a loss receives per micro-batch, what it returns, what it declares.

A loss is a `PolicyLoss`: a `compute(LossInputs) -> LossOutput` function plus the few facts the
trainer must know before the step (which old policy its ratio uses, how its token terms are
aggregated, whether it needs the rollout-level log-ratio pre-pass). The built-ins
(`vgbs_ray.losses.builtin`) and a user's loss (`train.loss.policy=my_pkg.losses:make_loss`) are
the same kind of object, so the reduction across micro-batches, DP, CP and PP ranks stays the
project's (`vgbs_ray.losses.reduction.micro_batch_loss`) and stays exact for both:

    step loss = sum over the step's samples s of  sum_t(token_loss_t * mask_t) / denominator_s  / divisor

with the denominators and the divisor of the aggregation (`vgbs_ray.losses.aggregation`), all
precomputed on the rollout side. A loss therefore returns *per-token* terms (a per-rollout or
per-sample term is the same value on each of its tokens: GSPO's sequence ratio is one) and never
divides by a count itself.

Units: every tensor of `LossInputs` and `LossOutput` is flat over the micro-batch's response
tokens (R of them, the samples' responses back to back), except where a docstring says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from vgbs_ray.errors import ConfigError

if TYPE_CHECKING:
    import torch

ANCHORS = ("behaviour", "proximal")
"""The old policy of a loss's ratio: the engine's sampling log-probs, or the step-start policy."""
AGGREGATIONS = ("rollout_token_mean", "sample_token_mean", "step_token_mean", "prompt_token_mean",
                "rollout_token_sum")
"""How token terms become the step loss (`vgbs_ray.losses.aggregation` defines each)."""
SEQUENCE_LEVELS = ("rollout", "sample")


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's response tokens, as a loss sees them ([R] tensors unless said otherwise)."""

    log_probs: "torch.Tensor"
    """The current policy's log-probs; the only input that carries a gradient."""
    old_log_probs: "torch.Tensor"
    """The ratio's old policy, per the loss's `anchor`: the behaviour log-probs, or the proximal ones
    (a `behaviour` loss on a shard without behaviour log-probs gets the proximal ones). Detached."""
    proximal_log_probs: "torch.Tensor"
    """The policy at the start of the step (before its one optimizer update). Detached."""
    behaviour_log_probs: "torch.Tensor | None"
    """The engine's log-probs of the tokens it sampled; None when the samples carry none. Detached."""
    advantages: "torch.Tensor"
    """Each token's sample advantage (one per rollout, shared by its samples)."""
    mask: "torch.Tensor"
    """1.0 where a token is trained, 0.0 elsewhere (the loss mask times scorability)."""
    sample_of_token: "torch.Tensor"
    """int64: the token's sample, 0..num_samples-1 within the micro-batch."""
    rollout_of_token: "torch.Tensor"
    """int64: the token's rollout index in the whole step (the same on every rank)."""
    rollout_token_counts: "torch.Tensor"
    """int64: the loss-mask tokens of the token's whole rollout, over every rank (the per-rollout denominator)."""
    versions: "torch.Tensor | None"
    """int64: the policy version that sampled each token, where the samples record it; else None."""
    rollout_log_ratio: "torch.Tensor | None"
    """The mean, over every masked token of the token's whole rollout (all its samples, wherever they
    train), of log pi_prox - log pi_behave; None unless the loss or the correction asked for it
    (`PolicyLoss.sequence_log_ratio`, a `rollout`-level correction) or no behaviour log-probs exist."""
    sample_log_ratio: "torch.Tensor | None"
    """The same mean over the token's own sample; None without behaviour log-probs."""


@dataclass(frozen=True)
class LossOutput:
    """What a loss returns for one micro-batch."""

    token_losses: "torch.Tensor"
    """[R]: each token's term, to be minimised; the project masks and aggregates it."""
    metrics: Mapping[str, "torch.Tensor"] = field(default_factory=dict)
    """Name -> [R] per-token values (no gradient needed); each is reported as its mean over the step's
    trained tokens (a 0/1 indicator reads as a share: a clip fraction, a masked-token share)."""


@dataclass(frozen=True, kw_only=True)
class PolicyLoss:
    """A policy loss and what the trainer must know of it before a step (see module docstring)."""

    name: str
    compute: Callable[[LossInputs], LossOutput]
    anchor: str = "behaviour"
    """`behaviour`: the ratio's old policy is the engine's (the proximal one when a shard has none);
    `proximal`: the step-start policy (an importance correction then weights pi_prox / pi_behave)."""
    aggregation: str = "rollout_token_mean"
    """The loss's own aggregation (one of `AGGREGATIONS`); `train.loss.aggregation` overrides it."""
    constant_tokens: int | None = None
    """`rollout_token_sum` only: the constant a rollout's token sum is divided by (Dr.GRPO's budget)."""
    sequence_log_ratio: str | None = None
    """`rollout`: the loss reads `LossInputs.rollout_log_ratio` (the trainer runs a pre-pass for it);
    `sample`: it reads `sample_log_ratio`; None: neither."""
    needs_behaviour_log_probs: bool = False
    """Refuse a shard whose samples carry no behaviour log-probs (before the step's first collective)."""
    corrects_staleness: bool = False
    """Whether the loss itself corrects for stale rollouts (an importance weight against the behaviour
    policy); with `max_staleness > 0` a loss that does not needs a correction or an explicit opt-in."""
    scale_advantages_by_std: bool | None = None
    """False: the loss wants group advantages not divided by the group's reward std (Dr.GRPO); the job
    then sets `scheduler.intake.advantage_std=false`. None: whatever the scheduler config says."""

    def __post_init__(self):
        where = f"policy loss {self.name!r}"
        if not callable(self.compute):
            raise ConfigError(f"{where}: compute must be callable (LossInputs -> LossOutput), got {self.compute!r}")
        if self.anchor not in ANCHORS:
            raise ConfigError(f"{where}: anchor={self.anchor!r} is unknown; pick one of {ANCHORS}")
        check_aggregation(self.aggregation, self.constant_tokens, where)
        if self.sequence_log_ratio is not None and self.sequence_log_ratio not in SEQUENCE_LEVELS:
            raise ConfigError(f"{where}: sequence_log_ratio={self.sequence_log_ratio!r} must be None or one of "
                              f"{SEQUENCE_LEVELS}")


def check_aggregation(aggregation: str, constant_tokens: int | None, where: str) -> None:
    """Refuse an unknown aggregation, or `rollout_token_sum` without a positive constant."""
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"{where}: aggregation={aggregation!r} is unknown; pick one of {AGGREGATIONS}")
    if aggregation == "rollout_token_sum" and (
            isinstance(constant_tokens, bool) or not isinstance(constant_tokens, int) or constant_tokens <= 0):
        raise ConfigError(f"{where}: aggregation='rollout_token_sum' divides each rollout's token sum by a constant "
                          f"token count: constant_tokens must be an int > 0, got {constant_tokens!r}")
