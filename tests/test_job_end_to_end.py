"""The job end to end: a local run with full and partial steps and a resume, and the README's
cluster commands as a user types them (venv activated, token auth on, `ray job submit` of the
closed-loop default with a bare `python` entrypoint) against a cluster this test starts (and
stops) itself; that run must finish without a failed task. Slow: a minute or two each. Every Ray
cluster here uses token auth (tests/conftest.py); none of them touches the user's
~/.ray/auth_token."""

from __future__ import annotations

import collections
import json
import re
import shlex
import subprocess
import time

import pytest

from jobs.job_config import load_job_config
from jobs.progress import read_records
from jobs.train import main
from tests.cluster_support import (ROOT, failed_tasks, http, in_user_shell, job_logs, job_status, scrape, step_lines,
                                   submit_job, token_auth_head)

pytestmark = pytest.mark.slow

GLOBAL_BATCH_SIZE = 7
PROMPTS, GROUP = 14, 2
# 2 producers, 14 prompts x 2 rollouts = 28 rollouts (not a multiple of 7), among them groups with a
# malformed member (prompts 0 and 8 with this seed), rejected by rule while training goes on.
SMALL_RUN = [
    "preset=synthetic",  # the synthetic preset (the default is the closed loop: tests/test_closed_loop_*)
    "closed_loop.num_producers=2", f"closed_loop.num_prompts={PROMPTS}", f"closed_loop.group_size={GROUP}",
    "closed_loop.prompts_kwargs.uniform_group_fraction=0", "closed_loop.prompts_kwargs.bad_rollout_fraction=0.2",
    "closed_loop.agent_kwargs.max_delay_s=0.1", f"scheduler.batch.global_batch_size={GLOBAL_BATCH_SIZE}",
    "run.num_steps=20",
]


CLUSTER_STEPS = 20  # the closed loop's steps on the README's cluster: long enough to scrape a step's gauge


def job_options(output_dir, *extra) -> list[str]:
    return [arg for item in (*SMALL_RUN, f"run.output_dir={output_dir}", *extra) for arg in ("--set", item)]


def run_job(capsys, output_dir, *extra) -> str:
    """Run the job (`jobs.train.main`, what `python -m jobs.train` runs) on the tests' Ray cluster; returns what it printed."""
    capsys.readouterr()
    assert main(job_options(output_dir, *extra)) == 0
    return capsys.readouterr().out


def test_local_job_trains_full_and_partial_steps_records_them_and_resumes(ray_session, tmp_path, capsys):
    out = tmp_path / "run"
    first = run_job(capsys, out, "run.checkpoint_every=2")
    records = read_records(out / "steps.jsonl")
    assert len(step_lines(first)) == len(records) >= 3
    rollouts = [r["num_rollouts"] for r in records]
    summary = json.loads((out / "summary.json").read_text())
    # Every rollout trained exactly once, but for a group whose two rollouts tied on reward by chance
    # (the dynamic-sampling filter drops it: no signal) and the groups with a malformed member (its
    # sample rejected, the group never complete: dropped when the input closed).
    dropped = summary["dropped_by_reason"]
    lost = [dropped.get(reason, 0) for reason in ("uniform_group_reward", "incomplete_group", "incomplete_rollout")]
    rejected_only = GROUP * PROMPTS - sum(rollouts) - sum(lost)  # the bad members wholly rejected
    assert 0 <= rejected_only <= summary["rejected_samples_by_rule"]["token_range"]
    assert dropped.get("incomplete_group", 0) >= 1 and sum(rollouts) >= 20
    assert all(n == GLOBAL_BATCH_SIZE for r, n in zip(records, rollouts) if not r["partial"])
    assert any(r["partial"] and r["num_rollouts"] < GLOBAL_BATCH_SIZE for r in records)
    assert [r["step"] for r in records] == list(range(len(records)))
    assert summary["rollouts_trained"] == sum(rollouts) and summary["rollouts_per_step"] == rollouts
    assert summary["rejected_samples_by_rule"].get("token_range", 0) >= 1  # bad input rejected, training went on
    assert (out / "steps.png").stat().st_size > 10_000
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{len(records):06d}"
    assert json.loads((out / "checkpoints" / latest / "ledger.json").read_text())["summary"]["rollouts_by_state"]["trained"] == sum(rollouts)

    # Resume: run.num_steps counts the whole run's steps, and the producers continue at their saved
    # cursors, which are past every prompt: nothing is left to train, nothing trains twice
    # (tests/test_resume*.py resume runs cut short).
    second = run_job(capsys, out, "run.resume=true", f"run.num_steps={len(records) + 2}")
    assert f"resumed from {out / 'checkpoints' / latest} at step {len(records)}" in second
    assert read_records(out / "steps.jsonl") == records


def test_readme_cluster_commands_run_the_job_under_token_auth_and_refuse_a_client_without_the_token(tmp_path):
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

        # docs/cluster.md's `ray job submit` of the closed-loop default (engines, producers, train group),
        # shortened, with --no-wait (the test polls).
        job_args = shlex.join(f"--set={item}" for item in (f"run.output_dir={tmp_path / 'job-out'}", "run.plot=false",
                                                           f"run.num_steps={CLUSTER_STEPS}", "run.ray_address=auto"))
        submission_id = submit_job(address, env, f"python -m jobs.train {job_args}")

        step_rollouts, finished_at, status = None, None, None
        deadline = time.monotonic() + 600
        # Scrape the node's metrics while the job runs (and briefly after: export is periodic).
        while time.monotonic() < deadline:
            status = job_status(address, token, submission_id)
            found = re.search(r'^ray_vgbs_scheduler_step_rollouts\{[^}]*\} ([0-9.]+)', scrape(metrics_port), re.M)
            if found:
                step_rollouts = float(found.group(1))
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                finished_at = finished_at or time.monotonic()
                if step_rollouts is not None or time.monotonic() - finished_at > 20:
                    break
            time.sleep(1)
        logs = job_logs(address, token, submission_id)
        (tmp_path / "job.log").write_text(logs)  # kept for a failure's post-mortem
        # The driver, the SchedulerActor, the engine, the producers and the TrainActors all ran under
        # token auth: the job trained and finished.
        assert status == "SUCCEEDED", logs[-3000:]
        # The engines, scheduler and producers end gracefully (actors/shutdown.py): with `ray.kill` the
        # tasks they finished in their last second would show as FAILED (WORKER_DIED).
        assert failed_tasks(address, token) == []
        assert len(step_lines(logs)) == CLUSTER_STEPS and "summary:" in logs
        assert step_rollouts is not None and 1 <= step_rollouts <= load_job_config().scheduler.batch.global_batch_size
        # Megatron's "Transformer Engine / Apex not installed" comes out at most once per process.
        said = collections.Counter(re.search(r"pid=(\d+)", line).group(1) if "pid=" in line else "driver"
                                   for line in logs.splitlines() if "not installed" in line)
        assert max(said.values(), default=0) <= 1, said
