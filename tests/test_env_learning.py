"""The digit task is learnable by RL from scratch, through the project's samples, shards and loss.

Pure torch (benchmarks/bench_env_learning.py's tiny Llama and GRPO loop), no Ray: a guard
that the environment, the advantages and `micro_batch_loss` together still teach a model,
before any engine or trainer is involved. Measured over 5 seeds at 16 prompts x 8 rollouts
a step: 46-55 steps to a mean reward of 0.8 on-policy, 52-63 at staleness 2 with decoupled
PPO; the budget here is 150 steps.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_env_learning import run

MAX_STEPS = 150


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the measured setting; also keeps the run reproducible
    yield
    torch.set_num_threads(previous)


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 2])
def test_a_tiny_llama_learns_the_digit_task_from_chance(staleness, one_thread):
    result = run("successor_of_last", prompts_per_step=16, staleness=staleness, seed=0, max_steps=MAX_STEPS)
    assert result.first_mean < 0.3, "the first 10 steps should be near chance (0.09)"
    assert result.steps_to_target is not None, f"mean reward {result.last_mean:.2f} after {MAX_STEPS} steps"
    assert result.last_mean >= result.first_mean + 0.3
