"""RolloutIntake and plan_step: completion, every rejection rule, groups, backpressure, leftovers."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.bad_inputs import BAD_INPUTS, CORPUS_LIMITS
from tests.rollout_factory import rollout_rows, sample_row
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.scheduler.intake import IntakeConfig, RolloutIntake
from vgbs_ray.scheduler.ledger import Ledger, RolloutState
from vgbs_ray.scheduler.stepping import leftover_action, plan_step


def make(**cfg) -> RolloutIntake:
    return RolloutIntake(IntakeConfig(**cfg), Ledger())


def test_interleaved_siblings_complete_in_completion_order():
    intake = make()
    rows = [r for i, n in enumerate([3, 1, 2]) for r in rollout_rows(f"r{i}", n)]
    random.Random(3).shuffle(rows)
    completed = []
    for row in rows:  # one sample per call, any order
        out = intake.ingest([row], now=len(completed))
        assert out.accepted == 1 and not out.rejections
        completed += out.completed
    ready = intake.take_oldest(10)
    assert [r.rollout_id for r in ready] == completed
    assert sorted(len(r.samples) for r in ready) == [1, 2, 3]
    for r in ready:
        assert [s.sample_index for s in r.samples] == list(range(len(r.samples)))
    assert intake.buffered_samples == 0 and intake.buffered_tokens == 0


def test_whole_call_rollout_without_rollout_size():
    intake = make()
    out = intake.ingest(rollout_rows("w", 3, with_size=False), now=0)
    assert out.accepted == 3 and out.completed == ["w"]
    out = intake.ingest([sample_row("w", 3, size=None)], now=1)
    assert [r.rule for r in out.rejections] == ["already_complete"]


def corpus_intake() -> RolloutIntake:
    """An intake with the corpus limits where rollout "trained" was trained and "dropped" dropped."""
    intake = make(drop_uniform_groups=True, **CORPUS_LIMITS)
    intake.ingest([sample_row("trained", 0, size=2), sample_row("trained", 1, size=2)], now=0)
    [ready] = intake.take_oldest(1)
    intake.ledger.schedule(["trained"], 0)
    intake.settle(["trained"])
    intake.ledger.train_step(0)
    intake.ingest([sample_row("dropped", 0, size=2, advantage=None, group=("dropped-group", 1)),
                   sample_row("dropped", 1, size=2, advantage=None, group=("dropped-group", 1))], now=0)
    assert intake.ledger.state("dropped") is RolloutState.DROPPED
    intake.ingest(rollout_rows("good", 2), now=0)
    return intake


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_each_bad_input_is_rejected_naming_rollout_and_rule(name):
    case = BAD_INPUTS[name]
    intake = corpus_intake()
    rows = case.rows()
    out = intake.ingest(rows, now=1)
    assert out.accepted == case.accepted and len(out.rejections) == len(rows) - case.accepted
    assert {r.rule for r in out.rejections} == {case.rule}, out.rejections
    err = out.rejections[-1].error()
    assert case.rule in str(err)
    if isinstance(rows[-1], dict):
        assert repr(rows[-1]["rollout_id"]) in str(err)  # the error names the offending rollout
    assert intake.ledger.summary().rejected_samples_by_rule == {case.rule: len(rows) - case.accepted}
    assert [r.rollout_id for r in intake.take_oldest(5)] == ["good"]  # nothing accepted was disturbed
    intake.ledger.check()


def test_sibling_disagreement_keeps_the_accepted_samples():
    intake = make()
    intake.ingest([sample_row("s", 0, size=3)], now=0)
    out = intake.ingest([sample_row("s", 1, size=3, reward=0.0), sample_row("s", 1, size=4),
                         sample_row("s", 0, size=3), sample_row("s", 2, size=3)], now=1)
    assert [r.rule for r in out.rejections] == ["sibling_reward", "sibling_rollout_size", "duplicate_sample"]
    assert out.accepted == 1 and intake.num_ready == 0
    out = intake.ingest([sample_row("s", 1, size=3)], now=2)  # the corrected sample completes it
    assert out.completed == ["s"]


def test_late_sample_of_scheduled_or_dropped_rollout_is_rejected():
    intake = make()
    intake.ingest(rollout_rows("a", 1) + rollout_rows("d", 1), now=0)
    taken = intake.take_oldest(2)
    intake.ledger.schedule(["a"], 0)
    intake.ledger.drop("d", "leftover")
    intake.settle([r.rollout_id for r in taken])
    out = intake.ingest([sample_row("a", 0, size=1), sample_row("d", 0, size=1)], now=1)
    assert [r.rule for r in out.rejections] == ["already_scheduled", "already_dropped"]
    assert "step 0" in out.rejections[0].message


def test_group_waits_then_gets_normalised_rewards_once_per_rollout():
    intake = make(advantage_eps=0.0)
    g = ("q1", 3)
    # rollout a has 3 samples, b and c one each: the reward must count once per rollout
    intake.ingest(rollout_rows("a", 3, reward=1.0, advantage=None, group=g), now=0)
    intake.ingest(rollout_rows("b", 1, reward=0.0, advantage=None, group=g), now=1)
    assert intake.num_ready == 0 and intake.num_buffered_rollouts == 2
    intake.ingest(rollout_rows("c", 1, reward=0.0, advantage=None, group=g), now=2)
    ready = {r.rollout_id: r for r in intake.take_oldest(3)}
    expected = (np.array([1.0, 0.0, 0.0]) - 1 / 3) / np.std([1.0, 0.0, 0.0])
    assert [ready[r].samples[0].advantage for r in "abc"] == pytest.approx(expected)
    assert [s.advantage for s in ready["a"].samples] == pytest.approx([expected[0]] * 3)
    assert ready["a"].completed_at == 0 and ready["a"].ready_at == 2
    out = intake.ingest(rollout_rows("d", 1, advantage=None, group=g), now=3)
    assert [r.rule for r in out.rejections] == ["group_closed"]


def test_group_rules_and_uniform_group_drop():
    intake = make(drop_uniform_groups=True)
    g = ("q", 2)
    intake.ingest(rollout_rows("a", 1, advantage=None, group=g), now=0)
    out = intake.ingest(rollout_rows("x", 1, advantage=None, group=("q", 3)), now=0)
    assert [r.rule for r in out.rejections] == ["group_size"]
    out = intake.ingest(rollout_rows("b", 1, advantage=None, group=g), now=1)
    assert out.dropped == [("a", "uniform_group_reward"), ("b", "uniform_group_reward")]
    assert intake.num_ready == 0 and intake.buffered_samples == 0
    assert intake.ledger.summary().dropped_by_reason == {"uniform_group_reward": 2}
    # A push that drops a group, then carries a late sample of a rollout of it: checked after the drop.
    h = ("h", 2)
    intake.ingest(rollout_rows("c", 1, advantage=None, group=h), now=2)
    out = intake.ingest(rollout_rows("d", 1, advantage=None, group=h) + [sample_row("c", 0, size=1, advantage=None, group=h)],
                        now=3)
    assert out.dropped == [("c", "uniform_group_reward"), ("d", "uniform_group_reward")]
    assert [(r.rollout_id, r.rule) for r in out.rejections] == [("c", "already_dropped")]


def test_backpressure_defers_new_rollouts_but_admits_open_ones():
    intake = make(max_buffered_samples=3)
    out = intake.ingest(rollout_rows("a", 2) + [sample_row("b", 0, size=2)], now=0)
    assert out.accepted == 3 and not out.deferred
    rows = [sample_row("c", 0, size=1), sample_row("b", 1, size=2), sample_row("d", 0, size=1)]
    out = intake.ingest(rows, now=1)
    assert out.deferred == [0, 2] and out.accepted == 1 and out.completed == ["b"]  # b's sibling got in
    out = intake.ingest(rows[:1], now=2, accept_new=False)
    assert out.deferred == [0]  # staleness / caller says no
    intake.take_oldest(2)
    assert intake.ingest([rows[0], rows[2]], now=3).accepted == 2


def test_close_incomplete_reports_open_and_group_waiting():
    intake = make()
    intake.ingest([sample_row("o", 0, size=2)], now=0)
    intake.ingest(rollout_rows("g1", 1, advantage=None, group=("g", 2)), now=0)
    closed = intake.close_incomplete()
    assert [(rid, reason) for rid, reason, _ in closed] == [("o", "incomplete_rollout"), ("g1", "incomplete_group")]
    assert intake.buffered_samples == 0 and intake.num_buffered_rollouts == 0


def test_return_front_keeps_first_ready_first():
    intake = make()
    for i in range(4):
        intake.ingest(rollout_rows(f"r{i}", 1), now=i)
    taken = intake.take_oldest(2)
    intake.return_front(taken)
    assert [r.rollout_id for r in intake.take_oldest(4)] == ["r0", "r1", "r2", "r3"]


def _ready(n: int, samples_each: int = 2):
    intake = make()
    for i in range(n):
        intake.ingest(rollout_rows(f"r{i}", samples_each), now=i)
    return intake.take_oldest(n)


def test_plan_step_lays_out_full_partial_and_lone_steps():
    parallel = ParallelConfig(dp_size=2)
    batch = BatchConfig(global_batch_size=4, max_tokens_per_gpu=64)
    planned = plan_step(_ready(4), step=3, parallel=parallel, batch=batch)
    assert planned.num_samples == 8
    assert [s.num_microbatches for s in planned.shards] == [planned.num_microbatches] * 2
    assert all(s.num_rollouts == 4 and s.step == 3 for s in planned.shards)
    assert sorted(r for s in planned.shards for r in s.rollout_ids) == sorted([f"r{i}" for i in range(4)] * 2)
    partial = plan_step(_ready(1), step=1, parallel=parallel, batch=batch)
    assert partial.shards[0].num_rollouts == 1
    assert partial.num_padding_microbatches == 0
    lone = plan_step(_ready(1, samples_each=1), step=1, parallel=parallel, batch=batch)
    assert lone.num_padding_microbatches == 1 and sorted(s.num_samples for s in lone.shards) == [0, 1]
    assert all(s.num_microbatches == 1 for s in lone.shards)  # the empty rank still runs one (empty) micro-batch


def test_leftover_action():
    assert leftover_action("partial", end_of_input=False) == "partial"
    assert leftover_action("drop", end_of_input=False) == "drop"
    assert leftover_action("carry", end_of_input=False) == "keep"
    assert leftover_action("carry", end_of_input=True) == "drop"
