"""Configs and results of the train group: frozen dataclasses, importable without Megatron.

The driver (jobs, the TrainGroup) builds these and ships them to the TrainActors; only the
actors import Megatron. Each config validates itself and names the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from vgbs_ray.config import ParallelConfig
from vgbs_ray.errors import ConfigError
from vgbs_ray.models.flops import TransformerFlopsModel
from vgbs_ray.models.lora import DEFAULT_ADAPTER, LoraConfig, check_adapter_name
from vgbs_ray.lr_schedule import LRScheduleConfig
from vgbs_ray.metrics import MetricPairs
from vgbs_ray.models.families import RopeScaling, WeightLayout, get_family
from vgbs_ray.losses.api import AGGREGATIONS
from vgbs_ray.losses.config import CorrectionConfig, check_policy_name
from vgbs_ray.losses.off_policy import OffPolicyConfig

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder of one model family (Megatron-Core GPTModel; maps one-to-one onto its HF `*ForCausalLM`).

    Every family: RMSNorm, SwiGLU MLP, rotary position embeddings, grouped-query attention, no
    output-projection or MLP biases. The family adds its own features (`vgbs_ray.models.families`:
    Qwen2's QKV biases, Qwen3's QK-norm); the fields below cover what varies between checkpoints.
    The defaults are the tiny Llama-shaped model of tests and the demo (head_dim 32: vLLM's CPU
    attention refuses head dimensions under 32).
    """

    family: str = "llama"
    """A registered model family (HF `model_type`): 'llama', 'qwen2', 'qwen3' or 'qwen3_moe' (docs/models.md)."""
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """Grouped-query attention: key/value heads (HF `num_key_value_heads`); divides num_attention_heads."""
    kv_channels: int | None = None
    """Per-head width when it is not hidden_size / num_attention_heads (HF `head_dim`, e.g. Qwen3); None = that ratio."""
    ffn_hidden_size: int = 256
    """SwiGLU inner width (HF `intermediate_size`)."""
    vocab_size: int = 128
    rope_theta: float = 10000.0
    """Rotary embedding base (HF `rope_theta`)."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.x rotary frequency scaling (HF `rope_type: llama3`); None = plain RoPE."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon (HF `rms_norm_eps`)."""
    max_position_embeddings: int = 256
    """Longest sample (tokens) the policy and the engines accept (HF `max_position_embeddings`)."""
    num_experts: int | None = None
    """Mixture of experts in every layer (families with `moe`, e.g. 'qwen3_moe'); None = a dense MLP."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's SwiGLU inner width (HF `moe_intermediate_size`)."""
    moe_router_topk: int = 2
    """Experts per token (HF `num_experts_per_tok`)."""
    moe_norm_topk_prob: bool = True
    """The chosen experts' gate weights are renormalised to sum to 1 (HF `norm_topk_prob`)."""
    tie_word_embeddings: bool = False
    """The output layer reuses the input embedding (HF `tie_word_embeddings`; Llama 3.2, Qwen2.5 and Qwen3's small sizes)."""
    seed: int = 1234
    """Weights are drawn from torch's generator seeded with this (deterministic init)."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    hf_checkpoint_dir: str | None = None
    """Start from the weights of this Hugging Face checkpoint directory (config.json + safetensors)
    instead of a random init; its config.json must match the fields above
    (`trainer.hf_checkpoint.model_config_from_hf` builds a matching config)."""

    def __post_init__(self):
        family = get_family(self.family)  # a ConfigError naming the supported families
        if family.moe != (self.num_experts is not None):
            raise ConfigError(f"ModelConfig.num_experts={self.num_experts!r}: family {self.family!r} is "
                              f"{'a mixture of experts: set num_experts' if family.moe else 'dense: leave it None'}")
        if self.num_experts is not None and not (self.moe_ffn_hidden_size and 1 <= self.moe_router_topk <= self.num_experts):
            raise ConfigError(f"ModelConfig: a mixture of experts needs moe_ffn_hidden_size > 0 and 1 <= "
                              f"moe_router_topk ({self.moe_router_topk}) <= num_experts ({self.num_experts})")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"ModelConfig.hidden_size={self.hidden_size} must be a multiple of "
                              f"num_attention_heads={self.num_attention_heads}, or set kv_channels (the head width)")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"ModelConfig.num_query_groups={self.num_query_groups} must divide "
                              f"num_attention_heads={self.num_attention_heads} (grouped-query attention)")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"ModelConfig: head_dim = {self.head_dim} (kv_channels, or hidden_size / "
                              "num_attention_heads) must be positive and even (rotary embeddings rotate pairs of "
                              "channels)")
        if self.rope_theta <= 0 or self.norm_epsilon <= 0:
            raise ConfigError(f"ModelConfig.rope_theta ({self.rope_theta}) and norm_epsilon ({self.norm_epsilon}) "
                              "must be > 0")
        if self.params_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"ModelConfig.params_dtype must be 'float32' or 'bfloat16', got {self.params_dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def weight_layout(self) -> WeightLayout:
        """What the HF <-> Megatron weight table needs to know of this model (`vgbs_ray.models.hf_mapping`)."""
        family = get_family(self.family)
        return WeightLayout(num_attention_heads=self.num_attention_heads, num_query_groups=self.num_query_groups,
                            qkv_bias=family.qkv_bias, qk_norm=family.qk_norm,
                            tied_embeddings=self.tie_word_embeddings, num_experts=self.num_experts or 0)

    @property
    def flops_model(self) -> TransformerFlopsModel:
        """What `scheduler.batch.balance=flops` weighs a sequence by: this model's dimensions (SwiGLU MLP; an
        MoE layer counts its top-k experts' width). An estimate for balancing ranks, not an exact count."""
        ffn = (self.moe_ffn_hidden_size or self.ffn_hidden_size) * self.moe_router_topk if self.num_experts \
            else self.ffn_hidden_size
        return TransformerFlopsModel(num_layers=self.num_layers, hidden_size=self.hidden_size,
                                     num_attention_heads=self.num_attention_heads,
                                     num_query_groups=self.num_query_groups, ffn_hidden_size=ffn, gated_mlp=True,
                                     vocab_size=self.vocab_size)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    kind: Literal["adamw", "sgd"] = "adamw"
    """AdamW, or plain SGD (no momentum by default; the packing-invariance tests use it)."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """Learning rate as a function of rollouts consumed (advances by each step's rollout count)."""
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None = no clipping."""

    def __post_init__(self):
        if self.kind not in ("adamw", "sgd"):
            raise ConfigError(f"OptimizerConfig.kind must be 'adamw' or 'sgd', got {self.kind!r}")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(f"OptimizerConfig.clip_grad_norm must be > 0 or None, got {self.clip_grad_norm}")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy loss of a train step (YAML `train.loss.*`; docs/losses.md).

    `policy` names a built-in loss or a user's factory by import path, called with `policy_kwargs`
    (`vgbs_ray.losses`: the API and the built-ins); `aggregation` and `correction` refine it.
    `off_policy.max_staleness` is the one staleness bound: the scheduler and producers read it, and
    `build()` refuses a loss without an off-policy correction above 0 unless allowed.

    Old / proximal log-probs (no flag: one train step is one optimizer update, so the step's own
    forward pass runs on the step-start weights): a loss anchored on the behaviour policy clips against
    the shard's `rollout_log_probs` (a shard without them: the step-start policy, recomputed by a
    `forward_only` pass before the update); one anchored on the proximal policy clips against the
    detached log-probs of the loss's own forward pass.
    """

    removed_keys: ClassVar[dict[str, str]] = {
        "legacy_max_tokens_per_microbatch": "every step is laid out on the rollout side; its micro-batches' token cap "
                                            "is scheduler.batch.max_tokens_per_gpu"}

    policy: str = "ppo"
    """A built-in (ppo, decoupled_ppo, gspo, cispo, dr_grpo, dapo) or a factory 'module.path:make_loss'
    returning a vgbs_ray.losses.PolicyLoss; ship its module like an agent's."""
    policy_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the loss factory (e.g. clip_eps, is_weight_cap, level for gspo)."""
    aggregation: str | None = None
    """How token terms become the step loss: rollout_token_mean, sample_token_mean, step_token_mean,
    prompt_token_mean or rollout_token_sum (with constant_tokens); null = the loss's own."""
    constant_tokens: int | None = None
    """rollout_token_sum's divisor of each rollout's token sum; null = the loss's own."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Importance correction for the engine/trainer mismatch: kind none / tis / mis / icepop, level
    token / rollout, low, high (vgbs_ray/losses/config.py)."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """Staleness bound: max_staleness, allow_uncorrected_staleness (see vgbs_ray/losses/off_policy.py)."""

    def __post_init__(self):
        if not isinstance(self.off_policy, OffPolicyConfig):
            raise ConfigError(f"LossConfig.off_policy must be an OffPolicyConfig, got {type(self.off_policy).__name__} "
                              "(YAML: a mapping under train.loss.off_policy)")
        if not isinstance(self.correction, CorrectionConfig):
            raise ConfigError(f"LossConfig.correction must be a CorrectionConfig, got {type(self.correction).__name__} "
                              "(YAML: a mapping under train.loss.correction)")
        check_policy_name(self.policy)
        if not isinstance(self.policy_kwargs, dict):
            raise ConfigError(f"train.loss.policy_kwargs must be a mapping, got {self.policy_kwargs!r}")
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"train.loss.aggregation={self.aggregation!r} is unknown; pick one of {AGGREGATIONS}")

    def build(self):
        """The `vgbs_ray.losses.loading.ResolvedLoss` this config names (imports the loss, so torch): refuses
        an unresolvable path, a kwarg the factory does not take, a loss whose output is unusable, and
        staleness without a correction, each naming the loss and the key."""
        from vgbs_ray.losses.loading import build_loss

        return build_loss(self.policy, self.policy_kwargs, aggregation=self.aggregation,
                          constant_tokens=self.constant_tokens, correction=self.correction,
                          max_staleness=self.off_policy.max_staleness,
                          allow_uncorrected_staleness=self.off_policy.allow_uncorrected_staleness)


@dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """One LoRA adapter the train group trains, with its own optimizer and LR schedule: train.lora's (named
    `policy`, with train.optimizer) or a multi-LoRA tenant's (docs/lora.md)."""

    name: str
    lora: LoraConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def __post_init__(self):
        check_adapter_name(self.name)


