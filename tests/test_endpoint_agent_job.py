"""An OpenAI-client agent trains through the job's endpoint, token for token.

The example examples/calculator_agent.py (ordinary `openai` code with a plain-text calculator
tool, compacting its history after the first turn) runs through `python -m jobs.train` with the
endpoint on, a byte-level BPE chat tokenizer made in code and the vLLM engine, for a few steps.
A wrapper agent in the test's directory (as a user would write one) records each rollout's
samples as pushed; the example records what the client saw (the engine's token ids per turn, the
tool's replies). Then, for every rollout the final ledger says was trained:
- the samples' trained tokens (mask 1) are exactly the engine's outputs the client received, in order;
- each tool or user reply sent back is the context right after the turn it answers;
- a rollout that compacted is two samples under its one rollout id;
- the step records count rollouts (the ledger's trained rollouts per step), not samples.
Slow: one closed-loop job, ~2 minutes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jobs.progress import read_records
from tests.agent_support import bpe_chat_tokenizer

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]

RECORDING_AGENT = '''
"""A user's wrapper: the OpenAI-client example through the endpoint, recording each rollout's samples."""
import json

from vgbs_ray.agents.openai_agent import make_agent as openai_agent


def make_agent(samples_path, **kwargs):
    inner = openai_agent(**kwargs)

    async def agent(row, ctx):
        result = await inner(row, ctx)
        samples = [{key: sample[key].tolist() for key in ("tokens", "loss_mask")} | {
            "response_length": int(sample["response_length"])} for sample in ctx.samples()]
        with open(samples_path, "a") as file:
            file.write(json.dumps({"rollout_id": ctx.rollout_id, "samples": samples}) + "\\n")
        return result

    return agent
'''


def trained_runs_and_gaps(sample: dict) -> tuple[list[list[int]], list[list[int]]]:
    """The mask-1 runs of a sample's response, and the mask-0 run after each (empty after the last)."""
    response = sample["tokens"][len(sample["tokens"]) - sample["response_length"]:]
    runs, gaps = [], []
    for token, mask in zip(response, sample["loss_mask"]):
        if mask:
            if not runs or gaps[-1]:
                runs.append([])
                gaps.append([])
            runs[-1].append(token)
        else:
            gaps[-1].append(token)
    return runs, gaps


def test_the_calculator_agent_trains_through_the_endpoint_token_for_token(tmp_path, cluster_address):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = bpe_chat_tokenizer()
    tokenizer.save_pretrained(tokenizer_dir)
    (tmp_path / "my_agents").mkdir()
    (tmp_path / "my_agents" / "__init__.py").write_text("")
    (tmp_path / "my_agents" / "recording.py").write_text(textwrap.dedent(RECORDING_AGENT))
    samples_path, transcript_path, out = tmp_path / "samples.jsonl", tmp_path / "transcripts.jsonl", tmp_path / "run"
    kwargs = {"samples_path": str(samples_path), "run": "examples.calculator_agent:run",
              "run_kwargs": {"compact_after": 1, "transcript_path": str(transcript_path)}}
    items = [f"run.output_dir={out}", f"run.ray_address={cluster_address}", "run.plot=false", "run.num_steps=3", "run.checkpoint_every=0",
             "rollout.endpoint.enabled=true", "rollout.agent=my_agents.recording:make_agent",
             f"rollout.agent_kwargs={json.dumps(kwargs)}",
             "rollout.prompts=examples.calculator_agent:make_prompts", f"rollout.tokenizer_dir={tokenizer_dir}",
             "rollout.group_size=4", "rollout.groups_in_flight=2", "rollout.num_producers=1",
             "rollout.timeout_s=120", "rollout.engines.max_model_len=256", "train.model.vocab_size=400",
             "scheduler.batch.global_batch_size=8"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "jobs.train", *[a for item in items for a in ("--set", item)]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (out / "endpoint_token").stat().st_mode & 0o077 == 0
    producers = json.loads((out / "summary.json").read_text())["closed_loop"]["producers"]
    assert producers["endpoint_refused"] == 0 and producers["groups"] > 0, (  # every request was a valid one
        producers, [line for line in done.stderr.splitlines() if "endpoint refused" in line])

    checkpoints = out / "checkpoints"
    ledger = json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "ledger.json").read_text())
    trained = {rid: step for rid, (state, step, _) in ledger["rollouts"].items() if state == "trained"}
    assert trained
    pushed = {row["rollout_id"]: row["samples"] for row in map(json.loads, samples_path.read_text().splitlines())}
    transcripts = {}
    for line in transcript_path.read_text().splitlines():
        record = json.loads(line)
        session = record["base_url"].rsplit("/sessions/", 1)[1].removesuffix("/v1")
        transcripts[session.rsplit("-", 1)[0]] = record["turns"]

    compacted = 0
    for rollout_id in trained:
        samples, turns = pushed[rollout_id], transcripts[rollout_id]
        runs, gaps = [], []
        for sample in samples:
            sample_runs, sample_gaps = trained_runs_and_gaps(sample)
            runs += sample_runs
            gaps += sample_gaps
        assert runs == [turn["token_ids"] for turn in turns], rollout_id  # the engine's outputs, in order
        for turn, sample_gap in zip(turns, gaps):
            if turn["environment"] is not None and not turn.get("compacted") and sample_gap:
                assert turn["environment"] in tokenizer.decode(sample_gap), rollout_id
        if any(t.get("compacted") for t in turns[:-1]):
            compacted += 1
            assert len(samples) == 2, rollout_id  # one id, two samples
            second_prompt = tokenizer.decode(samples[1]["tokens"][:len(samples[1]["tokens"]) -
                                                                  samples[1]["response_length"]])
            assert "So far:" in second_prompt
        else:
            assert len(samples) == 1, rollout_id
        assert sum(sum(s["loss_mask"]) for s in samples) == sum(len(t["token_ids"]) for t in turns)
    assert compacted > 0, "no trained rollout went past its compaction"

    records = list(read_records(out / "steps.jsonl"))
    assert len(records) == 3
    for record in records:
        step_rollouts = [rid for rid, step in trained.items() if step == record["step"]]
        assert record["num_rollouts"] == len(step_rollouts)
        assert record["num_samples"] == sum(len(pushed[rid]) for rid in step_rollouts)
    assert any(r["num_samples"] > r["num_rollouts"] for r in records)  # compactions: more samples than rollouts
    assert np.isfinite([r["loss"] for r in records]).all()
