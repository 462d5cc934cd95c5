"""A closed-loop job trains from a Hugging Face checkpoint of each family, started as a user would start
one: `python -m jobs.train --set train.model.hf_checkpoint_dir=DIR` (the family, shape and tokenizer come
from DIR), here `jobs.train.main` with those arguments on the tests' Ray cluster. The checkpoints are tiny random models made here (`tests.hf_support.FAMILY_SHAPES`) with
the digit task's tokenizer saved beside them, so the demo's agent runs on them unchanged.

The jobs run on-policy (max_staleness 0, decoupled PPO), so each step's `log_prob_mismatch` (mean |trainer's
recomputed log-prob - engine's behaviour log-prob| per token) tests that vLLM serves the family as the trainer
computes it: step 0 samples the engines' first load of the checkpoint's weights, step 1 the weights the group
trained and synced (HF names, as it publishes them; for the MoE, by a restart of vLLM). tests/test_model_families.py
checks the same per token, outside a job, for the shapes that have no job here. Slow: 20-35 s per family on 2 cores.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from jobs.progress import read_records
from jobs.train import main
from tests.hf_support import JOB_SHAPES, tiny_hf_model

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS, GLOBAL_BATCH = 2, 8  # each step's weights reach the engines (for the MoE, by a vLLM restart each time)
MISMATCH = 1e-5  # float32 on both sides: measured 3e-8 to 3e-7


# expert parallelism for the MoE: each rank holds half the experts
PARALLEL = {"qwen3_moe": ["train.dp_size=2", "train.ep_size=2"]}


@pytest.mark.parametrize("shape", JOB_SHAPES)
def test_a_closed_loop_job_trains_from_a_checkpoint_of_each_family(ray_session, shape, tmp_path):
    parallel = PARALLEL.get(shape, ["train.dp_size=1"])
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "run"
    hf_model = tiny_hf_model(checkpoint, shape, vocab_size=96)
    for path in (ROOT / "examples" / "digit_tokenizer").iterdir():
        shutil.copy(path, checkpoint / path.name)
    items = [f"run.output_dir={out}", "run.plot=false", f"run.num_steps={STEPS}", "run.checkpoint_every=0",
             f"train.model.hf_checkpoint_dir={checkpoint}", *parallel, "rollout.group_size=4",
             "rollout.num_producers=1", f"scheduler.batch.global_batch_size={GLOBAL_BATCH}",
             "train.loss.off_policy.max_staleness=0", "train.loss.policy=decoupled_ppo"]
    assert main([a for item in items for a in ("--set", item)]) == 0

    records = read_records(out / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["num_rollouts"] for r in records] == [GLOBAL_BATCH] * STEPS
    assert all(r["weight_sync_s"] is not None for r in records)  # every version reached the engines
    assert all(r["staleness_max"] == 0 and r["log_prob_mismatch"] < MISMATCH for r in records), [
        (r["staleness_max"], r["log_prob_mismatch"]) for r in records]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["closed_loop"]["failed_groups"] == {}
    # The engines started from the family's export, with the checkpoint's tokenizer beside it.
    engine_dir = out / "policy_init"
    written = json.loads((engine_dir / "config.json").read_text())
    assert written["model_type"] == hf_model.config.model_type
    assert written["tie_word_embeddings"] == hf_model.config.tie_word_embeddings
    assert (engine_dir / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
