"""Resolve `train.loss.*` into the loss a rank runs, refusing what cannot work before any rank starts.

    build_loss(policy, policy_kwargs, aggregation=, correction=, max_staleness=, allow_uncorrected_staleness=)
        -> ResolvedLoss

The job calls it while building (errors at start, before Ray), each TrainActor again at start-up.
It imports the factory (a built-in name or `module.path:make_loss`), binds `policy_kwargs` to its
signature (an unknown kwarg is named), checks what the factory returned, and runs the loss once on a
small made-up micro-batch so a wrong output shape or a non-finite value is refused then, not inside a
step where one rank's error would leave its peers waiting in a collective.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch

from vgbs_ray.agents.loading import resolve
from vgbs_ray.errors import ConfigError
from vgbs_ray.losses.api import LossInputs, LossOutput, PolicyLoss, check_aggregation
from vgbs_ray.losses.config import BUILTIN_LOSSES, CorrectionConfig, check_policy_name


class LossOutputError(ConfigError):
    """A policy loss returned something the reduction cannot use (shape, type, a non-finite value)."""


@dataclass(frozen=True)
class ResolvedLoss:
    """The policy loss (its aggregation as the config chose it) and the correction: what `micro_batch_loss` runs."""

    policy: PolicyLoss
    correction: CorrectionConfig = CorrectionConfig()

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def needs_behaviour_log_probs(self) -> bool:
        return self.policy.needs_behaviour_log_probs or self.correction.enabled

    @property
    def needs_rollout_log_ratio(self) -> bool:
        """Whether a step needs the pre-pass that forms each rollout's mean log pi_prox - log pi_behave."""
        return self.policy.sequence_log_ratio == "rollout" or (
            self.correction.enabled and self.correction.level == "rollout")

    @property
    def needs_sample_log_ratio(self) -> bool:
        """Whether the loss reads each sample's mean log-ratio (a pre-pass only when CP splits samples)."""
        return self.policy.sequence_log_ratio == "sample"


def build_loss(policy: str, policy_kwargs: dict | None = None, *, aggregation: str | None = None,
               constant_tokens: int | None = None, correction: CorrectionConfig = CorrectionConfig(),
               max_staleness: int = 0, allow_uncorrected_staleness: bool = False) -> ResolvedLoss:
    """The `ResolvedLoss` of a `train.loss` config (see module docstring)."""
    check_policy_name(policy)
    factory = resolve(BUILTIN_LOSSES.get(policy, policy), "train.loss.policy")
    kwargs = dict(policy_kwargs or {})
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as error:
        raise ConfigError(f"train.loss.policy={policy!r}: policy_kwargs {sorted(kwargs)} do not fit its factory "
                          f"{factory.__name__}{inspect.signature(factory)}: {error}") from error
    except ValueError:  # a callable without a signature (a builtin): its call says what is wrong
        pass
    made = factory(**kwargs)
    if not isinstance(made, PolicyLoss):
        if not callable(made):
            raise ConfigError(f"train.loss.policy={policy!r} returned {made!r}: a factory returns a "
                              "vgbs_ray.losses.PolicyLoss (or a function LossInputs -> LossOutput)")
        made = PolicyLoss(name=policy, compute=made)
    where = f"train.loss.policy={policy!r}"
    if aggregation is not None or constant_tokens is not None:
        made = replace(made, aggregation=aggregation or made.aggregation,
                       constant_tokens=made.constant_tokens if constant_tokens is None else constant_tokens)
    check_aggregation(made.aggregation, made.constant_tokens, f"{where} (train.loss.aggregation)")
    if correction.enabled and made.anchor != "proximal":
        raise ConfigError(f"train.loss.correction.kind={correction.kind!r} weights each token by pi_prox / pi_behave, "
                          f"but {where} takes its ratio against the behaviour policy (anchor='behaviour'), which "
                          "already holds that mismatch: set train.loss.policy_kwargs.anchor=proximal, or "
                          "correction.kind=none")
    corrected = made.corrects_staleness or correction.enabled
    if max_staleness > 0 and not corrected and not allow_uncorrected_staleness:
        raise ConfigError(
            f"train.loss.off_policy.max_staleness={max_staleness} trains on data up to {max_staleness} policy versions "
            f"old, but {where} has no off-policy correction: use policy=decoupled_ppo or cispo, or add "
            "train.loss.correction (kind=tis and policy_kwargs.anchor=proximal), or set max_staleness=0, or "
            "train.loss.off_policy.allow_uncorrected_staleness=true to accept it")
    resolved = ResolvedLoss(policy=made, correction=correction)
    probe_loss(made)
    return resolved


def check_loss_output(output: LossOutput, num_tokens: int, name: str) -> None:
    """Refuse an output the reduction cannot use: not a LossOutput, a term or metric not of shape [R]."""
    if not isinstance(output, LossOutput):
        raise LossOutputError(f"policy loss {name!r} returned {type(output).__name__}; it must return "
                              "vgbs_ray.losses.LossOutput(token_losses=..., metrics={...})")
    tensors = {"token_losses": output.token_losses, **{f"metrics[{k!r}]": v for k, v in output.metrics.items()}}
    for what, value in tensors.items():
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (num_tokens,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise LossOutputError(f"policy loss {name!r}: {what} must be a tensor of shape ({num_tokens},) (one value "
                                  f"per response token of the micro-batch), got {shape}")


def probe_loss(policy: PolicyLoss) -> None:
    """Run `policy` on 5 made-up tokens of 2 samples; refuse a wrong shape or a non-finite value."""
    generator = torch.Generator().manual_seed(0)
    num_tokens = 5

    def log_probs():
        return -torch.rand(num_tokens, generator=generator, dtype=torch.float32) - 0.1

    current = log_probs().requires_grad_(True)
    behaviour, proximal = log_probs(), log_probs()
    sample_of_token = torch.tensor([0, 0, 0, 1, 1])
    inputs = LossInputs(
        log_probs=current, old_log_probs=behaviour if policy.anchor == "behaviour" else proximal,
        proximal_log_probs=proximal, behaviour_log_probs=behaviour,
        advantages=torch.tensor([0.5, 0.5, 0.5, -1.0, -1.0]), mask=torch.ones(num_tokens),
        sample_of_token=sample_of_token, rollout_of_token=sample_of_token, rollout_token_counts=torch.tensor([3] * 3 + [2] * 2),
        versions=None, rollout_log_ratio=torch.full((num_tokens,), 0.05), sample_log_ratio=torch.full((num_tokens,), 0.05))
    try:
        output = policy.compute(inputs)
    except Exception as error:
        raise LossOutputError(f"policy loss {policy.name!r} failed on a 5-token probe micro-batch: "
                              f"{type(error).__name__}: {error}") from error
    check_loss_output(output, num_tokens, policy.name)
    if not bool(torch.isfinite(output.token_losses).all()):
        raise LossOutputError(f"policy loss {policy.name!r} returned non-finite token losses "
                              f"{output.token_losses.tolist()} on a 5-token probe micro-batch (finite inputs)")
    if not output.token_losses.requires_grad:
        raise LossOutputError(f"policy loss {policy.name!r}: token_losses carry no gradient; they must be computed "
                              "from LossInputs.log_probs")