@dataclass(frozen=True, kw_only=True)
class TrainGroupConfig:
    """Everything a train group needs: model, optimizer, loss, parallel sizes, placement, timeouts."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    lora: LoraConfig | None = None
    """Train LoRA adapters on the frozen model (docs/lora.md); None trains every weight."""
    tenant_adapters: tuple[AdapterConfig, ...] = ()
    """Multi-LoRA: one adapter per tenant over the one frozen base, each step training one of them (set by a
    multi-tenant job from its tenants; train.lora must then be unset)."""
    dp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    """Pipeline stages (Megatron's 1F1B schedule; interleaved with vpp_size > 1). Divides model.num_layers."""
    vpp_size: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank; > 1 needs pp_size > 1 and
    model.num_layers divisible by pp_size * vpp_size."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Interleaved schedule: micro-batches run per virtual stage before switching chunks
    (Megatron's N; None = pp_size). The scheduler aligns every rank's micro-batch count to it."""
    ep_size: int = 1
    """Expert-parallel size (a mixture-of-experts model): each rank holds model.num_experts / ep_size experts and
    tokens travel to their experts (Megatron's alltoall dispatcher). EP ranks are DP ranks (Megatron carves EP out
    of DP), so ep_size divides dp_size and the step layout is unchanged. Runs on CPU (gloo) and GPU."""
    cp_size: int = 1
    """Context-parallel size: GPU only (Megatron's CP for packed sequences needs Transformer Engine attention)."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """gloo: CPU ranks; nccl: one GPU per rank. Both run Megatron's schedule, DDP and optimizer."""
    placement_strategy: PlacementStrategy = "PACK"
    num_cpus_per_actor: float = 1.0
    placement_timeout_s: float = 60.0
    """How long to wait for the placement group before failing (the cluster cannot fit it)."""
    setup_timeout_s: float = 120.0
    """Rendezvous, Megatron import and init, model build."""
    collective_timeout_s: float = 60.0
    """torch.distributed timeout: a peer that never joins a collective fails the step after this."""
    step_timeout_s: float = 600.0
    """A whole step (including waiting for the scheduler's shard) must finish within this."""

    def __post_init__(self):
        for name in ("dp_size", "tp_size", "pp_size", "vpp_size", "cp_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"TrainGroupConfig.{name} must be a positive integer, got {value!r}")
        self._check_pipeline()
        self._check_experts()
        if self.lora is not None and self.tenant_adapters:
            raise ConfigError("train.lora and tenants both set: a multi-LoRA job gives each tenant its own "
                              "tenants[i].lora; unset train.lora")
        names = [adapter.name for adapter in self.tenant_adapters]
        if len(set(names)) != len(names):
            raise ConfigError(f"tenant names must differ, got {names}")
        for adapter in self.adapters.values():
            adapter.lora.check_model(num_experts=self.model.num_experts, family=self.model.family)
        if self.adapters and self.cp_size > 1:
            raise ConfigError(f"TrainGroupConfig.cp_size={self.cp_size} with LoRA adapters: context parallelism runs "
                              "in Transformer Engine's attention, whose layers fuse the norm into the projections the "
                              "adapters wrap (they need its output); LoRA trains with cp_size=1")
        if self.model.params_dtype == "bfloat16" and self.backend != "nccl":
            raise ConfigError(
                "TrainGroupConfig: model.params_dtype='bfloat16' needs backend='nccl' (a GPU): Megatron-Core 0.16.1's "
                "mixed-precision optimizer accepts only CUDA bf16 tensors; on CPU set train.model.params_dtype=float32 "
                "(a bf16 checkpoint then loads into float32 parameters)"
            )
        if self.cp_size != 1 and self.backend != "nccl":
            raise ConfigError(
                f"TrainGroupConfig.cp_size={self.cp_size} needs backend='nccl': Megatron's context parallelism "
                "for packed sequences runs only in Transformer Engine's GPU attention; on CPU set cp_size=1"
            )
        if self.model.num_query_groups % self.tp_size:
            raise ConfigError(f"TrainGroupConfig.tp_size={self.tp_size} must divide model.num_query_groups="
                              f"{self.model.num_query_groups} (and so num_attention_heads): each TP rank holds "
                              "whole key/value groups")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"TrainGroupConfig.backend must be 'gloo' (CPU) or 'nccl' (GPU), got {self.backend!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"TrainGroupConfig.placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                              f"got {self.placement_strategy!r}")
        for name in ("placement_timeout_s", "setup_timeout_s", "collective_timeout_s", "step_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"TrainGroupConfig.{name} must be > 0 seconds, got {getattr(self, name)}")

    def _check_pipeline(self) -> None:
        if self.model.num_experts is not None and self.pp_size > 1:
            # Megatron's variable-length pipeline exchange needs the alltoall dispatcher; the CPU path runs allgather.
            raise ConfigError("TrainGroupConfig: a mixture-of-experts model (model.num_experts) needs pp_size=1 "
                              f"(not supported with pipeline stages yet), got pp_size={self.pp_size}")
        if self.model.tie_word_embeddings and self.pp_size > 1:
            # Megatron keeps a copy of a tied embedding on the last stage and all-reduces their gradients
            # across the first and last stage; the CPU train step does not do that reduction yet.
            raise ConfigError("TrainGroupConfig: model.tie_word_embeddings=True needs pp_size=1 (tied embeddings "
                              f"across pipeline stages are not supported yet), got pp_size={self.pp_size}")
        pp, vpp, layers = self.pp_size, self.vpp_size, self.model.num_layers
        if vpp > 1 and pp == 1:
            raise ConfigError(f"TrainGroupConfig.vpp_size={vpp} needs pp_size > 1 (virtual stages interleave "
                              "pipeline ranks); set vpp_size=1 or raise pp_size")
        if layers % (pp * vpp):
            raise ConfigError(f"TrainGroupConfig: model.num_layers={layers} must be divisible by pp_size * vpp_size "
                              f"= {pp * vpp} (every model chunk holds the same number of layers)")
        group = self.microbatch_group_size_per_vp_stage
        if group is not None and (not isinstance(group, int) or group < pp):
            raise ConfigError(f"TrainGroupConfig.microbatch_group_size_per_vp_stage={group!r} must be an integer "
                              f">= pp_size={pp} (Megatron's interleaved schedule), or None for pp_size")

    def _check_experts(self) -> None:
        ep = self.ep_size
        if ep == 1:
            return
        if self.model.num_experts is None:
            raise ConfigError(f"TrainGroupConfig.ep_size={ep} needs a mixture-of-experts model (model.num_experts); "
                              "a dense model has no experts to spread: set ep_size=1")
        if self.model.num_experts % ep:
            raise ConfigError(f"TrainGroupConfig.ep_size={ep} must divide model.num_experts={self.model.num_experts} "
                              "(each EP rank holds the same number of experts)")
        if self.dp_size % ep:
            raise ConfigError(f"TrainGroupConfig.ep_size={ep} must divide dp_size={self.dp_size}: Megatron's expert-"
                              "parallel ranks are data-parallel ranks")
        if self.cp_size != 1:
            raise ConfigError(f"TrainGroupConfig.ep_size={ep} with cp_size={self.cp_size} is not supported: set "
                              "cp_size=1")

    @property
    def microbatch_group(self) -> int:
        """Megatron's micro-batch group per virtual stage (N): the configured one, or pp_size."""
        return self.microbatch_group_size_per_vp_stage or self.pp_size

    @property
    def adapters(self) -> dict[str, AdapterConfig]:
        """The LoRA adapters trained, by name: none (every weight trains), train.lora's, or the tenants'."""
        if self.lora is not None:
            return {DEFAULT_ADAPTER: AdapterConfig(name=DEFAULT_ADAPTER, lora=self.lora, optimizer=self.optimizer)}
        return {adapter.name: adapter for adapter in self.tenant_adapters}

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size

    @property
    def on_gpu(self) -> bool:
        return self.backend == "nccl"

    @property
    def parallel_config(self) -> ParallelConfig:
        """The layout the scheduler needs: dp, cp, vpp, micro-batch group (1 without virtual stages)."""
        return ParallelConfig(dp_size=self.dp_size, cp_size=self.cp_size, vpp_size=self.vpp_size,
                              microbatch_group_size_per_vp_stage=self.microbatch_group if self.vpp_size > 1 else 1)


@dataclass(frozen=True)
class RankInfo:
    """Where a TrainActor sits in the Megatron grid."""

    rank: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    pp_size: int = 1
    ep_rank: int = 0
    """Expert-parallel rank (which experts this rank holds: `dp_rank % ep_size`); 0 without expert parallelism."""
    ep_size: int = 1

    @property
    def in_first_replica(self) -> bool:
        """Whether this rank is among those that hold one whole copy of the model together: DP replica 0's ranks,
        and with expert parallelism its EP peers (DP ranks 0 .. ep_size - 1, each with its share of the experts).
        They export the weights and write the checkpoint files."""
        return self.dp_rank < self.ep_size

    @property
    def is_last_stage(self) -> bool:
        """The pipeline stage that computes the loss and the metrics."""
        return self.pp_rank == self.pp_size - 1

    @property
    def is_lead(self) -> bool:
        """The one rank of its DP replica that reports metrics (acks the step): TP/CP rank 0 of the last stage."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.is_last_stage


@dataclass(frozen=True)
class RankStepResult:
    """What one rank reports after one step."""

    step: int
    rank: int
    dp_rank: int
    num_rollouts: int
    num_microbatches: int
    metrics: MetricPairs
    """The (sum, count) pairs of this rank's DP replica, on the lead rank only (empty elsewhere):
    metrics travel once, in the lead's ack or result; whoever needs the step's totals sums them."""
    lr: float
    grad_norm: float
    step_time_s: float
    consumed_rollouts: int


@dataclass(frozen=True)
class StepResult:
    """One optimizer step of the whole group."""

    step: int
    num_rollouts: int
    metrics: dict[str, float]
    """Count-weighted values (total sum / total count) of the reduced metric pairs."""
    metric_pairs: MetricPairs
    lr: float
    grad_norm: float
    step_time_s: float
    """The slowest rank's step time."""
    num_microbatches: int
    consumed_rollouts: int
    shard_wait_s: float = 0.0
    """Seconds the group waited for the step's shards to be formed (trainer idle); 0 for `train_shards`."""
