"""Group advantages: the invariants in vgbs_ray/losses/advantages.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vgbs_ray.losses.advantages import group_advantages, is_uniform_group


def normalize_group_rewards(rewards, eps=None) -> np.ndarray:
    """The group's advantages in reward order (what the intake computes per rollout id)."""
    by_id = group_advantages({i: r for i, r in enumerate(rewards)}, **({} if eps is None else {"eps": eps}))
    return np.array([by_id[i] for i in range(len(rewards))])


def test_normalised_rewards_sum_to_zero_and_keep_order():
    rewards = [0.0, 1.0, 0.5, 2.0]
    adv = normalize_group_rewards(rewards)
    assert abs(adv.sum()) < 1e-9
    assert list(np.argsort(adv)) == list(np.argsort(rewards))
    expected = (np.array(rewards) - np.mean(rewards)) / (np.std(rewards) + 1e-6)
    np.testing.assert_allclose(adv, expected)


def test_unit_variance_with_zero_eps():
    adv = normalize_group_rewards([1.0, 3.0, 5.0], eps=0.0)
    assert np.isclose(adv.std(), 1.0)


def test_uniform_group_gets_zeros_even_without_eps():
    assert is_uniform_group([0.7, 0.7, 0.7])
    assert not is_uniform_group([0.7, 0.8])
    np.testing.assert_array_equal(normalize_group_rewards([0.7, 0.7, 0.7], eps=0.0), [0.0, 0.0, 0.0])


def test_group_advantages_by_rollout_id():
    adv = group_advantages({"a": 1.0, "b": 0.0})
    assert adv["a"] > 0 > adv["b"] and np.isclose(adv["a"], -adv["b"])


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_bad_groups_raise(bad):
    with pytest.raises(ValueError):
        normalize_group_rewards(bad)


def test_without_the_std_division_advantages_are_only_centred():
    """Dr. GRPO's advantages: r - mean(r), the same order and zero sum, no division by the group's std."""
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.5}
    centred = group_advantages(rewards, scale_by_std=False)
    assert centred == pytest.approx({"a": 0.5, "b": -0.5, "c": 0.0, "d": 0.0})
    scaled = group_advantages(rewards)
    assert scaled["a"] == pytest.approx(0.5 / (math.sqrt(0.125) + 1e-6))
