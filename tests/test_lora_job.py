"""The job with `train.lora` (the demo's digit agent, three steps): the engine samples with the adapter (the
first step's trainer and engine log-probs agree), every sync after the first carries the adapter alone, and the
checkpoint has an adapter/ in PEFT's format (peft reads it; tests/test_lora.py checks such files' logits).
"""

from __future__ import annotations

import json

import pytest

from jobs.progress import read_records
from jobs.train import main

pytestmark = pytest.mark.slow  # a vLLM engine and two Megatron ranks: ~30 s


def test_a_lora_job_syncs_the_adapter_alone_and_leaves_peft_files(ray_session, tmp_path):
    out = tmp_path / "run"
    items = [f"run.output_dir={out}", "run.plot=false", "run.num_steps=3", "run.checkpoint_every=3",
             "train.lora.rank=8", "train.lora.target_modules=[q_proj, v_proj, down_proj]"]
    assert main([a for item in items for a in ("--set", item)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    loop = summary["closed_loop"]
    assert loop["engine_load_mb_last"] < loop["engine_load_mb_first"] / 5  # the adapter alone after the first
    first = read_records(out / "steps.jsonl")[0]
    assert first["log_prob_mismatch"] < 1e-4  # at step 0 the engine samples exactly the trainer's policy
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(str(out / "checkpoints" / "step_000003" / "adapter"))
    assert config.r == 8 and set(config.target_modules) == {"q_proj", "v_proj", "down_proj"}
