"""What a model family is: how one Hugging Face architecture maps onto the Megatron policy.

A family (`ModelFamily`) fixes the layer shape features of its architecture (QKV biases, per-head
QK RMSNorm), names what `transformers` and vLLM build from its `config.json` (`hf_architecture`),
and reads and writes that `config.json` (`read_hf_config`, `write_hf_config`). The features that
vary between checkpoints of one family (tied embeddings, head_dim, Llama 3.x RoPE scaling) are
read into the policy's `ModelConfig` fields; everything the policy cannot hold is refused with
the key named (`HFConfigReader.refuse`). The weight-name table is `vgbs_ray.models.hf_mapping`, driven
by the family's features. Pure: no Megatron, no transformers, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from vgbs_ray.errors import ConfigError


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x rotary frequency scaling (HF `rope_parameters` with `rope_type: llama3`).

    Wavelengths (in tokens) above `original_max_position_embeddings / low_freq_factor` are
    stretched by `factor`, those under `original_max_position_embeddings / high_freq_factor` are
    kept, and the band between is interpolated smoothly (`vgbs_ray.models.families.rope`).
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.factor < 1 or self.low_freq_factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ConfigError(f"RopeScaling: factor ({self.factor}) must be >= 1, low_freq_factor "
                              f"({self.low_freq_factor}) and original_max_position_embeddings "
                              f"({self.original_max_position_embeddings}) > 0")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"RopeScaling: high_freq_factor ({self.high_freq_factor}) must exceed "
                              f"low_freq_factor ({self.low_freq_factor})")


@dataclass(frozen=True)
class WeightLayout:
    """What the HF <-> Megatron weight table (`vgbs_ray.models.hf_mapping`) needs to know of a model."""

    num_attention_heads: int
    num_query_groups: int
    qkv_bias: bool = False
    """q/k/v projection biases (Megatron `linear_qkv.bias`)."""
    qk_norm: bool = False
    """Per-head query and key RMSNorm weights (Megatron `q_layernorm` / `k_layernorm`)."""
    tied_embeddings: bool = False
    """No separate output layer: HF has no `lm_head.weight`, Megatron's is the embedding's."""
    num_experts: int = 0
    """Mixture of experts in every layer (router + this many SwiGLU experts); 0 = a dense MLP."""


class HFConfigReader:
    """Reads one `config.json` (a dict) for a family, naming the file and the key in every refusal."""

    def __init__(self, hf: Mapping[str, Any], where: str):
        self.hf, self.where = hf, where

    def get(self, key: str, default: Any = None) -> Any:
        return self.hf.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.hf:
            raise ConfigError(f"{self.where}: missing key {key!r}")
        return self.hf[key]

    def refuse(self, key: str, wanted: Any, why: str) -> None:
        """Refuse any value of `key` other than `wanted` (an absent key counts as `wanted`)."""
        if self.hf.get(key, wanted) != wanted and self.hf.get(key) is not None:
            raise ConfigError(f"{self.where}: {key}={self.hf[key]!r} is not supported ({why}); it must be {wanted!r}")

    def no_sliding_window(self) -> None:
        """Refuse sliding-window attention (`use_sliding_window`, or a `sliding_attention` layer type)."""
        self.refuse("use_sliding_window", False, "the policy attends over the whole sequence")
        sliding = [i for i, kind in enumerate(self.hf.get("layer_types") or []) if kind != "full_attention"]
        if sliding:
            raise ConfigError(f"{self.where}: layer_types has non-full attention at layers {sliding[:8]} (not "
                              "supported: the policy attends over the whole sequence in every layer)")

    def rope(self, allowed: tuple[str, ...]) -> tuple[float, RopeScaling | None]:
        """(rope_theta, Llama 3.x scaling or None) from `rope_parameters` (transformers 5) or `rope_scaling`."""
        rope = dict(self.hf.get("rope_parameters") or self.hf.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in allowed:
            raise ConfigError(f"{self.where}: rope type {kind!r} is not supported for this family; supported: "
                              f"{list(allowed)}")
        theta = float(rope.get("rope_theta", self.hf.get("rope_theta", 10000.0)))
        if kind != "llama3":
            return theta, None
        try:
            return theta, RopeScaling(factor=float(rope["factor"]),
                                      low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                                      high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                                      original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        except KeyError as missing:
            raise ConfigError(f"{self.where}: llama3 rope parameters lack {missing}") from None

    def common_fields(self) -> dict[str, Any]:
        """The ModelConfig fields every family reads alike (decoder shape, norms, embeddings, dtype)."""
        self.refuse("hidden_act", "silu", "the policy's MLP is SwiGLU (silu)")
        heads = self.require("num_attention_heads")
        head_dim = self.get("head_dim") or self.require("hidden_size") // heads
        dtype = self.get("dtype", self.get("torch_dtype"))
        return dict(
            num_layers=self.require("num_hidden_layers"),
            hidden_size=self.require("hidden_size"),
            num_attention_heads=heads,
            num_query_groups=self.get("num_key_value_heads") or heads,
            kv_channels=None if head_dim * heads == self.hf["hidden_size"] else head_dim,
            ffn_hidden_size=self.require("intermediate_size"),
            vocab_size=self.require("vocab_size"),
            norm_epsilon=float(self.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=self.require("max_position_embeddings"),
            tie_word_embeddings=bool(self.get("tie_word_embeddings", False)),
            params_dtype="bfloat16" if dtype == "bfloat16" else "float32",
        )


def common_hf_config(config, family: "ModelFamily") -> dict[str, Any]:
    """The `config.json` keys every family writes alike, from a ModelConfig (transformers 5 names)."""
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        scaling = config.rope_scaling
        rope.update(rope_type="llama3", factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
                    high_freq_factor=scaling.high_freq_factor,
                    original_max_position_embeddings=scaling.original_max_position_embeddings)
    return {
        "architectures": [family.hf_architecture],
        "model_type": family.hf_model_type,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_epsilon,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
        "dtype": config.params_dtype,
    }


@dataclass(frozen=True)
class ModelFamily:
    """One Hugging Face architecture the policy can be (see module docstring)."""

    name: str
    """The name `ModelConfig.family` holds (also the HF `model_type`)."""
    hf_architecture: str
    """The `transformers` class and the vLLM model it names in `config.json`'s `architectures`."""
    qkv_bias: bool
    """Biases on the query, key and value projections (Megatron `add_qkv_bias`); none on the output projection."""
    qk_norm: bool
    """Per-head RMSNorm of queries and keys before RoPE (Megatron `qk_layernorm`)."""
    moe: bool
    """Every layer's MLP is a mixture of experts (the model's `num_experts` must be set)."""
    read_hf_config: Callable[[HFConfigReader], dict[str, Any]]
    """config.json -> ModelConfig fields (refusing what the policy cannot hold)."""
    write_hf_config: Callable[[Any], dict[str, Any]]
    """ModelConfig -> the family's config.json (loadable by transformers and vLLM)."""

    @property
    def hf_model_type(self) -> str:
        return self.name
