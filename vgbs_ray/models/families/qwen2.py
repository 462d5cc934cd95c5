"""Qwen2 and Qwen2.5: the Llama layout plus biases on the query, key and value projections; usually
tied embeddings (the small sizes)."""

from __future__ import annotations

from vgbs_ray.models.families.spec import HFConfigReader, ModelFamily, common_hf_config


def _read(reader: HFConfigReader) -> dict:
    reader.no_sliding_window()
    theta, _ = reader.rope(("default",))
    return dict(reader.common_fields(), rope_theta=theta)


def _write(config) -> dict:
    return dict(common_hf_config(config, QWEN2), use_sliding_window=False)


QWEN2 = ModelFamily(name="qwen2", hf_architecture="Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, moe=False,
                    read_hf_config=_read, write_hf_config=_write)
