"""One rank's trainer: the step a TrainActor runs, without Ray (tests drive it in-process).

A step (`RankTrainer.train_shard`), the same on CPU (gloo) and GPU (NCCL):

1. Micro-batches: exactly `shard.micro_batch_indices` in that order (an empty entry is a
   zero-weight padding micro-batch); the rollout side laid them out, the same count on every
   DP rank (and a multiple of the interleaved schedule's group), so no rank agrees on it here.
   PP and TP peers of a DP rank train the same shard, so every stage sees the same list.
   With context parallelism (GPU) each CP rank keeps its load-balanced share of every row
   (`vgbs_ray.layout.context_parallel`).
2. Log-probs the loss compares against (`vgbs_ray.losses.reduction.micro_batch_loss`, chosen by
   `config.loss.off_policy.policy_loss`):
   - behaviour: the shard's `rollout_log_probs` (the engine's, at sampling time), per
     micro-batch `PackedMicroBatch.old_log_probs`;
   - proximal (the policy at the start of the step): a step takes exactly one optimizer update,
     after the last micro-batch's backward, so the loss's own forward pass already runs on the
     step-start weights: the proximal log-probs are that forward's log-probs, detached. No
     extra forward pass (tests/test_train_step.py checks it equals a separate no-grad pass).
   Only `ppo` on a shard without behaviour log-probs runs Megatron's schedule with
   `forward_only=True` before the update (the last stage keeps the result) and clips against
   it; `decoupled_ppo` refuses such a shard before any collective, naming step, rank and positions.
3. Megatron's schedule (`trainer/megatron_step.py`): the first stage embeds each packed THD row,
   the last computes the per-rollout loss (divided by the step's `num_rollouts`, times
   M * dp_size to undo Megatron's averaging; importance weights touch numerators only) and
   the metric pairs (`OFF_POLICY_METRIC_NAMES`: loss, reward, clip_fraction, ratio, approx_kl,
   is_weight, is_truncated, log_prob_mismatch); DDP all-reduces the gradients (SUM of
   pre-scaled gradients).
4. Clip, set the LR for the rollouts consumed so far, optimizer step (Megatron's optimizer).

Metrics travel once: the lead rank of each DP replica (TP/CP rank 0 of the last stage) returns
its replica's (sum, count) pairs; whoever needs the step's totals (the TrainGroup, the
scheduler's ack) sums them. No collective carries metrics across DP (with CP > 1, one SUM
joins the CP peers' partial pairs first), and no collective agrees on a count: no
all-reduce(MAX).
"""

from __future__ import annotations

import copy
import logging
import time

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from trainer.megatron_step import MegatronStep, padding_micro_batch
from trainer.config import RankInfo, RankStepResult, TrainGroupConfig
from vgbs_ray.layout.context_parallel import split_for_context_parallel
from vgbs_ray.errors import VgbsError
from vgbs_ray.models.lora import is_adapter_name
from vgbs_ray.lr_schedule import lr_at
from vgbs_ray.metrics import MetricPairs, reduce_metric_pairs
from vgbs_ray.layout.microbatch import PackedMicroBatch, pack_micro_batch
from vgbs_ray.losses.reduction import micro_batch_loss, undo_averaging_factor
from vgbs_ray.layout.shard import StepShard

log = logging.getLogger(__name__)


class ShardMismatchError(VgbsError, ValueError):
    """A shard was sent to a rank it was not built for."""


