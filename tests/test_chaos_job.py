"""The README's cluster commands, and chaos through them: the demo job, submitted with `ray job submit`
to a token-auth cluster, survives the death of each kind of actor, once each.

The test starts a cluster with docs/cluster.md's commands, as a user types them (tests/cluster_support.py:
a shell without the venv on its PATH, `ray get-auth-token --generate`, `ray start --head`). Without the
token the job API answers 401 (403 with a wrong one) and `ray job submit` stops with "Authentication
required"; nothing runs. Then it submits the demo with a bare `python -m jobs.train` entrypoint (the
closed loop, 100 steps) and SIGKILLs, one after another, the process of a rollout engine, a producer,
the SchedulerActor and a TrainActor, found with the state API (`ray list actors`). Each kill waits for
an event the job reported: a step record in its steps.jsonl, then the recovery of the previous kill in
its log, never a sleep. While it runs, the node's metrics endpoint serves the scheduler's per-step
rollout gauge (what the dashboard plots).

The job must finish SUCCEEDED with all its steps by itself, every step it trained (replays included)
a line in its log; its ledger check passes (the job ran it), the rollouts of the final history add up
to the ledger's trained count, every accepted rollout ended trained or dropped with a reason, and the
demo learns as its clean run must (tests/demo_support.py: from chance to >= 0.8, within staleness 1, no
failed group, no rejected sample); this run is the test of `make demo`'s learning. The job ends
gracefully: no task submitted after the last recovery failed (with `ray.kill` the tasks its actors finished
in their last second would show as FAILED, WORKER_DIED; actors/shutdown.py), and Megatron's "Transformer
Engine / Apex not installed" comes out at most once per process.
Slow: two to three minutes on 2 cores.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import signal
import subprocess
import time

import pytest

from jobs.job_config import load_job_config
from jobs.progress import read_records
from tests.cluster_support import (ROOT, alive_actors, failed_tasks, http, in_user_shell, job_logs, job_status, scrape,
                                   step_lines, submit_job, token_auth_head)
from tests.demo_support import STEPS, assert_the_demo_learned

pytestmark = pytest.mark.slow


def test_the_demo_job_survives_a_killed_engine_producer_scheduler_and_train_rank(tmp_path):
    out = tmp_path / "run"
    records = out / "steps.jsonl"
    with token_auth_head(tmp_path) as (address, token, env, metrics_port, _):
        # Without the token the job API answers 401, with a wrong one 403; nothing runs.
        assert http("GET", address + "/api/version")[0] == 401
        assert http("POST", address + "/api/jobs/", body={"entrypoint": "echo unauthenticated"})[0] == 401
        assert http("POST", address + "/api/jobs/", token="0" * 64, body={"entrypoint": "echo forged"})[0] == 403
        refused = subprocess.run(
            in_user_shell(f"RAY_AUTH_MODE=disabled ray job submit --address {address} -- echo no-token"),
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
        assert refused.returncode != 0 and "Authentication required" in refused.stderr, refused.stderr[-3000:]
        code, body = http("GET", address + "/api/jobs/", token=token)
        assert code == 200 and json.loads(body) == [], body

        args = shlex.join(f"--set={item}" for item in (f"run.output_dir={out}", "run.ray_address=auto",
                                                        "run.plot=false", "run.max_failures=3"))
        submission = submit_job(address, env, f"python -m jobs.train {args}")

        def logs() -> str:
            return job_logs(address, token, submission)

        def steps_recorded() -> int:
            return len(records.read_text().splitlines()) if records.exists() else 0

        step_rollouts = []  # the scheduler's per-step rollout gauge, scraped from the node's metrics endpoint

        def wait_for(what: str, done, timeout_s: float = 420.0) -> None:
            deadline = time.monotonic() + timeout_s
            while not done():
                if not step_rollouts:
                    found = re.search(r'^ray_vgbs_scheduler_step_rollouts\{[^}]*\} ([0-9.]+)', scrape(metrics_port), re.M)
                    step_rollouts.extend([float(found.group(1))] if found else [])
                status = job_status(address, token, submission)
                if status not in ("PENDING", "RUNNING"):  # ended: fine only if that is what was awaited
                    assert done(), f"job {status} while waiting for {what}:\n{logs()[-4000:]}"
                    return
                assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s:\n{logs()[-4000:]}"
                time.sleep(0.5)

        kills = []

        def kill_then_recovered(class_name: str, name: str | None, recovered: str, pattern: str) -> None:
            """SIGKILL the actor's process, wait for the job's line saying it recovered, then for a new step
            record; keeps the seconds from the kill to each."""
            actor = next(a for a in alive_actors(address, token)
                         if a["class_name"] == class_name and (name is None or a.get("name") == name))
            os.kill(int(actor["pid"]), signal.SIGKILL)
            killed_at, steps = time.monotonic(), steps_recorded()
            wait_for(recovered, lambda: re.search(pattern, logs()))
            recovered_s = time.monotonic() - killed_at
            wait_for(f"a step record after {recovered}", lambda: steps_recorded() > steps)
            kills.append({"actor": class_name, "at_step_record": steps, "recovered_s": round(recovered_s, 1),
                          "training_again_s": round(time.monotonic() - killed_at, 1)})

        def after_more_steps(count: int) -> None:
            start = steps_recorded()
            wait_for(f"{count} more step records", lambda: steps_recorded() >= start + count)

        after_more_steps(5)
        kill_then_recovered("RolloutEngine", None, "the engine's replacement", "replaced rollout engine")
        after_more_steps(3)
        kill_then_recovered("AgentProducer", "vgbs-producer-0", "the producer's restart", r"producer 0 died \(")
        after_more_steps(3)
        kill_then_recovered("SchedulerActor", None, "the scheduler's restore", "recovered from scheduler_lost")
        after_more_steps(3)
        kill_then_recovered("TrainActor", None, "the train group's recovery", "recovered from (?!scheduler_lost)")
        recovered_ms = time.time() * 1000  # Ray's task times are wall-clock milliseconds
        wait_for("the end of the job", lambda: job_status(address, token, submission) == "SUCCEEDED", 900)
        log_text = logs()
        (tmp_path / "job.log").write_text(log_text)  # kept for a failure's post-mortem
        failed = failed_tasks(address, token)

    # The job ended gracefully: no task submitted after the last recovery failed. Tasks of the killed actors, and
    # those a killed caller left running (a dead producer's requests, ended when their engine exits), did. The
    # teardown's own `__ray_terminate__` is not the run's work: its event can lose the race with the worker's exit
    # (reported ACTOR_DIED, seen once in a quiet fresh-clone run of the scheduler's), so it is not counted.
    work = [t for t in failed if not t["function"].endswith("__ray_terminate__")]
    assert [t for t in work if t["created_ms"] is None or t["created_ms"] >= recovered_ms] == [], failed
    assert failed, "the killed actors' tasks should show as FAILED: is the state API filter still right?"
    assert step_rollouts and 1 <= step_rollouts[0] <= load_job_config().scheduler.batch.global_batch_size
    # Megatron's "Transformer Engine / Apex not installed" comes out at most once per process.
    said = collections.Counter(re.search(r"pid=(\d+)", line).group(1) if "pid=" in line else "driver"
                               for line in log_text.splitlines() if "not installed" in line)
    assert max(said.values(), default=0) <= 1, said
    assert len(step_lines(log_text)) == len(read_records(records)) and "summary:" in log_text

    summary = json.loads((out / "summary.json").read_text())
    print("kills:", json.dumps(kills))
    print("recoveries:", summary["recoveries"], summary["producers"]["restarts"],
          summary["closed_loop"]["engine_replacements"])
    # Each death recovered by the job itself, once.
    (replacement,) = summary["closed_loop"]["engine_replacements"]
    assert replacement["engine"] == "rollout-engine-0" and replacement["cause"] == "dead"
    # It served from the newest version the engines had when it died, no older (the first kill came after
    # kills[0]["at_step_record"] steps, each of which published a version).
    assert replacement["serves_from_version"] >= kills[0]["at_step_record"]
    assert [r["producer"] for r in summary["producers"]["restarts"]] == [0]
    kinds = [r["kind"] for r in summary["recoveries"]]
    assert len(kinds) == 2 and kinds[0] == "scheduler_lost" and kinds[1] != "scheduler_lost", kinds
    # Every step it was asked for, each in the final history once, at its own policy version.
    final = {r["step"]: r for r in read_records(records)}  # a replayed step's record comes after the undone one
    assert sorted(final) == list(range(STEPS)) and summary["steps"] == STEPS
    assert all(r["policy_version"] == r["step"] for r in final.values())
    # The ledger: the final history's rollouts are the ledger's trained ones; nothing accepted is unaccounted.
    states = summary["rollouts_by_state"]
    assert summary["rollouts_trained"] == states["trained"] == sum(r["num_rollouts"] for r in final.values())
    assert states["buffered"] == states["scheduled"] == 0
    # The demo's learning bar, and everything the clean run of the demo asserts (its staleness bound is 1).
    assert_the_demo_learned([final[s] for s in range(STEPS)], summary, max_staleness=1)
