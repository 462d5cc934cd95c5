"""The loss's config, pure (no torch: the job builds and checks it before any rank starts).

    CorrectionConfig   the importance correction for engine/trainer mismatch (TIS, MIS, IcePop)
    BUILTIN_LOSSES     the built-in losses by name -> their factory's import path

`train.loss.policy` names a built-in or a factory `module.path:make_loss` called with
`train.loss.policy_kwargs`; `vgbs_ray.losses.loading.build_policy_loss` resolves it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vgbs_ray.errors import ConfigError

_BUILTIN = "vgbs_ray.losses.builtin"
BUILTIN_LOSSES = {
    "ppo": f"{_BUILTIN}:ppo",
    "decoupled_ppo": f"{_BUILTIN}:decoupled_ppo",
    "gspo": f"{_BUILTIN}:gspo",
    "cispo": f"{_BUILTIN}:cispo",
    "dr_grpo": f"{_BUILTIN}:dr_grpo",
    "dapo": f"{_BUILTIN}:dapo",
}
"""docs/losses.md has each one's formula, default aggregation and citation."""

CORRECTIONS = ("none", "tis", "mis", "icepop")
CORRECTION_LEVELS = ("token", "rollout")


@dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    """An importance correction for the gap between the engine (behaviour) and the trainer's step-start
    (proximal) policy: each token's term is multiplied by a weight w of rho = pi_prox / pi_behave, with no
    gradient through w (`vgbs_ray.losses.correction`).

      tis     truncated IS: w = clip(rho, low, high) (low optional: slime's lower bound)
      mis     masked IS: w = rho where rho <= high (and >= low, when given), 0 elsewhere: the token is dropped
      icepop  IcePop's two-sided mask (Ring-1T): w = rho inside [low, high], 0 outside; both bounds required

    `level`: `token` uses each token's rho; `rollout` the geometric mean of rho over every masked token of
    the whole rollout (all its samples, wherever they train), one weight for the rollout. The ratio's old
    policy must then be the proximal one (`policy_kwargs.anchor=proximal`), or the mismatch is counted twice.
    """

    kind: str = "none"
    """none, tis (truncate the weight), mis (mask: 0 outside the bounds), icepop (mask, both bounds)."""
    level: str = "token"
    """token: each token's own ratio; rollout: the geometric mean over its whole rollout (one weight per rollout)."""
    low: float | None = None
    """Lower bound of rho (tis, mis: optional; icepop: required, e.g. 0.5)."""
    high: float = 2.0
    """Upper bound of rho (>= 1)."""

    def __post_init__(self):
        where = "train.loss.correction"
        if self.kind not in CORRECTIONS:
            raise ConfigError(f"{where}.kind={self.kind!r} is unknown; pick one of {CORRECTIONS}")
        if self.level not in CORRECTION_LEVELS:
            raise ConfigError(f"{where}.level={self.level!r} is unknown; pick one of {CORRECTION_LEVELS}")
        if not self.high >= 1:
            raise ConfigError(f"{where}.high must be >= 1 (a bound below 1 cuts on-policy tokens), got {self.high}")
        if self.low is not None and not 0 <= self.low <= 1:
            raise ConfigError(f"{where}.low must be in [0, 1] or null, got {self.low}")
        if self.kind == "icepop" and self.low is None:
            raise ConfigError(f"{where}.kind='icepop' masks tokens outside [low, high] on both sides: set {where}.low "
                              "(e.g. 0.5)")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


def check_policy_name(policy: str) -> None:
    """A built-in name or a `module.path:name` import path (resolved later, where torch may load)."""
    if not isinstance(policy, str) or not (policy in BUILTIN_LOSSES or policy.count(":") == 1):
        raise ConfigError(f"train.loss.policy={policy!r} must be a built-in ({sorted(BUILTIN_LOSSES)}) or an "
                          "import path 'module.path:make_loss'")