class RankTrainer:
    """The model chunks, optimizer and step of one rank (after `init_distributed`)."""

    def __init__(self, config: TrainGroupConfig, info: RankInfo):
        self.config = config
        self.info = info
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.megatron = MegatronStep(config)
        self.device = self.megatron.device  # collective buffers live where the backend wants them
        self.consumed_rollouts = 0
        self.tenant_consumed = {name: 0 for name in config.adapters} if config.tenant_adapters else {}
        """Multi-LoRA: rollouts each tenant's steps consumed (each its own LR schedule)."""
        self.loss = config.loss.build()

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.megatron.local_parameters()]

    # -- the step -----------------------------------------------------------------------

    def train_shard(self, shard: StepShard, adapter: str | None = None) -> RankStepResult:
        """Train one step's shard; multi-LoRA: `adapter` names the tenant whose step it is (only its adapter and
        optimizer move, with its own LR schedule)."""
        start = time.perf_counter()
        if bool(adapter) != bool(self.tenant_consumed) or (adapter and adapter not in self.tenant_consumed):
            raise ShardMismatchError(f"step {shard.step}: shard for adapter {adapter!r}, but this group trains "
                                     f"{sorted(self.tenant_consumed) or 'no tenant adapters'}")
        self.megatron.activate(adapter)
        if shard.rank != self.info.dp_rank or shard.dp_size != self.dp_size:
            raise ShardMismatchError(
                f"step {shard.step}: shard for dp rank {shard.rank} of {shard.dp_size} sent to dp rank "
                f"{self.info.dp_rank} of {self.dp_size}; the scheduler's ParallelConfig must be this group's"
            )
        self._check_behaviour_log_probs(shard)  # before the first collective
        micro_batches = [pack_micro_batch(shard, positions) if len(positions) else padding_micro_batch()
                         for positions in self._micro_batch_positions(shard)]
        if self.config.cp_size > 1:  # GPU only (TrainGroupConfig refuses CP on CPU)
            micro_batches = [split_for_context_parallel(mb, self.info.cp_rank, self.config.cp_size)
                             for mb in micro_batches]
        behaviour = None if shard.rollout_log_probs is None else [mb.old_log_probs for mb in micro_batches]
        # Without behaviour log-probs the loss compares against the step-start policy, recomputed here
        # (an empty shard has only padding micro-batches: nothing to compare). With them, a loss that
        # needs each rollout's log-ratio over all its samples gets it from the same kind of pre-pass.
        step_start, sequence_log_ratios = None, None
        if shard.num_samples and behaviour is None:
            step_start = self.step_start_log_probs(micro_batches)
        elif behaviour is not None and (self.loss.needs_rollout_log_ratio
                                             or (self.config.cp_size > 1 and self.loss.needs_sample_log_ratio)):
            sequence_log_ratios = self.sequence_log_ratios(
                micro_batches, behaviour, self.step_start_log_probs(micro_batches), shard.num_rollouts)
        consumed = (self.tenant_consumed[adapter] if adapter else self.consumed_rollouts) + shard.num_rollouts
        optimizer = self.config.adapters[adapter].optimizer if adapter else self.config.optimizer
        lr = lr_at(optimizer.lr_schedule, consumed)
        local, grad_norm = self._step(micro_batches, behaviour, lr, step_start=step_start,
                                      sequence_log_ratios=sequence_log_ratios, step=shard.step)
        if adapter:  # a refused step (NonFiniteLossError) consumed nothing
            self.tenant_consumed[adapter] = consumed
        else:
            self.consumed_rollouts = consumed
        if self.config.cp_size > 1:
            local = self._sum_over_context_parallel(local)
        return RankStepResult(
            step=shard.step, rank=self.info.rank, dp_rank=self.info.dp_rank, num_rollouts=shard.num_rollouts,
            num_microbatches=len(micro_batches),
            metrics=local if self.info.is_lead else {}, lr=lr, grad_norm=grad_norm,
            step_time_s=time.perf_counter() - start, consumed_rollouts=consumed,
        )

    def _micro_batch_positions(self, shard: StepShard) -> list[list[int]]:
        if shard.num_microbatches != len(shard.micro_batch_indices):
            raise ValueError(f"step {shard.step}: shard says {shard.num_microbatches} micro-batches "
                             f"but carries {len(shard.micro_batch_indices)}")
        self._check_interleaving(shard.step, len(shard.micro_batch_indices))
        return shard.micro_batch_indices

    def _check_interleaving(self, step: int, count: int) -> None:
        """Megatron's interleaved schedule runs micro-batches in groups of N (megatron-core's interleaved 1F1B)."""
        if self.config.vpp_size == 1:
            return
        group = self.config.microbatch_group
        if count < group or (count % group and count % group < self.config.pp_size):
            raise ValueError(
                f"step {step}: {count} micro-batches on dp rank {self.info.dp_rank}, but the interleaved "
                f"schedule (pp_size={self.config.pp_size}, vpp_size={self.config.vpp_size}) needs a multiple of "
                f"microbatch_group_size_per_vp_stage={group}: the scheduler must lay steps out for this "
                "group's parallel_config (register the train group with it)"
            )

    def _sum_over_context_parallel(self, local: MetricPairs) -> MetricPairs:
        """CP ranks each scored a part of every micro-batch's tokens: one SUM of their pairs (CP > 1 only).

        Every CP rank holds a part of every sample, so the last stage's CP peers report the same names.
        """
        if not self.info.is_last_stage:
            return local
        names = sorted(local)
        values = torch.tensor([v for name in names for v in local.get(name, (0.0, 0.0))], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=parallel_state.get_context_parallel_group())
        return {name: (total, count) for name, (total, count) in zip(names, values.view(-1, 2).cpu().tolist())}

    def _check_behaviour_log_probs(self, shard: StepShard) -> None:
        """A loss (or correction) that cannot do without behaviour log-probs: a shard with samples but no
        `rollout_log_probs` is refused here, on every rank, before the step's first collective
        (a failure inside the schedule would leave pipeline and DP peers waiting for a message)."""
        if shard.rollout_log_probs is not None or not shard.num_samples:
            return
        if self.loss.needs_behaviour_log_probs:
            rollouts = list(dict.fromkeys(shard.rollout_ids))
            raise ValueError(
                f"policy loss {self.loss.name!r} (correction {self.loss.correction.kind!r}) needs behaviour log-probs "
                f"(the samples' rollout_log_probs) for step {shard.step}, dp rank {shard.rank}: shard positions "
                f"0..{shard.num_samples - 1} (rollouts {rollouts[:5]}{' ...' if len(rollouts) > 5 else ''}) lack "
                "them; producers must send rollout_log_probs with every sample, or set train.loss.policy=ppo")

    def sequence_log_ratios(self, micro_batches: list[PackedMicroBatch], behaviour: list[torch.Tensor],
                            step_start: list[torch.Tensor | None], num_rollouts: int) -> list[tuple | None]:
        """Per micro-batch, (rollout_log_ratio, sample_log_ratio) per token: the mean of log pi_prox - log pi_behave
        over every trained token of the token's whole rollout / sample, wherever its other tokens train.

        A two-phase reduction: each last-stage rank sums (log-ratio, tokens) per step rollout index over its
        micro-batches (the pre-pass's step-start log-probs), then one all-reduce SUM over the DP and CP ranks
        makes every rollout's totals whole (a sample is split only over CP ranks: one SUM there). Other
        pipeline stages compute no loss: None there.
        """
        if not self.info.is_last_stage:
            return [None] * len(micro_batches)
        rollout_sums = torch.zeros(num_rollouts, 2, dtype=torch.float64, device=self.device)
        sample_sums, per_micro_batch = [], []
        for mb, start, old in zip(micro_batches, step_start, behaviour):
            if mb.num_samples == 0:
                per_micro_batch.append(None)
                continue
            weight = mb.loss_weight.to(self.device, torch.float64)
            mismatch = (start.to(self.device, torch.float64) - old.to(self.device, torch.float64)) * weight
            sample_of_token = torch.repeat_interleave(torch.arange(mb.num_samples, device=self.device),
                                                      mb.response_lengths.to(self.device))
            rollout_of_token = mb.rollout_indices.to(self.device)[sample_of_token]
            rollout_sums.index_add_(0, rollout_of_token, torch.stack([mismatch, weight], dim=1))
            sums = torch.zeros(mb.num_samples, 2, dtype=torch.float64, device=self.device)
            sample_sums.append(sums.index_add_(0, sample_of_token, torch.stack([mismatch, weight], dim=1)))
            per_micro_batch.append((rollout_of_token, sample_of_token, len(sample_sums) - 1))
        dist.all_reduce(rollout_sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        if self.config.cp_size > 1 and sample_sums:
            joined = torch.cat(sample_sums)
            dist.all_reduce(joined, group=parallel_state.get_context_parallel_group())
            sample_sums = list(joined.split([len(sums) for sums in sample_sums]))
        rollout_means = rollout_sums[:, 0] / rollout_sums[:, 1].clamp(min=1)
        result = []
        for entry in per_micro_batch:
            if entry is None:
                result.append(None)
                continue
            rollout_of_token, sample_of_token, k = entry
            sample_means = sample_sums[k][:, 0] / sample_sums[k][:, 1].clamp(min=1)
            result.append((rollout_means[rollout_of_token].float().cpu(), sample_means[sample_of_token].float().cpu()))
        return result

    def step_start_log_probs(self, micro_batches: list[PackedMicroBatch]) -> list[torch.Tensor | None]:
        """Per micro-batch, the response log-probs under the current weights, from a separate
        `forward_only` pass of Megatron's schedule (last stage only; None elsewhere).

        Called before the update this is the step-start (proximal) policy: numerically what the
        loss's own forward pass yields, detached (same weights, no dropout, same packing).
        """
        result: list[torch.Tensor | None] = [None] * len(micro_batches)

        def keep(index, logits):
            mb = micro_batches[index]
            result[index] = self.megatron.response_log_probs(logits, mb).float().cpu()
            return logits.sum() * 0.0  # nothing to learn from this pass

        with torch.no_grad():
            self.megatron.run(micro_batches, keep, forward_only=True)
        return result

    def _step(self, micro_batches, behaviour, lr: float, *, step_start: list[torch.Tensor | None] | None = None,
              sequence_log_ratios: list[tuple | None] | None = None, step: int = -1) -> tuple[MetricPairs, float]:
        """One optimizer update over `micro_batches`; the loss compares against `behaviour` (per
        micro-batch, or None) and the proximal policy: `step_start` when given (a separate
        forward pass before the update), else the detached log-probs of this very forward pass,
        which runs on the step-start weights (the update comes after every micro-batch's backward).
        `sequence_log_ratios`: per micro-batch, the pre-pass's (rollout, sample) log-ratios, or None.

        A non-finite loss is carried into the gradients (made NaN where its own are finite): the gradient
        norm, all-reduced over every rank, then carries it to all of them, and `MegatronStep.optimizer_step`
        refuses the update on every rank alike (no weight is written); the error names the micro-batches
        whose loss it was. No extra collective.
        """
        # Megatron divides each micro-batch's loss by their count and DDP scales gradients by
        # 1 / dp before its SUM (module docstring of megatron_step): multiply both back, so the
        # reduced gradient is the mean over the step's rollouts whatever dp, split or packing.
        factor = undo_averaging_factor(dp_size=self.dp_size, num_microbatches=len(micro_batches),
                                       grads_averaged_over_dp=True, loss_averaged_over_microbatches=True)
        parts: list[MetricPairs] = []

        def loss(index, logits):
            mb = micro_batches[index]
            if mb.num_samples == 0:
                return logits.sum() * 0.0  # a padding micro-batch: zero loss, zero gradient
            log_probs = self.megatron.response_log_probs(logits, mb)
            proximal = log_probs.detach() if step_start is None else step_start[index]
            ratios = None if sequence_log_ratios is None else sequence_log_ratios[index]
            value, pairs = micro_batch_loss(self.loss, log_probs, mb,
                                            behaviour_log_probs=None if behaviour is None else behaviour[index],
                                            proximal_log_probs=proximal,
                                            rollout_log_ratio=None if ratios is None else ratios[0],
                                            sample_log_ratio=None if ratios is None else ratios[1])
            if not bool(torch.isfinite(value)):
                non_finite.append(f"micro-batch {index} (shard positions {mb.positions.tolist()[:8]})")
                # a non-finite value can have finite gradients (a NaN constant): make them NaN too, so the
                # gradient norm, which every rank computes over the reduced gradients, refuses the update
                value = value + logits.sum() * float("nan")
            parts.append(pairs)
            return value * factor

        non_finite: list[str] = []
        self.megatron.zero_grads()
        self.megatron.run(micro_batches, loss, forward_only=False)
        grad_norm = self.megatron.optimizer_step(
            lr, refusal=f"step {step}, dp rank {self.info.dp_rank}: policy loss {self.loss.name!r} "
                        + (f"was not finite in {', '.join(non_finite)}" if non_finite else "was finite on this rank"))
        return reduce_metric_pairs(parts), grad_norm

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Model chunks (this rank's TP/PP shard), optimizer and LR-schedule position (a copy, not live views).
        With LoRA the chunks hold the adapters only: the frozen base is built again from train.model (its seed or
        its hf_checkpoint_dir) as at the start, so a checkpoint does not repeat it."""
        lora = self.config.lora is not None
        return copy.deepcopy({
            "model": [{k: v for k, v in chunk.module.state_dict().items()
                       if isinstance(v, torch.Tensor) and (not lora or is_adapter_name(k))}
                      for chunk in self.megatron.chunks],
            "optimizer": ({name: optimizer.state_dict() for name, optimizer in self.megatron.optimizers.items()}
                          if self.tenant_consumed else self.megatron.optimizer.state_dict()),
            "consumed_rollouts": self.consumed_rollouts,
            "tenant_consumed": dict(self.tenant_consumed),
        })

    def load_state_dict(self, state: dict) -> None:
        if len(state["model"]) != len(self.megatron.chunks):
            raise ValueError(f"state has {len(state['model'])} model chunks, this rank {len(self.megatron.chunks)} "
                             "(saved with another vpp_size?)")
        for chunk, chunk_state in zip(self.megatron.chunks, state["model"]):
            chunk.module.load_state_dict(chunk_state, strict=False)
        if self.tenant_consumed:
            for name, optimizer in self.megatron.optimizers.items():
                optimizer.load_state_dict(state["optimizer"][name])
        else:
            self.megatron.optimizer.load_state_dict(state["optimizer"])
        self.consumed_rollouts = int(state["consumed_rollouts"])
        self.tenant_consumed.update(state.get("tenant_consumed", {}))

    def full_parameters(self, *, adapters: bool = False, adapter: str | None = None) -> dict[str, np.ndarray]:
        """Every parameter of the whole model, global names (collective over TP and PP: every such peer must call);
        with LoRA the base's, or the adapters' (`adapters=True`). bf16 parameters come out as float32 arrays
        (numpy has no bfloat16; the conversion is exact)."""
        return {name: (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
                for name, tensor in self.megatron.full_parameters(adapters=adapters, adapter=adapter).items()}

    def load_full_parameters(self, full: dict) -> None:
        """Set this rank's parameters from whole-model arrays (as `full_parameters` returns them)."""
        self.megatron.load_full_parameters(full)
