"""The checkpoints people post-train: Llama 3.x, Qwen2.5, Qwen3 and Qwen3-MoE shapes from Hugging Face (tiny random
models made here with `transformers`, norms and biases random too).

Per shape (`tests.hf_support.FAMILY_SHAPES`): Megatron's logits equal transformers' (fp32, 1e-4) at TP=1
and TP=2; import then export is bit-exact with the checkpoint's own tensor names (tied: no lm_head);
the export loads in transformers with the same logits, and in vLLM, whose log-probs equal the
trainer's before and after a weight sync (here for the shapes without a job; tests/test_model_family_jobs.py
checks the others inside a job). What the policy cannot hold is refused naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest
import torch

from tests.hf_support import (FAMILY_SHAPES, JOB_SHAPES, assert_logits_match, megatron_logits, model_config_for,
                              response_log_probs, run_parallel_ranks, tiny_hf_model)
from tests.train_support import ensure_single_process_group
from vgbs_ray.errors import ConfigError

VOCAB = 96
SEQUENCES = [[int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, length)]
             for seed, length in ((1, 7), (2, 40), (3, 120))]
SHAPES = sorted(FAMILY_SHAPES)
DIGIT_TOKENIZER = pathlib.Path(__file__).resolve().parents[1] / "examples" / "digit_tokenizer"


@pytest.fixture(scope="module", params=SHAPES)
def checkpoint(request, tmp_path_factory):
    """(shape, directory, transformers model, ModelConfig, Megatron model at TP=1)."""
    from trainer.model import build_gpt_model

    path = tmp_path_factory.mktemp(request.param)
    hf_model = tiny_hf_model(path, request.param, vocab_size=VOCAB)
    ensure_single_process_group()
    config = model_config_for(path)
    return request.param, path, hf_model, config, build_gpt_model(config).eval()


def test_model_config_carries_the_family_and_its_features(checkpoint):
    shape, _, hf_model, config, _ = checkpoint
    hf = hf_model.config
    assert config.family == hf.model_type and config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert (config.rope_scaling is not None) == (shape == "llama3_tied")


def test_megatron_logits_equal_transformers_at_tp1(checkpoint):
    _, _, hf_model, _, model = checkpoint
    assert_logits_match(hf_model, SEQUENCES, [megatron_logits(model, tokens) for tokens in SEQUENCES])


def test_import_then_export_is_bit_exact_with_the_checkpoints_names_and_loads_in_transformers(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.hf_checkpoint import export_hf_weights, read_hf_weights, write_hf_checkpoint

    _, path, hf_model, config, model = checkpoint
    original = read_hf_weights(path)
    exported = export_hf_weights(model, config)
    assert set(exported) == set(original)  # tied: neither side has lm_head.weight
    assert ("lm_head.weight" in exported) == (not config.tie_word_embeddings)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    out = write_hf_checkpoint(tmp_path / "export", config, exported)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == config.family and written["architectures"] == [type(hf_model).__name__]
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").float().eval()
    assert type(reloaded) is type(hf_model)
    with torch.no_grad():
        for tokens in SEQUENCES[:2]:
            ids = torch.tensor([tokens])
            assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)


def test_llama3_rope_scaling_is_applied_not_ignored(checkpoint):
    """The same weights with plain RoPE give other logits: the match above depends on the scaling."""
    from trainer.hf_checkpoint import load_hf_weights, read_hf_weights
    from trainer.model import build_gpt_model

    shape, path, hf_model, config, _ = checkpoint
    if config.rope_scaling is None:
        pytest.skip(f"{shape} has plain RoPE")
    plain = dataclasses.replace(config, rope_scaling=None, hf_checkpoint_dir=None)
    model = build_gpt_model(plain).eval()
    load_hf_weights(model, read_hf_weights(path), plain)
    tokens = SEQUENCES[-1]
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    assert float((megatron_logits(model, tokens) - expected).abs().max()) > 1e-2


MOE_SHAPES = [s for s in SHAPES if "moe" in s]


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """Every shape at TP=2, and each mixture of experts at EP=2, in one spawn of two ranks (a spawn costs more
    than its runs): {(shape, "tp2" | "ep2"): (transformers model, checkpoint directory, rank 0's logits, export)}."""
    checkpoints = {}
    for shape in SHAPES:
        path = tmp_path_factory.mktemp(f"{shape}-parallel")
        checkpoints[shape] = (tiny_hf_model(path, shape, vocab_size=VOCAB), path)
    runs = [(shape, "tp2", 1) for shape in SHAPES] + [(shape, "ep2", 2) for shape in MOE_SHAPES]
    reports = run_parallel_ranks([(checkpoints[shape][1], ep_size) for shape, _, ep_size in runs], SEQUENCES)
    return {(shape, kind): (*checkpoints[shape], *report) for (shape, kind, _), report in zip(runs, reports)}


def _assert_parallel_run(parallel_runs, shape: str, kind: str) -> None:
    from trainer.hf_checkpoint import read_hf_weights

    hf_model, path, logits, exported = parallel_runs[(shape, kind)]
    assert_logits_match(hf_model, SEQUENCES, logits)
    original = read_hf_weights(path)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(torch.from_numpy(exported[name]), tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_tp2_logits_equal_transformers_and_export_gathers_bit_exact(parallel_runs, shape):
    _assert_parallel_run(parallel_runs, shape, "tp2")


@pytest.mark.slow
@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_ep2_logits_equal_transformers_and_export_gathers_every_expert_bit_exact(parallel_runs, shape):
    """Expert parallelism over gloo: each of two ranks holds half the experts, and their token counts differ."""
    _assert_parallel_run(parallel_runs, shape, "ep2")


SERVED_SHAPES = [s for s in SHAPES if s not in JOB_SHAPES]
"""The shapes without a job (tests/test_model_family_jobs.py checks the JOB_SHAPES' engines against the trainer)."""


@pytest.fixture(scope="module")
def served_exports(ray_session, tmp_path_factory):
    """{shape: (ModelConfig, Megatron model at TP=1, its export, an engine pool serving the export)}: every
    SERVED_SHAPES engine starts at once (a start is one core's work for ~10 s), each test then uses its own."""
    from trainer.hf_checkpoint import export_hf_weights, write_hf_checkpoint
    from trainer.model import build_gpt_model
    from actors.rollout_engine import EngineConfig, RolloutEnginePool

    ensure_single_process_group()
    served = {}
    try:
        for shape in SERVED_SHAPES:
            path = tmp_path_factory.mktemp(f"{shape}-served")
            tiny_hf_model(path, shape, vocab_size=VOCAB)
            config = model_config_for(path)
            model = build_gpt_model(config).eval()
            exported = export_hf_weights(model, config)
            out = write_hf_checkpoint(path / "export", config, exported)
            engines = RolloutEnginePool(EngineConfig(num_engines=1, max_model_len=64), str(out), wait=False,
                                        name_prefix=f"served-{shape}")
            served[shape] = (config, model, exported, engines)
        yield served
    finally:
        for *_, engines in served.values():
            engines.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("shape", SERVED_SHAPES)
def test_the_export_serves_in_vllm_and_its_log_probs_equal_the_trainers_before_and_after_a_sync(served_exports, shape,
                                                                                               ray_session):
    """vLLM builds the family from the exported directory; a sync of other weights (HF names, as the
    train group publishes them) changes its outputs to exactly what the trainer computes."""
    from trainer.hf_checkpoint import load_hf_weights
    from trainer.model import build_gpt_model
    from actors.weight_sync import PublishedWeights
    from vgbs_ray.agents import SamplingConfig

    config, model, exported, engines = served_exports[shape]
    prompts = [SEQUENCES[0], SEQUENCES[1][:20]]
    sampling = SamplingConfig(max_tokens=10, seed=3)
    engines.wait_started()
    try:
        generations = engines.generate(prompts, sampling)
        for got, expected in zip([g.response_log_probs for g in generations], response_log_probs(model, generations)):
            assert np.abs(got - expected).max() < 1e-4, np.abs(got - expected).max()
        generator = torch.Generator().manual_seed(5)
        other = {name: (t + 0.05 * torch.randn(t.shape, generator=generator)).numpy() for name, t in exported.items()}
        synced = PublishedWeights(policy_version=1, ref=ray_session.put(other),
                                  num_bytes=sum(a.nbytes for a in other.values()), publish_time_s=0.0)
        engines.wait_for_weights(engines.update_weights(synced))
        after = engines.generate(prompts, sampling)
    finally:
        engines.shutdown()
    assert [g.policy_version for g in after] == [1, 1]
    trainer = build_gpt_model(dataclasses.replace(config, hf_checkpoint_dir=None)).eval()
    load_hf_weights(trainer, {k: torch.from_numpy(v) for k, v in other.items()}, config)
    for got, expected, before in zip([g.response_log_probs for g in after], response_log_probs(trainer, after),
                                     generations):
        assert np.abs(got - expected).max() < 1e-4, np.abs(got - expected).max()
    assert any(not np.allclose(a.response_log_probs[:1], b.response_log_probs[:1], atol=1e-3)
               for a, b in zip(generations, after))


# -- refusals (no model needed) --------------------------------------------------------------------------


def _config_json(**changes) -> dict:
    base = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 96, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu"}
    return {k: v for k, v in dict(base, **changes).items() if v is not None}


@pytest.mark.parametrize("changes, match", [
    (dict(model_type="deepseek_v3"),
     r"model_type='deepseek_v3' is not supported; supported: \['llama', 'qwen2', 'qwen3', 'qwen3_moe'\]"),
    (dict(model_type="qwen2_moe"), r"model_type='qwen2_moe' is not supported"),
    (dict(model_type="qwen3_moe", num_experts_per_tok=2, moe_intermediate_size=32), r"missing key 'num_experts'"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
          decoder_sparse_step=2), r"decoder_sparse_step=2 is not supported"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
          mlp_only_layers=[1]), r"mlp_only_layers=\[1\] is not supported"),
    (dict(model_type="mistral"), r"model_type='mistral' is not supported"),
    (dict(use_sliding_window=True), r"use_sliding_window=True is not supported"),
    (dict(model_type="qwen3", layer_types=["full_attention", "sliding_attention"]), r"layer_types .* layers \[1\]"),
    (dict(model_type="llama", attention_bias=True), r"attention_bias=True is not supported"),
    (dict(model_type="llama", mlp_bias=True), r"mlp_bias=True is not supported"),
    (dict(model_type="qwen3", attention_bias=True), r"attention_bias=True is not supported"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), r"rope type 'yarn' is not supported"),
    (dict(model_type="llama", rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     r"llama3 rope parameters lack 'original_max_position_embeddings'"),
    (dict(num_hidden_layers=None), r"missing key 'num_hidden_layers'"),
])
def test_what_the_policy_cannot_hold_is_refused_naming_the_key(changes, match):
    from vgbs_ray.models.families import model_fields_from_hf_config

    with pytest.raises(ConfigError, match=match):
        model_fields_from_hf_config(_config_json(**changes), "ckpt/config.json")


@pytest.mark.parametrize("family, extra", [
    ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})),
    ("qwen2", dict()),
    ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    ("qwen3_moe", dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True)),
])
def test_a_written_config_json_reads_back_as_the_same_model(family, extra):
    from trainer.hf_checkpoint import hf_config_dict
    from trainer.config import ModelConfig
    from vgbs_ray.models.families import model_fields_from_hf_config

    config = ModelConfig(**model_fields_from_hf_config(_config_json(model_type=family, **extra), "x"))
    again = ModelConfig(**model_fields_from_hf_config(hf_config_dict(config), "y"))
    assert again == config and config.family == family


