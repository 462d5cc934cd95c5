"""Llama (Llama 2, Llama 3.x): RMSNorm, SwiGLU, grouped-query attention, no biases; Llama 3.2's tied
embeddings and Llama 3.x `llama3` RoPE scaling."""

from __future__ import annotations

from vgbs_ray.models.families.spec import HFConfigReader, ModelFamily, common_hf_config


def _read(reader: HFConfigReader) -> dict:
    reader.refuse("attention_bias", False, "the policy has no output-projection bias (Llama's attention_bias "
                                           "biases q, k, v and o)")
    reader.refuse("mlp_bias", False, "the policy has no MLP biases")
    theta, scaling = reader.rope(("default", "llama3"))
    return dict(reader.common_fields(), rope_theta=theta, rope_scaling=scaling)


def _write(config) -> dict:
    return dict(common_hf_config(config, LLAMA), attention_bias=False, mlp_bias=False)


LLAMA = ModelFamily(name="llama", hf_architecture="LlamaForCausalLM", qkv_bias=False, qk_norm=False, moe=False,
                    read_hf_config=_read, write_hf_config=_write)
