"""LoRA adapters on a Megatron GPTModel's linear layers, sharded as the layers are (vgbs_ray/models/lora.py: config, names).

    active = attach_lora(model, {"policy": lora}, model_config)   # before Megatron DDP wraps it: the base frozen
    active.name = "tenant_b"                                          # multi-LoRA: which adapter the next step uses

Each adapted Megatron linear layer gets a submodule `lora` (a ModuleDict: one `LoraAdapters` per adapter name)
holding, per Hugging Face target it carries, A [rank, in] and B [out, rank] in that target's Hugging Face layout,
and a forward hook that adds the active adapter's `scaling * B A x` to the layer's output. The base parameters
keep their names (weight sync, checkpoints and the HF mapping see the same model); the adapters' names end in
`.lora.<adapter>.<target>_A|B` (`vgbs_ray.models.lora.is_adapter_name`, `adapter_of`).

Tensor parallelism, as Megatron shards the layer:
- column-parallel `linear_qkv` (q, k, v) and `linear_fc1` (gate, up): the input is whole, so A is replicated; B is
  split over its output rows (each TP rank holds its own query groups' q/k/v rows, its own slice of gate and up).
  The rank's outputs are placed in the fused layout: per local query group [q heads, k, v], and [gate; up].
  The input of B passes `copy_to_tensor_model_parallel_region` (its gradient is summed over TP: every rank's B
  rows contribute to A's gradient).
- row-parallel `linear_proj` (o) and `linear_fc2` (down): the input is split, so A is split over its input
  columns and `A x` is summed over TP (`reduce_from_tensor_model_parallel_region`); B is replicated.
The hook reads the layer's input: Megatron's local layers (always used with LoRA, also where Transformer Engine is
installed: TE's `linear_qkv` and `linear_fc1` take the un-normalised hidden states and fuse the norm in).
The split tensors carry Megatron's TP attributes, so gathering and splitting the whole model (weight sync,
`MegatronStep.full_parameters`) and the gradient norm treat them like the base weights. Pipeline stages hold
their own layers' adapters. A is drawn whole per (seed, layer, target) and then split: any layout starts from
the same adapters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                           reduce_from_tensor_model_parallel_region)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from vgbs_ray.models.lora import DEFAULT_ADAPTER, MEGATRON_LAYER_TARGETS, TARGET_MODULES, LoraConfig

_COLUMN_PARALLEL = ("self_attention.linear_qkv", "mlp.linear_fc1")


def target_shapes(config) -> dict[str, tuple[int, int]]:
    """Whole (unsplit) [out, in] of every target's projection for a ModelConfig."""
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_query_groups * config.head_dim
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    return {"q_proj": (q_out, hidden), "k_proj": (kv_out, hidden), "v_proj": (kv_out, hidden),
            "o_proj": (hidden, q_out), "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden),
            "down_proj": (hidden, ffn)}


def adapter_shapes(lora: LoraConfig, config, adapter: str = DEFAULT_ADAPTER) -> dict[str, tuple[int, int]]:
    """Whole-model shape of every parameter of adapter `adapter`, by Megatron global name."""
    shapes = target_shapes(config)
    result = {}
    for layer in range(config.num_layers):
        for megatron_layer in MEGATRON_LAYER_TARGETS:
            for target in lora.targets_of(megatron_layer):
                out_features, in_features = shapes[target]
                prefix = f"decoder.layers.{layer}.{megatron_layer}.lora.{adapter}.{target}"
                result[f"{prefix}_A"] = (lora.rank, in_features)
                result[f"{prefix}_B"] = (out_features, lora.rank)
    return result


class ActiveAdapter:
    """Which adapter the model's forward adds (one per step: a step trains one tenant's adapter); shared by every
    adapted layer of a model chunk. A layer that does not carry the active adapter adds nothing."""

    def __init__(self, name: str):
        self.name = name


