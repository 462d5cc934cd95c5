"""How stale a trained rollout may be: one frozen config, read by the scheduler, the producers and the loss.

Policy version v = the optimizer steps the weights have taken. A rollout trained by the step
that starts from version k, whose oldest token came from version v_old, has staleness
k - v_old (`vgbs_ray.scheduler.staleness`). The loss that corrects for it is `train.loss.policy`
(`vgbs_ray.losses`): with `max_staleness > 0` the job refuses a loss without an off-policy
correction (plain `ppo` against the behaviour policy, say) unless the user opts in with
`allow_uncorrected_staleness=True`: training on stale data without a correction is a known
way for async RL to collapse, so it must be a decision, not a default.

Pure: no torch, no Ray (the scheduler and the producers read `max_staleness` too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vgbs_ray.errors import ConfigError

MOVED_TO_LOSS = {
    "policy_loss": "train.loss.policy",
    "clip_eps": "train.loss.policy_kwargs.clip_eps",
    "is_weight_cap": "train.loss.policy_kwargs.is_weight_cap (policy=decoupled_ppo)",
}
"""Keys this config had, and where they live now (the config loader names the new place)."""


@dataclass(frozen=True, kw_only=True)
class OffPolicyConfig:
    """Staleness bound (see module docstring)."""

    moved_keys: ClassVar[dict[str, str]] = MOVED_TO_LOSS

    max_staleness: int = 0
    """Most policy versions a trained rollout may lag (version trained minus the rollout's
    oldest version). 0 = strictly on-policy. Enforced when a step is formed (drop reason
    `stale`) and by admission control before a rollout starts."""
    allow_uncorrected_staleness: bool = False
    """Permit max_staleness > 0 with a loss that has no off-policy correction. Off by default."""

    def __post_init__(self):
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError(f"OffPolicyConfig.max_staleness must be an int >= 0 (policy versions), got {self.max_staleness!r}")
