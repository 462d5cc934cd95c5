"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (QK-norm, own head_dim) with a mixture
of experts in every layer: a linear router over `num_experts` SwiGLU experts, the top `num_experts_per_tok`
of them per token, their gate weights renormalised over the chosen ones when `norm_topk_prob`.
"""

from __future__ import annotations

from vgbs_ray.errors import ConfigError
from vgbs_ray.models.families.spec import HFConfigReader, ModelFamily, common_hf_config


def _read(reader: HFConfigReader) -> dict:
    reader.refuse("attention_bias", False, "the policy has no attention biases in this family")
    reader.no_sliding_window()
    reader.refuse("decoder_sparse_step", 1, "every layer of the policy is a mixture of experts")
    if reader.get("mlp_only_layers"):
        raise ConfigError(f"{reader.where}: mlp_only_layers={reader.get('mlp_only_layers')!r} is not supported "
                          "(every layer of the policy is a mixture of experts); it must be []")
    theta, _ = reader.rope(("default",))
    experts = reader.get("num_experts") or reader.get("num_local_experts")  # transformers 5 writes the second
    if not experts:
        raise ConfigError(f"{reader.where}: missing key 'num_experts'")
    return dict(reader.common_fields(), rope_theta=theta, num_experts=int(experts),
                moe_ffn_hidden_size=reader.require("moe_intermediate_size"),
                moe_router_topk=reader.require("num_experts_per_tok"),
                moe_norm_topk_prob=bool(reader.get("norm_topk_prob", False)))


def _write(config) -> dict:
    return dict(common_hf_config(config, QWEN3_MOE), attention_bias=False, use_sliding_window=False,
                num_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=config.moe_ffn_hidden_size, norm_topk_prob=config.moe_norm_topk_prob,
                decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)


QWEN3_MOE = ModelFamily(name="qwen3_moe", hf_architecture="Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True,
                        moe=True, read_hf_config=_read, write_hf_config=_write)