class LoraAdapters(torch.nn.Module):
    """The adapters of one Megatron linear layer (see module docstring); `forward(x)` is the layer's added output."""

    def __init__(self, lora: LoraConfig, megatron_layer: str, layer_number: int, model_config, *,
                 tp_rank: int, tp_size: int, dtype: torch.dtype, device: torch.device, tp_group=None):
        super().__init__()
        self.targets = lora.targets_of(megatron_layer)
        self.all_targets = MEGATRON_LAYER_TARGETS[megatron_layer]
        self.column_parallel = megatron_layer in _COLUMN_PARALLEL
        self.fused_qkv = megatron_layer == "self_attention.linear_qkv"
        self.scaling, self.dropout = lora.scaling, lora.dropout
        self.tp_group = tp_group
        self.local_groups = model_config.num_query_groups // tp_size
        shapes = target_shapes(model_config)
        # each target's output rows on this rank (column-parallel layers split them; also for unadapted parts)
        self.out_local = {t: shapes[t][0] // (tp_size if self.column_parallel else 1) for t in self.all_targets}
        for target in self.targets:
            out_features, in_features = shapes[target]
            generator = torch.Generator().manual_seed(
                lora.seed * 1_000_003 + layer_number * 101 + TARGET_MODULES.index(target))
            bound = 1.0 / math.sqrt(in_features)  # PEFT's kaiming_uniform_(a=sqrt(5)) on A
            a = torch.empty(lora.rank, in_features).uniform_(-bound, bound, generator=generator)
            b = torch.zeros(out_features, lora.rank)
            if self.column_parallel:
                b = b.chunk(tp_size, dim=0)[tp_rank]
            else:
                a = a.chunk(tp_size, dim=1)[tp_rank]
            a_param = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            b_param = torch.nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
            split, whole = (b_param, a_param) if self.column_parallel else (a_param, b_param)
            set_tensor_model_parallel_attributes(split, True, 0 if self.column_parallel else 1, 1)
            set_tensor_model_parallel_attributes(whole, False, 0, 1)
            self.register_parameter(f"{target}_A", a_param)
            self.register_parameter(f"{target}_B", b_param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            x = F.dropout(x, p=self.dropout)
        deltas = {}
        for target in self.targets:
            inner = x @ getattr(self, f"{target}_A").t()
            if self.column_parallel:
                inner = copy_to_tensor_model_parallel_region(inner, group=self.tp_group)
            else:
                inner = reduce_from_tensor_model_parallel_region(inner, group=self.tp_group)
            deltas[target] = (inner @ getattr(self, f"{target}_B").t()) * self.scaling
        if not self.column_parallel:
            return deltas[self.targets[0]]
        leading = x.shape[:-1]
        if self.fused_qkv:  # Megatron's fused layout: per local query group, [its q heads, k, v]
            groups = self.local_groups
            parts = [deltas[t].reshape(*leading, groups, -1) if t in deltas else
                     x.new_zeros(*leading, groups, self.out_local[t] // groups) for t in self.all_targets]
            return torch.cat(parts, dim=-1).reshape(*leading, -1)
        return torch.cat([deltas[t] if t in deltas else x.new_zeros(*leading, self.out_local[t])
                          for t in self.all_targets], dim=-1)  # [gate; up]


def _add_adapter_output(module, args, kwargs, output):
    adapters = module.lora
    active = module.lora_active.name
    if active not in adapters:  # this layer carries no target of the active adapter
        return output
    x = args[0] if args else kwargs["input_"]
    result, bias = output
    return result + adapters[active](x).to(result.dtype), bias


def attach_lora(model: torch.nn.Module, adapters: dict[str, LoraConfig], model_config) -> ActiveAdapter:
    """Freeze every parameter of `model` (a GPTModel, or one pipeline stage of it) and add the adapters of its
    layers, one set per name of `adapters` (a single adapter: `{"policy": train.lora}`); they alone train.
    Returns the switch that says which one the forward uses (the first at start)."""
    for param in model.parameters():
        param.requires_grad_(False)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    active = ActiveAdapter(next(iter(adapters)))
    for layer in model.decoder.layers:
        for megatron_layer in MEGATRON_LAYER_TARGETS:
            carried = {name: lora for name, lora in adapters.items() if lora.targets_of(megatron_layer)}
            if not carried:
                continue
            linear = layer.get_submodule(megatron_layer)
            linear.lora = torch.nn.ModuleDict({
                name: LoraAdapters(lora, megatron_layer, layer.layer_number, model_config, tp_rank=tp_rank,
                                   tp_size=tp_size, dtype=dtype, device=device,
                                   tp_group=getattr(linear, "tp_group", None))
                for name, lora in carried.items()})
            linear.lora_active = active
            linear.register_forward_hook(_add_adapter_output, with_kwargs=True)
    return active
