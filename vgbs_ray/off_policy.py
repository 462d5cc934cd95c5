"""How stale a trained rollout may be, and how the loss corrects for it: one frozen config.

Policy version v = the optimizer steps the weights have taken. A rollout trained by the step
that starts from version k, whose oldest token came from version v_old, has staleness
k - v_old (`vgbs_ray.staleness`). The loss choices (`vgbs_ray.policy_loss`):

  ppo            on-policy PPO: the ratio pi / pi_old is clipped, with pi_old the behaviour
                 log-probs the engine sampled with (or, without them, a forward pass before
                 the update). Exact at staleness 0; with stale data it clips against a policy
                 that may be several updates old and has no correction for it.
  decoupled_ppo  decoupled PPO with truncated importance weights: the ratio pi / pi_prox is
                 clipped against the *proximal* policy (the weights at the start of the
                 step: with one optimizer update per step, the detached log-probs of the
                 loss's own forward pass; no extra pass), and each token's term is
                 weighted by w = min(pi_prox / pi_behave, is_weight_cap) (no gradient through w).

This config refuses `max_staleness > 0` with plain `ppo` unless the user opts in with
`allow_uncorrected_staleness=True`: training on stale data without a correction is a known
way for async RL to collapse, so it must be a decision, not a default.

Pure: no torch, no Ray (the scheduler and the producers read `max_staleness` too).
"""

from __future__ import annotations

from dataclasses import dataclass

from vgbs_ray.errors import ConfigError

POLICY_LOSSES = ("ppo", "decoupled_ppo")


@dataclass(frozen=True, kw_only=True)
class OffPolicyConfig:
    """Staleness bound and the policy loss that corrects for it (see module docstring)."""

    max_staleness: int = 0
    """Most policy versions a trained rollout may lag (version trained minus the rollout's
    oldest version). 0 = strictly on-policy. Enforced when a step is formed (drop reason
    `stale`) and by admission control before a rollout starts."""
    policy_loss: str = "ppo"
    """`ppo` (old = behaviour log-probs) or `decoupled_ppo` (clip against the proximal policy,
    truncated importance weights pi_prox / pi_behave)."""
    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    is_weight_cap: float = 2.0
    """decoupled_ppo: the truncation C of the importance weight min(pi_prox / pi_behave, C); >= 1."""
    allow_uncorrected_staleness: bool = False
    """Permit max_staleness > 0 with plain `ppo` (no off-policy correction). Off by default."""

    def __post_init__(self):
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError(f"OffPolicyConfig.max_staleness must be an int >= 0 (policy versions), got {self.max_staleness!r}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ConfigError(f"OffPolicyConfig.policy_loss={self.policy_loss!r} is unknown; pick one of {POLICY_LOSSES}")
        if not 0 < self.clip_eps < 1:
            raise ConfigError(f"OffPolicyConfig.clip_eps must be in (0, 1), got {self.clip_eps}")
        if not self.is_weight_cap >= 1:
            raise ConfigError(f"OffPolicyConfig.is_weight_cap must be >= 1 (a cap below 1 down-weights on-policy "
                              f"tokens), got {self.is_weight_cap}")
        if self.max_staleness > 0 and self.policy_loss == "ppo" and not self.allow_uncorrected_staleness:
            raise ConfigError(
                f"OffPolicyConfig.max_staleness={self.max_staleness} trains on data up to {self.max_staleness} "
                "policy versions old, but policy_loss='ppo' has no off-policy correction: set "
                "policy_loss='decoupled_ppo', or max_staleness=0, or allow_uncorrected_staleness=True to accept it"
            )

    @property
    def needs_proximal_log_probs(self) -> bool:
        """Whether the loss needs the proximal (step-start) log-probs. A trainer taking one optimizer
        update per step has them for free: its loss forward runs on the step-start weights."""
        return self.policy_loss == "decoupled_ppo"

    @property
    def needs_behaviour_log_probs(self) -> bool:
        """Whether every sample must carry the engine's log-probs (`rollout_log_probs`)."""
        return self.policy_loss == "decoupled_ppo"
