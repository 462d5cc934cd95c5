"""The synthetic agent: made-up multi-sample rollouts for the scheduler, without rollout engines.

    python -m jobs.train --preset synthetic                   # the job's synthetic preset runs this agent

An agent like any user's (the public API only), but it samples nothing: each rollout is a few
synthetic samples (`vgbs_ray.synthetic`: 1..N samples per rollout, lognormal lengths, masked tool
spans) handed over with `ctx.add_sample`, after an asynchronous delay like a real agent's. It
drives the scheduler, the packing and the train group through the job's control flow in seconds,
and exercises the scheduler's rules while training runs:

- a share of prompts is *uniform* (every member gets reward 1.0): the dynamic-sampling filter drops
  the group (`uniform_group_reward`);
- a share of prompts is *bad*: member 0's first sample holds a token outside the vocabulary (what a
  wrong tokenizer gives), so the scheduler rejects it (`token_range`) and that group never
  completes: when the input closes, its other members end `incomplete_group` (and member 0
  `incomplete_rollout`, when it has other samples).

Everything is a pure function of (prompt row, member), and a row of (seed, position): a resumed
run regenerates the same samples under the same rollout ids. The samples carry no behaviour
log-probs and no policy version, so the loss is on-policy PPO without a staleness bound.
"""

from __future__ import annotations

import asyncio

import numpy as np

from vgbs_ray.agents import RolloutContext
from vgbs_ray.synthetic import SyntheticRolloutConfig, synthetic_samples


def make_prompts(seed: int, uniform_group_fraction: float = 0.1, bad_rollout_fraction: float = 0.1):
    """Prompt rows as a pure function of (seed, position): the generator seed of the prompt's group and
    whether it is uniform or bad (see module docstring)."""
    for name, share in (("uniform_group_fraction", uniform_group_fraction), ("bad_rollout_fraction",
                                                                              bad_rollout_fraction)):
        if not 0 <= share <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {share}")

    def prompt(position: int) -> dict:
        rng = np.random.default_rng([seed, position])
        return {"seed": int(rng.integers(1 << 31)), "uniform": bool(rng.random() < uniform_group_fraction),
                "bad": bool(rng.random() < bad_rollout_fraction)}

    return prompt


def make_agent(max_delay_s: float = 0.3, **rollout_shape):
    """The agent; `rollout_shape` holds `SyntheticRolloutConfig` fields (vocab_size must be the model's).
    A rollout finishes after a uniform random delay in [0, max_delay_s] seconds."""
    if max_delay_s < 0:
        raise ValueError(f"max_delay_s must be >= 0 seconds, got {max_delay_s}")
    shape = SyntheticRolloutConfig(**rollout_shape)

    async def agent(row: dict, ctx: RolloutContext) -> float:
        rng = np.random.default_rng([row["seed"], ctx.member])
        await asyncio.sleep(float(rng.uniform(0, max_delay_s)))
        samples, reward = synthetic_samples(shape, rng)
        for index, sample in enumerate(samples):
            tokens = sample["tokens"]
            if row["bad"] and ctx.member == 0 and index == 0:
                tokens = np.concatenate([tokens[:-1], [shape.vocab_size]])  # one id past the vocabulary
            ctx.add_sample(tokens, sample["loss_mask"])
        return 1.0 if row["uniform"] else reward

    return agent
