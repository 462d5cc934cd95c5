"""Qwen3 (dense): the Llama layout plus a per-head RMSNorm on queries and keys (QK-norm), a head_dim
set on its own (not hidden_size / heads), tied or untied embeddings."""

from __future__ import annotations

from vgbs_ray.models.families.spec import HFConfigReader, ModelFamily, common_hf_config


def _read(reader: HFConfigReader) -> dict:
    reader.refuse("attention_bias", False, "the policy has no attention biases in this family")
    reader.no_sliding_window()
    theta, _ = reader.rope(("default",))
    return dict(reader.common_fields(), rope_theta=theta)


def _write(config) -> dict:
    return dict(common_hf_config(config, QWEN3), attention_bias=False, use_sliding_window=False)


QWEN3 = ModelFamily(name="qwen3", hf_architecture="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, moe=False,
                    read_hf_config=_read, write_hf_config=_write)
