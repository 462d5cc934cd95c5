"""The job end to end on the tests' Ray cluster: a local run (the synthetic preset) with full and partial
steps, then a resume. Slow: a minute or so. The README's cluster commands (`ray start` with token auth,
`ray job submit` of the closed-loop default) run in tests/test_chaos_job.py, which also kills one actor
of each kind in that job."""

from __future__ import annotations

import json

import pytest

from jobs.progress import read_records
from jobs.train import main
from tests.cluster_support import step_lines

pytestmark = pytest.mark.slow

GLOBAL_BATCH_SIZE = 7
PROMPTS, GROUP = 14, 2
# 2 producers, 14 prompts x 2 rollouts = 28 rollouts (not a multiple of 7), among them groups with a
# malformed member (prompts 0 and 8 with this seed), rejected by rule while training goes on.
SMALL_RUN = [
    "preset=synthetic",  # the synthetic preset (the default is the closed loop: tests/test_closed_loop_*)
    "rollout.num_producers=2", f"rollout.num_prompts={PROMPTS}", f"rollout.group_size={GROUP}",
    "rollout.prompts_kwargs.uniform_group_fraction=0", "rollout.prompts_kwargs.bad_rollout_fraction=0.2",
    "rollout.agent_kwargs.max_delay_s=0.1", f"scheduler.batch.global_batch_size={GLOBAL_BATCH_SIZE}",
    "run.num_steps=20",
]


def job_options(output_dir, *extra) -> list[str]:
    return [arg for item in (*SMALL_RUN, f"run.output_dir={output_dir}", *extra) for arg in ("--set", item)]


def run_job(capsys, output_dir, *extra) -> str:
    """Run the job (`jobs.train.main`, what `python -m jobs.train` runs) on the tests' Ray cluster; returns what it printed."""
    capsys.readouterr()
    assert main(job_options(output_dir, *extra)) == 0
    return capsys.readouterr().out


def test_local_job_trains_full_and_partial_steps_records_them_and_resumes(ray_session, tmp_path, capsys):
    out = tmp_path / "run"
    # the policy loss is a user's, by import path from a file outside the package (tests/user_loss.py)
    first = run_job(capsys, out, "run.checkpoint_every=2", "train.loss.policy=tests.user_loss:make_loss",
                    "train.loss.policy_kwargs.temperature=2.0")
    records = read_records(out / "steps.jsonl")
    assert all(0 <= r["loss_metrics"]["ratio_above_one"] <= 1 and "clip_fraction" not in r["loss_metrics"]
               for r in records)  # the user's metric reached the step records, no built-in's
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
    second = run_job(capsys, out, "run.resume=true", f"run.num_steps={len(records) + 2}",
                     "train.loss.policy=tests.user_loss:make_loss")
    assert f"resumed from {out / 'checkpoints' / latest} at step {len(records)}" in second
    assert read_records(out / "steps.jsonl") == records
