"""The job end to end: a local run with full and partial steps and a resume, and `ray job submit`
against a cluster this test starts (and stops) itself. Slow: a minute or two each."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from jobs.progress import read_records

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = dict(os.environ, RAY_AUTH_MODE="disabled")
GLOBAL_BATCH_SIZE = 7
# 2 agents x 5 prompts x 2 rollouts + 2 dataset prompts x 2 = 24 rollouts (not a multiple of 7),
# plus malformed rollouts that must be rejected while training goes on.
SMALL_RUN = [
    "producers.num_agents=2", "producers.prompts_per_agent=5", "producers.group_size=2",
    "producers.dataset_prompts=2", "producers.uniform_group_fraction=0", "producers.bad_rollout_fraction=0.5",
    "producers.max_delay_s=0.1", f"scheduler.batch.global_batch_size={GLOBAL_BATCH_SIZE}", "run.num_steps=20",
]


def job_command(output_dir, *extra):
    args = [sys.executable, "-m", "jobs.train"]
    for item in (*SMALL_RUN, f"run.output_dir={output_dir}", *extra):
        args += ["--set", item]
    return args


def step_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^step +\d+ \| rollouts", line)]


def test_local_job_trains_full_and_partial_steps_records_them_and_resumes(tmp_path):
    out = tmp_path / "run"
    first = subprocess.run(job_command(out, "run.checkpoint_every=2"), cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    records = read_records(out / "steps.jsonl")
    assert len(step_lines(first.stdout)) == len(records) >= 3
    rollouts = [r["num_rollouts"] for r in records]
    assert sum(rollouts) == 24  # every accepted rollout trained exactly once
    assert all(n == GLOBAL_BATCH_SIZE for r, n in zip(records, rollouts) if not r["partial"])
    assert any(r["partial"] and r["num_rollouts"] < GLOBAL_BATCH_SIZE for r in records)
    assert [r["step"] for r in records] == list(range(len(records)))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollouts_trained"] == 24 and summary["rollouts_per_step"] == rollouts
    assert summary["rejected_samples_by_rule"].get("mask_length", 0) >= 1  # bad input rejected, training went on
    assert (out / "steps.png").stat().st_size > 10_000
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{len(records):06d}"
    assert json.loads((out / "checkpoints" / latest / "ledger.json").read_text())["summary"]["rollouts_by_state"]["trained"] == 24

    second = subprocess.run(job_command(out, "run.resume=true", "run.num_steps=2"), cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / latest} at step {len(records)}" in second.stdout
    resumed = read_records(out / "steps.jsonl")
    assert [r["step"] for r in resumed] == list(range(len(records) + 2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return ""


def test_ray_job_submit_runs_the_job_and_the_node_exports_per_step_rollouts(tmp_path):
    gcs_port, dashboard_port, metrics_port = free_port(), free_port(), free_port()
    ray = str(pathlib.Path(sys.executable).with_name("ray"))
    log = open(tmp_path / "head.log", "w")
    ray_temp_dir = tempfile.mkdtemp(prefix="vgbs-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", f"--port={gcs_port}", f"--dashboard-port={dashboard_port}",
         "--dashboard-host=127.0.0.1", f"--metrics-export-port={metrics_port}", "--num-cpus=8",
         f"--temp-dir={ray_temp_dir}"],
        env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(address + "/api/version", timeout=2)
                break
            except OSError:
                alive = head.poll() is None and time.monotonic() < deadline
                assert alive, (tmp_path / "head.log").read_text()[-3000:]
                time.sleep(0.5)
        submitted = subprocess.run(
            [ray, "job", "submit", "--address", address, "--working-dir", ".", "--no-wait", "--",
             *job_command(tmp_path / "job-out", "run.ray_address=auto")],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
        )
        assert submitted.returncode == 0, submitted.stderr[-3000:]
        submission_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully", submitted.stdout + submitted.stderr).group(1)

        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(address)
        step_rollouts, finished_at = None, None
        deadline = time.monotonic() + 600
        # Scrape the node's metrics while the job runs (and briefly after: export is periodic).
        while time.monotonic() < deadline:
            status = client.get_job_status(submission_id)
            found = re.search(r'^ray_vgbs_scheduler_step_rollouts\{[^}]*\} ([0-9.]+)', scrape(metrics_port), re.M)
            if found:
                step_rollouts = float(found.group(1))
            if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                finished_at = finished_at or time.monotonic()
                if step_rollouts is not None or time.monotonic() - finished_at > 20:
                    break
            time.sleep(1)
        logs = client.get_job_logs(submission_id)
        assert status == JobStatus.SUCCEEDED, logs[-3000:]
        lines = step_lines(logs)
        assert len(lines) >= 3 and "summary:" in logs
        assert step_rollouts is not None and 1 <= step_rollouts <= GLOBAL_BATCH_SIZE
    finally:
        head.terminate()  # ray start --block drains and stops this cluster's processes only
        try:
            head.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(ray_temp_dir, ignore_errors=True)
