"""The job's configuration: one frozen dataclass per component, loaded from YAML + overrides.

    JobConfig
      run          RunConfig          steps, outputs, checkpoints, Ray address
      rollout      RolloutConfig      the rollouts: an agent in producers, sampling vLLM engines on the policy
                                      (the digit task; use_engines=false: no engines, the agent makes its samples)
      scheduler    SchedulerConfig    batch (gbs in rollouts, token cap, balance, leftover), buffers
      train        TrainGroupConfig   model, optimizer, loss, parallel sizes, placement

`load_job_config(path, overrides, preset)` builds it on a preset (`PRESETS`: `closed_loop`, the
default, `synthetic` and `long_tail`: whole configs); every error names the key and the fix. A JobConfig
built in Python is checked by itself the same way.
Cross-component checks (schedule alignment, sequence lengths vs the model) run here too,
so a wrong config fails at start-up, before any actor exists.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from actors.rollout_engine import EngineConfig
from actors.weight_sync import WeightSyncConfig
from vgbs_ray.scheduler.types import ENGINES_BUDGET, SchedulerConfig
from trainer.config import AdapterConfig, LossConfig, ModelConfig, OptimizerConfig, TrainGroupConfig
from jobs.config_loader import apply_overrides, config_from_mapping, describe, load_yaml
from jobs.tracking import LOGGER_NAMES
from jobs.tracking_backends import MlflowConfig, TensorBoardConfig, WandbConfig
from vgbs_ray.config import BatchConfig, check_schedule_configs
from vgbs_ray.agents import SamplingConfig
from vgbs_ray.agents.tool_calls import FAMILY_PARSERS, ToolRequestError, check_parser_name
from vgbs_ray.errors import ConfigError
from vgbs_ray.scheduler.intake import IntakeConfig
from vgbs_ray.models.lora import LoraConfig, check_adapter_name
from vgbs_ray.lr_schedule import LRScheduleConfig
from vgbs_ray.checkpoint_files import has_tokenizer
from vgbs_ray.models.families import model_fields_from_hf_config
from vgbs_ray.losses.off_policy import OffPolicyConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    num_steps: int = 100
    """Optimizer steps to train; the run also ends when producers are done and the last (partial) step is trained.
    100: the closed-loop demo's digit agent reaches a 10-step mean sampled reward of 0.8 after ~55-65 steps and
    0.9-0.95 by step 80 (measured); past ~0.95 nearly every group is uniform and dropped, so later steps mostly
    wait for sampling."""
    output_dir: str = "runs/latest"
    """Step records (steps.jsonl), the plot (steps.png), the summary and checkpoints go here."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many steps (0 = only at the end). A recovered failure redoes
    the steps after the latest checkpoint: fewer steps between checkpoints, less work redone
    (each checkpoint of the demo's tiny model and ledger holds ~4 MB)."""
    max_failures: int = 2
    """Train-group failures (a dead rank, a failed or hung step) recovered in the job: tear the group
    down, start a new one from the latest checkpoint, replay the steps after it. Also the restarts each
    producer gets when its actor dies (from the latest checkpoint's cursor). 0 = fail fast."""
    resume: bool = False
    """Resume from the latest checkpoint in output_dir/checkpoints."""
    ray_address: str = "local"
    """"local": start an in-process Ray cluster; "auto": attach to a running cluster (what `ray job submit` gives)."""
    local_num_cpus: int = 8
    """Logical CPUs of the in-process cluster (bookkeeping, not cores)."""
    shard_timeout_s: float = 120.0
    """How long a train rank waits for its shard of a step before the run fails."""
    plot: bool = True
    """Draw rollouts per step and loss over steps to output_dir/steps.png at the end."""
    loggers: tuple[str, ...] = ("console", "jsonl")
    """Where the run's numbers go (docs/metrics.md): console (the step line), jsonl (output_dir/steps.jsonl), and
    any of tensorboard, wandb, mlflow (each an extra: pip install '.[tracking]'), e.g.
    --set run.loggers=[console,jsonl,tensorboard,wandb]. The list replaces the default."""
    project: str = "vgbs-ray"
    """The W&B project and the MLflow experiment."""
    run_name: str | None = None
    """The run's display name in W&B and MLflow (None: the tracker picks one)."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    def __post_init__(self):
        if self.num_steps < 1:
            raise ConfigError(f"run.num_steps must be >= 1, got {self.num_steps}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"run.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if not isinstance(self.max_failures, int) or self.max_failures < 0:
            raise ConfigError(f"run.max_failures must be an integer >= 0 (0 = fail fast), got {self.max_failures!r}")
        if self.ray_address != "local" and not self.ray_address:
            raise ConfigError('run.ray_address must be "local", "auto" or a cluster address')
        known = LOGGER_NAMES
        if not isinstance(self.loggers, tuple) or not all(isinstance(name, str) for name in self.loggers):
            raise ConfigError(f"run.loggers must be a list of names, e.g. [console,jsonl,tensorboard], got "
                              f"{self.loggers!r}")
        unknown = [name for name in self.loggers if name not in known]
        if unknown or len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"run.loggers={list(self.loggers)}: each of {list(known)} at most once"
                              + (f" ({unknown} unknown)" if unknown else ""))


DIGIT_AGENT = "examples.digit_agent"
"""The demo's agent module (examples/digit_agent.py): named by import path like any user's."""
DIGIT_VOCAB_SIZE = 17
"""The digit agent's tokenizer (examples/digit_tokenizer): 10 digits, 3 chat tokens, 3 feedback words, pad."""


@dataclass(frozen=True, kw_only=True)
class EndpointConfig:
    """The OpenAI-compatible endpoint agents can call (docs/agents.md, "Agents behind an OpenAI client")."""

    enabled: bool = False
    """Serve /v1/chat/completions and /v1/completions from every producer; each rollout gets its own session
    (ctx.endpoint.base_url). The token is made per job, written to <output_dir>/endpoint_token (mode 600)."""
    host: Literal["loopback", "node"] = "loopback"
    """"loopback": 127.0.0.1 (agents run in the producer's process or node); "node": the node's private address,
    for agents elsewhere in the cluster. Never every interface."""
    tool_parser: str | None = None
    """The vLLM tool parser replies to requests with `tools` are parsed with (docs/agents.md, "Tool calls"): null =
    the model family's (hermes for Qwen2.5 / Qwen3, llama3_json for Llama 3.x), 'none' = tools are refused, or any
    name vLLM registers (vllm.tool_parsers)."""

    def resolved_tool_parser(self, family: str) -> str | None:
        """The parser name the producers use for a model of `family` (None: none)."""
        if self.tool_parser == "none":
            return None
        return self.tool_parser or FAMILY_PARSERS.get(family)

    def __post_init__(self):
        if self.tool_parser is not None and (not isinstance(self.tool_parser, str) or not self.tool_parser):
            raise ConfigError(f"rollout.endpoint.tool_parser must be a vLLM parser name, 'none' or null, got "
                              f"{self.tool_parser!r}")
        if self.host not in ("loopback", "node"):
            raise ConfigError(f"rollout.endpoint.host={self.host!r} must be 'loopback' or 'node' (the node's "
                              "private address); the endpoint never listens on every interface")


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """Prompt rows from a file, read with Ray Data (any filesystem it reads: local, s3://, gs://, ...)."""

    path: str
    """A JSON Lines (.jsonl / .json) or Parquet (.parquet) file or directory."""
    format: Literal["auto", "json", "parquet"] = "auto"
    """"auto": by the path's extension."""
    keys: tuple[str, ...] | None = None
    """Columns the agent gets in its row (None: every column)."""
    epochs: int = 1
    """Passes over the rows; the run's input ends after the last one."""
    shuffle_seed: int | None = 0
    """Each epoch's row order is a permutation seeded by (shuffle_seed, epoch); None = file order."""

    def __post_init__(self):
        if not self.path:
            raise ConfigError("rollout.dataset.path must name a JSON Lines or Parquet file")
        if self.format not in ("auto", "json", "parquet"):
            raise ConfigError(f"rollout.dataset.format must be auto, json or parquet, got {self.format!r}")
        if self.resolved_format is None:
            raise ConfigError(f"rollout.dataset.path={self.path!r}: cannot tell the format from the extension; "
                              "set rollout.dataset.format to json or parquet")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ConfigError(f"rollout.dataset.epochs must be an integer >= 1, got {self.epochs!r}")

    @property
    def resolved_format(self) -> str | None:
        if self.format != "auto":
            return self.format
        path = self.path.rstrip("/").lower()
        if path.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
            return "json"
        if path.endswith((".parquet", ".pq")):
            return "parquet"
        return None


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The job's rollouts: `num_producers` AgentProducers run the agent named by `agent` in GRPO
    groups of `group_size` on prompt rows (from `dataset`, or from `prompts`) and push the samples
    to the scheduler. docs/agents.md says how to write one.

    Closed loop (the default): rollout engines (vLLM) start from the train group's initial weights
    and load every version it publishes (one per optimizer step); the agents sample them.
    """

    use_engines: bool = True
    """Whether rollout engines run. false: none; the agent makes its samples itself (ctx.add_sample), as the
    synthetic preset's does (`--preset synthetic`), and their versions are not bounded (no staleness rules)."""
    agent: str = f"{DIGIT_AGENT}:make_agent"
    """Import path of the agent factory ('module:function'), called with agent_kwargs; ship the module with
    `ray job submit --working-dir .` (or run from its directory)."""
    agent_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the agent factory."""
    prompts: str | None = f"{DIGIT_AGENT}:make_prompts"
    """Import path of a prompt generator `make(seed, **prompts_kwargs) -> (position -> row dict)`; used when
    `dataset` is not set."""
    prompts_kwargs: dict = field(default_factory=dict)
    num_prompts: int | None = None
    """Prompt positions answered over all producers (None: every dataset row of every epoch; a generator's are
    endless, and the run ends at run.num_steps)."""
    dataset: DatasetConfig | None = None
    """Prompt rows from a file (set rollout.dataset.path=...); takes the place of `prompts`."""
    tokenizer_dir: str | None = "examples/digit_tokenizer"
    """A Hugging Face tokenizer directory (tokenizer.json, chat template) that chat sessions and the engines
    use, copied next to the policy's weights; None = token-id-only agents."""
    engines: EngineConfig = field(default_factory=lambda: EngineConfig(num_engines=1, max_model_len=32))
    """vLLM rollout engines (count, CPUs or GPUs each, max_model_len <= train.model.max_position_embeddings)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How each policy version reaches the engines: object_store (default) or collective, float32 or bfloat16."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_tokens=16, temperature=1.0, seed=0))
    """What a request without its own SamplingConfig uses; every request's seed is mixed with its rollout's."""
    num_producers: int = 2
    """AgentProducer actors (asyncio, num_cpus=0); producer i answers prompt positions i, i + n, ..."""
    groups_in_flight: int = 8
    """GRPO groups each producer runs concurrently (each admitted by the scheduler before it starts)."""
    group_size: int = 8
    """Rollouts per prompt row (GRPO group)."""
    timeout_s: float = 300.0
    """Seconds one rollout (one agent call) may run; past it the group is dropped as `agent_timeout`."""
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    """An OpenAI-compatible endpoint over the rollouts, for agents written against an OpenAI client."""
    record_samples: bool = False
    """Write every pushed rollout's samples (token ids, loss mask, policy versions) to
    <output_dir>/samples/producer-<i>.jsonl, on each producer's node (docs/agents.md, "Checking your agent")."""
    sample_push_fraction: float = 0.0
    """Share of groups pushed one sample per call (the push API's sibling-by-sibling path, interleaved with other
    groups) instead of whole; for agents that give the same samples on every run (docs/agents.md)."""
    seed: int = 0
    """Prompt generation and sampling seeds derive from it."""

    def __post_init__(self):
        for name in ("num_producers", "groups_in_flight", "group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"rollout.{name} must be an integer >= 1, got {value!r}")
        if self.group_size < 2:
            raise ConfigError(f"rollout.group_size must be >= 2: GRPO advantages compare a group's rollouts, "
                              f"got {self.group_size}")
        if not isinstance(self.agent, str) or self.agent.count(":") != 1:
            raise ConfigError(f"rollout.agent={self.agent!r} must be an import path 'module:function'")
        if self.dataset is None and not self.prompts:
            raise ConfigError("rollout needs prompts: set rollout.dataset.path (a file) or rollout.prompts "
                              "(a generator's import path)")
        if self.timeout_s <= 0:
            raise ConfigError(f"rollout.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.num_prompts is not None and (not isinstance(self.num_prompts, int) or self.num_prompts < 1):
            raise ConfigError(f"rollout.num_prompts must be an integer >= 1 or null, got {self.num_prompts!r}")
        if not 0 <= self.sample_push_fraction <= 1:
            raise ConfigError(f"rollout.sample_push_fraction must be in [0, 1], got {self.sample_push_fraction}")


def _default_scheduler() -> SchedulerConfig:
    # gbs counts trained rollouts: 8 GRPO groups of 8 with a reward signal (uniform groups are dropped).
    batch = BatchConfig(global_batch_size=64, max_tokens_per_gpu=512, balance="tokens", leftover="partial")
    return SchedulerConfig(batch=batch, intake=IntakeConfig(max_buffered_samples=512, drop_uniform_groups=True))


def _default_train() -> TrainGroupConfig:
    # Rollouts up to one policy version old, with decoupled PPO's correction (the closed loop's default).
    loss = LossConfig(policy="decoupled_ppo", off_policy=OffPolicyConfig(max_staleness=1))
    # The tiny Llama with the digit agent's vocabulary; Adam 1e-3 (measured: benchmarks/bench_env_learning.py).
    return TrainGroupConfig(dp_size=2, model=ModelConfig(vocab_size=DIGIT_VOCAB_SIZE), loss=loss,
                            optimizer=OptimizerConfig(lr_schedule=LRScheduleConfig(lr=1e-3)))


@dataclass(frozen=True, kw_only=True)
class TenantConfig:
    """One multi-LoRA tenant (docs/lora.md): its own adapter, optimizer, agent, prompts, global batch and steps over
    the job's one base model, train group and engine pool. What it leaves unset it takes from the job's sections
    (rollout, scheduler.batch, train.optimizer, run.num_steps)."""

    name: str
    """Letters, digits and underscores: names its adapter, its actors and its output directory."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    optimizer: OptimizerConfig | None = None
    """Its adapter's optimizer and LR schedule (None: train.optimizer)."""
    agent: str | None = None
    agent_kwargs: dict | None = None
    prompts: str | None = None
    prompts_kwargs: dict | None = None
    num_prompts: int | None = None
    """Prompt positions it answers (None: rollout.num_prompts)."""
    global_batch_size: int | None = None
    """Its steps' size, in its own rollouts (None: scheduler.batch.global_batch_size)."""
    num_steps: int | None = None
    """Its optimizer steps (None: run.num_steps)."""
    seed: int | None = None
    """Its prompts' and sampling seed (None: rollout.seed + its index)."""

    def __post_init__(self):
        check_adapter_name(self.name)
        for key in ("num_prompts", "global_batch_size", "num_steps"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"tenants[{self.name}].{key} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    moved_keys: ClassVar[dict[str, str]] = {
        "closed_loop": "rollout.<key> (the section was renamed: it holds the rollouts whether or not engines close a "
                       "loop; closed_loop.enabled is rollout.use_engines)"}

    run: RunConfig = field(default_factory=RunConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    scheduler: SchedulerConfig = field(default_factory=_default_scheduler)
    train: TrainGroupConfig = field(default_factory=_default_train)
    tenants: tuple[TenantConfig, ...] = ()
    """Multi-LoRA tenants (docs/lora.md): each trains its own adapter on its own rollouts over the one base; the
    job's sections are their defaults. Empty: one policy (train.lora or every weight)."""

    def __post_init__(self):
        check_schedule_configs(self.train.parallel_config, self.scheduler.batch)
        if self.tenants:
            self._check_tenants()
        model = self.train.model
        if self.rollout.use_engines:
            self._check_rollout()
        else:
            self._check_no_engines()
        self._check_token_budget()
        if self.scheduler.max_staleness is not None:
            raise ConfigError(f"scheduler.max_staleness={self.scheduler.max_staleness}: the job has one staleness bound, "
                              "train.loss.off_policy.max_staleness (the loss corrects for it and the scheduler enforces "
                              "it when engines run); set that and leave scheduler.max_staleness out")
        hold = self.scheduler.max_hold_s
        if hold is not None and self.run.shard_timeout_s is not None and hold >= self.run.shard_timeout_s:
            raise ConfigError(f"scheduler.max_hold_s={hold} s holds a step for slow rollouts at least as long as the train "
                              f"group waits for it (run.shard_timeout_s={self.run.shard_timeout_s} s): the run would fail "
                              "before the step forms; keep scheduler.max_hold_s below run.shard_timeout_s")
        intake = self.scheduler.intake
        if intake.vocab_size is not None and intake.vocab_size != model.vocab_size:
            raise ConfigError(f"scheduler.intake.vocab_size={intake.vocab_size} must equal train.model.vocab_size="
                              f"{model.vocab_size} (or leave it out: the job fills it in from the model)")
        if intake.max_sequence_length is not None and intake.max_sequence_length > model.max_position_embeddings:
            raise ConfigError(f"scheduler.intake.max_sequence_length={intake.max_sequence_length} exceeds "
                              f"train.model.max_position_embeddings={model.max_position_embeddings}")

    def _check_tenants(self) -> None:
        """What a multi-tenant job does not do (yet), refused by key; each tenant's own view must hold too."""
        names = [tenant.name for tenant in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"tenants: two tenants named alike: {names}")
        refusals = {"train.lora": self.train.lora is not None,
                    "rollout.use_engines=false": not self.rollout.use_engines,
                    "rollout.endpoint.enabled": self.rollout.endpoint.enabled}
        refused = [key for key, set_ in refusals.items() if set_]
        if refused:
            raise ConfigError(f"tenants: {refused} are not supported with tenants (each tenant has its own "
                              "tenants[i].lora; endpoint agents are single-policy for now, docs/lora.md)")
        for index, tenant in enumerate(self.tenants):
            try:
                self.tenant_view(index)  # each tenant's batch, prompts and agent pass the single-job checks
            except ConfigError as error:
                raise ConfigError(f"tenants[{tenant.name}]: {error}") from error

    def tenant_view(self, index: int) -> "JobConfig":
        """The job as tenant `index` sees it: its agent, prompts, batch, steps and seed in the job's sections; the
        train group trains every tenant's adapter (jobs/tenants.py)."""
        tenant = self.tenants[index]
        loop = self.rollout
        loop = replace(loop, agent=tenant.agent or loop.agent,
                       agent_kwargs=loop.agent_kwargs if tenant.agent_kwargs is None else tenant.agent_kwargs,
                       prompts=tenant.prompts or loop.prompts,
                       prompts_kwargs=loop.prompts_kwargs if tenant.prompts_kwargs is None else tenant.prompts_kwargs,
                       num_prompts=loop.num_prompts if tenant.num_prompts is None else tenant.num_prompts,
                       seed=loop.seed + index if tenant.seed is None else tenant.seed)
        batch = replace(self.scheduler.batch, global_batch_size=tenant.global_batch_size
                        or self.scheduler.batch.global_batch_size)
        run = replace(self.run, num_steps=tenant.num_steps or self.run.num_steps,
                      output_dir=os.path.join(self.run.output_dir, "tenants", tenant.name))
        return replace(self, run=run, rollout=loop, scheduler=replace(self.scheduler, batch=batch),
                       train=self.train_with_tenants(), tenants=())

    def train_with_tenants(self) -> TrainGroupConfig:
        """The train group of a multi-tenant job: one adapter per tenant, each with its optimizer."""
        return replace(self.train, tenant_adapters=tuple(
            AdapterConfig(name=t.name, lora=t.lora, optimizer=t.optimizer or self.train.optimizer)
            for t in self.tenants))

    def _check_no_engines(self) -> None:
        """rollout.use_engines=false turns the rollout engines off: an agent that samples them cannot run."""
        loop = self.rollout
        if loop.endpoint.enabled:
            raise ConfigError("rollout.endpoint.enabled=true serves the rollout engines, which "
                              "rollout.use_engines=false turns off: set rollout.use_engines=true, or turn the endpoint off")
        if loop.agent.split(":")[0] == DIGIT_AGENT:
            raise ConfigError(f"rollout.use_engines=false turns the rollout engines off, but rollout.agent="
                              f"{loop.agent} samples them (ctx.chat): keep rollout.use_engines=true, or run an agent "
                              "that makes its samples itself (ctx.add_sample), e.g. --preset synthetic")

    def _check_token_budget(self) -> None:
        budget = self.scheduler.admission_token_budget
        if budget is None:
            return
        if not self.rollout.use_engines:
            raise ConfigError(f"scheduler.admission_token_budget={budget} admits groups against the engines' tokens, "
                              "and rollout.use_engines=false runs no engines: set rollout.use_engines=true or leave "
                              "the budget out")
        if budget == ENGINES_BUDGET:
            if self.tenants:
                raise ConfigError("scheduler.admission_token_budget=engines gives one scheduler the engines' whole KV "
                                  "cache, and tenants share the engines: give the budget in tokens, or leave it out")
            return
        longest = self.rollout.engines.max_model_len
        if budget < longest:
            raise ConfigError(f"scheduler.admission_token_budget={budget} tokens is smaller than one request may be "
                              f"(rollout.engines.max_model_len={longest}): raise the budget (the engines' KV "
                              "cache in tokens, over all engines) or lower max_model_len")

    def _check_rollout(self) -> None:
        loop, model = self.rollout, self.train.model
        if loop.engines.max_model_len > model.max_position_embeddings:
            raise ConfigError(f"rollout.engines.max_model_len={loop.engines.max_model_len} exceeds "
                              f"train.model.max_position_embeddings={model.max_position_embeddings}")
        if not self.scheduler.intake.drop_uniform_groups:
            raise ConfigError("scheduler.intake.drop_uniform_groups must be true in the closed loop: a group whose "
                              "rollouts all earned the same reward carries no GRPO signal (dynamic sampling)")

    @property
    def max_staleness(self) -> int | None:
        """`train.loss.off_policy.max_staleness` (None while the loss has no off-policy section)."""
        off_policy = getattr(self.train.loss, "off_policy", None)
        return None if off_policy is None else off_policy.max_staleness

    def scheduler_with_model_limits(self) -> SchedulerConfig:
        """The scheduler's config with the model's vocabulary and sequence limit filled in where unset,
        so the scheduler rejects a sample the model could not take (token_range, sequence_length)."""
        intake, model = self.scheduler.intake, self.train.model
        scheduler = self.scheduler
        if self.rollout.use_engines and self.max_staleness is not None:
            # The scheduler enforces the bound the loss was configured for (one number, one place);
            # synthetic rollouts carry no policy versions, so there is nothing to bound without the loop.
            scheduler = replace(scheduler, max_staleness=self.max_staleness)
        if scheduler.admission_token_budget is not None and scheduler.admission_tokens_per_rollout is None:
            # Before any rollout completed, expect the longest request an engine takes (the budget then learns).
            scheduler = replace(scheduler, admission_tokens_per_rollout=self.rollout.engines.max_model_len)
        return replace(scheduler, intake=replace(
            intake,
            vocab_size=intake.vocab_size if intake.vocab_size is not None else model.vocab_size,
            max_sequence_length=(intake.max_sequence_length if intake.max_sequence_length is not None
                                 else model.max_position_embeddings)))


SYNTHETIC_AGENT = "examples.synthetic_agent"
"""The synthetic preset's agent module (examples/synthetic_agent.py)."""
LONG_TAIL_AGENT = "examples.long_tail_agent"
LOOKUP_AGENT = "examples.lookup_agent"
LOOKUP_VOCAB_SIZE = 19
"""The lookup task's vocabulary (examples/lookup_agent.py's VOCABULARY, checked by a test)."""


def closed_loop_preset() -> JobConfig:
    """The default: the closed-loop digit task (vLLM engine, examples/digit_agent.py, weight sync, staleness 1
    with decoupled PPO, 100 steps); the reward rises."""
    return JobConfig()


def synthetic_preset() -> JobConfig:
    """No engines: the synthetic agent makes its samples itself (examples/synthetic_agent.py): no policy
    versions and no behaviour log-probs (so on-policy ppo), tokens over 128 ids, half its groups pushed sample
    by sample, some uniform or malformed; 30 prompts in groups of 2 at gbs 8 show full and partial steps in
    8 steps, a checkpoint every 2."""
    rollout = RolloutConfig(
        use_engines=False, agent=f"{SYNTHETIC_AGENT}:make_agent", prompts=f"{SYNTHETIC_AGENT}:make_prompts",
        num_prompts=30, group_size=2, groups_in_flight=4, tokenizer_dir=None, sample_push_fraction=0.5)
    scheduler = _default_scheduler()
    train = _default_train()
    return JobConfig(
        run=RunConfig(num_steps=8, checkpoint_every=2), rollout=rollout,
        scheduler=replace(scheduler, batch=replace(scheduler.batch, global_batch_size=8)),
        train=replace(train, model=ModelConfig(), optimizer=OptimizerConfig(),
                      loss=replace(train.loss, policy="ppo", off_policy=OffPolicyConfig(max_staleness=0))))


def long_tail_preset() -> JobConfig:
    """The closed loop on a long-tail agentic workload (examples/long_tail_agent.py: 79% one-token episodes, 16%
    2-4 turns, 5% 8-16 turns of 8 tokens holding most of the tokens), engines taking 256-token requests; the
    digit task's reward, so it learns. For measuring the engines and the scheduler on the workload the project
    exists for (benchmarks/bench_long_tail_job.py)."""
    base = JobConfig()
    loop = replace(base.rollout, agent=f"{LONG_TAIL_AGENT}:make_agent",
                   engines=replace(base.rollout.engines, max_model_len=256))
    return replace(base, rollout=loop, run=replace(base.run, num_steps=40))


def tool_use_preset() -> JobConfig:
    """Function calling through the endpoint (examples/lookup_agent.py): the reward is a secret only the `lookup`
    tool tells; vLLM's hermes parser reads the engine's calls; the tokenizer holds the call as one word
    (examples/lookup_tokenizer). 128 rollouts a step (16 prompts x 8): the sampled reward rises from chance (~0.1)
    as the share of first replies that are valid calls rises (docs/agents.md, "A task where the tool is the way")."""
    base = JobConfig()
    loop = replace(base.rollout, agent="vgbs_ray.agents.openai_agent:make_agent",
                   agent_kwargs={"run": f"{LOOKUP_AGENT}:run"}, prompts=f"{LOOKUP_AGENT}:make_prompts",
                   tokenizer_dir="examples/lookup_tokenizer", groups_in_flight=16,
                   endpoint=replace(base.rollout.endpoint, enabled=True, tool_parser="hermes"))
    scheduler = replace(base.scheduler, batch=replace(base.scheduler.batch, global_batch_size=128))
    train = replace(base.train, model=replace(base.train.model, vocab_size=LOOKUP_VOCAB_SIZE))
    return replace(base, rollout=loop, scheduler=scheduler, train=train, run=replace(base.run, num_steps=120))


PRESETS = {"closed_loop": closed_loop_preset, "synthetic": synthetic_preset, "long_tail": long_tail_preset,
           "tool_use": tool_use_preset}
"""Whole job configs by name: `--preset NAME` (or `preset: NAME` at the top of a YAML file); the file's keys
and `--set` overrides then change that preset's fields, nothing else."""
DEFAULT_PRESET = "closed_loop"


def load_job_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                    preset: str | None = None) -> JobConfig:
    """JobConfig from a preset (`preset`, else the YAML file's top-level `preset:` or a `preset=NAME`
    override, else the closed loop) with the YAML file's keys and `section.key=value` overrides on top.
    The policy loss is built once here (`LossConfig.build`, which imports torch), so a loss that cannot
    run is refused with the config, before Ray."""
    mapping = apply_overrides(load_yaml(path), list(overrides))
    named = mapping.pop("preset", None)
    name = preset or named or DEFAULT_PRESET
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r} is unknown; pick one of {sorted(PRESETS)}")
    mapping, flops_balance = _without_flops_balance(_with_checkpoint_model(mapping))
    config = config_from_mapping(JobConfig, mapping, base=PRESETS[name]())
    if flops_balance:  # the cost model is the policy's own dimensions, derived here (BatchConfig needs it at once)
        batch = replace(config.scheduler.batch, balance="flops", flops_model=config.train.model.flops_model)
        config = replace(config, scheduler=replace(config.scheduler, batch=batch))
    config.train.loss.build()
    endpoint = config.rollout.endpoint
    if endpoint.enabled and endpoint.tool_parser not in (None, "none"):
        try:
            check_parser_name(endpoint.tool_parser)  # imports vLLM: only for a parser named by hand
        except ToolRequestError as error:
            raise ConfigError(str(error)) from None
    return config


def _without_flops_balance(mapping: dict) -> tuple[dict, bool]:
    """(`mapping` with scheduler.batch.balance=flops taken out, whether it was there): the FLOPs model that
    balance needs is derived from train.model, known only once the config is loaded."""
    batch = (mapping.get("scheduler") or {}).get("batch") or {}
    if batch.get("balance") != "flops":
        return mapping, False
    scheduler = dict(mapping["scheduler"], batch={k: v for k, v in batch.items() if k != "balance"})
    return dict(mapping, scheduler=scheduler), True


def _with_checkpoint_model(mapping: dict) -> dict:
    """`train.model.hf_checkpoint_dir=DIR` alone is enough: the model's family and shape come from
    DIR/config.json (fields also given must agree; the model build names any that differ), and the
    closed loop's tokenizer is DIR's own unless `rollout.tokenizer_dir` is given (None when DIR has
    none: token-id-only agents)."""
    model = (mapping.get("train") or {}).get("model") or {}
    path = model.get("hf_checkpoint_dir")
    if path is None:
        return mapping
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ConfigError(f"train.model.hf_checkpoint_dir={path!r} has no config.json (a Hugging Face checkpoint "
                          "directory is expected)")
    with open(file) as handle:
        fields = model_fields_from_hf_config(json.load(handle), file)
    fields.update(model, hf_checkpoint_dir=os.path.abspath(path))
    mapping = dict(mapping, train=dict(mapping["train"], model=fields))
    loop = mapping.get("rollout") or {}
    if "tokenizer_dir" not in loop:
        mapping["rollout"] = dict(loop, tokenizer_dir=os.path.abspath(path) if has_tokenizer(path) else None)
    return mapping


def options_help() -> str:
    """Every option with its default and help text, for `--help`."""
    return "\n".join(describe(JobConfig))
