"""Admission by tokens (vgbs_ray/scheduler/token_budget.py) alone and in the scheduler's core: groups are admitted while
the rollouts in flight, each charged the expected tokens of a rollout, fit the budget; the expectation follows
the rollouts that complete; every way a rollout leaves frees its share."""

from __future__ import annotations

import pytest

from jobs.job_config import load_job_config
from tests.test_scheduler_core import make_core, push
from vgbs_ray.errors import ConfigError
from vgbs_ray.scheduler.token_budget import TokenBudget


def test_a_budget_admits_while_the_expected_tokens_fit_and_learns_from_completed_rollouts():
    budget = TokenBudget(100, initial_tokens_per_rollout=50)
    assert budget.fits(3)  # nothing in flight: always (a run never stalls on the budget)
    budget.add(["a", "b"])
    assert budget.tokens_in_use == 100 and not budget.fits(1)
    budget.completed("a", tokens=10)  # shorter than expected: the expectation moves toward it
    assert budget.tokens_per_rollout == pytest.approx(46.0)
    assert budget.fits(1) and not budget.fits(2)  # 2 x 46 <= 100 < 3 x 46
    budget.release(["b"])
    assert budget.in_flight == 0
    for i in range(60):  # many short rollouts: the expectation converges, many more fit at once
        budget.add([i])
        budget.completed(i, tokens=10)
    assert budget.tokens_per_rollout == pytest.approx(10.0, abs=0.1) and budget.fits(9)


def test_the_scheduler_refuses_a_group_the_budget_cannot_hold_and_frees_it_as_rollouts_leave():
    core = make_core(gbs=8, max_staleness=1, admission_token_budget=60, admission_tokens_per_rollout=30)
    assert core.admit(["a", "b"], engine_version=0).admit
    assert not core.admit(["c"], engine_version=0).admit  # 3 x 30 > 60
    assert core.stats().token_refusals == 1
    push(core, ["a"])  # 2 samples of 10 and 13 tokens: the expectation moves from 30 toward 23
    assert core.tokens.tokens_per_rollout == pytest.approx(29.3)
    assert core.admit(["c"], engine_version=0).admit  # b and c: 2 x 29.3 <= 60
    core.fail_rollouts(["b"], "agent_error")
    core.abandon(["c"])
    stats = core.stats()
    assert stats.tokens_in_use == 0 and stats.refused_admissions == 1
    assert core.admit(["d", "e"], engine_version=0).admit


@pytest.mark.parametrize("preset, message", [
    ("closed_loop", r"admission_token_budget=16 tokens is smaller than one request may be "
                    r"\(rollout.engines.max_model_len=32\)"),
    ("synthetic", r"admission_token_budget=16 admits groups against the engines' tokens.*rollout.use_engines=true"),
])
def test_a_token_budget_that_cannot_work_is_refused_at_start_naming_the_key(preset, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(None, ["scheduler.admission_token_budget=16"], preset=preset)


def test_a_budget_of_the_engines_admits_freely_until_they_set_it_then_holds_it():
    core = make_core(gbs=8, max_staleness=1, admission_token_budget="engines", admission_tokens_per_rollout=30)
    assert core.tokens is None and core.stats().token_budget is None
    assert core.admit(["a", "b", "c"], engine_version=0).admit  # no budget yet (a job sets it before producers run)
    core.set_token_budget(60)  # the engines' KV caches, read when they started
    assert core.admit(["d"], engine_version=0).admit  # nothing in flight in the budget's count: always
    assert not core.admit(["e", "f"], engine_version=0).admit  # 3 x 30 > 60
    assert core.stats().token_budget == 60 and core.stats().token_refusals == 1
    with pytest.raises(ConfigError, match="integer >= 1"):
        core.set_token_budget(0)


def test_a_budget_that_is_neither_tokens_nor_the_engines_is_refused_and_tenants_cannot_share_the_engines_kv():
    assert load_job_config(None, ["scheduler.admission_token_budget=engines"]).scheduler.admission_token_budget == "engines"
    with pytest.raises(ConfigError, match=r'admission_token_budget must be an integer >= 1 \(tokens\), "engines"'):
        load_job_config(None, ["scheduler.admission_token_budget=lots"])
    with pytest.raises(ConfigError, match="tenants share the engines"):
        load_job_config(None, ["scheduler.admission_token_budget=engines", "tenants=[{name: a}, {name: b}]"])


def test_the_job_fills_the_first_expectation_from_the_engines_longest_request():
    config = load_job_config(None, ["scheduler.admission_token_budget=4096"])
    assert config.scheduler_with_model_limits().admission_tokens_per_rollout == 32
