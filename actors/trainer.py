"""One rank's trainer: the step a TrainActor runs, without Ray (tests drive it in-process).

A step (`RankTrainer.train_shard`), on the CPU path:

1. Micro-batches: with a layout, exactly `shard.micro_batch_indices` in that order; the legacy
   path (no layout) packs the rank's own samples under a token cap and agrees on the count
   with one all-reduce(MAX) over DP, padding with empty micro-batches.
2. Old log-probs: the shard's rollout log-probs, or a no-grad forward pass before the update.
3. Per micro-batch: forward on the packed THD row, per-rollout PPO loss divided by the
   step's `num_rollouts`, backward (gradients accumulate).
4. One all-reduce SUM of all gradients over DP (one flat buffer): the gradient is then the
   mean over the step's rollouts, whatever the DP size, split or packing. No averaging to undo.
5. Clip, set the LR for the rollouts consumed so far, optimizer step.
6. One all-reduce SUM of the metric pairs over DP.

So with a layout the step's collectives are exactly: gradient SUM, metric SUM (plus, with
TP > 1, Megatron's tensor-parallel ones inside the model and a TP SUM for the grad norm).

The GPU path (`backend="nccl"`) runs steps 3-5 with Megatron's schedule, DDP and optimizer
(`actors/megatron_gpu.py`); steps 1, 2, 6 and the loss are this module's.
"""

from __future__ import annotations

import copy
import logging
import time

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from actors.model import build_gpt_model, packed_seq_params
from actors.train_config import RankInfo, RankStepResult, TrainGroupConfig
from vgbs_ray.errors import VgbsError
from vgbs_ray.lr_schedule import lr_at
from vgbs_ray.metrics import MetricPairs, reduce_metric_pairs
from vgbs_ray.microbatch import PackedMicroBatch, legacy_micro_batches, pack_micro_batch, pad_micro_batches
from vgbs_ray.policy_loss import METRIC_NAMES, micro_batch_policy_loss
from vgbs_ray.shard import StepShard

log = logging.getLogger(__name__)


class ShardMismatchError(VgbsError, ValueError):
    """A shard was sent to a rank it was not built for."""


