"""A multi-LoRA job (jobs/tenants.py): three tenants over one base, one train group and one engine pool.

`short` runs the digit agent (one sample per rollout), `long` asks each rollout's question four times (four
samples per rollout), `broken` raises on every rollout. Checked: `short` and `long` each train their steps, each
step counted in its own tenant's rollouts (16 each, whatever their samples), and neither gets more steps for its
samples; `broken` ends alone, failed, while the others go on; each tenant's adapter is written as PEFT files
that `peft` loads; the records name each tenant's own policy versions.
"""

from __future__ import annotations

import json

import pytest

from jobs.progress import read_records
from jobs.train import main

pytestmark = pytest.mark.slow  # engines, a train group and three tenants' producers: about a minute

STEPS = 3
TENANTS = ("[{name: short, num_steps: 3, global_batch_size: 16}, "
           "{name: long, num_steps: 3, global_batch_size: 16, agent: 'tests.agent_support:make_repeated_agent', "
           "agent_kwargs: {samples: 4}, lora: {rank: 4, target_modules: [q_proj, v_proj]}}, "
           "{name: broken, num_steps: 3, agent: 'tests.agent_support:make_failing_agent'}]")


def test_tenants_train_their_own_adapters_on_their_own_rollouts_and_a_broken_one_ends_alone(ray_session, tmp_path,
                                                                                            capsys):
    out = tmp_path / "run"
    items = [f"run.output_dir={out}", "run.plot=false", "run.shard_timeout_s=30", "scheduler.max_hold_s=10",
             f"tenants={TENANTS}"]
    assert main([a for item in items for a in ("--set", item)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    tenants = summary["tenants"]
    assert {name: t["outcome"] for name, t in tenants.items() if name != "broken"} == {"short": "finished",
                                                                                       "long": "finished"}
    assert tenants["broken"]["outcome"].startswith("failed: step 0 did not come")
    assert summary["steps_by_tenant"] == {"short": STEPS, "long": STEPS, "broken": 0}
    for name in ("short", "long"):
        assert tenants[name]["rollouts_per_step"] == [16] * STEPS  # counted in its own rollouts
        records = read_records(out / "tenants" / name / "steps.jsonl")
        assert [r["step"] for r in records] == list(range(STEPS))
        assert [r["policy_version"] for r in records] == list(range(STEPS))  # its own versions
        assert tenants[name]["closed_loop"]["staleness_max"] <= 1
    assert tenants["long"]["samples_per_rollout"] == 4.0 and tenants["short"]["samples_per_rollout"] == 1.0
    assert tenants["long"]["engine_token_share"] > tenants["short"]["engine_token_share"]

    from peft import PeftConfig

    assert sorted(p.split("/")[-1] for p in summary["adapters"]) == ["broken", "long", "short"]
    assert PeftConfig.from_pretrained(str(out / "adapters" / "long")).r == 4
    printed = capsys.readouterr().out
    assert "[short] step   0" in printed and "[long] step   2" in printed
