"""Hugging Face `LlamaForCausalLM` checkpoints in and out of the Megatron policy, for any TP size.

    config = model_config_from_hf(path)                  # ModelConfig from config.json (refuses non-Llama)
    load_hf_weights(model, read_hf_weights(path), config) # this rank's TP shards of every tensor
    hf = export_hf_weights(model, config)                 # full HF-named weights (TP gathered; collective)
    write_hf_checkpoint(out_dir, config, hf)              # config.json + model.safetensors

The name and layout table is `vgbs_ray.hf_mapping` (pure); this module adds files, the model
config and tensor parallelism. A rank's shard of a tensor follows the parameter's own Megatron
attributes (`partition_dim`, `partition_stride`), so the same code serves every TP size.
Export is a collective over the tensor-parallel group: every TP rank must call it.
Nothing here downloads anything: paths are local directories.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from actors.train_config import ModelConfig
from vgbs_ray.errors import ConfigError
from vgbs_ray.hf_mapping import (WeightMappingError, canonical_megatron_name, gather_tp_shards, hf_to_megatron,
                                 megatron_to_hf, split_tp_shard)

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hf_config_dict(config: ModelConfig) -> dict:
    """The `config.json` of a `LlamaForCausalLM` with `config`'s shape (transformers 5 keys)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_epsilon,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": config.params_dtype,
        # No special tokens: the policies here are token-id models; callers stop generation
        # with max_tokens or explicit stop token ids.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def model_config_from_hf(path: str | Path, **overrides) -> ModelConfig:
    """A ModelConfig with the shape of the `LlamaForCausalLM` in `path` (its `config.json`).

    `overrides` set the fields config.json does not decide (`seed`, and `params_dtype` if wanted).
    Refuses what the Llama policy cannot represent, naming the key.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"{path}: no config.json (expected a Hugging Face LlamaForCausalLM directory)")
    hf = json.loads(file.read_text())
    where = f"{file}"
    if hf.get("model_type") != "llama":
        raise ConfigError(f"{where}: model_type={hf.get('model_type')!r}; only 'llama' (LlamaForCausalLM) is supported")
    refusals = {
        "tie_word_embeddings": (False, "the policy has untied input and output embeddings"),
        "attention_bias": (False, "the policy has no attention biases"),
        "mlp_bias": (False, "the policy has no MLP biases"),
        "hidden_act": ("silu", "the policy's MLP is SwiGLU (silu)"),
    }
    for key, (wanted, why) in refusals.items():
        if hf.get(key, wanted) != wanted:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported ({why}); it must be {wanted!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                          "only plain RoPE ('default') is")
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise ConfigError(f"{where}: head_dim={head_dim} x num_attention_heads={heads} != hidden_size="
                          f"{hf['hidden_size']}; the policy needs head_dim = hidden_size / num_attention_heads")
    fields = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        rope_theta=float(rope_theta),
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf["max_position_embeddings"],
        params_dtype="bfloat16" if hf.get("dtype", hf.get("torch_dtype")) == "bfloat16" else "float32",
        hf_checkpoint_dir=str(Path(path).resolve()),  # absolute: Ray workers need not share the driver's cwd
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def read_hf_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file(s) in `path` (one file, or shards listed by the index)."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / SAFETENSORS_INDEX_NAME
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / SAFETENSORS_NAME).is_file():
        files = [SAFETENSORS_NAME]
    else:
        raise FileNotFoundError(f"{path}: neither {SAFETENSORS_NAME} nor {SAFETENSORS_INDEX_NAME}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(path / name)))
    return weights


def write_hf_checkpoint(path: str | Path, config: ModelConfig, hf_weights: Mapping[str, torch.Tensor]) -> Path:
    """Write `config.json` and `model.safetensors` (loadable by transformers and vLLM); returns the dir."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in hf_weights.items()}, str(path / SAFETENSORS_NAME),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2) + "\n")
    return path


def load_hf_weights(model: torch.nn.Module, hf_weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Copy HF weights into this rank's Megatron model (its TP shard of every parameter)."""
    from megatron.core import parallel_state

    from actors.model import named_parameters_global

    full = hf_to_megatron(hf_weights, num_attention_heads=config.num_attention_heads,
                          num_query_groups=config.num_query_groups)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    used = set()
    with torch.no_grad():
        for name, param in named_parameters_global(model):
            key = canonical_megatron_name(name)
            if key not in full:
                raise WeightMappingError(f"model parameter {name!r} has no weight in the checkpoint")
            used.add(key)
            tensor = full[key]
            if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
                tensor = split_tp_shard(tensor, tp_rank=tp_rank, tp_size=tp_size, partition_dim=param.partition_dim,
                                        stride=getattr(param, "partition_stride", 1))
            if tensor.shape != param.shape:
                raise WeightMappingError(f"{name}: checkpoint shard {tuple(tensor.shape)} != parameter "
                                         f"{tuple(param.shape)} (tp rank {tp_rank} of {tp_size})")
            param.copy_(tensor)
    # Pipeline stages hold a subset of the layers; with one stage every weight must be used.
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 and set(full) - used:
        raise WeightMappingError(f"checkpoint weights the model has no parameter for: {sorted(set(full) - used)[:8]}")


def full_megatron_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of this pipeline stage with its TP shards gathered (local-spec, global names).
    Collective over TP."""
    from megatron.core import parallel_state

    from actors.model import named_parameters_global

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, param in named_parameters_global(model):
        tensor = param.detach()
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(tensor) for _ in range(tp_size)]
            torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
            tensor = gather_tp_shards(shards, partition_dim=param.partition_dim,
                                      stride=getattr(param, "partition_stride", 1))
        full[canonical_megatron_name(name)] = tensor.cpu()
    return full


def export_hf_weights(model: torch.nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole policy as `LlamaForCausalLM` weights (TP gathered, copies). Collective over TP."""
    hf = megatron_to_hf(full_megatron_weights(model), num_attention_heads=config.num_attention_heads,
                        num_query_groups=config.num_query_groups)
    return {name: tensor.clone() for name, tensor in hf.items()}
