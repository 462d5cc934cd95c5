"""LoRA adapters: their config, their names, and the PEFT files they are saved in (no torch, no Megatron).

An adapter of a projection W [out, in] adds `scaling * B @ A @ x` to `W @ x`, with A [rank, in] drawn at
start (PEFT's default: uniform in +-1/sqrt(in)), B [out, rank] zero at start (so the adapted model starts
as the base, exactly) and `scaling = alpha / rank`. Only A and B train; the base stays frozen.

Targets are named as in Hugging Face and PEFT: `q_proj`, `k_proj`, `v_proj`, `o_proj` (attention) and
`gate_proj`, `up_proj`, `down_proj` (the dense MLP). Megatron fuses q/k/v into `linear_qkv` and gate/up into
`linear_fc1`, so one Megatron layer carries the adapters of several targets (trainer/lora_layers.py); each
adapter keeps the Hugging Face layout of its own A and B, so a name maps one-to-one:

    decoder.layers.3.self_attention.linear_qkv.lora.q_proj_A
    <-> base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight

The files are PEFT's (`adapter_config.json` + `adapter_model.safetensors`), written here rather than through
`peft.PeftModel.save_pretrained`: that needs the adapter on a Hugging Face model in one process, and ours
live on Megatron layers, sharded over TP and PP ranks. `peft` (the `lora` extra) and vLLM load them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from vgbs_ray.errors import ConfigError, VgbsError

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_TARGETS + MLP_TARGETS

# Megatron layer (under `decoder.layers.N.`) -> the targets it carries, and the HF module holding them.
MEGATRON_LAYER_TARGETS = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
_HF_PARENT = {**{t: "self_attn" for t in ATTENTION_TARGETS}, **{t: "mlp" for t in MLP_TARGETS}}
_MEGATRON_LAYER = {target: layer for layer, targets in MEGATRON_LAYER_TARGETS.items() for target in targets}

DEFAULT_ADAPTER = "policy"
"""The adapter of train.lora (a multi-LoRA job's adapters are named after their tenants)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class AdapterMismatchError(VgbsError, ValueError):
    """An adapter's files do not fit the model they were loaded onto."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """`train.lora`: train LoRA adapters on a frozen base (see module docstring)."""

    rank: int = 8
    """r: the inner width of every adapter (A is [rank, in], B [out, rank])."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (PEFT's lora_dropout)."""
    target_modules: tuple[str, ...] = TARGET_MODULES
    """Hugging Face projection names to adapt (every layer's); see TARGET_MODULES."""
    seed: int = 0
    """Draws A (B starts at zero); the same A for any TP and PP layout."""
    adapter_dir: str | None = None
    """Start from this PEFT adapter (e.g. an earlier run's checkpoints/step_N/adapter) instead of B = 0; it must
    have been made for this base, with this rank, alpha and target_modules."""

    def __post_init__(self):
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"train.lora.rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ConfigError(f"train.lora.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"train.lora.dropout must be in [0, 1), got {self.dropout!r}")
        unknown = [name for name in self.target_modules if name not in TARGET_MODULES]
        if unknown:
            raise ConfigError(f"train.lora.target_modules: {unknown} are not modules of the model; valid: "
                              f"{list(TARGET_MODULES)}")
        if not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError(f"train.lora.target_modules must name each target once, got {list(self.target_modules)}")

    def same_adapter_shape(self, other: "LoraConfig") -> bool:
        return (self.rank, self.alpha, sorted(self.target_modules)) == (other.rank, other.alpha,
                                                                        sorted(other.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def targets_of(self, megatron_layer: str) -> tuple[str, ...]:
        """The targets adapted on one Megatron layer (e.g. "self_attention.linear_qkv"), in its output order."""
        return tuple(t for t in MEGATRON_LAYER_TARGETS[megatron_layer] if t in self.target_modules)

    def check_model(self, *, num_experts: int | None, family: str) -> None:
        """Refuse what the trainer cannot adapt, naming the key and the reason."""
        mlp = [t for t in self.target_modules if t in MLP_TARGETS]
        if num_experts is not None and mlp:
            raise ConfigError(
                f"train.lora.target_modules={list(self.target_modules)}: the {family} model is a mixture of experts, and "
                f"its MLP targets {mlp} would be one adapter per expert; experts take no adapters here (their weights "
                "are split over expert-parallel ranks, and PEFT and vLLM name per-expert adapters differently per "
                f"family): adapt the attention projections only, target_modules={list(ATTENTION_TARGETS)}")


def is_adapter_name(name: str) -> bool:
    """A Megatron parameter name of an adapter (trainer/lora_layers.py names them `...lora.<adapter>.<target>_A|B`)."""
    return ".lora." in name


_MEGATRON_NAME = re.compile(
    r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_\w+)\.lora\.(\w+)\.(\w+)_(A|B)$")
_PEFT_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


def _megatron_parts(name: str) -> tuple[str, ...]:
    match = _MEGATRON_NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not an adapter parameter name (decoder.layers.N.<layer>.lora.<adapter>."
                         "<target>_A|B)")
    return match.groups()


def adapter_of(name: str) -> str:
    """The adapter a Megatron adapter parameter belongs to (`policy` for the one of train.lora, else a tenant's)."""
    return _megatron_parts(name)[3]


def megatron_to_peft_name(name: str) -> str:
    """`decoder.layers.N.<layer>.lora.<adapter>.<target>_A` (global layer index) -> PEFT's name for it."""
    layer, _, _, _, target, matrix = _megatron_parts(name)
    return f"{PEFT_PREFIX}model.layers.{layer}.{_HF_PARENT[target]}.{target}.lora_{matrix}.weight"


def peft_to_megatron_name(name: str, adapter: str = DEFAULT_ADAPTER) -> str:
    match = _PEFT_NAME.match(name)
    if match is None or match.group(3) not in _MEGATRON_LAYER:
        raise AdapterMismatchError(f"{name!r} is not a LoRA weight of a projection this trainer adapts "
                                   f"({list(TARGET_MODULES)})")
    layer, _, target, matrix = match.groups()
    return f"decoder.layers.{layer}.{_MEGATRON_LAYER[target]}.lora.{adapter}.{target}_{matrix}"


def sync_key(name: str) -> str:
    """How an adapter parameter travels in a weight sync: `<adapter>/<PEFT name>` (base weights keep their Hugging
    Face names, which have no `/`)."""
    return f"{adapter_of(name)}/{megatron_to_peft_name(name)}"


def split_sync_key(key: str) -> tuple[str, str] | None:
    """(adapter, PEFT name) of an adapter's key in a weight sync; None for a base weight."""
    adapter, slash, peft_name = key.partition("/")
    return (adapter, peft_name) if slash and peft_name.startswith(PEFT_PREFIX) else None


def check_adapter_name(name: str) -> None:
    if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
        raise ConfigError(f"adapter (tenant) name {name!r} must be letters, digits and underscores (it names "
                          "parameters, files and vLLM adapters)")


_ADAPTER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")


def base_model_name(model) -> str:
    """What an adapter records as its base (`base_model_name_or_path`): the checkpoint directory it started from,
    or a description of the model (family and shapes) for a model made from a config."""
    if model.hf_checkpoint_dir is not None:
        return os.path.abspath(model.hf_checkpoint_dir)
    return (f"vgbs-ray:{model.family}-layers{model.num_layers}-hidden{model.hidden_size}-heads"
            f"{model.num_attention_heads}x{model.num_query_groups}-ffn{model.ffn_hidden_size}-vocab{model.vocab_size}")


def peft_adapter_config(lora: LoraConfig, base_model_name_or_path: str) -> dict:
    """The `adapter_config.json` of an adapter (the PEFT LoraConfig fields that peft 0.21 and vLLM read)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(lora.target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True}


def save_peft_adapter(directory: str, adapter: Mapping[str, np.ndarray], lora: LoraConfig,
                      base_model_name_or_path: str) -> str:
    """Write one adapter (Megatron names of one adapter, or PEFT names -> arrays) as PEFT files in `directory`;
    returns it."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {(name if name.startswith(PEFT_PREFIX) else megatron_to_peft_name(name)):
               np.ascontiguousarray(array, dtype=np.float32) for name, array in adapter.items()}
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as handle:
        json.dump(peft_adapter_config(lora, base_model_name_or_path), handle, indent=2)
    return directory


def load_peft_adapter(directory: str, *, expected_shapes: Mapping[str, tuple[int, ...]],
                      base_model_name_or_path: str,
                      adapter: str = DEFAULT_ADAPTER) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """An adapter's config and its tensors under Megatron names (as adapter `adapter`), checked against the model:
    `expected_shapes` (Megatron adapter name -> whole-model shape). An adapter made for another base (other
    shapes, other targets) is refused, naming both bases."""
    from safetensors.numpy import load_file

    with open(os.path.join(directory, ADAPTER_CONFIG)) as handle:
        config = json.load(handle)
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise AdapterMismatchError(f"{directory}: only plain LoRA adapters load here (peft_type LORA, no DoRA or "
                                   f"rsLoRA), got {config.get('peft_type')!r}")
    lora = LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                      dropout=float(config.get("lora_dropout", 0.0)),
                      target_modules=tuple(sorted(config["target_modules"])))
    tensors = {peft_to_megatron_name(name, adapter): array
               for name, array in load_file(os.path.join(directory, ADAPTER_WEIGHTS)).items()}
    theirs = config.get("base_model_name_or_path")
    wrong = sorted(set(tensors) ^ set(expected_shapes))[:3] or [
        f"{name} {tuple(array.shape)} != {tuple(expected_shapes[name])}"
        for name, array in tensors.items() if tuple(array.shape) != tuple(expected_shapes[name])][:3]
    if wrong:
        raise AdapterMismatchError(
            f"{directory}: the adapter does not fit this model: it was made for base {theirs!r}, this model is "
            f"{base_model_name_or_path!r} (first differences: {wrong})")
    return lora, tensors


