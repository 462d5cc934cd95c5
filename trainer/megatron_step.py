"""One rank's Megatron machinery: model chunks, Megatron DDP and optimizer, and the schedule.

The same code runs on CPU (gloo; `megatron_cpu_compat` redirects Megatron's CUDA literals)
and on GPU (NCCL; Megatron unmodified):

- Model chunks: one GPTModel per virtual stage (`vpp_size`, 1 without interleaving), each
  holding this pipeline rank's layers of that stage; the first stage embeds the packed THD
  tokens, the last one computes logits, the per-rollout loss and the metrics.
- `run(micro_batches, loss_fn, forward_only)`: Megatron's `get_forward_backward_func()`
  (no pipelining at PP=1, 1F1B at PP>1, interleaved with VPP>1) over exactly the given
  micro-batches, in order. `loss_fn(micro_batch_index, logits)` runs on the last stage only.
- `optimizer_step(lr)`: DDP's gradient all-reduce happened in the schedule's
  `finalize_model_grads`; Megatron's optimizer clips (reporting the grad norm) and steps.

Loss scaling (what `undo_averaging_factor` undoes): a loss function returning (loss, dict)
is multiplied by cp_size and divided by the micro-batch count M in the schedule, and DDP
scales gradients by 1 / (dp_size * cp_size) before its SUM all-reduce. Net: 1 / (M * dp_size),
so the per-rollout loss (already divided by the step's rollouts) is multiplied by M * dp_size.
M counts padding micro-batches too: they run, with zero loss.

Padding micro-batches (no samples) still take part in the schedule: they carry one dummy
token (pipeline stages must exchange a tensor per micro-batch) and return `0 * sum(logits)`,
so their loss and gradient are exactly zero.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer import clip_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from trainer.global_names import is_expert_parameter, named_parameters_global, with_other_experts
from trainer.model import build_gpt_model, packed_seq_params
from trainer.config import TrainGroupConfig
from vgbs_ray.errors import VgbsError
from vgbs_ray.models.hf_mapping import gather_tp_shards, split_tp_shard
from vgbs_ray.models.lora import (AdapterMismatchError, LoraConfig, adapter_of, base_model_name, is_adapter_name,
                           load_peft_adapter)
from vgbs_ray.layout.microbatch import PackedMicroBatch


class NonFiniteLossError(VgbsError, FloatingPointError):
    """A step's loss or gradients were not finite; the update was refused, the weights are those before it."""


def padding_micro_batch() -> PackedMicroBatch:
    """A micro-batch with no samples: one dummy token so every stage has a tensor to pass on."""
    one = torch.zeros(1, 1, dtype=torch.int64)
    empty_i = torch.zeros(0, dtype=torch.int64)
    empty_f = torch.zeros(0, dtype=torch.float32)
    return PackedMicroBatch(
        positions=empty_i.numpy(), tokens=one, position_ids=one.clone(), targets=one.clone(),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), max_seqlen=1, response_logit_index=empty_i,
        response_lengths=empty_i, loss_weight=empty_f, advantages=empty_f, rewards=empty_f,
        rollout_mask_sums=empty_i, old_log_probs=empty_f, rollout_indices=empty_i, sample_mask_sums=empty_i,
        group_mask_sums=empty_i, step_totals=None,
    )


