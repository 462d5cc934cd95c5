"""The job end to end: a local run with full and partial steps and a resume, and the README's
cluster commands as a user types them (venv activated, token auth on, `ray job submit` with a
bare `python` entrypoint) against a cluster this test starts (and stops) itself. Slow: a
minute or two each. Every Ray cluster here uses token auth (tests/conftest.py); none of them
touches the user's ~/.ray/auth_token."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from jobs.progress import read_records

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
GLOBAL_BATCH_SIZE = 7
PROMPTS, GROUP = 14, 2
# 2 producers, 14 prompts x 2 rollouts = 28 rollouts (not a multiple of 7), among them groups with a
# malformed member (prompts 0 and 8 with this seed), rejected by rule while training goes on.
SMALL_RUN = [
    "closed_loop.enabled=false",  # the synthetic preset (the default is the closed loop: tests/test_closed_loop_*)
    "closed_loop.num_producers=2", f"closed_loop.num_prompts={PROMPTS}", f"closed_loop.group_size={GROUP}",
    "closed_loop.prompts_kwargs.uniform_group_fraction=0", "closed_loop.prompts_kwargs.bad_rollout_fraction=0.2",
    "closed_loop.agent_kwargs.max_delay_s=0.1", f"scheduler.batch.global_batch_size={GLOBAL_BATCH_SIZE}",
    "run.num_steps=20",
]


def job_options(output_dir, *extra) -> list[str]:
    return [arg for item in (*SMALL_RUN, f"run.output_dir={output_dir}", *extra) for arg in ("--set", item)]


def job_command(output_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "jobs.train", *job_options(output_dir, *extra)]


def step_lines(text: str) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)  # a job log holds Ray Data's progress-bar escapes
    return [line for line in text.splitlines() if re.match(r"^step +\d+ \| rollouts", line)]


def test_local_job_trains_full_and_partial_steps_records_them_and_resumes(tmp_path):
    out = tmp_path / "run"
    first = subprocess.run(job_command(out, "run.checkpoint_every=2"), cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    records = read_records(out / "steps.jsonl")
    assert len(step_lines(first.stdout)) == len(records) >= 3
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
    second = subprocess.run(job_command(out, "run.resume=true", f"run.num_steps={len(records) + 2}"), cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / latest} at step {len(records)}" in second.stdout
    assert read_records(out / "steps.jsonl") == records


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return ""


def http(method: str, url: str, token: str | None = None, body: dict | None = None) -> tuple[int, str]:
    """One request to the dashboard; returns (HTTP status, body), 4xx/5xx included."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


# The README's cluster commands start with these two lines: the venv on PATH (the job's
# `python` is whatever is on the head's PATH) and token auth for the cluster and every client.
ACTIVATE = os.path.relpath(pathlib.Path(sys.prefix) / "bin" / "activate", ROOT)  # .venv/bin/activate
README_PRELUDE = f"source {ACTIVATE} && export RAY_AUTH_MODE=token"


def user_shell_env(home: pathlib.Path) -> dict[str, str]:
    """A new terminal's environment: no venv on PATH, no Ray settings (the conftest's test token
    included), and a HOME of its own so `~/.ray/auth_token` is this test's, not the user's."""
    venv_bin = str(pathlib.Path(sys.prefix) / "bin")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("RAY_") and key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(part for part in env.get("PATH", "").split(os.pathsep) if part != venv_bin)
    env["HOME"] = str(home)
    return env


def in_user_shell(command: str) -> list[str]:
    """`command` typed after the README's prelude in a bash shell."""
    return ["bash", "-c", f"{README_PRELUDE} && {command}"]


