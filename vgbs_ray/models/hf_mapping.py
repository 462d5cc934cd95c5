"""Megatron-Core GPT <-> Hugging Face `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM`: names and layouts.

Plain tensors in, plain tensors out (no Megatron, no transformers). Both sides hold the full,
unsharded weights; `split_tp_shard` / `gather_tp_shards` convert between a full Megatron
tensor and its tensor-parallel shards.

The table (per layer `i`; H hidden, V vocab, F ffn, q query heads, g key/value groups, d head dim):

| Megatron (`GPTModel`, local spec)                    | Hugging Face                                   | layout                                   |
| ---------------------------------------------------- | ---------------------------------------------- | ---------------------------------------- |
| `embedding.word_embeddings.weight`                    | `model.embed_tokens.weight`                    | same [V, H]                              |
| `decoder.layers.i.input_layernorm.weight`             | `model.layers.i.input_layernorm.weight`        | same [H]                                 |
| `decoder.layers.i.self_attention.linear_qkv.weight`   | `...self_attn.{q,k,v}_proj.weight`             | rows grouped per key/value group: for each of the g groups, its q/g query heads, then its key head, then its value head (d rows each) |
| `decoder.layers.i.self_attention.linear_proj.weight`  | `...self_attn.o_proj.weight`                   | same [H, q*d]                            |
| `decoder.layers.i.pre_mlp_layernorm.weight`           | `model.layers.i.post_attention_layernorm.weight` | same [H]                               |
| `decoder.layers.i.mlp.linear_fc1.weight`              | `...mlp.gate_proj.weight`, `...mlp.up_proj.weight` | `cat([gate, up])` [2F, H]            |
| `decoder.layers.i.mlp.linear_fc2.weight`              | `...mlp.down_proj.weight`                      | same [H, F]                              |
| `decoder.final_layernorm.weight`                      | `model.norm.weight`                            | same [H]                                 |
| `output_layer.weight`                                 | `lm_head.weight`                               | same [V, H] (untied only)                |
| `decoder.layers.i.self_attention.linear_qkv.bias`     | `...self_attn.{q,k,v}_proj.bias`               | grouped like the weight's rows (Qwen2)   |
| `decoder.layers.i.self_attention.{q,k}_layernorm.weight` | `...self_attn.{q,k}_norm.weight`            | same [d] (Qwen3's QK-norm)               |
| `decoder.layers.i.mlp.router.weight`                  | `...mlp.gate.weight`                           | same [E, H] (mixture of experts)         |
| `decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight` | `...mlp.experts.e.{gate,up}_proj.weight` | `cat([gate, up])` per expert     |
| `decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight` | `...mlp.experts.e.down_proj.weight` | same per expert                       |

Which optional rows apply is the model's `WeightLayout` (`vgbs_ray.models.families`). With tied
embeddings HF has no `lm_head.weight`; a Megatron last pipeline stage's copy of the embedding
(`output_layer.weight`) is consumed on export and not written.

No rotary permutation: Megatron (`rotary_interleaved=False`) and HF both rotate halves.
With Transformer Engine's layer spec (GPU) the two norms are fused into the next linear layer
and named `...linear_qkv.layer_norm_weight` / `...linear_fc1.layer_norm_weight`;
`canonical_megatron_name` maps those onto the local names above.

Invariants (tests/test_hf_mapping.py): `hf_to_megatron(megatron_to_hf(m)) == m` and the
reverse, bit for bit; every name of either side is consumed exactly once (an unknown or missing
name raises, naming it); `gather_tp_shards(split_tp_shard(t, r, n) for r) == t` for every
partition dim and stride.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import torch

from vgbs_ray.errors import VgbsError
from vgbs_ray.models.families.spec import WeightLayout


class WeightMappingError(VgbsError, ValueError):
    """A weight name or shape does not fit the HF <-> Megatron table."""


# Whole-model tensors: (Megatron name, HF name).
_GLOBAL = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
)
_OUTPUT = ("output_layer.weight", "lm_head.weight")
# Per-layer tensors copied as they are: (Megatron suffix, HF suffix).
_LAYER_SAME = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
)
_QK_NORM = (
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)
_QKV = "self_attention.linear_qkv.weight"
_QKV_HF = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_QKV_BIAS = "self_attention.linear_qkv.bias"
_QKV_BIAS_HF = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_FC1 = "mlp.linear_fc1.weight"
_FC1_HF = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_FC2 = ("mlp.linear_fc2.weight", "mlp.down_proj.weight")
_ROUTER = ("mlp.router.weight", "mlp.gate.weight")
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def canonical_megatron_name(name: str) -> str:
    """The local-spec name of a Megatron parameter (TE-fused norm names -> separate norms; DDP prefix off)."""
    name = name.removeprefix("module.")
    match = _MEGATRON_LAYER.match(name)
    if match and match.group(2) in _TE_FUSED_NORMS:
        return f"decoder.layers.{match.group(1)}.{_TE_FUSED_NORMS[match.group(2)]}"
    return name


def _num_layers(names, pattern: re.Pattern) -> int:
    layers = {int(m.group(1)) for m in map(pattern.match, names) if m}
    if layers != set(range(len(layers))):
        raise WeightMappingError(f"layer indices {sorted(layers)} are not 0..{len(layers) - 1}")
    return len(layers)


def _qkv_split(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int, name: str):
    heads_per_group = num_attention_heads // num_query_groups
    rows, hidden = qkv.shape
    head_dim, rest = divmod(rows, num_query_groups * (heads_per_group + 2))
    if rest:
        raise WeightMappingError(f"{name}: {rows} rows is not num_query_groups={num_query_groups} x "
                                 f"(heads per group {heads_per_group} + 2) x head_dim")
    grouped = qkv.view(num_query_groups, heads_per_group + 2, head_dim, hidden)
    q = grouped[:, :heads_per_group].reshape(num_attention_heads * head_dim, hidden)
    k = grouped[:, heads_per_group].reshape(num_query_groups * head_dim, hidden)
    v = grouped[:, heads_per_group + 1].reshape(num_query_groups * head_dim, hidden)
    return q, k, v


def _qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_attention_heads: int,
              num_query_groups: int, name: str) -> torch.Tensor:
    heads_per_group = num_attention_heads // num_query_groups
    hidden = q.shape[1]
    head_dim, rest = divmod(q.shape[0], num_attention_heads)
    if rest or k.shape != (num_query_groups * head_dim, hidden) or v.shape != k.shape:
        raise WeightMappingError(
            f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
            f"num_attention_heads={num_attention_heads}, num_query_groups={num_query_groups}")
    grouped = torch.cat([q.view(num_query_groups, heads_per_group, head_dim, hidden),
                         k.view(num_query_groups, 1, head_dim, hidden),
                         v.view(num_query_groups, 1, head_dim, hidden)], dim=1)
    return grouped.reshape(-1, hidden)


def _take(state: Mapping[str, torch.Tensor], name: str, used: set) -> torch.Tensor:
    if name not in state:
        raise WeightMappingError(f"missing weight {name!r}")
    used.add(name)
    return state[name]


def _check_all_used(state: Mapping[str, torch.Tensor], used: set, side: str) -> None:
    unknown = sorted(set(state) - used)
    if unknown:
        raise WeightMappingError(f"{side} weights not in the weight table of this model's layout: {unknown[:8]}"
                                 f"{' ...' if len(unknown) > 8 else ''}")


def _global_pairs(layout: WeightLayout) -> tuple:
    return _GLOBAL if layout.tied_embeddings else (*_GLOBAL, _OUTPUT)


def _same_pairs(layout: WeightLayout) -> tuple:
    return (*_LAYER_SAME, *(_QK_NORM if layout.qk_norm else ()), *(_mlp_pairs(layout)))


def _mlp_pairs(layout: WeightLayout) -> tuple:
    """The MLP rows copied as they are: the dense down projection, or the router and every expert's."""
    if not layout.num_experts:
        return (_FC2,)
    return (_ROUTER, *((f"mlp.experts.local_experts.{e}.linear_fc2.weight", f"mlp.experts.{e}.down_proj.weight")
                       for e in range(layout.num_experts)))


