"""Agents built on the OpenAI Agents SDK and on LangGraph train through the job, unchanged (slow: one job).

One closed-loop job (vLLM engine, the tiny model, a byte-level BPE chat tokenizer made in code, the endpoint
with vLLM's `hermes` tool parser) runs a user's dispatcher that hands each prompt to one of the two examples,
half of them streaming. A tiny random policy rarely writes a parseable call, so this test holds the plumbing
(each framework's requests accepted, streamed or not, its rollouts trained, their samples what the sessions
held); tests/test_endpoint_tools.py holds a parsed call's token exactness against a scripted engine.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from jobs.progress import read_records
from tests.agent_support import bpe_chat_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

DISPATCHER = '''
"""A user's agent: prompt i goes to the Agents SDK example (a + b even) or the LangGraph one (odd), streaming
when a is even; the rollout's samples and framework are recorded. A small tie-breaker keeps a group of equal
rewards (a random policy's usual) from being dropped as uniform, so the plumbing test trains steps."""
import json

from examples import agents_sdk_agent, langgraph_agent
from vgbs_ray.agents.openai_agent import make_agent as openai_agent

FRAMEWORK = {}  # base_url -> the framework that ran it


async def run(row, base_url, api_key):
    FRAMEWORK[base_url] = "agents_sdk" if (row["a"] + row["b"]) % 2 == 0 else "langgraph"
    module = agents_sdk_agent if FRAMEWORK[base_url] == "agents_sdk" else langgraph_agent
    return await module.run(row, base_url, api_key, max_tokens=24, streaming=row["a"] % 2 == 0)


def make_agent(record_path):
    inner = openai_agent("my_agents.dispatch:run")

    async def agent(row, ctx):
        reward = await inner(row, ctx)
        samples = ctx.samples()
        with open(record_path, "a") as file:
            file.write(json.dumps({"rollout_id": ctx.rollout_id, "framework": FRAMEWORK.pop(ctx.endpoint.base_url),
                                   "masks": [s["loss_mask"].tolist() for s in samples]}) + "\\n")
        return reward + 1e-3 * (sum(len(s["loss_mask"]) for s in samples) % 7)

    return agent
'''


def test_agents_sdk_and_langgraph_agents_train_three_steps(tmp_path, cluster_address):
    tokenizer_dir = tmp_path / "tokenizer"
    bpe_chat_tokenizer().save_pretrained(tokenizer_dir)
    (tmp_path / "my_agents").mkdir()
    (tmp_path / "my_agents" / "__init__.py").write_text("")
    (tmp_path / "my_agents" / "dispatch.py").write_text(textwrap.dedent(DISPATCHER))
    record, out = tmp_path / "rollouts.jsonl", tmp_path / "run"
    items = [f"run.output_dir={out}", f"run.ray_address={cluster_address}", "run.plot=false", "run.num_steps=3",
             "run.checkpoint_every=0", "rollout.endpoint.enabled=true", "rollout.endpoint.tool_parser=hermes",
             "rollout.agent=my_agents.dispatch:make_agent",
             f"rollout.agent_kwargs={json.dumps({'record_path': str(record)})}",
             "rollout.prompts=examples.calculator_agent:make_prompts", f"rollout.tokenizer_dir={tokenizer_dir}",
             "rollout.group_size=4", "rollout.groups_in_flight=2", "rollout.num_producers=1",
             "rollout.timeout_s=120", "rollout.engines.max_model_len=256", "train.model.vocab_size=400",
             "scheduler.batch.global_batch_size=8", "rollout.record_samples=true"]
    # Run from the user's directory (as `python -m jobs.train` there), attached to the tests' cluster.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "jobs.train", *[a for item in items for a in ("--set", item)]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    producers = summary["closed_loop"]["producers"]
    assert producers["endpoint_refused"] == 0 and producers["groups"] > 0, (  # every framework request was accepted
        producers, [line for line in done.stderr.splitlines() if "endpoint refused" in line])
    assert summary["closed_loop"]["failed_groups"] == {}  # no framework raised
    records = read_records(out / "steps.jsonl")
    assert len(records) == 3 and all(r["num_rollouts"] == 8 for r in records)
    pushed = [json.loads(line) for line in record.read_text().splitlines()]
    assert {row["framework"] for row in pushed} == {"agents_sdk", "langgraph"}
    assert all(row["masks"] and all(any(mask) for mask in row["masks"]) for row in pushed)  # each sample trains tokens
    # the opt-in record of what was pushed: the same rollouts and masks the agents saw in their sessions
    recorded = {row["rollout_id"]: row for row in map(json.loads, (out / "samples" / "producer-0.jsonl").read_text()
                                                      .splitlines())}
    assert {row["rollout_id"] for row in pushed} >= set(recorded) and recorded
    for row in pushed:
        if row["rollout_id"] in recorded:
            assert [s["loss_mask"] for s in recorded[row["rollout_id"]]["samples"]] == row["masks"]
