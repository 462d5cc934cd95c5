"""The producer's bookkeeping without Ray (vgbs_ray/producer_core.py): positions, cursor, open groups, reports."""

from __future__ import annotations

import pytest

from vgbs_ray.errors import ConfigError
from vgbs_ray.producer_core import AgentProducerConfig, ProducerCore, member_seed


class Prompts:
    """A source of `length` prompts keyed by position (what GeneratedPrompts answers)."""

    def prompt(self, position: int):
        return f"p{position}", {"position": position}


def core(index=0, num_producers=2, length=10, cursor=None, **config):
    settings = dict(agent="tests.agent_support:make_repeated_agent", group_size=2, num_producers=num_producers)
    return ProducerCore(index, AgentProducerConfig(**{**settings, **config}), Prompts(), length=length, cursor=cursor)


def test_producers_split_the_source_and_ids_are_the_positions():
    first, second = core(0), core(1)
    drawn = [[g.position for g in iter(c.draw, None)] for c in (first, second)]
    assert drawn == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    again = core(1).draw()
    assert again.rollout_ids == ("p1-r0", "p1-r1") and again.local == 0 and again.row == {"position": 1}
    assert member_seed(3, 1, 1) != member_seed(3, 1, 0) != member_seed(3, 2, 0)


def test_the_cursor_is_the_oldest_open_group_and_a_resume_from_it_draws_every_unsettled_group_again():
    producer = core()
    groups = [producer.draw() for _ in range(4)]  # positions 0, 2, 4, 6
    for group in (groups[0], groups[2]):
        producer.settle(group.local)
    producer.abandon(groups[1].local)  # stopped before it was pushed: still unsettled
    assert producer.cursor() == {"next_index": 1}
    resumed = core(cursor=producer.cursor())
    assert [g.position for g in iter(resumed.draw, None)] == [2, 4, 6, 8]  # 4 again: settled groups are skipped
    producer.settle(groups[1].local)
    producer.settle(groups[3].local)
    assert producer.cursor() == {"next_index": 4}  # all settled: the next undrawn one


def test_max_prompts_and_an_endless_source():
    capped = core(length=None, max_prompts=3)
    assert [g.position for g in iter(capped.draw, None)] == [0, 2, 4]
    endless = core(length=None)
    assert [endless.draw().position for _ in range(50)][-1] == 98


def test_abandon_gives_back_the_admitted_ids_once_and_counts_the_groups_rollouts():
    producer = core()
    group = producer.draw()
    producer.admitted(group.local, ["p0-r1"])  # the scheduler held p0-r0 already
    assert producer.abandon(group.local) == ["p0-r1"]
    assert producer.abandon(group.local) == []
    report = producer.report(stopped=True)
    assert report.abandoned_rollouts == 4 and report.stopped and report.cursor == {"next_index": 0}


def test_a_pushed_group_counts_rewards_and_averages_each_metric_over_the_rollouts_that_reported_it():
    producer = core()
    first, second = producer.draw(), producer.draw()
    producer.admitted(first.local, first.rollout_ids)
    producer.pushed(first.local, [1.0, 0.0], 3, {"turns": 4.0, "num_samples": 3}, {"turns": 2, "num_samples": 2})
    producer.pushed(second.local, [0.5, 0.5], 2, {"turns": 1.0}, {"turns": 1})
    producer.failed(producer.draw().local, "agent_timeout")
    assert producer.drain_rewards() == (2.0, 4) and producer.drain_rewards() == (0.0, 0)
    report = producer.report(stopped=False)
    assert (report.groups, report.rollouts, report.samples, report.mean_reward) == (2, 4, 5, 0.5)
    assert report.agent_metrics == {"turns": 5.0 / 3} and report.agent_metric_counts == {"turns": 3}
    assert report.failed_groups == {"agent_timeout": 1} and report.in_flight == 3  # none released yet
    assert producer.abandon(first.local) == []  # pushed: nothing admitted is left to give back


def test_in_flight_and_engine_requests_follow_the_workers():
    producer = core()
    group = producer.draw()
    producer.engine_request(group.local, +1)
    producer.engine_request(group.local, +1)
    report = producer.report(stopped=False)
    assert (report.in_flight, report.awaiting_engine, report.awaiting_requests) == (1, 1, 2)
    producer.engine_request(group.local, -1)
    producer.engine_request(group.local, -1)
    producer.release(group.local)
    report = producer.report(stopped=False)
    assert (report.in_flight, report.awaiting_engine, report.awaiting_requests) == (0, 0, 0)


def test_group_push_mode_is_a_pure_function_of_the_position():
    modes = [g.one_by_one for g in iter(core(length=200, sample_push_fraction=0.5).draw, None)]
    assert modes == [g.one_by_one for g in iter(core(length=200, sample_push_fraction=0.5).draw, None)]
    assert 20 < sum(modes) < 80


@pytest.mark.parametrize("settings, message", [
    (dict(group_size=0), "group_size must be an integer >= 1"),
    (dict(sample_push_fraction=1.5), r"sample_push_fraction must be in \[0, 1\]"),
    (dict(endpoint_host="loopback"), "needs endpoint_token"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(ConfigError, match=message):
        core(**settings)