def _fc1_pairs(layout: WeightLayout) -> tuple:
    """(Megatron [gate; up] name, (HF gate name, HF up name)) of the dense MLP or of every expert."""
    if not layout.num_experts:
        return ((_FC1, _FC1_HF),)
    return tuple((f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                  (f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"))
                 for e in range(layout.num_experts))


def _layout(layout: WeightLayout | None, num_attention_heads: int | None, num_query_groups: int | None) -> WeightLayout:
    """The layout given, or the plain Llama one for `num_attention_heads` / `num_query_groups`."""
    if layout is not None:
        return layout
    if num_attention_heads is None or num_query_groups is None:
        raise TypeError("give a WeightLayout, or num_attention_heads and num_query_groups")
    return WeightLayout(num_attention_heads=num_attention_heads, num_query_groups=num_query_groups)


def megatron_to_hf(state: Mapping[str, torch.Tensor], layout: WeightLayout | None = None, *,
                   num_attention_heads: int | None = None, num_query_groups: int | None = None) -> dict[str, torch.Tensor]:
    """Full (TP-gathered) Megatron weights -> the HF state dict (contiguous tensors)."""
    layout = _layout(layout, num_attention_heads, num_query_groups)
    heads, groups = layout.num_attention_heads, layout.num_query_groups
    state = {canonical_megatron_name(k): v for k, v in state.items()}
    used: set = set()
    out: dict[str, torch.Tensor] = {}
    for megatron, hf in _global_pairs(layout):
        out[hf] = _take(state, megatron, used)
    if layout.tied_embeddings and _OUTPUT[0] in state:
        used.add(_OUTPUT[0])  # the last pipeline stage's copy of the embedding
    for i in range(_num_layers(state, _MEGATRON_LAYER)):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for megatron, hf in _same_pairs(layout):
            out[h + hf] = _take(state, m + megatron, used)
        q, k, v = _qkv_split(_take(state, m + _QKV, used), heads, groups, m + _QKV)
        out.update(zip((h + n for n in _QKV_HF), (q, k, v)))
        if layout.qkv_bias:
            bias = _take(state, m + _QKV_BIAS, used)[:, None]
            out.update(zip((h + n for n in _QKV_BIAS_HF), (b[:, 0] for b in _qkv_split(bias, heads, groups,
                                                                                       m + _QKV_BIAS))))
        for fc1_name, gate_up in _fc1_pairs(layout):
            fc1 = _take(state, m + fc1_name, used)
            if fc1.shape[0] % 2:
                raise WeightMappingError(f"{m + fc1_name}: {fc1.shape[0]} rows cannot be [gate; up]")
            out.update(zip((h + n for n in gate_up), fc1.chunk(2, dim=0)))
    _check_all_used(state, used, "Megatron")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def hf_to_megatron(state: Mapping[str, torch.Tensor], layout: WeightLayout | None = None, *,
                   num_attention_heads: int | None = None, num_query_groups: int | None = None) -> dict[str, torch.Tensor]:
    """The HF state dict -> full Megatron weights (local-spec names, contiguous; no `output_layer` when tied)."""
    layout = _layout(layout, num_attention_heads, num_query_groups)
    heads, groups = layout.num_attention_heads, layout.num_query_groups
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # a buffer, not a weight
    if layout.tied_embeddings and _OUTPUT[1] in state:  # some tied checkpoints store the head: it must be the embedding
        if not torch.equal(state[_OUTPUT[1]], state[_GLOBAL[0][1]]):
            raise WeightMappingError(f"tie_word_embeddings is set but {_OUTPUT[1]} differs from {_GLOBAL[0][1]}")
        state.pop(_OUTPUT[1])
    used: set = set()
    out: dict[str, torch.Tensor] = {}
    for megatron, hf in _global_pairs(layout):
        out[megatron] = _take(state, hf, used)
    for i in range(_num_layers(state, _HF_LAYER)):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for megatron, hf in _same_pairs(layout):
            out[m + megatron] = _take(state, h + hf, used)
        q, k, v = (_take(state, h + n, used) for n in _QKV_HF)
        out[m + _QKV] = _qkv_fuse(q, k, v, heads, groups, h + "self_attn")
        if layout.qkv_bias:
            q, k, v = (_take(state, h + n, used)[:, None] for n in _QKV_BIAS_HF)
            out[m + _QKV_BIAS] = _qkv_fuse(q, k, v, heads, groups, h + "self_attn (bias)")[:, 0]
        for fc1_name, gate_up in _fc1_pairs(layout):
            gate, up = (_take(state, h + n, used) for n in gate_up)
            if gate.shape != up.shape:
                raise WeightMappingError(f"{h}{gate_up[0]} {tuple(gate.shape)} and up_proj {tuple(up.shape)} differ")
            out[m + fc1_name] = torch.cat([gate, up], dim=0)
    _check_all_used(state, used, "Hugging Face")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def split_tp_shard(full: torch.Tensor, *, tp_rank: int, tp_size: int, partition_dim: int,
                   stride: int = 1) -> torch.Tensor:
    """This TP rank's shard of a full tensor, as Megatron lays it out.

    The full tensor is cut into `tp_size * stride` equal chunks along `partition_dim`; rank r
    holds chunks r, r + tp_size, ... (stride 2 is SwiGLU's fc1: each rank holds [gate_r; up_r]).
    """
    if full.shape[partition_dim] % (tp_size * stride):
        raise WeightMappingError(f"dim {partition_dim} of size {full.shape[partition_dim]} does not split into "
                                 f"tp_size={tp_size} x stride={stride} equal chunks")
    chunks = full.chunk(tp_size * stride, dim=partition_dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=partition_dim).contiguous()


def gather_tp_shards(shards: Sequence[torch.Tensor], *, partition_dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from every TP rank's shard, in rank order (inverse of `split_tp_shard`)."""
    per_rank = [shard.chunk(stride, dim=partition_dim) for shard in shards]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(len(shards))], dim=partition_dim)
