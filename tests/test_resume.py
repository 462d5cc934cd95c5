"""Resume pieces without a train group: producers' cursors and stable rollout ids, and the
checkpoint's pure helpers (which dataset prompts a resume sends again, the ledger record,
refusing a checkpoint without the scheduler's state).

The producer test drives a real AgenticProducer actor against a recording stand-in for the
scheduler: it holds the producer right after a push that sent only some siblings of a rollout
(`hold_at_next_partial_push`, event-gated), takes its cursor, kills it, and checks that a
producer started from that cursor pushes exactly the prompts not wholly pushed before, with the
same ids and samples.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import pytest
import ray

from actors.producers import AgenticProducer, ProducerConfig, prompt_rollouts
from jobs.checkpoint import load_resume_point
from tests.resume_support import RecordingScheduler
from vgbs_ray.errors import ConfigError
from vgbs_ray.intake import IntakeSnapshot
from vgbs_ray.resume import dataset_prompts_to_resend, ledger_record
from vgbs_ray.scheduler_state import SchedulerState
from vgbs_ray.settled_ids import SettledIds
from vgbs_ray.synthetic import SyntheticRolloutConfig

CONFIG = ProducerConfig(num_agents=1, prompts_per_agent=8, group_size=2, dataset_prompts=0, max_delay_s=0.02,
                        sibling_push_fraction=1.0, uniform_group_fraction=0.0, bad_rollout_fraction=0.3,
                        rollouts=SyntheticRolloutConfig(vocab_size=16, multi_sample_fraction=0.3))


def test_a_prompts_rollouts_are_a_pure_function_of_seed_agent_and_index():
    first, again = prompt_rollouts(CONFIG, 1, 5), prompt_rollouts(CONFIG, 1, 5, first_index=3)
    assert [p.samples[0]["rollout_id"] for p in first][:2] == ["agent1/prompt5/r0", "agent1/prompt5/r1"]
    assert len(first) == len(again)
    for a, b in zip(first, again):
        assert len(a.samples) == len(b.samples) and a.split == b.split
        for x, y in zip(a.samples, b.samples):
            assert x["rollout_id"] == y["rollout_id"] and x["reward"] == y["reward"]
            assert np.array_equal(x["tokens"], y["tokens"]) and np.array_equal(x["loss_mask"], y["loss_mask"])
        assert b.finish_s < a.finish_s  # only the pacing depends on where the producer started
    other = prompt_rollouts(CONFIG, 0, 5)
    assert other[0].samples[0]["rollout_id"] == "agent0/prompt5/r0"
    assert not np.array_equal(other[0].samples[0]["tokens"], first[0].samples[0]["tokens"])


def test_a_cursor_with_another_seed_is_refused():
    with pytest.raises(ConfigError, match="seed"):
        AgenticProducer(0, CONFIG, None, cursor={"seed": CONFIG.seed + 1, "next_index": 2})


def everything(config: ProducerConfig) -> dict[str, tuple[int, set]]:
    """rollout id -> (prompt index, its sample indexes), over every prompt of agent 0."""
    return {planned.samples[0]["rollout_id"]: (p, {s["sample_index"] for s in planned.samples})
            for p in range(config.prompts_per_agent) for planned in prompt_rollouts(config, 0, p)}


def test_a_producer_resumed_from_its_cursor_pushes_exactly_what_was_not_wholly_pushed(ray_session):
    scheduler = ray.remote(RecordingScheduler).remote()
    producer_cls = ray.remote(num_cpus=0, max_concurrency=4)(AgenticProducer)
    first = producer_cls.remote(0, CONFIG, scheduler)
    ray.get(first.hold_at_next_partial_push.remote())  # armed before it pushes anything
    first.run.remote()
    deadline = time.monotonic() + 60
    while not (held := ray.get(first.holding.remote())):
        assert time.monotonic() < deadline, "the producer never made a partial push"
        time.sleep(0.01)
    cursor = ray.get(first.cursor.remote())
    before = ray.get(scheduler.seen.remote())
    ray.kill(first)

    rollouts = everything(CONFIG)
    pushed = defaultdict(set)
    for rid, index, _ in before:
        pushed[rid].add(index)
    # The cursor: every prompt before it was wholly pushed; the held rollout is partly pushed, at or past it.
    assert cursor["seed"] == CONFIG.seed and 0 <= cursor["next_index"] < CONFIG.prompts_per_agent
    for rid, (prompt, indexes) in rollouts.items():
        if prompt < cursor["next_index"]:
            assert pushed[rid] == indexes, rid
    for rid in held:
        prompt, indexes = rollouts[rid]
        assert prompt >= cursor["next_index"] and pushed[rid] and pushed[rid] < indexes

    second = producer_cls.remote(0, CONFIG, scheduler, cursor)
    report = ray.get(second.run.remote(), timeout=60)
    assert not report.stopped and report.abandoned_rollouts == 0
    assert ray.get(second.cursor.remote())["next_index"] == CONFIG.prompts_per_agent
    after = ray.get(scheduler.seen.remote())[len(before):]
    # The resumed producer sent exactly the prompts from the cursor on, every sample of them ...
    resent = defaultdict(set)
    for rid, index, _ in after:
        resent[rid].add(index)
    assert resent == {rid: indexes for rid, (prompt, indexes) in rollouts.items() if prompt >= cursor["next_index"]}
    # ... with the same samples under the same ids (what was pushed twice is the scheduler's to reject).
    first_tokens = {(rid, index): tokens for rid, index, tokens in before}
    again = [(rid, index) for rid, index, _ in after if (rid, index) in first_tokens]
    assert again, "nothing was pushed twice: the held rollout's first sibling at least must be"
    for rid, index, tokens in after:
        if (rid, index) in first_tokens:
            assert first_tokens[(rid, index)] == tokens, (rid, index)
    ray.kill(second)
    ray.kill(scheduler)


def _state(settled: SettledIds, *, ready=(), waiting=(), open_=(), next_step=3) -> SchedulerState:
    return SchedulerState(next_step=next_step, policy_version=next_step, settled=settled.to_bytes(),
                          intake=IntakeSnapshot(ready=tuple((rid, ()) for rid in ready),
                                                waiting=tuple((rid, ()) for rid in waiting),
                                                open=tuple((rid, 2, ()) for rid in open_)))


def test_a_resume_sends_again_only_the_dataset_prompts_the_checkpoint_does_not_hold_whole():
    settled = SettledIds()
    settled.add("dataset/prompt0/r0", step=0)
    settled.add("dataset/prompt0/r1", reason="uniform_group_reward")
    settled.add("dataset/prompt1/r0", step=2)
    state = _state(settled, ready=["dataset/prompt1/r1"], waiting=["dataset/prompt2/r0"],
                   open_=["dataset/prompt2/r1", "dataset/prompt3/r0"])
    prompts = {p: [f"dataset/prompt{p}/r{k}" for k in range(2)] for p in range(5)}
    # 0 settled, 1 settled + buffered: skipped. 2 has a partly received rollout, 3 one partly
    # received and one unknown, 4 nothing known: sent again.
    assert dataset_prompts_to_resend(state, prompts) == [2, 3, 4]


def test_the_ledger_record_of_a_checkpoint_lists_every_rollout_in_it():
    settled = SettledIds()
    settled.add("a", step=0)
    settled.add("b", reason="incomplete_rollout")
    record = ledger_record(_state(settled, ready=["c"], open_=["d"], next_step=1))
    assert record["rollouts"] == {"a": ["trained", 0, None], "b": ["dropped", None, "incomplete_rollout"],
                                  "c": ["buffered", None, None], "d": ["buffered", None, None]}
    assert record["summary"]["rollouts_by_state"] == {"trained": 1, "dropped": 1, "buffered": 2}
    assert record["summary"]["next_step"] == 1


def test_a_checkpoint_without_the_schedulers_state_is_not_resumed(tmp_path):
    (tmp_path / "job.json").write_text('{"next_step": 2}')
    with pytest.raises(ConfigError, match="scheduler.pkl"):
        load_resume_point(str(tmp_path))
