"""Parameters of a rank's Megatron GPTModel by their whole-model names, and the experts of every EP rank.

A pipeline stage numbers its layers from 0 and an EP rank its local experts from 0; checkpoints, weight syncs
and tests name them as in the whole (PP=1, EP=1) model. Used by the model's train step and by the Hugging Face
checkpoint code alike (so neither imports the other for it).
"""

from __future__ import annotations

import re

import torch

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def named_parameters_global(model: torch.nn.Module):
    """(name, parameter) pairs named as in the whole (PP=1, EP=1) model: a pipeline stage's layer
    indices are local to it, `layer_number` (1-based) is global; an EP rank's local expert i is
    global expert `ep_rank * num_local_experts + i` (Megatron's order)."""
    for name, param in model.named_parameters():
        match = _LAYER_PREFIX.match(name)
        if match:
            layer = model.decoder.layers[int(match.group(1))]
            name = f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]
            expert = _LOCAL_EXPERT.search(name)
            if expert:
                experts = layer.mlp.experts
                group = getattr(experts, "ep_group", None)
                offset = (group.rank() if group is not None else 0) * experts.num_local_experts
                name = f"{name[:expert.start(1)]}{offset + int(expert.group(1))}{name[expert.end(1):]}"
        yield name, param


def is_expert_parameter(param: torch.nn.Parameter) -> bool:
    """An expert's weight: held by one EP rank, its gradient reduced over the expert-data-parallel group only
    (Megatron marks these `allreduce=False`)."""
    return not getattr(param, "allreduce", True)


def with_other_experts(mine: dict[str, torch.Tensor], expert_names: list[str]) -> dict[str, torch.Tensor]:
    """`mine` (global names) with the experts of every other EP rank added: a collective over the EP group
    (every EP peer must call it). `mine` itself at EP=1."""
    from megatron.core import parallel_state

    ep_size = parallel_state.get_expert_model_parallel_world_size()
    if ep_size == 1:
        return mine
    shares = [None] * ep_size
    torch.distributed.all_gather_object(shares, {name: mine[name] for name in expert_names},
                                        group=parallel_state.get_expert_model_parallel_group())
    return {**mine, **{name: tensor for share in shares for name, tensor in share.items()}}

