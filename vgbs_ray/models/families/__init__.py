"""The model families the policy can be, by name (HF `model_type`): one module per family.

    family = family_for_hf_config(json.load(open("config.json")), where="ckpt/config.json")
    fields = family.read_hf_config(HFConfigReader(hf, where))   # -> ModelConfig fields
    get_family(config.family).write_hf_config(config)            # -> config.json

Adding a family: a module with its `ModelFamily` (see `spec.py`), listed in `FAMILIES`. Mixture
of experts: Qwen3-MoE (`qwen3_moe`); Qwen2-MoE's shared experts, DeepSeek's MLA and others are refused
by `model_type` like any other unknown family.
"""

from __future__ import annotations

from typing import Any, Mapping

from vgbs_ray.errors import ConfigError
from vgbs_ray.models.families.llama import LLAMA
from vgbs_ray.models.families.qwen2 import QWEN2
from vgbs_ray.models.families.qwen3 import QWEN3
from vgbs_ray.models.families.qwen3_moe import QWEN3_MOE
from vgbs_ray.models.families.spec import HFConfigReader, ModelFamily, RopeScaling, WeightLayout

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (LLAMA, QWEN2, QWEN3, QWEN3_MOE)}


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ConfigError(f"model family {name!r} is not supported; supported: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_for_hf_config(hf: Mapping[str, Any], where: str) -> ModelFamily:
    """The family of a `config.json`, by its `model_type` (refused, naming it, when none fits)."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{where}: model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def model_fields_from_hf_config(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig fields (`family` included) for a `config.json`; refuses what the policy cannot hold."""
    family = family_for_hf_config(hf, where)
    return dict(family.read_hf_config(HFConfigReader(hf, where)), family=family.name)


__all__ = ["FAMILIES", "HFConfigReader", "ModelFamily", "RopeScaling", "WeightLayout", "family_for_hf_config",
           "get_family", "model_fields_from_hf_config"]
