"""Hugging Face LlamaForCausalLM checkpoints in and out of the Megatron policy (tiny random models made here).

Megatron's logits equal transformers' (fp32, 1e-4) at TP=1 and TP=2; import then export gives
the same tensors bit for bit (TP=1 and TP=2, gathered); the export loads in transformers; a THD
packed micro-batch (the trainer's packing) gives the per-token log-probs of the HF model run
one sequence at a time.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.hf_support import (assert_logits_match, hf_log_probs, megatron_logits, model_config_for, run_tp_ranks,
                              tiny_hf_llama)
from tests.train_support import ensure_single_process_group
from vgbs_ray.errors import ConfigError

VOCAB = 96
SEQUENCES = [list(np.random.default_rng(seed).integers(0, VOCAB, length)) for seed, length in
             ((1, 7), (2, 23), (3, 40), (4, 2))]
SEQUENCES = [[int(t) for t in s] for s in SEQUENCES]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, tiny_hf_llama(path, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def megatron_tp1(hf_dir):
    from trainer.model import build_gpt_model

    ensure_single_process_group()
    config = model_config_for(hf_dir[0])
    return config, build_gpt_model(config).eval()


def test_megatron_logits_equal_transformers_at_tp1(hf_dir, megatron_tp1):
    _, hf_model = hf_dir
    _, model = megatron_tp1
    assert_logits_match(hf_model, SEQUENCES, [megatron_logits(model, tokens) for tokens in SEQUENCES])


def test_import_then_export_is_bit_exact_and_loads_in_transformers(hf_dir, megatron_tp1, tmp_path):
    from transformers import LlamaForCausalLM

    from trainer.hf_checkpoint import export_hf_weights, read_hf_weights, write_hf_checkpoint

    path, hf_model = hf_dir
    config, model = megatron_tp1
    original = read_hf_weights(path)
    exported = export_hf_weights(model, config)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    out = write_hf_checkpoint(tmp_path / "export", config, exported)
    reloaded = LlamaForCausalLM.from_pretrained(str(out), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for tokens in SEQUENCES[:2]:
            ids = torch.tensor([tokens])
            assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == config.num_query_groups


def test_tp2_logits_equal_transformers_and_export_gathers_bit_exact(hf_dir):
    from trainer.hf_checkpoint import read_hf_weights

    path, hf_model = hf_dir
    logits, exported = run_tp_ranks(path, SEQUENCES)
    assert_logits_match(hf_model, SEQUENCES, logits)
    original = read_hf_weights(path)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(torch.from_numpy(exported[name]), tensor), name


def test_packed_thd_log_probs_equal_transformers_one_sequence_at_a_time(hf_dir, megatron_tp1):
    from trainer.model import packed_seq_params
    from vgbs_ray.config import BatchConfig, ParallelConfig
    from vgbs_ray.layout.microbatch import pack_micro_batch
    from vgbs_ray.sample import make_rollout
    from vgbs_ray.layout.schedule import build_dp_schedule
    from vgbs_ray.layout.shard import build_step_shards

    _, hf_model = hf_dir
    _, model = megatron_tp1
    sequences = [s for s in SEQUENCES if len(s) > 2]
    samples = []
    for i, tokens in enumerate(sequences):  # response = the second half of each sequence
        response = len(tokens) // 2
        samples += make_rollout(f"r{i}", [dict(tokens=np.array(tokens), response_length=response,
                                                loss_mask=np.ones(response, np.int8))], reward=0.0, advantage=0.0)
    schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                 ParallelConfig(dp_size=1),
                                 BatchConfig(global_batch_size=len(samples), max_tokens_per_gpu=4096))
    shard = build_step_shards(samples, schedule.steps[0], 0)[0]
    (positions,) = shard.micro_batch_indices  # all sequences in one packed row
    mb = pack_micro_batch(shard, positions)
    assert mb.num_samples == len(sequences) and mb.max_seqlen == max(map(len, sequences))
    with torch.no_grad():
        logits = model(mb.tokens, mb.position_ids, None,
                       packed_seq_params=packed_seq_params(mb.cu_seqlens, mb.max_seqlen))[0].float()
    packed = torch.log_softmax(logits, dim=-1).gather(-1, mb.targets[0][:, None])[:, 0][mb.response_logit_index]
    expected = torch.cat([hf_log_probs(hf_model, sequences[p])[-samples[p].response_length:] for p in positions])
    assert packed.shape == expected.shape
    assert torch.allclose(packed, expected, atol=1e-4, rtol=0), float((packed - expected).abs().max())


def test_model_config_from_hf_refuses_what_the_policy_cannot_hold(hf_dir, tmp_path):
    from trainer.hf_checkpoint import model_config_from_hf

    path, _ = hf_dir
    hf = json.loads((path / "config.json").read_text())
    for key, value, match in (("mlp_bias", True, "mlp_bias=True"),
                              ("attention_bias", True, "attention_bias=True"),
                              ("model_type", "mistral", "model_type='mistral'"),
                              ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope type 'yarn'")):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(dict(hf, **{key: value})))
        with pytest.raises(ConfigError, match=match):
            model_config_from_hf(bad)
    config = model_config_from_hf(path)
    assert (config.num_query_groups, config.rope_theta, config.norm_epsilon, config.vocab_size) == (2, 5000.0, 1e-5, 96)


def test_a_model_config_that_differs_from_the_checkpoint_is_refused(hf_dir):
    from trainer.model import build_gpt_model
    from trainer.config import ModelConfig

    path, _ = hf_dir
    ensure_single_process_group()
    with pytest.raises(ConfigError, match=r"vocab_size=128 \(checkpoint: 96\)"):
        build_gpt_model(ModelConfig(hf_checkpoint_dir=str(path)))


@pytest.mark.slow
def test_train_group_at_tp2_pp2_starts_from_the_checkpoint_and_publishes_it_back(hf_dir, ray_session):
    """Every rank loads its TP shard of its pipeline stage's layers; the weight-sync export of the
    whole group (TP gathered, stages joined, HF names) is the checkpoint bit for bit."""
    from trainer.hf_checkpoint import read_hf_weights
    from trainer.config import TrainGroupConfig
    from actors.train_group import TrainGroup
    from actors.weight_sync import publish_weights

    path, _ = hf_dir
    group = TrainGroup(TrainGroupConfig(tp_size=2, pp_size=2, model=model_config_for(path)))
    try:
        published = publish_weights(group, 0)
        exported = ray_session.get(published.ref)
    finally:
        group.shutdown()
    original = read_hf_weights(path)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert np.array_equal(exported[name], tensor.numpy()), name
    assert published.num_bytes == sum(t.numel() * 4 for t in original.values())
