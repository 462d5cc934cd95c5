"""Synthetic agentic rollouts: what a multi-turn agent hands the trainer, made up in code.

No model weights or data sets: a rollout answers one prompt (`group_id`, GRPO groups of
`group_size` rollouts per prompt). It yields 1..max_samples samples: context compaction
cuts the trajectory into several training sequences, each with its own prompt and
response. Lengths are lognormal (tokens); the reward is the share of response tokens in
the lower half of the vocabulary, so a policy can actually learn to raise it.

Pure numpy, deterministic for a given generator state. `examples/synthetic_agent.py` hands these
samples to the job as an agent (`ctx.add_sample`), without rollout engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vgbs_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class SyntheticRolloutConfig:
    vocab_size: int = 128
    """Token ids are drawn from [0, vocab_size); must match the model."""
    max_sequence_length: int = 256
    """Longest sample (tokens); must not exceed the model's position table."""
    mean_prompt_tokens: int = 24
    mean_response_tokens: int = 48
    length_sigma: float = 0.6
    """Lognormal spread of prompt and response lengths (wide: skewed lengths)."""
    multi_sample_fraction: float = 0.4
    """Share of rollouts that yield several samples (context compaction, sub-agents)."""
    max_samples_per_rollout: int = 4

    def __post_init__(self):
        if self.max_sequence_length < 4:
            raise ConfigError(f"max_sequence_length must be >= 4, got {self.max_sequence_length}")
        if not 0 <= self.multi_sample_fraction <= 1:
            raise ConfigError(f"multi_sample_fraction must be in [0, 1], got {self.multi_sample_fraction}")
        if self.max_samples_per_rollout < 1:
            raise ConfigError(f"max_samples_per_rollout must be >= 1, got {self.max_samples_per_rollout}")


def synthetic_samples(config: SyntheticRolloutConfig, rng: np.random.Generator) -> tuple[list[dict], float]:
    """One rollout's samples (tokens, response_length, loss_mask; no shared fields) and its reward."""
    num_samples = 1
    if config.max_samples_per_rollout > 1 and rng.random() < config.multi_sample_fraction:
        num_samples = int(rng.integers(2, config.max_samples_per_rollout + 1))
    rows, low_tokens, response_tokens = [], 0, 0
    for _ in range(num_samples):
        prompt = _lognormal_length(rng, config.mean_prompt_tokens, config.length_sigma, 1, config.max_sequence_length // 2)
        response = _lognormal_length(rng, config.mean_response_tokens, config.length_sigma, 1,
                                     config.max_sequence_length - prompt)
        tokens = rng.integers(0, config.vocab_size, prompt + response)
        mask = (rng.random(response) > 0.1).astype(np.int8)  # tool outputs inside a response are masked out
        low_tokens += int((tokens[prompt:] < config.vocab_size // 2).sum())
        response_tokens += response
        rows.append(dict(tokens=tokens, response_length=response, loss_mask=mask))
    return rows, round(low_tokens / max(response_tokens, 1), 2)


def _lognormal_length(rng, mean: float, sigma: float, low: int, high: int) -> int:
    # mean of a lognormal is exp(mu + sigma^2 / 2)
    mu = np.log(max(mean, 1)) - sigma * sigma / 2
    return int(np.clip(round(rng.lognormal(mu, sigma)), low, max(low, high)))
