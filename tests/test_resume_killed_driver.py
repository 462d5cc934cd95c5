"""Resume across job restarts, exactly once: the job's driver SIGKILLed mid-run, then resumed.

`python -m jobs.train` (the synthetic preset, a small config, run to the end of its input) runs
as a subprocess in its own session, with its own Ray. Once its records show step 3 trained and its
latest checkpoint holds it (files polled: event-gated, no sleeps racing the run), the whole session
is SIGKILLed: the driver, the in-process Ray it started (GCS, raylet) and the Ray workers, which sit
in process groups of their own; the test checks none is left. Then the same command with
run.resume=true finishes the run, attached to the tests' cluster (a killed job is resubmitted to a
cluster that lives), as is the uninterrupted run it is compared with: the same set of trained
rollout ids, each in exactly one step of the final history; rollouts trained before the checkpoint
keep their step; rollouts the resumed producers sent again are rejected by rule.

Slow: three job runs (the uninterrupted one beside the killed one), about a minute on a quiet 2-core machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import pytest

from vgbs_ray.producer_core import pushes_samples_one_by_one
from jobs.job_config import load_job_config
from jobs.progress import read_records
from tests.resume_support import synthetic_producers

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
AGENTS, PROMPTS, GROUP = 2, 10, 2
"""Producers, prompts per producer, rollouts per prompt."""
KILL_AFTER_STEP = 3
# Each producer's first group is held until a path exists (tests/resume_support.py: make_held_agent;
# the killed run's never does), so the checkpoint the test kills at has its cursors at 0 and the
# groups pushed before it lie past them: the resumed producers regenerate them and, every group being
# pushed sample by sample, push them again.
RUN = [
    "rollout.agent=tests.resume_support:make_held_agent", f"rollout.num_producers={AGENTS}",
    f"rollout.num_prompts={AGENTS * PROMPTS}", f"rollout.group_size={GROUP}", "rollout.groups_in_flight=3",
    "rollout.sample_push_fraction=1.0", "rollout.prompts_kwargs.uniform_group_fraction=0",
    "rollout.prompts_kwargs.bad_rollout_fraction=0.2", "rollout.agent_kwargs.max_delay_s=1.0",
    "scheduler.batch.global_batch_size=4",
    "run.num_steps=50", "run.checkpoint_every=2", "run.plot=false",
]


def job_command(out: pathlib.Path, hold_until: pathlib.Path, *extra: str) -> list[str]:
    """The job; the first groups finish once `hold_until` exists (see RUN)."""
    items = [*synthetic_producers(), *RUN, f"run.output_dir={out}", f"rollout.agent_kwargs.hold_until={hold_until}",
             *extra]
    return [sys.executable, "-m", "jobs.train", *[arg for item in items for arg in ("--set", item)]]


def session_processes(sid: int) -> list[int]:
    """Pids of the live processes in session `sid` (from /proc; a zombie counts as gone)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields_after_name = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        state, session = fields_after_name[0], int(fields_after_name[3])
        if session == sid and state != "Z":
            pids.append(int(entry))
    return pids