@contextlib.contextmanager
def token_auth_head(tmp_path: pathlib.Path):
    """A Ray head started with the README's commands in a user's shell (token made with `ray
    get-auth-token --generate`, `ray start --head`), on ports and a temp dir of its own; yields
    (dashboard address, token, the shell's env) once the dashboard answers the token. Stopped after."""
    home = tmp_path / "home"
    home.mkdir()
    env = user_shell_env(home)
    made = subprocess.run(in_user_shell("ray get-auth-token --generate > /dev/null && chmod 600 ~/.ray/auth_token"),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    token_file = home / ".ray" / "auth_token"
    token = token_file.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", token) and token_file.stat().st_mode & 0o777 == 0o600

    gcs_port, dashboard_port, metrics_port = free_port(), free_port(), free_port()
    # Ray's fixed defaults (dashboard agent 52365, client server 10001) are taken while the suite's
    # in-process cluster runs; a second head whose agent cannot bind never accepts a job.
    agent_port, client_port = free_port(), free_port()
    log = open(tmp_path / "head.log", "w")
    ray_temp_dir = tempfile.mkdtemp(prefix="vgbs-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    # The README's `ray start`, plus what keeps this cluster apart from any other on the machine
    # (its own ports and temp dir) and `--block` so that stopping this process stops only it.
    head = subprocess.Popen(
        in_user_shell(f"exec ray start --head --num-cpus=8 --dashboard-host=127.0.0.1 --block --port={gcs_port} "
                      f"--dashboard-port={dashboard_port} --metrics-export-port={metrics_port} "
                      f"--dashboard-agent-listen-port={agent_port} --ray-client-server-port={client_port} "
                      f"--temp-dir={ray_temp_dir}"),
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # up once it answers the token with 200 (before: refused connections, then 5xx)
            try:
                if http("GET", address + "/api/version", token=token)[0] == 200:
                    break
            except OSError:
                pass
            alive = head.poll() is None and time.monotonic() < deadline
            assert alive, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        yield address, token, env, metrics_port, gcs_port
    finally:
        head.terminate()  # ray start --block drains and stops this cluster's processes only
        try:
            head.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(ray_temp_dir, ignore_errors=True)


def failed_tasks(address: str, token: str) -> list[tuple]:
    """(function, error type) of every FAILED task the cluster's state API knows (`ray list tasks
    --filter state=FAILED`)."""
    code, body = http("GET", f"{address}/api/v0/tasks?filter_keys=state&filter_predicates=%3D&filter_values=FAILED",
                      token=token)
    assert code == 200, body
    return [(t["func_or_class_name"], t.get("error_type")) for t in json.loads(body)["data"]["result"]["result"]]


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

        # The README's `ray job submit`, with this test's small run and --no-wait (the test polls).
        job_args = shlex.join(job_options(tmp_path / "job-out", "run.ray_address=auto"))
        deadline = time.monotonic() + 300
        while True:  # a submit before the head's job agent registered is refused with "No available
            # agent" and creates no job, so it is retried (wait for readiness, not for a time)
            submitted = subprocess.run(
                in_user_shell(f"ray job submit --address {address} --working-dir . --no-wait -- "
                              f"python -m jobs.train {job_args}"),
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
            )
            if "No available agent" not in submitted.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert submitted.returncode == 0, submitted.stderr[-3000:]
        submission_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully",
                                  submitted.stdout + submitted.stderr).group(1)

        step_rollouts, finished_at, job_status = None, None, None
        deadline = time.monotonic() + 600
        # Scrape the node's metrics while the job runs (and briefly after: export is periodic).
        while time.monotonic() < deadline:
            code, body = http("GET", f"{address}/api/jobs/{submission_id}", token=token)
            assert code == 200, body
            job_status = json.loads(body)["status"]
            found = re.search(r'^ray_vgbs_scheduler_step_rollouts\{[^}]*\} ([0-9.]+)', scrape(metrics_port), re.M)
            if found:
                step_rollouts = float(found.group(1))
            if job_status in ("SUCCEEDED", "FAILED", "STOPPED"):
                finished_at = finished_at or time.monotonic()
                if step_rollouts is not None or time.monotonic() - finished_at > 20:
                    break
            time.sleep(1)
        code, body = http("GET", f"{address}/api/jobs/{submission_id}/logs", token=token)
        assert code == 200, body
        logs = json.loads(body)["logs"]
        (tmp_path / "job.log").write_text(logs)  # kept for a failure's post-mortem
        # The driver, the SchedulerActor, the producers and the TrainActors all ran under token
        # auth: the job trained and finished.
        assert job_status == "SUCCEEDED", logs[-3000:]
        assert failed_tasks(address, token) == []  # a finished run fails no task
        assert len(step_lines(logs)) >= 3 and "summary:" in logs
        assert step_rollouts is not None and 1 <= step_rollouts <= GLOBAL_BATCH_SIZE
        # Megatron's "Transformer Engine / Apex not installed" comes out at most once per process.
        said = collections.Counter(re.search(r"pid=(\d+)", line).group(1) if "pid=" in line else "driver"
                                   for line in logs.splitlines() if "not installed" in line)
        assert max(said.values(), default=0) <= 1, said


def test_a_closed_loop_run_that_succeeds_fails_no_task(tmp_path):
    """The closed loop's engines, scheduler and producers end gracefully (actors/shutdown.py): with
    `ray.kill` the tasks they finished in their last second show as FAILED (WORKER_DIED)."""
    with token_auth_head(tmp_path) as (address, token, env, _, gcs_port):
        done = subprocess.run(
            in_user_shell(f"python -m jobs.train --set run.ray_address=127.0.0.1:{gcs_port} --set run.num_steps=3 "
                          f"--set run.output_dir={tmp_path / 'closed-loop'} --set run.plot=false"),
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert len(step_lines(done.stdout)) == 3
        assert failed_tasks(address, token) == []
