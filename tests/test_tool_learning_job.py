"""Function calling is learned through the endpoint: `--preset tool_use`'s first steps, in CI.

Real everything: the job (`jobs.train.main` on the tests' Ray cluster), the vLLM CPU engine sampling a
from-scratch tiny Llama, the producers' endpoint with vLLM's `hermes` parser, examples/lookup_agent.py
(AsyncOpenAI with `tools=[lookup]`), Megatron trainers. The preset's whole curve (sampled reward from 0.09 to
0.91 in 120 steps at 128 rollouts a step, docs/agents.md) takes six minutes; this runs its first phase, 36
steps at 64 rollouts a step, where the policy learns to call the tool: the share of first replies the endpoint
returned as parsed `tool_calls`, by the policy version that sampled them (the agent's own record), rises from
chance (~0.05: the call is one word of 19) to >= 0.5, and the reward of the rollouts those versions sampled rises
with it by >= 0.15. Measured at 36 steps: 0.94 calls, reward 0.07 -> 0.48. At 30 steps most runs reached
0.82-0.87 calls, but one `.ci/run` 0.67 and a rise of 0.14 in the per-step sampled reward (a mean over whatever the
producers pushed between two steps: noisy), hence 36 steps and each version's rollouts pooled. The preset
credits a call answered with wrong digits 0.2, so in this phase its reward rises by ~0.08, within the noise of
five steps: a test of that failed CI once. Here the call earns 0.5 (the agent's `called_credit`), so a policy
that calls earns ~0.5 against chance's 0.1 and the rise is far above the noise. Slow: about a minute.
"""

from __future__ import annotations

import json
import statistics

import pytest

from jobs.progress import read_records
from jobs.train import main

pytestmark = pytest.mark.slow

STEPS = 36
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
    by_version = {}  # policy version that sampled the first reply -> its rollouts' records
    for rollout in rollouts:
        by_version.setdefault(int(rollout["version"].removeprefix("policy-v")), []).append(rollout)

    def mean_over_versions(key: str, versions: range) -> float:
        """Mean of `key` over every rollout the `versions` sampled (pooled: a version may sample few)."""
        return statistics.fmean(r[key] for version in versions for r in by_version.get(version, []))

    first, last = range(5), range(STEPS - 5, STEPS)
    early, late = mean_over_versions("called", first), mean_over_versions("called", last)
    reward_early, reward_late = mean_over_versions("reward", first), mean_over_versions("reward", last)
    sampled = [r["sampled_reward"] for r in read_records(out / "steps.jsonl") if r["sampled_reward"] is not None]
    print(f"by policy version, valid calls {early:.2f} (0-4) -> {late:.2f} ({STEPS - 5}-{STEPS - 1}), reward "
          f"{reward_early:.2f} -> {reward_late:.2f}; sampled reward by step {statistics.fmean(sampled[:5]):.2f} -> "
          f"{statistics.fmean(sampled[-5:]):.2f}")
    assert early < 0.25, f"the initial policies should call at chance (~0.05), got {early:.2f}"
    assert late >= 0.5, f"valid calls {late:.2f} by the last 5 versions"
    assert reward_late >= reward_early + 0.15, (reward_early, reward_late)

    summary = json.loads((out / "summary.json").read_text())
    outcomes = summary["closed_loop"]["endpoint_outcomes"]
    assert outcomes["tool_calls/called"] >= sum(r["called"] for r in rollouts)
    assert summary["closed_loop"]["failed_groups"] == {} and summary["rejected_samples_by_rule"] == {}
