"""A multi-LoRA job (jobs/tenants.py): three tenants over one base, one train group and one engine pool, stopped
after two steps each and resumed to four, a train rank killed on the way.

`short` runs the digit agent with its retry appended to the first sample (one sample per rollout), `long` asks
each rollout's question four times (four samples per rollout, its own rank-4 adapter), `broken` raises on every
rollout. Checked: `short` and `long` each
train their steps, each step counted in its own tenant's rollouts (16 each, whatever their samples), neither
gets more steps for its samples, and their records carry their own policy versions; `broken` ends alone, failed,
naming why, while the others go on; each tenant's adapter is written as PEFT files that `peft` reads. The
resumed run (to four steps) has a train rank killed after its first step: a new group from the checkpoint, that
step redone. Across both, exactly once per tenant: every step trained, the steps the checkpoint held keep their
rollouts, each trained rollout is in one step of the final ledger, and what the resumed producers sent again was
rejected by a duplicate rule, nothing else.
"""

from __future__ import annotations

import json

import pytest
import ray

from jobs.job_config import load_job_config
from jobs.progress import read_records
from jobs.train import train

pytestmark = pytest.mark.slow  # engines, a train group and three tenants' producers, twice: about two minutes

TENANTS = ("[{name: short, global_batch_size: 16, agent_kwargs: {retry_as_new_sample: false}}, "
           "{name: long, global_batch_size: 16, agent: 'tests.agent_support:make_repeated_agent', "
           "agent_kwargs: {samples: 4}, lora: {rank: 4, target_modules: [q_proj, v_proj]}}, "
           "{name: broken, num_prompts: 2, agent: 'tests.agent_support:make_failing_agent'}]")
DUPLICATE_RULES = {"already_scheduled", "already_complete", "already_dropped", "duplicate_sample"}


def run_job(capsys, out, *extra: str, on_event=None) -> tuple[dict, str]:
    """The job on the tests' cluster (`jobs.train.train`, as `main` runs it); its summary and what it printed."""
    items = [f"run.output_dir={out}", "run.plot=false", "run.shard_timeout_s=30", "scheduler.max_hold_s=10",
             f"tenants={TENANTS}", *extra]
    capsys.readouterr()
    summary = train(load_job_config(None, items), str(out / "steps.jsonl"), on_event)
    return summary, capsys.readouterr().out


def trained_by_step(out, tenant: str) -> dict[int, set]:
    checkpoints = out / "checkpoints"
    ledger = json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "tenants" / tenant
                         / "ledger.json").read_text())
    steps: dict[int, set] = {}
    for rollout, state in ledger["rollouts"].items():
        if state[0] == "trained":
            steps.setdefault(state[1], set()).add(rollout)
    return steps


def test_tenants_train_their_own_adapters_on_their_own_rollouts_across_a_resume_and_a_killed_rank(
        ray_session, tmp_path, capsys):
    out = tmp_path / "run"
    first, printed = run_job(capsys, out, "run.num_steps=2")
    assert first["steps_by_tenant"] == {"short": 2, "long": 2, "broken": 0}
    assert first["tenants"]["broken"]["outcome"].startswith("failed: its input ended after 0 of 2 steps")
    assert "[short] step   0" in printed and "[long] step   1" in printed
    held = {name: trained_by_step(out, name) for name in ("short", "long")}

    kills = []

    def kill_a_rank(event, tenant, step, job):  # after the resumed run's first step: that step is redone
        if event == "step_trained" and not kills:
            kills.append((tenant.name, step))
            ray.kill(job.group.actors[0], no_restart=True)

    summary, printed = run_job(capsys, out, "run.num_steps=4", "run.resume=true", on_event=kill_a_rank)
    assert "resumed from" in printed and "short at step 2" in printed
    (killed_in, killed_step), = kills
    (recovery,) = summary["recoveries"]
    assert recovery["steps_redone"][killed_in] == 1 and killed_step == 2
    tenants = summary["tenants"]
    assert {name: t["outcome"] for name, t in tenants.items() if name != "broken"} == {"short": "finished",
                                                                                       "long": "finished"}
    assert tenants["broken"]["outcome"].startswith("failed: its input ended after 0 of 4 steps")
    for name in ("short", "long"):
        records = read_records(out / "tenants" / name / "steps.jsonl")
        last = {r["step"]: r for r in records}  # a redone step is recorded again, later
        assert sorted(last) == [0, 1, 2, 3] and len(records) == 4 + (name == killed_in)
        assert [last[s]["policy_version"] for s in range(4)] == [0, 1, 2, 3]  # its own versions
        assert [last[s]["num_rollouts"] for s in range(4)] == [16] * 4  # counted in its own rollouts
        final = trained_by_step(out, name)
        assert sorted(final) == [0, 1, 2, 3] and all(len(ids) == 16 for ids in final.values())
        assert {step: final[step] for step in (0, 1)} == held[name]  # the checkpoint's steps kept their rollouts
        assert set(tenants[name]["rejected_samples_by_rule"]) <= DUPLICATE_RULES
    assert tenants["long"]["samples_per_rollout"] == 4.0 and tenants["short"]["samples_per_rollout"] == 1.0
    # The engines count generated tokens by adapter: `long` asks four one-token questions per rollout, `short` one
    # or two; a rollout cut at the end (abandoned) made some. (The shares also depend on how far each tenant's
    # producers ran ahead, which is timing: only their sum is checked.)
    made = {name: tenants[name]["closed_loop"]["producers"] for name in ("short", "long")}
    assert tenants["long"]["engine_tokens"] >= 4 * made["long"]["rollouts"] > 0
    assert made["short"]["rollouts"] <= tenants["short"]["engine_tokens"] <= 2 * (
        made["short"]["rollouts"] + made["short"]["abandoned_rollouts"])
    assert tenants["broken"]["engine_tokens"] == 0
    assert sum(t["engine_token_share"] for t in tenants.values()) == pytest.approx(1.0, abs=0.002)

    from peft import PeftConfig

    assert sorted(p.split("/")[-1] for p in summary["adapters"]) == ["broken", "long", "short"]
    assert PeftConfig.from_pretrained(str(out / "adapters" / "long")).r == 4