class RankTrainer:
    """The model, optimizer and step of one rank (after `init_distributed`)."""

    def __init__(self, config: TrainGroupConfig, info: RankInfo):
        self.config = config
        self.info = info
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.model = build_gpt_model(config.model, tp_size=config.tp_size, on_gpu=config.on_gpu)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.consumed_rollouts = 0
        # Collective buffers live where the backend wants them (NCCL: CUDA tensors only).
        self.device = torch.device("cuda") if config.on_gpu else torch.device("cpu")
        self.gpu = None
        if config.on_gpu:
            from actors.megatron_gpu import GpuStepRunner

            self.gpu = GpuStepRunner(config, self)
            self.optimizer = self.gpu.optimizer
        else:
            for p in self.params:
                p.grad = torch.zeros_like(p)  # every grad exists: one flat all-reduce, padded ranks too
            self.optimizer = _torch_optimizer(config, self.params)

    # -- the step -----------------------------------------------------------------------

    def train_shard(self, shard: StepShard) -> RankStepResult:
        start = time.perf_counter()
        if shard.rank != self.info.dp_rank or shard.dp_size != self.dp_size:
            raise ShardMismatchError(
                f"step {shard.step}: shard for dp rank {shard.rank} of {shard.dp_size} sent to dp rank "
                f"{self.info.dp_rank} of {self.dp_size}; the scheduler's ParallelConfig must be this group's"
            )
        micro_batches = [pack_micro_batch(shard, positions) for positions in self._micro_batch_positions(shard)]
        old_log_probs = self._old_log_probs(micro_batches)
        self.consumed_rollouts += shard.num_rollouts
        lr = lr_at(self.config.optimizer.lr_schedule, self.consumed_rollouts)
        if self.gpu is not None:
            local, grad_norm = self.gpu.run(micro_batches, old_log_probs, shard.num_rollouts, lr)
        else:
            local, grad_norm = self._cpu_step(micro_batches, old_log_probs, shard.num_rollouts, lr)
        reduced = self._all_reduce_metrics(local)
        return RankStepResult(
            step=shard.step, rank=self.info.rank, dp_rank=self.info.dp_rank, num_rollouts=shard.num_rollouts,
            num_microbatches=len(micro_batches), path="layout" if shard.has_layout else "legacy",
            local_metrics=local, reduced_metrics=reduced, lr=lr, grad_norm=grad_norm,
            step_time_s=time.perf_counter() - start, consumed_rollouts=self.consumed_rollouts,
        )

    def _micro_batch_positions(self, shard: StepShard) -> list[list[int]]:
        if shard.has_layout:
            if shard.num_microbatches != len(shard.micro_batch_indices):
                raise ValueError(f"step {shard.step}: shard says {shard.num_microbatches} micro-batches "
                                 f"but carries {len(shard.micro_batch_indices)}")
            return shard.micro_batch_indices
        # Legacy path: this rank's own packing; the ranks must agree on the count (pipeline
        # stages and DP all-reduces run in lockstep), hence the all-reduce(MAX).
        own = legacy_micro_batches(shard.total_lengths, self.config.loss.legacy_max_tokens_per_microbatch)
        count = torch.tensor([len(own)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dp_group)
        log.info("step %d dp rank %d: legacy path (no layout), %d own micro-batches, all-reduce(MAX) -> %d",
                 shard.step, self.info.dp_rank, len(own), int(count))
        return pad_micro_batches(own, int(count))

    def _old_log_probs(self, micro_batches: list[PackedMicroBatch]) -> list[torch.Tensor]:
        recompute = self.config.loss.recompute_old_log_probs
        result = []
        for mb in micro_batches:
            if mb.old_log_probs is not None and not recompute:
                result.append(mb.old_log_probs)
            elif mb.num_samples == 0:
                result.append(torch.zeros(0))
            else:
                self.model.eval()
                with torch.no_grad():
                    result.append(self.response_log_probs(mb).float().cpu())
        self.model.train()
        return result

    def response_log_probs(self, mb: PackedMicroBatch) -> torch.Tensor:
        """Log-probs of the micro-batch's response tokens under the current model (flat, [R])."""
        device = self.device
        logits = self.model(mb.tokens.to(device), mb.position_ids.to(device), None,
                            packed_seq_params=packed_seq_params(mb.cu_seqlens.to(device), mb.max_seqlen))
        logits = logits[0].float()  # [T, vocab / tp]
        targets = mb.targets[0].to(device)
        if self.tp_size == 1:
            token_log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        else:  # the vocabulary is split over TP ranks
            token_log_probs = -tensor_parallel.vocab_parallel_cross_entropy(
                logits.unsqueeze(1), targets.unsqueeze(1)).squeeze(1)
        return token_log_probs[mb.response_logit_index.to(device)]

    def _cpu_step(self, micro_batches, old_log_probs, num_rollouts: int, lr: float) -> tuple[MetricPairs, float]:
        self.optimizer.zero_grad(set_to_none=False)
        parts = []
        for mb, old in zip(micro_batches, old_log_probs):
            if mb.num_samples == 0:
                continue  # a legacy padding micro-batch: zero weight
            loss, pairs = micro_batch_policy_loss(self.response_log_probs(mb), old, mb,
                                                  num_rollouts=num_rollouts, clip_eps=self.config.loss.clip_eps)
            loss.backward()
            parts.append(pairs)
        self._all_reduce_grads()
        grad_norm = self._clip_grads()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return reduce_metric_pairs(parts), grad_norm

    def _all_reduce_grads(self) -> None:
        """SUM (not average) over DP: each rank's loss is already divided by the step's rollouts."""
        if self.dp_size == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def _clip_grads(self) -> float:
        """Global grad norm over the whole (TP-split) model; clip to the configured max."""
        sharded = torch.zeros(1, dtype=torch.float64)
        replicated = torch.zeros(1, dtype=torch.float64)
        for p in self.params:
            square = p.grad.double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += square
            else:
                replicated += square
        if self.tp_size > 1:
            dist.all_reduce(sharded, op=dist.ReduceOp.SUM, group=self.tp_group)
        norm = float((sharded + replicated).sqrt())
        max_norm = self.config.optimizer.clip_grad_norm
        if max_norm is not None and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.params:
                p.grad.mul_(scale)
        return norm

    def _all_reduce_metrics(self, local: MetricPairs) -> MetricPairs:
        """One SUM over DP of every metric's (sum, count); TP peers hold identical copies."""
        values = torch.tensor([v for name in METRIC_NAMES for v in local.get(name, (0.0, 0.0))],
                              dtype=torch.float64, device=self.device)
        if self.dp_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.dp_group)
        pairs = values.view(-1, 2).cpu().tolist()
        return {name: (total, count) for name, (total, count) in zip(METRIC_NAMES, pairs)}

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Model (this rank's TP shard), optimizer and LR-schedule position (a copy, not live views)."""
        return copy.deepcopy({
            "model": {k: v for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)},
            "optimizer": self.optimizer.state_dict(),
            "consumed_rollouts": self.consumed_rollouts,
        })

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.consumed_rollouts = int(state["consumed_rollouts"])

    def full_parameters(self) -> dict[str, np.ndarray]:
        """Every parameter with its TP shards gathered (collective over TP; every TP rank must call)."""
        full = {}
        for name, p in self.model.named_parameters():
            name = name.removeprefix("module.")  # Megatron DDP's wrapper on the GPU path
            tensor = p.detach().float().cpu()
            if self.tp_size > 1 and getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(p.detach()) for _ in range(self.tp_size)]
                dist.all_gather(parts, p.detach().contiguous(), group=self.tp_group)
                tensor = torch.cat(parts, dim=p.partition_dim).float().cpu()
            full[name] = tensor.numpy().copy()  # never a view of the live parameter
        return full


def _torch_optimizer(config: TrainGroupConfig, params) -> torch.optim.Optimizer:
    opt = config.optimizer
    lr = opt.lr_schedule.lr
    if opt.kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=opt.sgd_momentum, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=opt.adam_betas, eps=opt.adam_eps, weight_decay=opt.weight_decay)