def test_what_the_cpu_train_path_does_not_run_yet_is_refused_at_configuration():
    from trainer.config import ModelConfig, TrainGroupConfig

    with pytest.raises(ConfigError, match="tie_word_embeddings=True needs pp_size=1"):
        TrainGroupConfig(pp_size=2, model=ModelConfig(tie_word_embeddings=True))
    moe = ModelConfig(family="qwen3_moe", kv_channels=32, num_experts=4, moe_ffn_hidden_size=32)
    with pytest.raises(ConfigError, match="mixture-of-experts model .* needs pp_size=1"):
        TrainGroupConfig(pp_size=2, model=moe)
    with pytest.raises(ConfigError, match="ep_size=2 needs a mixture-of-experts model"):
        TrainGroupConfig(dp_size=2, ep_size=2)
    with pytest.raises(ConfigError, match="ep_size=2 must divide dp_size=1"):
        TrainGroupConfig(ep_size=2, model=moe)
    with pytest.raises(ConfigError, match="ep_size=3 must divide model.num_experts=4"):
        TrainGroupConfig(dp_size=3, ep_size=3, model=moe)
    assert TrainGroupConfig(dp_size=4, ep_size=2, model=moe).parallel_config.dp_size == 4  # EP ranks are DP ranks
    with pytest.raises(ConfigError, match="params_dtype='bfloat16' needs backend='nccl'"):
        TrainGroupConfig(model=ModelConfig(params_dtype="bfloat16"))
    with pytest.raises(ConfigError, match="family 'llama' is dense: leave it None"):
        ModelConfig(num_experts=4, moe_ffn_hidden_size=32)
    with pytest.raises(ConfigError, match="family 'qwen3_moe' is a mixture of experts: set num_experts"):
        ModelConfig(family="qwen3_moe")
    with pytest.raises(ConfigError, match=r"1 <= moe_router_topk \(5\) <= num_experts \(4\)"):
        ModelConfig(family="qwen3_moe", num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=5)


def test_job_config_takes_the_model_and_tokenizer_from_the_checkpoint_directory(tmp_path):
    """`train.model.hf_checkpoint_dir=DIR` alone sets the family and shape; the tokenizer is DIR's own."""
    import shutil

    from jobs.job_config import load_job_config

    (tmp_path / "config.json").write_text(json.dumps(_config_json(model_type="qwen3", head_dim=32)))
    bare = load_job_config(None, [f"train.model.hf_checkpoint_dir={tmp_path}", "train.dp_size=1"])
    assert (bare.train.model.family, bare.train.model.head_dim, bare.train.model.vocab_size) == ("qwen3", 32, 96)
    assert bare.rollout.tokenizer_dir is None  # no tokenizer there: token ids only
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DIGIT_TOKENIZER / name, tmp_path / name)
    with_tokenizer = load_job_config(None, [f"train.model.hf_checkpoint_dir={tmp_path}", "train.dp_size=1"])
    assert with_tokenizer.rollout.tokenizer_dir == str(tmp_path.resolve())
    with pytest.raises(ConfigError, match="has no config.json"):
        load_job_config(None, [f"train.model.hf_checkpoint_dir={tmp_path / 'nowhere'}"])