class MegatronStep:
    """Model chunks wrapped in Megatron DDP, Megatron's optimizer, and the schedule (see module docstring)."""

    def __init__(self, config: TrainGroupConfig):
        if not config.on_gpu:
            from trainer.megatron_cpu_compat import activate

            activate()
        self.config = config
        self.device = torch.device("cuda") if config.on_gpu else torch.device("cpu")
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        vpp = config.vpp_size
        modules = []
        self.active_adapters = []  # LoRA: each chunk's switch of the adapter its forward adds
        for vp_stage in range(vpp):
            stage = None if vpp == 1 else vp_stage
            modules.append(build_gpt_model(
                config.model, tp_size=config.tp_size, pp_size=config.pp_size, cp_size=config.cp_size,
                on_gpu=config.on_gpu, vpp_size=vpp, vp_stage=stage, ep_size=config.ep_size,
                microbatch_group_size_per_vp_stage=config.microbatch_group if config.pp_size > 1 else None,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                local_spec=bool(config.adapters),
            ))
            if config.adapters:  # before DDP, which allocates gradient buffers for what trains
                from trainer.lora_layers import attach_lora

                self.active_adapters.append(attach_lora(
                    modules[-1], {name: adapter.lora for name, adapter in config.adapters.items()}, config.model))
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        self.chunks = [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m,
                                               disable_bucketing=vp_stage > 0)
                       for vp_stage, m in enumerate(modules)]
        # The schedule reads these hooks from the first chunk's config (as Megatron's own trainer sets them).
        schedule_config = self.chunks[0].module.config
        schedule_config.finalize_model_grads_func = finalize_model_grads
        no_sync = [chunk.no_sync for chunk in self.chunks]
        schedule_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        bf16 = config.model.params_dtype == "bfloat16"
        if len(config.adapters) > 1:
            self.optimizers = self._optimizer_per_adapter(bf16)
        else:
            self.optimizers = {None: get_megatron_optimizer(_optimizer_config(config.optimizer, bf16), self.chunks)}
        self.optimizer = next(iter(self.optimizers.values()))
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        for name, adapter in config.adapters.items():
            if adapter.lora.adapter_dir is not None:
                self.load_full_parameters(initial_adapter(adapter.lora, config.model, name))

    def _optimizer_per_adapter(self, bf16: bool) -> dict:
        """Multi-LoRA: one Megatron optimizer per adapter, over its parameters alone (Megatron takes the parameters
        that require gradients when it builds one), so a step moves its tenant's adapter and optimizer state only
        (Adam's moments would move every adapter at each step otherwise)."""
        adapters = [(name, p) for chunk in self.chunks for name, p in named_parameters_global(chunk.module)
                    if is_adapter_name(name)]
        optimizers = {}
        for tenant, adapter in self.config.adapters.items():
            for name, p in adapters:
                p.requires_grad_(adapter_of(name) == tenant)
            optimizers[tenant] = get_megatron_optimizer(_optimizer_config(adapter.optimizer, bf16), self.chunks)
        for _, p in adapters:
            p.requires_grad_(True)
        return optimizers

    def activate(self, adapter: str | None) -> None:
        """The adapter the next step trains (and the forward adds): multi-LoRA only; its optimizer steps."""
        if len(self.optimizers) == 1:
            return
        if adapter not in self.optimizers:
            raise ValueError(f"adapter {adapter!r} is not trained here; adapters: {sorted(self.optimizers)}")
        for switch in self.active_adapters:
            switch.name = adapter
        self.optimizer = self.optimizers[adapter]

    # -- the schedule ---------------------------------------------------------------------

    def run(self, micro_batches: Sequence[PackedMicroBatch], loss_fn: Callable, *, forward_only: bool) -> None:
        """Megatron's schedule over `micro_batches` in order; `loss_fn(index, logits) -> loss` on the last stage."""
        device = self.device

        def forward_step(data_iterator, model):
            index, mb = next(data_iterator)
            output = model(mb.tokens.to(device), mb.position_ids.to(device), None,
                           packed_seq_params=packed_seq_params(mb.cu_seqlens.to(device), mb.max_seqlen))

            def loss_func(logits):
                return loss_fn(index, logits), {}

            return output, loss_func

        numbered = list(enumerate(micro_batches))
        vpp = len(self.chunks)
        data = [iter(numbered) for _ in range(vpp)] if vpp > 1 else iter(numbered)
        for chunk in self.chunks:
            chunk.train(not forward_only)
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data,
            model=self.chunks if vpp > 1 else self.chunks[0],
            num_microbatches=len(numbered),
            seq_length=max(mb.num_tokens for mb in micro_batches),  # shapes travel per micro-batch (variable)
            micro_batch_size=1, forward_only=forward_only,
        )

    def response_log_probs(self, logits: torch.Tensor, mb: PackedMicroBatch) -> torch.Tensor:
        """Log-probs of the micro-batch's response tokens from the last stage's logits [1, T, vocab / tp] (flat [R])."""
        logits = logits[0].float()
        targets = mb.targets[0].to(logits.device)
        if self.tp_size == 1:
            token_log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        else:  # the vocabulary is split over TP ranks
            token_log_probs = -tensor_parallel.vocab_parallel_cross_entropy(
                logits.unsqueeze(1), targets.unsqueeze(1)).squeeze(1)
        return token_log_probs[mb.response_logit_index.to(logits.device)]

    def zero_grads(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self, lr: float, refusal: str = "") -> float:
        """Clip and step with `lr`; returns the global grad norm (over the whole model-parallel group).

        Megatron's own `step()` in its parts (ChainedOptimizer's order: prepare, one norm, clip each part
        by it, step), so the norm can be checked between them at no extra collective: a non-finite norm
        refuses the update on every rank alike (DP ranks hold the same reduced gradients, and the norm is
        all-reduced over the model-parallel group), the gradients are zeroed, no weight changes, and
        `NonFiniteLossError` names `refusal`'s cause.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.prepare_grads()  # bf16 or fp32 here: no fp16 grad scaler, so no overflow to skip
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            self.zero_grads()
            raise NonFiniteLossError(f"the update was refused (gradient norm {norm}): {refusal}")
        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            parameters = [] if getattr(part, "is_stub_optimizer", False) else part.get_parameters()
            if parameters and part.config.clip_grad > 0.0:
                # looked up at call time: on CPU, trainer/megatron_cpu_compat.py swaps in a version without the CUDA assert
                clip_grads.clip_grad_by_total_norm_fp32(
                    parameters, max_norm=part.config.clip_grad, total_norm=norm,
                    use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        self.optimizer.step_with_ready_grads()
        return norm

    # -- parameters by global name --------------------------------------------------------

    def local_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters named as in the whole (PP=1) model: layer indices are global."""
        return [pair for chunk in self.chunks for pair in named_parameters_global(chunk.module)]

    def full_parameters(self, *, adapters: bool = False, adapter: str | None = None) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model (TP shards gathered, experts gathered over EP, PP stages joined); a
        collective over TP, EP and PP. With LoRA: the base's (`adapters=False`) or the adapters' (True; one
        adapter's when `adapter` names it)."""
        mine, experts = {}, []
        for name, p in self.local_parameters():
            if is_adapter_name(name) != adapters or (adapter is not None and adapter_of(name) != adapter):
                continue
            tensor = p.detach()
            if self.tp_size > 1 and getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
                # stride 2 = SwiGLU fc1: each rank holds [gate_r; up_r], not a contiguous slice
                tensor = gather_tp_shards(parts, partition_dim=p.partition_dim, stride=p.partition_stride)
            mine[name] = tensor.float().cpu().clone()  # never a view of the live parameter
            if is_expert_parameter(p):
                experts.append(name)
        mine = with_other_experts(mine, experts)
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return mine
        stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
        return {name: tensor for stage in stages for name, tensor in stage.items()}

    def load_full_parameters(self, full: dict) -> None:
        """Set this rank's parameters from whole-model tensors (global names; TP slices taken here). With LoRA,
        `full` may hold the base, the adapters (`full_parameters(adapters=True)`), or both: what it lacks stays."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        has_base = any(not is_adapter_name(name) for name in full)
        with torch.no_grad():
            for name, p in self.local_parameters():
                if name not in full and (is_adapter_name(name) or not has_base):
                    continue
                if name not in full:
                    raise KeyError(f"load_full_parameters: no tensor for parameter {name!r}")
                tensor = torch.as_tensor(full[name])
                if self.tp_size > 1 and getattr(p, "tensor_model_parallel", False):
                    tensor = split_tp_shard(tensor, tp_rank=tp_rank, tp_size=self.tp_size,
                                            partition_dim=p.partition_dim, stride=p.partition_stride)
                if tensor.shape != p.shape:
                    raise ValueError(f"load_full_parameters: {name} has shape {tuple(tensor.shape)}, "
                                     f"this rank's parameter {tuple(p.shape)}")
                p.copy_(tensor.to(p.dtype))
        for optimizer in self.optimizers.values():
            if hasattr(optimizer, "reload_model_params"):
                optimizer.reload_model_params()  # mixed precision keeps fp32 main copies


def initial_adapter(lora: LoraConfig, model, adapter: str) -> dict:
    """The adapter `lora.adapter_dir` holds (Megatron names of adapter `adapter` -> arrays), refused unless it was
    made for this base with this rank, alpha and targets (naming both sides)."""
    from trainer.lora_layers import adapter_shapes

    theirs, tensors = load_peft_adapter(lora.adapter_dir, expected_shapes=adapter_shapes(lora, model, adapter),
                                        base_model_name_or_path=base_model_name(model), adapter=adapter)
    if not lora.same_adapter_shape(theirs):
        raise AdapterMismatchError(
            f"train.lora.adapter_dir={lora.adapter_dir}: the adapter has rank {theirs.rank}, alpha {theirs.alpha}, "
            f"targets {sorted(theirs.target_modules)}; train.lora says rank {lora.rank}, alpha {lora.alpha}, targets "
            f"{sorted(lora.target_modules)}")
    return tensors


def _optimizer_config(opt, bf16: bool) -> MegatronOptimizerConfig:
    return MegatronOptimizerConfig(
        optimizer="adam" if opt.kind == "adamw" else "sgd",
        lr=opt.lr_schedule.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_betas[0],
        adam_beta2=opt.adam_betas[1],
        adam_eps=opt.adam_eps,
        sgd_momentum=opt.sgd_momentum,
        clip_grad=opt.clip_grad_norm or 0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
