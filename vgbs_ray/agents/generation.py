"""What one generation request asks for and what it returns: the agent API's token-in/token-out types.

Both cross Ray boundaries (producer -> engine -> producer) by pickling. Units: tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vgbs_ray.errors import ConfigError, VgbsError


class RequestTooLongError(VgbsError, ValueError):
    """A request does not fit the engine's context (prompt + max_tokens > max_model_len)."""


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How one request samples. Log-probs are always those of the raw model distribution (before
    temperature / top-p), i.e. what the trainer's forward pass computes."""

    max_tokens: int = 16
    """Response tokens to sample at most (fewer if a stop token or stop string comes first)."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens with this much probability."""
    seed: int | None = None
    """Request i of a call samples with seed + i: the same seed, prompts and weights give the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (included in it)."""
    stop: tuple[str, ...] = ()
    """Strings that end a response (the token that completes one is the last of the response). Needs an
    engine that holds the checkpoint's tokenizer."""

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"SamplingConfig.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingConfig: temperature must be >= 0 and top_p in (0, 1], got "
                              f"{self.temperature}, {self.top_p}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"SamplingConfig.stop must be a tuple of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"SamplingConfig.stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")


@dataclass(frozen=True)
class Generation:
    """One request's result."""

    prompt_token_ids: np.ndarray
    response_token_ids: np.ndarray
    """int64 [R]."""
    response_log_probs: np.ndarray
    """float32 [R]: log-prob of each sampled token under the weights that sampled it (behaviour log-probs)."""
    policy_version: int
    """The oldest version among the response's tokens (the one its first token was sampled by): a rollout's
    staleness counts from it."""
    finish_reason: str
    """'length' (max_tokens reached) or 'stop' (a stop token or stop string)."""
    engine: str
    version_runs: tuple[tuple[int, int], ...] = ()
    """(policy version, tokens) runs over the response, in order, summing to its length: a weight update
    while the request was in flight starts a new run. Empty: every token was sampled by `policy_version`."""

    def token_versions(self) -> np.ndarray:
        """int64 [R]: the policy version that sampled each response token."""
        if not self.version_runs:
            return np.full(len(self.response_token_ids), self.policy_version, dtype=np.int64)
        return np.repeat(np.asarray([v for v, _ in self.version_runs], dtype=np.int64),
                         [n for _, n in self.version_runs])
