"""Typed, frozen configs for the schedule: the parallel layout and the batch policy.

Each config validates itself at construction and names the field and the fix.
`check_schedule_configs(parallel, batch)` validates the pair together; call it at start-up
so a static batch that can never be aligned fails before any rollout is produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from vgbs_ray.errors import ConfigError
from vgbs_ray.models.flops import TransformerFlopsModel

BalanceMode = Literal["none", "tokens", "flops"]
LeftoverPolicy = Literal["drop", "partial", "carry"]
BALANCE_MODES = ("none", "tokens", "flops")
LEFTOVER_POLICIES = ("drop", "partial", "carry")


def _require_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The training backend's parallel layout, as it advertises it to the rollout side.

    Only the sizes that shape a layout live here: data-parallel ranks, context-parallel
    size (a micro-batch's tokens are split over cp ranks, so its cap scales by cp), and the
    virtual-pipeline size with its micro-batch group (with vpp > 1 every rank's micro-batch
    count must be a multiple of the group).
    """

    dp_size: int
    cp_size: int = 1
    vpp_size: int = 1
    microbatch_group_size_per_vp_stage: int = 1

    def __post_init__(self):
        _require_positive(
            "ParallelConfig",
            dp_size=self.dp_size,
            cp_size=self.cp_size,
            vpp_size=self.vpp_size,
            microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage,
        )

    @property
    def microbatch_alignment(self) -> int:
        """The step's total micro-batch count must be a multiple of this (micro-batches)."""
        group = self.microbatch_group_size_per_vp_stage if self.vpp_size > 1 else 1
        return self.dp_size * group


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How rollouts become steps and micro-batches.

    Exactly one of `max_tokens_per_gpu` (dynamic packing, tokens) and `micro_batch_size`
    (static chunks, samples) is set.
    """

    derived_keys: ClassVar[dict[str, str]] = {"flops_model": "train.model (with scheduler.batch.balance=flops)"}

    global_batch_size: int
    """Rollouts per optimizer step (not samples)."""
    max_tokens_per_gpu: int | None = None
    """Dynamic path: token cap of one micro-batch on one GPU (the micro-batch cap is this * cp_size)."""
    micro_batch_size: int | None = None
    """Static path: samples per micro-batch."""
    balance: BalanceMode = "tokens"
    """"none" (strided round-robin), "tokens" (equal tokens per rank), "flops" (equal estimated FLOPs)."""
    leftover: LeftoverPolicy = "partial"
    """Rollouts past the last full step: "drop" (reported), "partial" (one smaller last step), "carry"."""
    flops_model: TransformerFlopsModel | None = None
    """Model dimensions for balance="flops" (a job fills them from train.model)."""

    def __post_init__(self):
        _require_positive("BatchConfig", global_batch_size=self.global_batch_size)
        if (self.max_tokens_per_gpu is None) == (self.micro_batch_size is None):
            raise ConfigError(
                "BatchConfig: set exactly one of max_tokens_per_gpu (dynamic packing) and "
                f"micro_batch_size (static chunks); got max_tokens_per_gpu={self.max_tokens_per_gpu}, "
                f"micro_batch_size={self.micro_batch_size}"
            )
        if self.max_tokens_per_gpu is not None:
            _require_positive("BatchConfig", max_tokens_per_gpu=self.max_tokens_per_gpu)
        if self.micro_batch_size is not None:
            _require_positive("BatchConfig", micro_batch_size=self.micro_batch_size)
        if self.balance not in BALANCE_MODES:
            raise ConfigError(f"BatchConfig.balance must be one of {BALANCE_MODES}, got {self.balance!r}")
        if self.leftover not in LEFTOVER_POLICIES:
            raise ConfigError(f"BatchConfig.leftover must be one of {LEFTOVER_POLICIES}, got {self.leftover!r}")
        if self.balance == "flops" and self.flops_model is None:
            raise ConfigError(
                'BatchConfig.balance="flops" needs a cost description: pass '
                "flops_model=TransformerFlopsModel(num_layers=..., hidden_size=..., ...), "
                'or use balance="tokens"'
            )

    @property
    def is_dynamic(self) -> bool:
        return self.max_tokens_per_gpu is not None


def check_schedule_configs(parallel: ParallelConfig, batch: BatchConfig) -> None:
    """Validate a parallel and a batch config together; raise ConfigError with the fix.

    - Every rank needs at least one micro-batch with at least one sample, so a full step
      (gbs rollouts, at least gbs samples) must hold `microbatch_alignment` samples.
    - Static path: gbs one-sample rollouts must fill whole micro-batches on every rank, so
      `global_batch_size % (dp_size * micro_batch_size * mb_group) == 0`.
    """
    align = parallel.microbatch_alignment
    if batch.global_batch_size < align:
        raise ConfigError(
            f"global_batch_size={batch.global_batch_size} rollouts is fewer than the micro-batch "
            f"alignment dp_size*mb_group={align}: every rank needs at least one sample per step; "
            f"raise global_batch_size to >= {align} or lower dp_size"
        )
    if not batch.is_dynamic:
        chunk = align * batch.micro_batch_size
        if batch.global_batch_size % chunk:
            raise ConfigError(
                "static batch cannot be aligned: need step_size % (dp_size * micro_batch_size * mb_group) == 0, "
                f"got {batch.global_batch_size} % ({parallel.dp_size} * {batch.micro_batch_size} * "
                f"{align // parallel.dp_size}) = {batch.global_batch_size % chunk}; set global_batch_size "
                f"to a multiple of {chunk}, or use max_tokens_per_gpu for dynamic packing"
            )
