"""Failure recovery through the real job (in-process Ray, real placement groups, Megatron over gloo).

- Chaos: a random TrainActor killed twice (between steps, and with a step in flight) while
  producers push: the run finishes; the trained rollout ids equal those of the same run without
  faults, each in exactly one step of the final history; the ledger check passes; the LR
  schedule's consumed-rollout count matches.
- Life cycle: a run that reaches run.num_steps while producers still push stops them first:
  no traceback, no ActorDiedError, no failed producer in the output.
- Scheduler loss: the SchedulerActor killed mid-run is restored in the job from the latest
  checkpoint (a new scheduler, train group and producers): every rollout of the run without faults
  trains exactly once. With run.max_failures=0 the job stops within a bounded time with a message
  saying what was lost (never hangs).
- Producer loss: one AgentProducer killed right after it pushed some siblings of a rollout but
  not all. Restarted from the latest checkpoint's cursor (run.max_failures > 0): every rollout
  trains once, the held one too. Not restarted (run.max_failures=0): that rollout ends
  `incomplete_rollout` (its group's others `incomplete_group`), every other rollout trains. The
  ledger check passes, the job ends cleanly.

The job runs the synthetic preset (tests/resume_support.py: examples/synthetic_agent.py, no engines). Resuming across a killed driver
is tests/test_resume_killed_driver.py.

Kills happen at events the job reports (`on_event`), never after sleeps racing the run.
Slow: about three minutes in all.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import ray

import actors.agent_producer
from actors.agent_producer import PRODUCER_NAME
from jobs.checkpoint import latest_checkpoint
from jobs.job_config import load_job_config
from jobs.recovery import SchedulerLostError
from jobs.train import train
from tests.resume_support import HoldingProducer, names_free, synthetic_producers

pytestmark = pytest.mark.slow

# 2 producers x 8 prompts x 2 rollouts = 32 rollouts, less the groups with a malformed member (never
# complete) and any group whose two rewards are equal (dropped as uniform): ~7 steps of 4, the last partial.
RUN = [
    *synthetic_producers(),
    "rollout.num_producers=2", "rollout.num_prompts=16", "rollout.group_size=2",
    "rollout.prompts_kwargs.uniform_group_fraction=0", "rollout.prompts_kwargs.bad_rollout_fraction=0.1",
    "rollout.agent_kwargs.max_delay_s=0.05", "scheduler.batch.global_batch_size=4", "run.num_steps=50",
    "run.checkpoint_every=2", "run.max_failures=2", "run.plot=false",
]


def position(rollout_id: str) -> int:
    """The prompt position of a rollout id `p{position}-r{member}` (producer i of 2 answers positions i, i + 2, ...)."""
    return int(rollout_id[1:].split("-")[0])


def run_job(out, extra=(), on_event=None):
    """Run the job in this process; returns (summary, the rollout ids of each step in the final history)."""
    config = load_job_config(None, [*RUN, f"run.output_dir={out}", *extra])
    names_free()
    history: dict[int, tuple] = {}

    def observe(event, step, controller):
        if event == "step_trained":  # a replayed step overwrites the undone one
            history[step] = ray.get(controller.scheduler.step_record.remote(step), timeout=60).rollout_ids
        if on_event is not None:
            on_event(event, step, controller)

    summary = train(config, str(out / "steps.jsonl"), observe)
    return summary, [history[s] for s in range(summary["steps"])]


@pytest.fixture(scope="module")
def clean_run(ray_session, tmp_path_factory):
    """The run without faults that the fault tests compare with: (summary, history). Run once for the module."""
    return run_job(tmp_path_factory.mktemp("clean"))


def ledger_trained(out) -> dict:
    """rollout id -> step, of every rollout the final checkpoint's ledger says was trained."""
    with open(latest_checkpoint(str(out)) + "/ledger.json") as handle:
        ledger = json.load(handle)
    return {rid: state[1] for rid, state in ledger["rollouts"].items() if state[0] == "trained"}


