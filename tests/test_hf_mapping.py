"""The Megatron <-> Hugging Face Llama table (pure: plain tensors, no Megatron, no transformers)."""

from __future__ import annotations

import pytest
import torch

from vgbs_ray.models.hf_mapping import (WeightMappingError, canonical_megatron_name, gather_tp_shards, hf_to_megatron,
                                 megatron_to_hf, split_tp_shard)

HIDDEN, HEADS, GROUPS, FFN, VOCAB, LAYERS = 64, 4, 2, 96, 50, 2
HEAD_DIM = HIDDEN // HEADS


def random_hf_state(seed: int = 0, heads: int = HEADS, groups: int = GROUPS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    state = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": r(HIDDEN),
             "lm_head.weight": r(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": r(HIDDEN), p + "post_attention_layernorm.weight": r(HIDDEN),
            p + "self_attn.q_proj.weight": r(heads * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": r(groups * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": r(groups * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": r(HIDDEN, heads * HEAD_DIM),
            p + "mlp.gate_proj.weight": r(FFN, HIDDEN), p + "mlp.up_proj.weight": r(FFN, HIDDEN),
            p + "mlp.down_proj.weight": r(HIDDEN, FFN),
        })
    return state


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (4, 1)])
def test_round_trips_are_bit_exact(heads, groups):
    hf = random_hf_state(heads=heads, groups=groups)
    megatron = hf_to_megatron(hf, num_attention_heads=heads, num_query_groups=groups)
    back = megatron_to_hf(megatron, num_attention_heads=heads, num_query_groups=groups)
    assert set(back) == set(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
    again = hf_to_megatron(back, num_attention_heads=heads, num_query_groups=groups)
    assert all(torch.equal(again[name], megatron[name]) for name in megatron)


def test_fused_qkv_rows_are_grouped_per_key_value_head():
    hf = random_hf_state()
    p = "model.layers.1.self_attn."
    # Label every row by its head: q head h -> 100 + h, k group j -> 200 + j, v group j -> 300 + j.
    hf[p + "q_proj.weight"] = (100 + torch.arange(HEADS)).repeat_interleave(HEAD_DIM)[:, None].float().expand(-1, HIDDEN)
    hf[p + "k_proj.weight"] = (200 + torch.arange(GROUPS)).repeat_interleave(HEAD_DIM)[:, None].float().expand(-1, HIDDEN)
    hf[p + "v_proj.weight"] = (300 + torch.arange(GROUPS)).repeat_interleave(HEAD_DIM)[:, None].float().expand(-1, HIDDEN)
    qkv = hf_to_megatron(hf, num_attention_heads=HEADS, num_query_groups=GROUPS)[
        "decoder.layers.1.self_attention.linear_qkv.weight"]
    row_heads = qkv[::HEAD_DIM, 0].tolist()  # one label per head-sized block of rows
    assert row_heads == [100, 101, 200, 300, 102, 103, 201, 301]


def test_fc1_is_gate_then_up():
    hf = random_hf_state()
    fc1 = hf_to_megatron(hf, num_attention_heads=HEADS, num_query_groups=GROUPS)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:FFN], hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[FFN:], hf["model.layers.0.mlp.up_proj.weight"])


def test_unknown_and_missing_weights_are_named():
    hf = random_hf_state()
    extra = dict(hf, **{"model.layers.0.self_attn.q_norm.weight": torch.ones(HEAD_DIM)})
    with pytest.raises(WeightMappingError, match=r"q_norm"):
        hf_to_megatron(extra, num_attention_heads=HEADS, num_query_groups=GROUPS)
    missing = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    with pytest.raises(WeightMappingError, match=r"missing weight 'lm_head.weight'"):
        hf_to_megatron(missing, num_attention_heads=HEADS, num_query_groups=GROUPS)
    with pytest.raises(WeightMappingError, match=r"num_query_groups=3"):
        hf_to_megatron(hf, num_attention_heads=HEADS, num_query_groups=3)


def test_transformer_engine_fused_norm_names_map_to_the_local_ones():
    assert canonical_megatron_name("module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_megatron_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    assert canonical_megatron_name("decoder.layers.0.mlp.linear_fc1.weight") == "decoder.layers.0.mlp.linear_fc1.weight"


@pytest.mark.parametrize("dim,stride,tp", [(0, 1, 2), (1, 1, 2), (0, 2, 2), (0, 2, 4), (0, 1, 1)])
def test_tp_split_then_gather_is_identity(dim, stride, tp):
    full = torch.randn(16, 8) if dim == 0 else torch.randn(8, 16)
    shards = [split_tp_shard(full, tp_rank=r, tp_size=tp, partition_dim=dim, stride=stride) for r in range(tp)]
    assert all(s.shape[dim] == full.shape[dim] // tp for s in shards)
    assert torch.equal(gather_tp_shards(shards, partition_dim=dim, stride=stride), full)


def test_stride_two_shard_holds_its_gate_and_up_slices():
    gate, up = torch.arange(8.0)[:, None], 100 + torch.arange(8.0)[:, None]
    shard = split_tp_shard(torch.cat([gate, up]), tp_rank=1, tp_size=2, partition_dim=0, stride=2)
    assert shard[:, 0].tolist() == [4, 5, 6, 7, 104, 105, 106, 107]
    # a plain concatenation of such shards would interleave gate and up: the stride must be honoured
    shards = [split_tp_shard(torch.cat([gate, up]), tp_rank=r, tp_size=2, partition_dim=0, stride=2) for r in range(2)]
    assert not torch.equal(torch.cat(shards), torch.cat([gate, up]))


def test_tied_embeddings_have_no_head_and_a_stored_head_must_be_the_embedding():
    from vgbs_ray.models.families import WeightLayout

    tied = WeightLayout(num_attention_heads=HEADS, num_query_groups=GROUPS, tied_embeddings=True)
    hf = random_hf_state()
    del hf["lm_head.weight"]
    megatron = hf_to_megatron(hf, tied)
    assert "output_layer.weight" not in megatron
    last_stage = dict(megatron, **{"output_layer.weight": megatron["embedding.word_embeddings.weight"]})
    assert set(megatron_to_hf(last_stage, tied)) == set(hf)  # a last stage's copy is consumed, not written
    stored = dict(hf, **{"lm_head.weight": hf["model.embed_tokens.weight"].clone()})
    assert set(hf_to_megatron(stored, tied)) == set(megatron)
    with pytest.raises(WeightMappingError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf_to_megatron(dict(hf, **{"lm_head.weight": torch.zeros(VOCAB, HIDDEN)}), tied)
