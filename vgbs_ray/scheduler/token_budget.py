"""Admission by tokens: new rollouts start only while the engines' token (KV) budget holds them.

Counting admitted groups treats a one-turn rollout of 10 tokens and a sixteen-turn one of 2,000 alike: a few long
episodes overflow the engines (vLLM preempts and recomputes, everyone slows) while a count high enough for long
ones starves the engines of short ones. Here each rollout in flight (admitted, not yet complete, dropped or
abandoned) is charged the tokens a rollout is expected to hold at its end, and a group is admitted only while

    (rollouts in flight + the group's) x expected tokens per rollout <= budget_tokens

(always when nothing is in flight, so a run cannot stall; a budget smaller than one rollout is a start-up error).
The expectation starts at `initial_tokens_per_rollout` and is corrected by what actually ran: every rollout that
completes moves it toward its real token count (prompt + response over every sample; an exponential average with
weight `smoothing`). So the budget admits many short rollouts and few long ones, and follows a workload that
changes. Pure and O(1) per call; `SchedulerCore.admit` applies it before the staleness rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable

from vgbs_ray.errors import ConfigError


@dataclass
class TokenBudget:
    budget_tokens: int
    """Tokens the engines hold at once (all engines together): their KV cache, in tokens."""
    initial_tokens_per_rollout: float
    """The expectation before any rollout completed (e.g. the engines' max_model_len: the worst case)."""
    smoothing: float = 0.1
    """Weight of each completed rollout in the expectation."""
    refusals: int = 0
    """Groups refused for tokens (counted by the caller of `fits`)."""
    _in_flight: set = field(default_factory=set, repr=False)

    def __post_init__(self):
        if self.budget_tokens < 1 or self.initial_tokens_per_rollout <= 0:
            raise ConfigError(f"a token budget needs budget_tokens >= 1 and a positive expectation, got "
                              f"{self.budget_tokens}, {self.initial_tokens_per_rollout}")
        if not 0 < self.smoothing <= 1:
            raise ConfigError(f"TokenBudget.smoothing must be in (0, 1], got {self.smoothing}")
        self.tokens_per_rollout = float(self.initial_tokens_per_rollout)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def tokens_in_use(self) -> float:
        """What the rollouts in flight are expected to hold."""
        return len(self._in_flight) * self.tokens_per_rollout

    def fits(self, count: int) -> bool:
        """Whether `count` more rollouts fit (always when none is in flight: a run never stalls on the budget)."""
        return not self._in_flight or (len(self._in_flight) + count) * self.tokens_per_rollout <= self.budget_tokens

    def add(self, rollout_ids: Iterable[Hashable]) -> None:
        """Admitted rollouts: in flight until they complete or are released."""
        self._in_flight.update(rollout_ids)

    def completed(self, rollout_id: Hashable, tokens: int) -> None:
        """A rollout arrived whole with `tokens` tokens: it leaves the budget and corrects the expectation."""
        self._in_flight.discard(rollout_id)
        self.tokens_per_rollout += self.smoothing * (tokens - self.tokens_per_rollout)

    def release(self, rollout_ids: Iterable[Hashable]) -> None:
        """Rollouts that will not complete (dropped, abandoned, failed, their producer lost)."""
        self._in_flight.difference_update(rollout_ids)

    def clear(self) -> None:
        self._in_flight.clear()
