"""Function calling is learned through the endpoint: `--preset tool_use`'s first steps, in CI.

Real everything: the job (`jobs.train.main` on the tests' Ray cluster), the vLLM CPU engine sampling a
from-scratch tiny Llama, the producers' endpoint with vLLM's `hermes` parser, examples/lookup_agent.py
(AsyncOpenAI with `tools=[lookup]`), Megatron trainers. The preset's whole curve (sampled reward from 0.09 to
0.91 in 120 steps at 128 rollouts a step, docs/agents.md) takes six minutes; this runs its first phase, 30
steps at 64 rollouts a step, where the policy learns to call the tool: the share of first replies the endpoint
returned as parsed `tool_calls`, by the policy version that sampled them (the agent's own record), rises from
chance (~0.05: the call is one word of 19) to >= 0.5 (measured 0.82-0.87 with rollout.seed 0, 0.94 with 1), and the sampled
reward rises with it. The preset credits a call answered with wrong digits 0.2, so in this phase its reward rises
by ~0.08 (0.09 -> 0.16-0.17), within three standard errors of the noise of five steps: a test of that failed CI
once. Here the call earns 0.5 (the agent's `called_credit`), so a policy that calls earns ~0.5 against chance's
0.1 and the rise is far above the noise. Slow: about a minute.
"""

from __future__ import annotations

import json
import statistics

import pytest

from jobs.progress import read_records
from jobs.train import main

pytestmark = pytest.mark.slow

STEPS = 30
CALLED_CREDIT = 0.5


def test_the_tool_use_preset_learns_to_call_the_tool(tmp_path, ray_session):
    out, record = tmp_path / "run", tmp_path / "rollouts.jsonl"
    agent_kwargs = {"run": "examples.lookup_agent:run",
                    "run_kwargs": {"record_path": str(record), "called_credit": CALLED_CREDIT}}
    items = [f"run.output_dir={out}", "run.plot=false", f"run.num_steps={STEPS}", "run.checkpoint_every=0",
             "scheduler.batch.global_batch_size=64", "rollout.groups_in_flight=8",
             f"rollout.agent_kwargs={json.dumps(agent_kwargs)}"]
    assert main(["--preset", "tool_use", *[a for item in items for a in ("--set", item)]]) == 0

    rollouts = [json.loads(line) for line in record.read_text().splitlines()]
    called = {}  # policy version -> first replies that were parsed calls (1) or not (0)
    for rollout in rollouts:
        called.setdefault(int(rollout["version"].removeprefix("policy-v")), []).append(rollout["called"])
    early = statistics.fmean(c for version in range(5) for c in called.get(version, []))
    late = statistics.fmean(c for version in range(STEPS - 5, STEPS) for c in called.get(version, []))
    sampled = [r["sampled_reward"] for r in read_records(out / "steps.jsonl") if r["sampled_reward"] is not None]
    print(f"valid calls by policy version: {early:.2f} (0-4) -> {late:.2f} ({STEPS - 5}-{STEPS - 1}); "
          f"sampled reward {statistics.fmean(sampled[:5]):.2f} -> {statistics.fmean(sampled[-5:]):.2f}")
    assert early < 0.25, f"the initial policies should call at chance (~0.05), got {early:.2f}"
    assert late >= 0.5, f"valid calls {late:.2f} by the last 5 versions"
    assert statistics.fmean(sampled[-5:]) >= statistics.fmean(sampled[:5]) + 0.15, sampled

    summary = json.loads((out / "summary.json").read_text())
    outcomes = summary["closed_loop"]["endpoint_outcomes"]
    assert outcomes["tool_calls/called"] >= sum(len(c) * statistics.fmean(c) for c in called.values())
    assert summary["closed_loop"]["failed_groups"] == {} and summary["rejected_samples_by_rule"] == {}
