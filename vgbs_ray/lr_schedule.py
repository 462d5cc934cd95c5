"""A learning-rate schedule counted in rollouts, not optimizer steps.

With a variable global batch size, steps differ in size: a partial step of 8 rollouts must
move the schedule a third as far as a full step of 24. The schedule is therefore a function
of the rollouts consumed so far:

    lr(consumed) = lr * consumed / warmup_rollouts                      while consumed < warmup
                 = min_lr + (lr - min_lr) * decay(progress)              after warmup
    progress     = (consumed - warmup) / (decay_rollouts - warmup), clipped to [0, 1]
    decay        = 1 (constant), 1 - progress (linear), (1 + cos(pi * progress)) / 2 (cosine)

A step that trains k rollouts first advances `consumed` by k, then uses lr(consumed)
(so the very first step of a warmup does not train with lr 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from vgbs_ray.errors import ConfigError

LRDecayStyle = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor reached at the end of the decay."""
    warmup_rollouts: int = 0
    """Rollouts of linear warmup from 0 to lr."""
    decay_rollouts: int | None = None
    """Rollouts at which the decay reaches min_lr (counted from 0, including warmup); None = no decay."""
    style: LRDecayStyle = "constant"

    def __post_init__(self):
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"LRScheduleConfig: need 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_rollouts < 0:
            raise ConfigError(f"LRScheduleConfig.warmup_rollouts must be >= 0, got {self.warmup_rollouts}")
        if self.style not in ("constant", "linear", "cosine"):
            raise ConfigError(f"LRScheduleConfig.style must be constant, linear or cosine, got {self.style!r}")
        if self.style != "constant" and (self.decay_rollouts is None or self.decay_rollouts <= self.warmup_rollouts):
            raise ConfigError(
                f"LRScheduleConfig.style={self.style!r} needs decay_rollouts > warmup_rollouts "
                f"(got decay_rollouts={self.decay_rollouts}, warmup_rollouts={self.warmup_rollouts})"
            )


def lr_at(config: LRScheduleConfig, consumed_rollouts: int) -> float:
    """The learning rate after `consumed_rollouts` rollouts (see module docstring)."""
    if consumed_rollouts < config.warmup_rollouts:
        return config.lr * consumed_rollouts / config.warmup_rollouts
    if config.style == "constant":
        return config.lr
    span = config.decay_rollouts - config.warmup_rollouts
    progress = min(max((consumed_rollouts - config.warmup_rollouts) / span, 0.0), 1.0)
    decay = 1.0 - progress if config.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr + (config.lr - config.min_lr) * decay
