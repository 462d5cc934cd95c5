"""Closed-loop resume: the demo job (vLLM engine, env producers, staleness admission) stopped at a
checkpoint, then started again with run.resume=true, continues where it was and trains every
rollout once.

Two runs of the job on the embedded default (`jobs.train.main`, what `python -m jobs.train` runs, on the
tests' Ray cluster): 6 steps with a checkpoint every 3, then
the same output directory to 9 steps. The resumed run restores the scheduler at step 6 (its
untrained rollouts train first), starts the engines from the checkpoint's weights at policy version
6 and the producers at their cursors. Checked: every step 0-8 appears once with policy version =
step and staleness within the bound; the final ledger puts each trained rollout in exactly one step,
step for step what the records say; steps the checkpoint held keep their rollouts; the LR schedule
counted each trained rollout once; whatever the resumed producers sent again was rejected by a
duplicate rule, nothing else. Slow: about two minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from jobs.progress import read_records
from jobs.train import main

pytestmark = pytest.mark.slow

FIRST_STEPS, ALL_STEPS, MAX_STALENESS = 6, 9, 1
DUPLICATE_RULES = {"already_scheduled", "already_complete", "already_dropped", "duplicate_sample"}


def run_job(capsys, out: pathlib.Path, *extra: str) -> str:
    """Run the job; returns what it printed."""
    items = [f"run.output_dir={out}", "run.checkpoint_every=3", "run.plot=false", *extra]
    capsys.readouterr()
    assert main([a for item in items for a in ("--set", item)]) == 0
    return capsys.readouterr().out


def latest_ledger(out: pathlib.Path) -> dict:
    checkpoints = out / "checkpoints"
    return json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "ledger.json").read_text())


def trained_ids(ledger: dict) -> dict[str, int]:
    return {rid: state[1] for rid, state in ledger["rollouts"].items() if state[0] == "trained"}


def test_a_closed_loop_run_resumes_at_its_checkpoint_and_trains_each_rollout_once(ray_session, tmp_path, capsys):
    out = tmp_path / "run"
    run_job(capsys, out, f"run.num_steps={FIRST_STEPS}")
    at_stop = trained_ids(latest_ledger(out))
    assert set(at_stop.values()) == set(range(FIRST_STEPS))

    resumed = run_job(capsys, out, f"run.num_steps={ALL_STEPS}", "run.resume=true")
    assert f"at step {FIRST_STEPS} (policy version {FIRST_STEPS}," in resumed, resumed[-2000:]
    assert f"rollout engine(s) at policy version {FIRST_STEPS}" in resumed

    history = {}
    for record in read_records(out / "steps.jsonl"):
        assert record["step"] not in history, f"step {record['step']} recorded twice"
        history[record["step"]] = record
    assert sorted(history) == list(range(ALL_STEPS))
    assert all(r["policy_version"] == step for step, r in history.items())  # versions continue across the restart
    assert all(r["staleness_max"] is None or r["staleness_max"] <= MAX_STALENESS for r in history.values())

    trained = trained_ids(latest_ledger(out))
    per_step = {step: sum(1 for s in trained.values() if s == step) for step in history}
    assert per_step == {step: r["num_rollouts"] for step, r in history.items()}  # none trained twice, none lost
    assert {rid: s for rid, s in trained.items() if s < FIRST_STEPS} == at_stop
    summary = json.loads((out / "summary.json").read_text())
    assert summary["consumed_rollouts"] == len(trained)
    assert set(summary["rejected_samples_by_rule"]) <= DUPLICATE_RULES, summary["rejected_samples_by_rule"]
