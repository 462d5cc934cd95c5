"""The data contract: every rule names the rollout id and the rule it broke."""

from __future__ import annotations

import numpy as np
import pytest

from vgbs_ray.errors import RolloutValidationError
from vgbs_ray.sample import Sample, make_rollout, validate_rollout, validate_sample


def sample(**overrides):
    row = dict(rollout_id="r1", tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 0], reward=1.0)
    row.update(overrides)
    return Sample.from_dict(row)


def test_a_valid_rollout_passes_and_round_trips_through_dicts():
    rollout = make_rollout("r1", [dict(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1])] * 2, reward=0.5)
    validate_rollout(rollout)
    assert [s.sample_index for s in rollout] == [0, 1] and {s.rollout_size for s in rollout} == {2}
    again = Sample.from_dict(rollout[1].to_dict())
    assert again.rollout_id == "r1" and again.sample_index == 1 and np.array_equal(again.tokens, [1, 2, 3])


@pytest.mark.parametrize(
    "overrides, rule",
    [
        (dict(tokens=[]), "empty_tokens"),
        (dict(response_length=5, loss_mask=[1] * 5), "response_length"),
        (dict(loss_mask=[1]), "mask_length"),
        (dict(loss_mask=[1, 2]), "mask_values"),
        (dict(rollout_log_probs=[0.1]), "log_probs_length"),
        (dict(rollout_size=2, sample_index=2), "rollout_size"),
        (dict(group_id="g"), "group"),
        (dict(reward=float("nan")), "reward"),
        (dict(policy_version_min=2, policy_version_max=3, policy_version_runs=[[2, 1], [3, 2]]), "version_runs"),
        (dict(policy_version_min=2, policy_version_max=3, policy_version_runs=[[2, 1], [4, 1]]), "version_runs"),
        (dict(policy_version_runs=[[2, 2]]), "version_runs"),  # versions without policy_version_min/max
        (dict(policy_version_min=2, policy_version_max=3, policy_version_runs=[2, 3]), "wrong_type"),
    ],
)
def test_each_sample_rule_is_named(overrides, rule):
    with pytest.raises(RolloutValidationError) as error:
        validate_sample(sample(**overrides))
    assert error.value.rule == rule
    assert error.value.rollout_id == "r1"
    assert "rollout 'r1'" in str(error.value) and rule in str(error.value)


def test_missing_required_field_is_named():
    with pytest.raises(RolloutValidationError, match="missing_field.*reward"):
        Sample.from_dict(dict(rollout_id="r9", tokens=[1], response_length=0, loss_mask=[]))


@pytest.mark.parametrize(
    "second, rule",
    [
        (dict(reward=2.0, sample_index=1), "sibling_reward"),
        (dict(rollout_id="other", sample_index=1), "sibling_rollout_id"),
        (dict(sample_index=0), "duplicate_sample"),
        (dict(sample_index=1, rollout_size=3), "sibling_rollout_size"),
    ],
)
def test_sibling_rules_are_named(second, rule):
    first = sample(rollout_size=2, sample_index=0)
    other = sample(**{"rollout_size": 2, **second})
    with pytest.raises(RolloutValidationError) as error:
        validate_rollout([first, other])
    assert error.value.rule == rule and error.value.rollout_id == "r1"


def test_incomplete_rollout_is_named():
    with pytest.raises(RolloutValidationError, match="incomplete_rollout"):
        validate_rollout([sample(rollout_size=3)])
    validate_rollout([sample(rollout_size=3)], require_complete=False)


def test_errors_survive_pickling():
    import pickle

    error = RolloutValidationError("r7", "mask_values", "bad", sample_index=2)
    again = pickle.loads(pickle.dumps(error))
    assert (again.rollout_id, again.rule, again.sample_index, str(again)) == ("r7", "mask_values", 2, str(error))


def test_per_token_versions_round_trip_and_span_the_response():
    row = sample(policy_version_min=2, policy_version_max=3, policy_version_runs=[[2, 1], [3, 1]])
    validate_sample(row)
    again = Sample.from_dict(row.to_dict())
    assert again.policy_version_runs.tolist() == [[2, 1], [3, 1]] and again.policy_version_runs.dtype == np.int64
