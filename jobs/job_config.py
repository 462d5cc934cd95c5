"""The job's configuration: one frozen dataclass per component, loaded from YAML + overrides.

    JobConfig
      run        RunConfig            steps, outputs, checkpoints, Ray address
      producers  ProducerConfig       synthetic agentic producers and the Ray Data source
      scheduler  SchedulerConfig      batch (gbs in rollouts, token cap, balance, leftover), buffers
      train      TrainGroupConfig     model, optimizer, loss, parallel sizes, placement

`load_job_config(path, overrides)` builds it; every error names the key and the fix.
Cross-component checks (schedule alignment, sequence lengths vs the model) run here too,
so a wrong config fails at start-up, before any actor exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from actors.producers import ProducerConfig
from actors.scheduler_api import SchedulerConfig
from actors.train_config import TrainGroupConfig
from jobs.config_loader import apply_overrides, config_from_mapping, describe, load_yaml
from vgbs_ray.config import BatchConfig, check_schedule_configs
from vgbs_ray.errors import ConfigError
from vgbs_ray.intake import IntakeConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    num_steps: int = 8
    """Optimizer steps to train; the run also ends when producers are done and the last (partial) step is trained."""
    output_dir: str = "runs/latest"
    """Step records (steps.jsonl), the plot (steps.png), the summary and checkpoints go here."""
    checkpoint_every: int = 2
    """Save a checkpoint every this many steps (0 = only at the end). A recovered failure redoes
    the steps after the latest checkpoint: fewer steps between checkpoints, less work redone."""
    max_failures: int = 2
    """Train-group failures (a dead rank, a failed or hung step) recovered in the job: tear the group
    down, start a new one from the latest checkpoint, replay the steps after it. 0 = fail fast."""
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

    def __post_init__(self):
        if self.num_steps < 1:
            raise ConfigError(f"run.num_steps must be >= 1, got {self.num_steps}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"run.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if not isinstance(self.max_failures, int) or self.max_failures < 0:
            raise ConfigError(f"run.max_failures must be an integer >= 0 (0 = fail fast), got {self.max_failures!r}")
        if self.ray_address != "local" and not self.ray_address:
            raise ConfigError('run.ray_address must be "local", "auto" or a cluster address')


def _default_scheduler() -> SchedulerConfig:
    batch = BatchConfig(global_batch_size=8, max_tokens_per_gpu=512, balance="tokens", leftover="partial")
    return SchedulerConfig(batch=batch, intake=IntakeConfig(max_buffered_samples=256, drop_uniform_groups=True))


def _default_train() -> TrainGroupConfig:
    return TrainGroupConfig(dp_size=2)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    producers: ProducerConfig = field(default_factory=ProducerConfig)
    scheduler: SchedulerConfig = field(default_factory=_default_scheduler)
    train: TrainGroupConfig = field(default_factory=_default_train)

    def __post_init__(self):
        check_schedule_configs(self.train.parallel_config, self.scheduler.batch)
        rollouts, model = self.producers.rollouts, self.train.model
        if rollouts.max_sequence_length > model.max_position_embeddings:
            raise ConfigError(
                f"producers.rollouts.max_sequence_length={rollouts.max_sequence_length} exceeds "
                f"train.model.max_position_embeddings={model.max_position_embeddings}: lower the first or raise the second"
            )
        if rollouts.vocab_size != model.vocab_size:
            raise ConfigError(
                f"producers.rollouts.vocab_size={rollouts.vocab_size} must equal train.model.vocab_size={model.vocab_size}"
            )
        intake = self.scheduler.intake
        if intake.vocab_size is not None and intake.vocab_size != model.vocab_size:
            raise ConfigError(f"scheduler.intake.vocab_size={intake.vocab_size} must equal train.model.vocab_size="
                              f"{model.vocab_size} (or leave it out: the job fills it in from the model)")
        if intake.max_sequence_length is not None and intake.max_sequence_length > model.max_position_embeddings:
            raise ConfigError(f"scheduler.intake.max_sequence_length={intake.max_sequence_length} exceeds "
                              f"train.model.max_position_embeddings={model.max_position_embeddings}")

    def scheduler_with_model_limits(self) -> SchedulerConfig:
        """The scheduler's config with the model's vocabulary and sequence limit filled in where unset,
        so the scheduler rejects a sample the model could not take (token_range, sequence_length)."""
        intake, model = self.scheduler.intake, self.train.model
        return replace(self.scheduler, intake=replace(
            intake,
            vocab_size=intake.vocab_size if intake.vocab_size is not None else model.vocab_size,
            max_sequence_length=(intake.max_sequence_length if intake.max_sequence_length is not None
                                 else model.max_position_embeddings)))


def load_job_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """JobConfig from a YAML file (or the embedded default) with `section.key=value` overrides."""
    mapping = apply_overrides(load_yaml(path), list(overrides))
    return config_from_mapping(JobConfig, mapping)


def options_help() -> str:
    """Every option with its default and help text, for `--help`."""
    return "\n".join(describe(JobConfig))
