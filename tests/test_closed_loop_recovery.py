"""The closed loop survives the death of a rollout engine, its SchedulerActor and a TrainActor, over the weight
channel.

One job (in this process: real engine, producers, scheduler and Megatron ranks) takes both deaths, at events
the job reports (`on_event`), never after a sleep: a job start costs more than its steps on 2 cores. It syncs
weights over the weight channel (`rollout.weight_sync.transport=collective`): each recovery's new train
group opens a new channel from its rank 0 to the same engines, and sends the restored weights as the restored
step's version. Every step of the final history trained once, with its policy version equal to its step and
staleness within the bound. The default transport (`object_store`) goes through the death of an engine, a
producer, the scheduler and a rank in tests/test_chaos_job.py (the demo under `ray job submit`). Slow: about
a minute.
"""

from __future__ import annotations

import pytest
import ray

from jobs.job_config import load_job_config
from jobs.progress import read_records
from jobs.train import train

pytestmark = pytest.mark.slow

CHECKPOINT_EVERY = 4


def assert_every_step_trained_at_its_version(records: list[dict], steps: int) -> None:
    final = {r["step"]: r for r in records}  # a replayed step's record comes after the undone one
    assert sorted(final) == list(range(steps))
    assert all(r["policy_version"] == r["step"] and r["staleness_max"] <= 1 for r in final.values())


def test_a_killed_engine_scheduler_and_rank_are_each_recovered_over_the_channel_and_every_step_trains(ray_session,
                                                                                                   tmp_path):
    """One run, weight transport `collective`, three deaths at events the job reports:
    - one of the two rollout engines dies after step 1, its channel open: the other engine's rollouts make the
      next steps, whose syncs find the dead one gone (before its replacement, ~10 s, resets the channel). No
      train rank is blamed and nothing is restored: the watch replaces the engine, the newest version goes over
      a new channel to both, and the live engine keeps the version it holds whole until then (without the fix
      the send's failure was a train-group failure);
    - the scheduler dies after step 5: a new one is restored from the checkpoint of step 4, the producers start
      again from its cursors and the engines go back to version 4;
    - a TrainActor dies as step 9 starts: the group is restored from the checkpoint of step 8 and the engines get
      its weights as version 8 over a channel from the new rank 0.
    Every step of the final history trains a full batch at its own policy version, within the staleness bound,
    and the records show exactly the steps each restore trained again."""
    steps, rank_kill_at = 12, 2 * CHECKPOINT_EVERY + 1
    config = load_job_config(None, [f"run.output_dir={tmp_path}", f"run.num_steps={steps}", "run.plot=false",
                                    f"run.checkpoint_every={CHECKPOINT_EVERY}",
                                    "rollout.weight_sync.transport=collective", "rollout.engines.num_engines=2"])
    killed = {}

    def kill(event, step, controller):
        if event == "step_trained" and step == 1 and "engine" not in killed:
            killed["engine"] = ray.get_actor("rollout-engine-1")
            ray.kill(killed["engine"], no_restart=True)
        if event == "step_trained" and step == 5 and "scheduler" not in killed:
            killed["scheduler"] = controller.scheduler
            ray.kill(controller.scheduler, no_restart=True)
        if event == "step_started" and step == rank_kill_at and "rank" not in killed:
            killed["rank"] = controller.group.actors[1]
            ray.kill(killed["rank"])

    summary = train(config, str(tmp_path / "steps.jsonl"), kill)
    scheduler_recovery, rank_recovery = summary["recoveries"]
    assert scheduler_recovery["kind"] == "scheduler_lost" and scheduler_recovery["restored_step"] == CHECKPOINT_EVERY
    assert rank_recovery["kind"] != "scheduler_lost" and rank_recovery["restored_step"] == 2 * CHECKPOINT_EVERY
    assert summary["closed_loop"]["restored_versions"] == [CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY]
    assert summary["steps"] == steps and summary["rollouts_by_state"]["trained"] == steps * 64
    (replacement,) = summary["closed_loop"]["engine_replacements"]
    assert replacement == dict(replacement, engine="rollout-engine-1", cause="dead") and replacement["serves_from_version"] >= 2
    records = read_records(tmp_path / "steps.jsonl")
    assert_every_step_trained_at_its_version(records, steps)
    # Steps 4, 5 trained again after the scheduler's restore; step 8 after the group's.
    assert [r["step"] for r in records] == [*range(6), *range(4, 9), *range(8, steps)]
    print(f"engine replaced in {replacement['replace_s']} s, sends that found it gone: "
          f"{summary['closed_loop']['weight_channel_failures']}; "
          f"scheduler restored in {scheduler_recovery['time_to_recover_s']} s; "
          f"group restored in {rank_recovery['time_to_recover_s']} s")
