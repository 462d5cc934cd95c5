"""Policy versions and staleness: the sample rule, the pure rules, and the bound under random timings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.staleness_sim import RULE_SETS, SimConfig, simulate
from vgbs_ray.errors import ConfigError, RolloutValidationError
from vgbs_ray.sample import Sample, validate_sample
from vgbs_ray.scheduler.staleness import (STALE_REASON, admit_rollouts, check_admission_config,
                                last_chance_in_flight, oldest_first, split_stale, staleness,
                                staleness_stats)


def sample(index=0, **versions):
    return Sample.from_dict(dict(rollout_id="r7", tokens=[1, 2, 3], response_length=1, loss_mask=[1], reward=1.0,
                                 sample_index=index, rollout_size=2, **versions))


# -- the sample rule ----------------------------------------------------------------------

def test_versions_round_trip_and_validate():
    s = sample(policy_version_min=3, policy_version_max=4)
    validate_sample(s)
    again = Sample.from_dict(s.to_dict())
    assert (again.policy_version_min, again.policy_version_max) == (3, 4)
    validate_sample(sample())  # no versions at all: a synthetic sample


@pytest.mark.parametrize("versions", [dict(policy_version_min=2), dict(policy_version_max=2),
                                      dict(policy_version_min=5, policy_version_max=4),
                                      dict(policy_version_min=-1, policy_version_max=0)])
def test_bad_versions_break_the_named_rule(versions):
    with pytest.raises(RolloutValidationError) as error:
        validate_sample(sample(**versions))
    assert error.value.rule == "policy_version" and error.value.rollout_id == "r7"


# -- the rules --------------------------------------------------------------------------

def test_staleness_is_trained_minus_oldest_and_refuses_the_future():
    assert staleness(7, 5) == 2 and staleness(5, 5) == 0
    with pytest.raises(ValueError, match="future"):
        staleness(4, 5)


def test_step_staleness_stats_leave_unversioned_rollouts_out():
    stats = staleness_stats([5, 3, None, 5], trained_version=5)
    assert (stats.mean, stats.max, stats.versioned) == (2 / 3, 2, 3)
    assert staleness_stats([None], trained_version=5) == staleness_stats([], trained_version=5)


def test_split_stale_keeps_the_bound_inclusive_and_the_order():
    oldest = {"a": 8, "b": 7, "c": None, "d": 6, "e": 10}
    split = split_stale(oldest, trained_version=10, max_staleness=3)
    assert split.fresh == ["a", "b", "c", "e"] and split.stale == ["d"]
    assert split_stale(oldest, trained_version=10, max_staleness=0).fresh == ["c", "e"]
    assert STALE_REASON == "stale"


def test_oldest_first_sorts_by_version_then_arrival_unversioned_last():
    oldest = {"a": 5, "b": 3, "c": None, "d": 3, "e": 4}
    assert oldest_first(["a", "b", "c", "d", "e"], oldest) == ["b", "d", "e", "a", "c"]


def test_last_chance_counts_only_rollouts_whose_last_step_this_is():
    # trained version 10, max_staleness 2: oldest 8 must go now; 9 can wait; 7 is already stale
    assert last_chance_in_flight([8, 8, 9, 7, None, 10], trained_version=10, max_staleness=2) == 2


def test_admission_fills_exactly_the_staleness_window():
    # idle pipeline at version 3, gbs 4: on-policy admits one step's worth, staleness 1 two steps'.
    for max_staleness, window in ((0, 4), (1, 8)):
        admitted = 0
        while admit_rollouts(num_rollouts=1, engine_version=3, steps_formed=3, pending_rollouts=admitted,
                             gbs=4, max_staleness=max_staleness).admit:
            admitted += 1
        assert admitted == window
    # a group is all or none: 3 pending + a group of 2 straddles into the next step
    straddle = admit_rollouts(num_rollouts=2, engine_version=3, steps_formed=3, pending_rollouts=3, gbs=4, max_staleness=0)
    assert not straddle.admit and straddle.landing_step == 4 and straddle.expected_staleness == 1
    # steps already formed but not trained, and an engine that lags, both count against the window
    assert not admit_rollouts(num_rollouts=1, engine_version=3, steps_formed=5, pending_rollouts=0, gbs=4, max_staleness=1).admit
    assert not admit_rollouts(num_rollouts=1, engine_version=1, steps_formed=3, pending_rollouts=0, gbs=4, max_staleness=1).admit
    assert admit_rollouts(num_rollouts=1, engine_version=2, steps_formed=3, pending_rollouts=0, gbs=4, max_staleness=1).admit


def test_admission_refuses_nonsense_and_checks_groups_fit():
    with pytest.raises(ValueError, match="num_rollouts >= 1"):
        admit_rollouts(num_rollouts=0, engine_version=0, steps_formed=0, pending_rollouts=0, gbs=4, max_staleness=0)
    with pytest.raises(ValueError, match="max_staleness"):
        split_stale({}, trained_version=0, max_staleness=-1)
    check_admission_config(gbs=8, group_size=16, max_staleness=1)
    with pytest.raises(ConfigError, match="group_size=16.*raise gbs to >= 16"):
        check_admission_config(gbs=8, group_size=16, max_staleness=0)


# -- the bound under random timings ----------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(gbs=st.integers(1, 8), group_size=st.integers(1, 4), max_staleness=st.integers(0, 3),
       concurrency=st.integers(4, 24), long_fraction=st.floats(0, 0.6), long_s=st.floats(1, 8),
       train_s=st.floats(0.1, 4), sync_s=st.floats(0, 2), rules=st.sampled_from(RULE_SETS),
       ahead=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_no_trained_rollout_exceeds_max_staleness(gbs, group_size, max_staleness, concurrency, long_fraction, long_s,
                                                  train_s, sync_s, rules, ahead, seed):
    if group_size > gbs * (max_staleness + 1) or group_size > concurrency:
        return  # refused at start-up (check_admission_config) / a group never fits the engines
    cfg = SimConfig(gbs=gbs, group_size=group_size, max_staleness=max_staleness, concurrency=concurrency,
                    long_fraction=long_fraction, long_s=long_s, train_s=train_s, sync_s=sync_s, rules=rules,
                    max_steps_ahead=ahead, num_steps=12, seed=seed)
    result = simulate(cfg)
    assert all(lag <= max_staleness for _, lag in result.trained.values())
    # live (the rules never wait on each other forever), and steps train one after another:
    # step k starts from version k (what split_stale assumed)
    assert result.trained_versions == [(k, k) for k in range(cfg.num_steps)]
    # every started rollout is trained once, dropped as stale, buffered or still in flight
    trained, dropped = set(result.trained), set(result.dropped)
    assert not trained & dropped and not (trained | dropped) & result.buffered_at_end
    assert len(trained) + len(dropped) + len(result.buffered_at_end) + result.in_flight_at_end == len(result.started)
    assert set(result.dropped.values()) <= {STALE_REASON}


def test_steady_state_keeps_stale_drops_low_and_long_rollouts_fed():
    """max_staleness=1, a fifth of rollouts 4x longer: the full rules (StalenessWindow) drop
    under 5% and train long rollouts at their started share; with admission alone (arrival
    order, no last-chance wait) the long ones starve."""
    base = dict(gbs=16, group_size=4, max_staleness=1, concurrency=32, long_fraction=0.2, num_steps=120)
    for seed in range(3):
        fed = simulate(SimConfig(**base, seed=seed))
        assert fed.stale_drop_rate() < 0.05
        assert abs(fed.long_share(fed.trained) - fed.long_share(fed.started)) < 0.03
        starved = simulate(SimConfig(**base, seed=seed, rules="admission_only"))
        assert starved.long_share(starved.trained) < 0.5 * starved.long_share(starved.started)
        assert starved.stale_drop_rate() > 0.05