def test_two_killed_train_ranks_are_recovered_and_every_rollout_trains_exactly_once(ray_session, tmp_path, clean_run):
    clean, clean_history = clean_run
    total = clean["rollouts_by_state"]["trained"]
    assert clean["recoveries"] == [] and clean["rollouts_trained"] == total >= 24

    rng = random.Random(11)
    kills: list[dict] = []

    def kill_a_rank(controller, when: str, step: int):
        rank = rng.randrange(len(controller.group.actors))
        kills.append(dict(when=when, step=step, rank=rank, at=time.monotonic()))
        ray.kill(controller.group.actors[rank], no_restart=True)

    def kill_when_emitted(controller, step):
        """With step `step` emitted (its shards published, ranks pulling and training): kill a rank."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ray.get(controller.scheduler.step_record.remote(step), timeout=10)
                break
            except ray.exceptions.RayTaskError:
                time.sleep(0.005)
        kill_a_rank(controller, "in_flight", step)

    def chaos(event, step, controller):
        if event == "step_trained" and step == 2 and not kills:
            kill_a_rank(controller, "between_steps", step)  # after step 2's record exists
        if event == "step_started" and step == 5 and len(kills) == 1:
            threading.Thread(target=kill_when_emitted, args=(controller, step), daemon=True).start()

    faulty, faulty_history = run_job(tmp_path / "faulty", on_event=chaos)

    assert [k["when"] for k in kills] == ["between_steps", "in_flight"]
    recoveries = faulty["recoveries"]
    assert len(recoveries) == 2 and all(r["kind"] == "rank_died" for r in recoveries), recoveries
    # The first kill broke step 3 (the checkpoint holds steps < 2): step 2 was redone.
    assert recoveries[0]["failed_step"] == 3 and recoveries[0]["restored_step"] == 2
    assert recoveries[0]["steps_redone"] == 1 and recoveries[0]["rollouts_replayed"] >= 8
    # The second broke step 5 in flight (or, had step 5 won the race, step 6 or its checkpoint).
    second = recoveries[1]
    assert second["failed_step"] in (5, 6) and second["restored_step"] in (4, 6)
    assert second["steps_redone"] == second["failed_step"] - second["restored_step"] <= 1
    # Same rollouts as the run without faults, each in exactly one step of the final history.
    flat = [rid for ids in faulty_history for rid in ids]
    assert len(flat) == len(set(flat)) == total
    assert set(flat) == {rid for ids in clean_history for rid in ids}
    assert faulty["rollouts_trained"] == clean["rollouts_trained"] == total
    trained = ledger_trained(tmp_path / "faulty")  # train() already ran stats(check_ledger=True)
    assert trained == {str(rid): step for step, ids in enumerate(faulty_history) for rid in ids}
    assert faulty["rollouts_by_state"] == clean["rollouts_by_state"]
    # The LR schedule's consumed-rollout count came back with each checkpoint.
    assert faulty["consumed_rollouts"] == clean["consumed_rollouts"] == total
    print("recoveries:", json.dumps(recoveries))


def test_a_run_that_reaches_its_last_step_stops_producers_first_and_fails_nothing(ray_session, tmp_path, capfd):
    # Producers of an endless prompt source, still pushing when the run ends.
    summary, history = run_job(tmp_path / "short", extra=["run.num_steps=2", "rollout.num_prompts=null",
                                                          "rollout.agent_kwargs.max_delay_s=0.2"])
    assert summary["steps"] == 2 and len(history) == 2
    states = summary["rollouts_by_state"]
    # Every accepted rollout ends trained or dropped: what the stopped run never trained is run_ended.
    assert states["buffered"] == states["scheduled"] == 0 and states["trained"] == sum(summary["rollouts_per_step"])
    assert summary["dropped_by_reason"].get("run_ended", 0) > 0
    assert summary["producers"]["stopped"] == 2 and summary["producers"]["failed"] == 0
    assert summary["producers"]["input_closed"] and summary["producers"]["abandoned_rollouts"] > 0
    names_free()
    output = "".join(capfd.readouterr())
    for bad in ("Traceback", "ActorDiedError", "a producer failed", "end of input"):
        assert bad not in output, output[-3000:]


def test_a_killed_scheduler_stops_the_run_with_what_was_lost(ray_session, tmp_path):
    killed = {}

    def kill_scheduler(event, step, controller):
        if event == "step_trained" and step == 2 and not killed:
            killed["at"] = time.monotonic()
            ray.kill(controller.scheduler)

    with pytest.raises(SchedulerLostError) as failure:
        run_job(tmp_path / "lost", extra=["rollout.num_prompts=40", "run.max_failures=0"], on_event=kill_scheduler)
    stopped_after_s = time.monotonic() - killed["at"]
    message = str(failure.value)
    assert "SchedulerActor died at step 3" in message and "buffered rollouts" in message
    assert "step_000002" in message and "run.resume=true" in message
    assert stopped_after_s < 60, stopped_after_s  # detection is bounded: never a hang
    print(f"scheduler loss: stopped {stopped_after_s:.1f} s after the kill")


def test_a_killed_scheduler_is_restored_in_the_job_and_every_rollout_trains_exactly_once(ray_session, tmp_path,
                                                                                        clean_run):
    clean, clean_history = clean_run
    killed = {}

    def kill_scheduler(event, step, controller):
        if event == "step_trained" and step == 2 and not killed:  # the checkpoint of step 2 holds steps 0-1
            killed["scheduler"] = controller.scheduler
            ray.kill(controller.scheduler, no_restart=True)

    faulty, faulty_history = run_job(tmp_path / "restored", on_event=kill_scheduler)

    (recovery,) = faulty["recoveries"]
    assert recovery["kind"] == "scheduler_lost" and recovery["restored_step"] == 2, recovery
    assert recovery["steps_redone"] == recovery["failed_step"] - 2 >= 1
    flat = [rid for ids in faulty_history for rid in ids]
    assert len(flat) == len(set(flat)) == clean["rollouts_trained"]
    assert set(flat) == {rid for ids in clean_history for rid in ids}
    assert ledger_trained(tmp_path / "restored") == {str(rid): step for step, ids in enumerate(faulty_history)
                                                      for rid in ids}
    assert faulty["producers"]["input_closed"] and faulty["consumed_rollouts"] == clean["consumed_rollouts"]


@pytest.mark.parametrize("restart", [False, True])
def test_a_producer_killed_mid_rollout_is_restarted_or_leaves_that_rollout_incomplete(ray_session, tmp_path, restart,
                                                                                      monkeypatch):
    monkeypatch.setattr(actors.agent_producer, "AgentProducer", HoldingProducer)  # the job starts these
    killed = {}

    def kill_producer_mid_rollout(event, step, controller):
        """Before the first step: hold producer 0 right after a push that sent only some siblings of a
        rollout, then kill it there."""
        if event != "step_started" or killed:
            return
        producer = ray.get_actor(PRODUCER_NAME.format(0))
        ray.get(producer.hold_at_next_partial_push.remote(), timeout=60)
        deadline = time.monotonic() + 120
        while not (held := ray.get(producer.holding.remote(), timeout=60)):
            assert time.monotonic() < deadline, "producer 0 never pushed part of a rollout"
            time.sleep(0.01)
        killed["held"] = held
        ray.kill(producer, no_restart=True)

    # Every group pushed sample by sample, one group at a time per producer; no malformed ones (every
    # incomplete rollout below is the kill's). run.max_failures=0: the dead producer stays dead.
    out = tmp_path / "producer"
    summary, history = run_job(out, on_event=kill_producer_mid_rollout, extra=[
        "rollout.num_prompts=20", "rollout.agent_kwargs.max_delay_s=0.3", "rollout.groups_in_flight=1",
        "rollout.prompts_kwargs.bad_rollout_fraction=0", "rollout.sample_push_fraction=1.0",
        "rollout.agent_kwargs.multi_sample_fraction=0.8", f"run.max_failures={2 if restart else 0}"])

    assert killed["held"], killed
    assert summary["producers"]["input_closed"]
    with open(latest_checkpoint(str(out)) + "/ledger.json") as handle:
        ledger = json.load(handle)["rollouts"]
    trained_or_filtered = {rid for rid, state in ledger.items()
                           if state[0] == "trained" or state[2] == "uniform_group_reward"}
    if restart:
        # Restarted from its cursor: it answered its prompts from there again, the held rollouts
        # among them; what the scheduler already held was rejected, every rollout trained once.
        assert summary["producers"]["failed"] == 0 and [r["producer"] for r in summary["producers"]["restarts"]] == [0]
        assert set(ledger) == trained_or_filtered and len(ledger) == 20 * 2
        assert "incomplete_rollout" not in summary["dropped_by_reason"]
        assert sum(summary["rejected_samples_by_rule"].get(rule, 0)
                   for rule in ("duplicate_sample", "already_complete", "already_scheduled")) >= 1
    else:
        # The killed producer's partly pushed rollouts end incomplete (reported), never trained.
        assert summary["producers"]["failed"] == 1 and summary["producers"]["restarts"] == []
        for rid in killed["held"]:
            assert ledger[rid] == ["dropped", None, "incomplete_rollout"], (rid, ledger.get(rid))
        assert summary["dropped_by_reason"]["incomplete_rollout"] == len(killed["held"])
        assert summary["incomplete_rollouts"] >= len(killed["held"])
        # Everything the other producer made trains (or is dropped by the uniform-reward filter).
        others = {rid for rid in ledger if position(rid) % 2 == 1}
        assert len(others) == 10 * 2 and others <= trained_or_filtered
    # The final history trains each trained rollout once; train() ran the ledger check at the end.
    flat = [rid for ids in history for rid in ids]
    assert len(flat) == len(set(flat)) == summary["rollouts_trained"]
    assert {rid for rid, state in ledger.items() if state[0] == "trained"} == set(flat)
    print(f"producer killed holding {killed['held']} (restart={restart}): {summary['dropped_by_reason']}, "
          f"{summary['rollouts_trained']} rollouts trained, restarts {summary['producers']['restarts']}")
