"""The Llama-architecture policy: its config rules, RoPE on CPU (megatron_cpu_compat), and RoPE
positions in THD packed micro-batches (they restart at every sequence)."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ModelConfig, TrainGroupConfig
from tests.train_support import ensure_single_process_group
from vgbs_ray.errors import ConfigError


def test_default_model_fits_the_vllm_cpu_attention_and_uses_gqa():
    config = ModelConfig()
    assert config.head_dim >= 32  # vLLM's CPU attention refuses smaller head dimensions
    assert config.num_query_groups < config.num_attention_heads


@pytest.mark.parametrize("overrides,match", [
    (dict(num_query_groups=3), r"num_query_groups=3 must divide num_attention_heads=4"),
    (dict(hidden_size=102), r"hidden_size=102 must be a multiple of num_attention_heads=4"),
    (dict(hidden_size=36, num_attention_heads=4, num_query_groups=1), r"head_dim = 9 .* must be positive and even"),
    (dict(kv_channels=7), r"head_dim = 7 .* must be positive and even"),
    (dict(family="gpt2"), r"model family 'gpt2' is not supported; supported: \['llama', 'qwen2', 'qwen3', 'qwen3_moe'\]"),
    (dict(norm_epsilon=0.0), r"norm_epsilon \(0.0\) must be > 0"),
])
def test_model_config_errors_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**overrides)


def test_tp_size_must_divide_the_key_value_groups():
    with pytest.raises(ConfigError, match=r"tp_size=4 must divide model.num_query_groups=2"):
        TrainGroupConfig(tp_size=4)


@pytest.fixture(scope="module")
def model():
    from trainer.model import build_gpt_model

    ensure_single_process_group()
    return build_gpt_model(ModelConfig(rope_theta=500.0)).eval()


def test_rope_on_cpu_uses_the_compat_embedding_and_the_llama_frequencies(model):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from trainer.megatron_cpu_compat import make_rotary_embedding_cpu_safe

    rope = model.rotary_pos_emb
    assert isinstance(rope, RotaryEmbedding) and type(rope) is not RotaryEmbedding
    assert not make_rotary_embedding_cpu_safe(model)  # idempotent: already swapped
    emb = rope(7)  # Megatron's own get_emb would ask for torch.cuda.current_device() here
    head_dim = ModelConfig().head_dim
    inv_freq = 1.0 / 500.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(7, dtype=torch.float32), inv_freq)
    assert emb.device.type == "cpu" and emb.shape == (7, 1, 1, head_dim)
    assert torch.equal(emb[:, 0, 0], torch.cat([angles, angles], dim=-1))  # rotate-half layout, as HF


def _queries_seen_by_attention(model, tokens, position_ids, **kwargs) -> torch.Tensor:
    """The rotated queries the first layer's core attention receives, one row per token ([T, heads, dim])."""
    seen = []
    attention = model.decoder.layers[0].self_attention.core_attention
    handle = attention.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            model(tokens, position_ids, None, **kwargs)
    finally:
        handle.remove()
    (query,) = seen
    return query.reshape(tokens.shape[1], *query.shape[-2:])  # sbhd [s, 1, h, d] or thd [t, h, d]


def test_packed_sequences_get_positions_that_restart_at_every_sequence(model):
    """Log-probs cannot show this (RoPE is relative and attention stays within a sequence): compare
    the rotated queries of a packed row with each sequence run alone."""
    from trainer.model import packed_seq_params

    lengths = [5, 9, 3]
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, ModelConfig().vocab_size, (1, n), generator=gen) for n in lengths]
    packed = torch.cat(sequences, dim=1)
    cu_seqlens = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    alone = torch.cat([_queries_seen_by_attention(model, s, torch.arange(s.shape[1])[None]) for s in sequences])

    right = _queries_seen_by_attention(model, packed, positions,
                                       packed_seq_params=packed_seq_params(cu_seqlens, max(lengths)))
    assert torch.allclose(right, alone, atol=1e-6, rtol=0)
    # The trap: max_seqlen = total tokens makes Megatron run one offset over the whole row.
    wrong = _queries_seen_by_attention(model, packed, positions,
                                       packed_seq_params=packed_seq_params(cu_seqlens, sum(lengths)))
    assert torch.allclose(wrong[:5], alone[:5], atol=1e-6, rtol=0)
    assert not torch.allclose(wrong[5:], alone[5:], atol=1e-3, rtol=0)
