"""The GPU path of a step: Megatron's forward-backward schedule, DDP and optimizer.

NOT RUN IN THIS REPOSITORY'S TESTS: no GPU was available while it was written. It shares
the micro-batches, old log-probs, loss and metric code with the CPU path
(`actors/trainer.py`); only the accumulation, gradient reduction and optimizer differ.

Undoing Megatron's averaging: without `calculate_per_token_loss` the schedule divides each
micro-batch's loss by the number of micro-batches, and DDP scales gradients by 1 / dp size
before its all-reduce. The per-rollout loss is therefore multiplied by
`num_microbatches * dp_size` (`undo_averaging_factor`), so the reduced gradient is again
the sum over the step's samples of their per-rollout contributions / num_rollouts.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from actors.train_config import TrainGroupConfig
from vgbs_ray.metrics import MetricPairs, reduce_metric_pairs
from vgbs_ray.policy_loss import micro_batch_policy_loss, undo_averaging_factor


class GpuStepRunner:
    """Wraps the trainer's model in Megatron DDP and runs a step with Megatron's schedule."""

    def __init__(self, config: TrainGroupConfig, trainer):
        self.config = config
        self.trainer = trainer
        transformer_config = trainer.model.config
        self.ddp = DistributedDataParallel(
            config=transformer_config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=False),
            module=trainer.model,
        )
        trainer.model = self.ddp  # every forward, including old log-probs, goes through DDP
        transformer_config.finalize_model_grads_func = finalize_model_grads
        transformer_config.no_sync_func = self.ddp.no_sync
        opt = config.optimizer
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam" if opt.kind == "adamw" else "sgd",
                lr=opt.lr_schedule.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_betas[0],
                adam_beta2=opt.adam_betas[1],
                adam_eps=opt.adam_eps,
                sgd_momentum=opt.sgd_momentum,
                clip_grad=opt.clip_grad_norm or 0.0,
                bf16=config.model.params_dtype == "bfloat16",
                params_dtype=torch.bfloat16 if config.model.params_dtype == "bfloat16" else torch.float32,
            ),
            [self.ddp],
        )

    def run(self, micro_batches, old_log_probs, num_rollouts: int, lr: float) -> tuple[MetricPairs, float]:
        live = [(mb, old) for mb, old in zip(micro_batches, old_log_probs) if mb.num_samples]
        factor = undo_averaging_factor(dp_size=self.trainer.dp_size, num_microbatches=len(live),
                                       grads_averaged_over_dp=True, loss_averaged_over_microbatches=True)
        parts: list[MetricPairs] = []
        clip_eps = self.config.loss.clip_eps

        def forward_step(data_iterator, model):
            mb, old = next(data_iterator)
            log_probs = self.trainer.response_log_probs(mb)

            def loss_func(output):
                loss, pairs = micro_batch_policy_loss(output, old, mb, num_rollouts=num_rollouts, clip_eps=clip_eps)
                parts.append(pairs)
                return loss * factor, {}

            return log_probs, loss_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if live:
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(live), model=[self.ddp],
                num_microbatches=len(live), seq_length=max(mb.num_tokens for mb, _ in live),
                micro_batch_size=1, forward_only=False,
            )
        _, grad_norm, _ = self.optimizer.step()
        return reduce_metric_pairs(parts), float(grad_norm or 0.0)