def merge_into_hf_weights(hf_weights: Mapping[str, np.ndarray], adapter: Mapping[str, np.ndarray],
                          lora: LoraConfig) -> dict[str, np.ndarray]:
    """Hugging Face weights with the adapter merged in (W + alpha / rank * B @ A per adapted projection): a full
    checkpoint that needs no `peft` to load. `adapter`: Megatron or PEFT names -> arrays."""
    merged = dict(hf_weights)
    by_projection: dict[str, dict[str, np.ndarray]] = {}
    for name, array in adapter.items():
        peft_name = name if name.startswith(PEFT_PREFIX) else megatron_to_peft_name(name)
        projection, matrix = peft_name[len(PEFT_PREFIX):].rsplit(".lora_", 1)
        by_projection.setdefault(f"{projection}.weight", {})[matrix.split(".")[0]] = np.asarray(array)
    for weight_name, pair in by_projection.items():
        if weight_name not in merged or set(pair) != {"A", "B"}:
            raise AdapterMismatchError(f"merge: the model has no {weight_name!r}, or its adapter lacks A or B")
        base = np.asarray(merged[weight_name])
        merged[weight_name] = (base.astype(np.float64) + lora.scaling * pair["B"].astype(np.float64)
                               @ pair["A"].astype(np.float64)).astype(base.dtype)
    return merged
