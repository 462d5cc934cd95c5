"""Hugging Face checkpoints (Llama, Qwen2, Qwen3, Qwen3-MoE) in and out of the Megatron policy, for any TP size.

    config = model_config_from_hf(path)                  # ModelConfig from config.json (its family's reader)
    load_hf_weights(model, read_hf_weights(path), config) # this rank's TP shards of every tensor
    hf = export_hf_weights(model, config)                 # full HF-named weights (TP gathered; collective)
    write_hf_checkpoint(out_dir, config, hf)              # config.json + model.safetensors

The name and layout table is `vgbs_ray.models.hf_mapping` (pure); this module adds files, the model
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

from trainer.global_names import is_expert_parameter, named_parameters_global, with_other_experts
from trainer.config import ModelConfig
from vgbs_ray.checkpoint_files import copy_tokenizer
from vgbs_ray.errors import ConfigError
from vgbs_ray.models.families import FAMILIES, get_family, model_fields_from_hf_config
from vgbs_ray.models.hf_mapping import (WeightMappingError, canonical_megatron_name, gather_tp_shards, hf_to_megatron,
                                 megatron_to_hf, split_tp_shard)

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hf_config_dict(config: ModelConfig) -> dict:
    """The `config.json` of `config`'s family and shape (transformers 5 keys; `vgbs_ray.models.families`)."""
    return dict(get_family(config.family).write_hf_config(config),
                # No special tokens here: a tokenizer copied next to the weights brings its own
                # (`tokenizer_config.json`); token-id policies stop on max_tokens or explicit stop ids.
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config_from_hf(path: str | Path, **overrides) -> ModelConfig:
    """A ModelConfig with the family and shape of the checkpoint in `path` (its `config.json`).

    `overrides` set the fields config.json does not decide (`seed`, and `params_dtype` if wanted).
    Refuses what the policy cannot represent (an unknown `model_type`, sliding-window attention,
    output-projection biases, ...), naming the key.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"{path}: no config.json (expected a Hugging Face checkpoint directory of one of "
                          f"{sorted(FAMILIES)})")
    fields = model_fields_from_hf_config(json.loads(file.read_text()), str(file))
    fields["hf_checkpoint_dir"] = str(Path(path).resolve())  # absolute: Ray workers need not share the driver's cwd
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


def write_hf_checkpoint(path: str | Path, config: ModelConfig, hf_weights: Mapping[str, torch.Tensor], *,
                        tokenizer_dir: str | Path | None = None) -> Path:
    """Write `config.json`, `model.safetensors` (loadable by transformers and vLLM) and the tokenizer files of
    `tokenizer_dir`, or else of the checkpoint the model started from (`config.hf_checkpoint_dir`); returns the dir."""
    from safetensors.torch import save_file

    path = write_hf_config(path, config, tokenizer_dir=tokenizer_dir)
    save_file({k: v.detach().contiguous().cpu() for k, v in hf_weights.items()}, str(path / SAFETENSORS_NAME),
              metadata={"format": "pt"})
    return path


def write_hf_config(path: str | Path, config: ModelConfig, *, tokenizer_dir: str | Path | None = None) -> Path:
    """A checkpoint directory without weights: `config.json` and the tokenizer files (see write_hf_checkpoint).
    What the job's engines start from: vLLM builds the model from it, and the weights come by weight sync."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2) + "\n")
    copy_tokenizer(tokenizer_dir if tokenizer_dir is not None else config.hf_checkpoint_dir, path)
    return path


def load_hf_weights(model: torch.nn.Module, hf_weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Copy HF weights into this rank's Megatron model (its TP shard of every parameter, its EP share of the
    experts)."""
    from megatron.core import parallel_state

    full = hf_to_megatron(hf_weights, config.weight_layout)
    if config.tie_word_embeddings:  # a last pipeline stage keeps its own copy of the embedding as output layer
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
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
    # Pipeline stages hold a subset of the layers, EP ranks a subset of the experts; with one stage every weight
    # but the other EP ranks' experts must be used.
    unused = set(full) - used - ({"output_layer.weight"} if config.tie_word_embeddings else set())
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        unused = {name for name in unused if ".local_experts." not in name}
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 and unused:
        raise WeightMappingError(f"checkpoint weights the model has no parameter for: {sorted(unused)[:8]}")


def full_megatron_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of this pipeline stage with its TP shards and EP experts gathered (local-spec, global
    names). Collective over TP and EP."""
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    full, experts = {}, []
    for name, param in named_parameters_global(model):
        tensor = param.detach()
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(tensor) for _ in range(tp_size)]
            torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
            tensor = gather_tp_shards(shards, partition_dim=param.partition_dim,
                                      stride=getattr(param, "partition_stride", 1))
        full[canonical_megatron_name(name)] = tensor.cpu()
        if is_expert_parameter(param):
            experts.append(canonical_megatron_name(name))
    return with_other_experts(full, experts)


def export_hf_weights(model: torch.nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole policy as its family's HF weights (TP and EP gathered, copies). Collective over TP and EP."""
    hf = megatron_to_hf(full_megatron_weights(model), config.weight_layout)
    return {name: tensor.clone() for name, tensor in hf.items()}