def kill_session(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGKILL every process of the job's session (all started by this test), then check none is left."""
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, GCS, raylet, dashboard agent
    for pid in session_processes(proc.pid):  # Ray workers run in process groups of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout_s)
    deadline = time.monotonic() + timeout_s
    while (left := session_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the killed job still alive: {left}"


def latest_checkpoint_mid_run(out: pathlib.Path) -> bool:
    """Whether the latest checkpoint holds step KILL_AFTER_STEP and a producer had not pushed all then."""
    marker = out / "checkpoints" / "latest"
    if not marker.exists():
        return False
    checkpoint = out / "checkpoints" / marker.read_text().strip()
    if int(checkpoint.name.removeprefix("step_")) <= KILL_AFTER_STEP:
        return False
    cursors = json.loads((checkpoint / "producers.json").read_text())["cursors"]
    return any(cursor is None or cursor["next_index"] < PROMPTS for cursor in cursors)


def trained_steps(out: pathlib.Path) -> set[int]:
    path = out / "steps.jsonl"
    return {record["step"] for record in read_records(path)} if path.exists() else set()


def final_ledger(out: pathlib.Path) -> dict:
    with open(out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() / "ledger.json") as handle:
        return json.load(handle)


def trained_ids(ledger: dict) -> dict[str, int]:
    return {rid: state[1] for rid, state in ledger["rollouts"].items() if state[0] == "trained"}


def start_job(out: pathlib.Path, hold_until: pathlib.Path, *extra: str) -> tuple[subprocess.Popen, pathlib.Path, float]:
    """The job as a subprocess, its output (stdout and stderr) to `<out>.log`."""
    log = out.with_suffix(".log")
    with open(log, "w") as handle:
        proc = subprocess.Popen(job_command(out, hold_until, *extra), cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
    return proc, log, time.monotonic()


def run_to_end(job: tuple[subprocess.Popen, pathlib.Path, float]) -> tuple[str, float]:
    """The job's output once it ended (it must succeed), and its seconds from start."""
    proc, log, started = job
    proc.wait(timeout=900)
    output = log.read_text()
    assert proc.returncode == 0, output[-5000:]
    return output, time.monotonic() - started


def test_a_driver_killed_mid_run_resumes_and_trains_every_rollout_exactly_once(tmp_path, cluster_address):
    clean_out, out = tmp_path / "clean", tmp_path / "killed"
    attach = f"run.ray_address={cluster_address}"  # the clean and the resumed run; the killed one has a Ray of its own
    # The uninterrupted run, beside the run to kill (they share nothing; a job's start leaves a core idle at times).
    # Its first groups finish after the checkpoint the killed run is killed at: late, as they will after the resume.
    clean = start_job(clean_out, clean_out / "checkpoints" / f"step_{KILL_AFTER_STEP + 1:06d}", attach)
    try:
        # The run to kill: in a session of its own, so the kill reaches everything it started.
        log = open(tmp_path / "killed.log", "w")
        proc = subprocess.Popen(job_command(out, tmp_path / "never"), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while not (KILL_AFTER_STEP in trained_steps(out) and latest_checkpoint_mid_run(out)):
                assert proc.poll() is None, ("the run ended before a checkpoint past step "
                                             f"{KILL_AFTER_STEP} caught producers mid-run\n"
                                             + (tmp_path / "killed.log").read_text()[-3000:])
                assert time.monotonic() < deadline, "the run never reached the kill point"
                time.sleep(0.05)
        finally:
            kill_session(proc)
        _, clean_s = run_to_end(clean)
    finally:
        if clean[0].poll() is None:  # this test failed before the uninterrupted run ended
            clean[0].kill()
    assert proc.returncode == -signal.SIGKILL and not (out / "summary.json").exists()
    clean_summary = json.loads((clean_out / "summary.json").read_text())
    clean_trained = trained_ids(final_ledger(clean_out))
    assert len(clean_trained) == clean_summary["rollouts_trained"] > 4 * KILL_AFTER_STEP
    checkpoint = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    at_kill = json.loads((checkpoint / "ledger.json").read_text())
    next_step = at_kill["summary"]["next_step"]
    assert next_step > KILL_AFTER_STEP
    cursors = json.loads((checkpoint / "producers.json").read_text())["cursors"]
    state = pickle.loads((checkpoint / "scheduler.pkl").read_bytes())
    assert state.next_step == state.policy_version == next_step

    # What the resumed producers will send again although the checkpoint already holds it: the groups
    # from their cursors on that are pushed sample by sample (all here; one pushed whole and held is skipped).
    config = load_job_config(None, [*synthetic_producers(), *RUN]).rollout
    positions = [producer + k * AGENTS for producer, cursor in enumerate(cursors)
                 for k in range((cursor or {"next_index": 0})["next_index"], PROMPTS)]
    regenerated = {f"p{position}-r{member}" for position in positions for member in range(GROUP)
                   if pushes_samples_one_by_one(config.seed, position, config.sample_push_fraction)}
    sent_again = {rid for rid in regenerated if rid in at_kill["rollouts"]}
    assert cursors == [{"next_index": 0}] * AGENTS  # the held groups
    assert len(sent_again) >= 4 * KILL_AFTER_STEP, "the rollouts pushed before the checkpoint are past the cursors"

    resumed, resume_s = run_to_end(start_job(out, tmp_path, "run.resume=true", attach))
    assert f"resumed from {checkpoint} at step {next_step}" in resumed
    summary = json.loads((out / "summary.json").read_text())
    ledger = final_ledger(out)
    trained = trained_ids(ledger)

    # The same set of trained rollouts as the uninterrupted run, each in exactly one step.
    assert set(trained) == set(clean_trained)
    assert summary["rollouts_by_state"] == clean_summary["rollouts_by_state"]
    history: dict[int, int] = {}
    for record in read_records(out / "steps.jsonl"):  # a step trained again after the kill: the later line counts
        history[record["step"]] = record["num_rollouts"]
    assert sorted(history) == list(range(len(history)))
    per_step = {step: sum(1 for s in trained.values() if s == step) for step in history}
    assert per_step == history and sum(history.values()) == len(trained)
    # Steps the checkpoint held keep their rollouts; the resumed run continued at its step.
    assert {rid: s for rid, s in trained.items() if s < next_step} == \
        {rid: s for rid, s in trained_ids(at_kill).items()}
    assert summary["steps"] == len(history) - next_step
    # The LR schedule counted every trained rollout once.
    assert summary["consumed_rollouts"] == clean_summary["consumed_rollouts"] == len(trained)
    # Rollouts sent again were rejected by rule (the scheduler knew them), never trained twice.
    for rid in sent_again:
        before = at_kill["rollouts"][rid]
        if before[0] in ("trained", "dropped"):
            assert ledger["rollouts"][rid] == before, rid
    duplicates = {rule: n for rule, n in summary["rejected_samples_by_rule"].items()
                  if rule in ("already_scheduled", "already_complete", "already_dropped", "duplicate_sample")}
    assert duplicates, (summary["rejected_samples_by_rule"], sorted(sent_again))
    # Time to resume: the resumed job's start (Ray, train group from the checkpoint, scheduler state,
    # producers at their cursors) until its step loop began, against a fresh start.
    clean_start_s, resume_start_s = clean_s - clean_summary["elapsed_s"], resume_s - summary["elapsed_s"]
    print(f"killed after step {KILL_AFTER_STEP}, checkpoint at step {next_step}, cursors {cursors}; "
          f"{len(state.intake.rollout_ids)} untrained rollouts restored; {len(sent_again)} rollouts sent again, "
          f"rejected samples by rule {duplicates}; clean run {clean_s:.1f} s (start {clean_start_s:.1f} s), "
          f"resumed run {resume_s:.1f} s (start {resume_start_s:.1f} s)")
