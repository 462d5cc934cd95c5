"""The closed loop learns, across a stop and a resume: the demo's configuration takes a from-scratch tiny
Llama from near chance to a mean reward >= 0.8 on the digit task, in two runs of the job.

Real everything: in-process Ray, a vLLM CPU engine sampling the policy, two AgentProducers running
the digit agent (examples/digit_agent.py: chat sessions over its Hugging Face tokenizer), the
SchedulerActor with staleness admission and dynamic sampling, Megatron TrainActors (dp=2,
decoupled PPO), weight sync after every step. Seeded; measured on 2 cores: 10-step means of the sampled
reward 0.13 0.20 0.38 0.56 0.68 0.79 0.86 0.95 0.98 0.99 (under load) and 0.16 0.22 0.36 0.44 0.69
0.71 0.82 0.91 (quiet, 80 steps in 137 s for the whole job); chance is 0.09. Slow: 1-2 minutes.

Here the demo runs at staleness 2 (`jobs.train.main` on the tests' Ray cluster), first for STOP_AT
steps (it ends with a checkpoint), then again with run.resume=true to the demo's 100 steps: the resumed
run restores the scheduler at step STOP_AT (its untrained rollouts train first), starts the engines
from the checkpoint's weights at policy version STOP_AT and the producers at their cursors. Checked:
every step appears once in the records with policy version = step and staleness within the bound; the
final ledger puts each trained rollout in exactly one step, step for step what the records say; steps
the checkpoint held keep their rollouts; the LR schedule counted each trained rollout once; whatever the
resumed producers sent again was rejected by a duplicate rule, nothing else (the first run rejected
nothing); and the whole history learns (tests/demo_support.py). The demo exactly as `make demo` runs it
(staleness 1) is held to the same bar by tests/test_chaos_job.py, which submits it with `ray job submit`
and kills one actor of each kind along the way.

The reward asserted is the sampled one (every rollout the producers pushed, groups the filter
dropped included: the policy's own reward); the trained reward excludes all-correct groups.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from jobs.progress import read_records
from jobs.train import main
from tests.demo_support import STEPS, assert_the_demo_learned

pytestmark = pytest.mark.slow

STOP_AT, MAX_STALENESS = 30, 2  # STOP_AT: a multiple of run.checkpoint_every (10), like any run's last step
DUPLICATE_RULES = {"already_scheduled", "already_complete", "already_dropped", "duplicate_sample"}


def run_job(capsys, out: pathlib.Path, *extra: str) -> str:
    """Run the demo at staleness 2 (`jobs.train.main`); returns what it printed."""
    items = [f"run.output_dir={out}", "run.plot=false", f"train.loss.off_policy.max_staleness={MAX_STALENESS}",
             "train.loss.policy=decoupled_ppo", *extra]
    capsys.readouterr()
    assert main([a for item in items for a in ("--set", item)]) == 0
    return capsys.readouterr().out


def latest_ledger(out: pathlib.Path) -> dict:
    checkpoints = out / "checkpoints"
    return json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "ledger.json").read_text())


def trained_ids(ledger: dict) -> dict[str, int]:
    return {rid: state[1] for rid, state in ledger["rollouts"].items() if state[0] == "trained"}


def test_the_demo_at_staleness_2_learns_from_chance_across_a_resume_that_trains_each_rollout_once(ray_session, tmp_path,
                                                                                                 capsys):
    out = tmp_path / "run"
    run_job(capsys, out, f"run.num_steps={STOP_AT}")
    at_stop = trained_ids(latest_ledger(out))
    assert set(at_stop.values()) == set(range(STOP_AT))
    assert json.loads((out / "summary.json").read_text())["rejected_samples_by_rule"] == {}

    resumed = run_job(capsys, out, f"run.num_steps={STEPS}", "run.resume=true")
    assert f"at step {STOP_AT} (policy version {STOP_AT}," in resumed, resumed[-2000:]
    assert f"rollout engine(s) at policy version {STOP_AT}" in resumed

    history = {}
    for record in read_records(out / "steps.jsonl"):
        assert record["step"] not in history, f"step {record['step']} recorded twice"
        history[record["step"]] = record
    assert sorted(history) == list(range(STEPS))  # versions continue across the restart: assert_the_demo_learned
    trained = trained_ids(latest_ledger(out))
    per_step = {step: sum(1 for s in trained.values() if s == step) for step in history}
    assert per_step == {step: r["num_rollouts"] for step, r in history.items()}  # none trained twice, none lost
    assert {rid: s for rid, s in trained.items() if s < STOP_AT} == at_stop
    summary = json.loads((out / "summary.json").read_text())
    assert summary["consumed_rollouts"] == len(trained)
    assert_the_demo_learned([history[s] for s in range(STEPS)], summary, max_staleness=MAX_STALENESS,
                            allowed_rejections=DUPLICATE_RULES)
