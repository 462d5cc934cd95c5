"""Typed config and results of the scheduler (`vgbs_ray.scheduler.core` and the SchedulerActor around it).

Everything here is a frozen dataclass that crosses Ray boundaries by pickling, and imports no Ray.
Units: `_s` in seconds; token counts are prompt + response tokens. Where a shard lives in the object
store is `actors.shard_ref.ShardRef` (it holds an ObjectRef).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Hashable

from vgbs_ray.config import BatchConfig
from vgbs_ray.errors import ConfigError
from vgbs_ray.scheduler.intake import IntakeConfig
from vgbs_ray.scheduler.ledger import LedgerSummary, Rejection
from vgbs_ray.scheduler.staleness import AdmissionDecision

__all__ = [
    "Admission", "FlushResult", "SchedulerConfig", "SchedulerStats", "StepRecord", "SubmitResult",
]


ENGINES_BUDGET = "engines"
"""`admission_token_budget` that the engines' KV caches set once they start."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    removed_keys: ClassVar[dict[str, str]] = {
        "features": "every step is laid out on the rollout side (docs/architecture.md, 'One layout path'); "
                    "multi-LoRA tenants have a scheduler each (the job's tenants section)"}
    derived_keys: ClassVar[dict[str, str]] = {
        "max_staleness": "train.loss.off_policy.max_staleness (the job's one staleness bound: the loss corrects "
                         "for it, the scheduler enforces it while engines run)",
        "retain_until_checkpoint": "run.max_failures (kept while a failed train group may be recovered)"}

    batch: BatchConfig
    """gbs in rollouts, token cap or micro-batch size, balance, leftover policy."""
    intake: IntakeConfig = IntakeConfig()
    """Validation limits (vocabulary, sequence length, push size), buffer bounds, group advantages."""
    max_steps_ahead: int | None = None
    """Backpressure, not staleness: new rollouts are deferred while more than this many steps are emitted
    but not trained (the staleness bound is `max_staleness`)."""
    max_wait_s: float | None = None
    """Flush (per leftover policy) when the oldest ready rollout waited this long; None = never.
    Has no effect with leftover="carry"."""
    max_hold_s: float | None = 60.0
    """Staleness rule 2 holds a full step for admitted rollouts still in flight on their last chance: at most this
    many seconds after the step could have formed. Then it forms without them (logged with their ids); such a rollout,
    when it ends, trains in a later step if the versions that sampled its tokens are recent enough (an agent that
    waited before sampling), else it is dropped as `stale`. A slow rollout never holds the trainer past this (keep it
    below run.shard_timeout_s). None: wait for them however long they take."""
    retry_after_s: float = 0.05
    """The wait a deferred producer is told to sleep before resubmitting."""
    max_concurrency: int = 4096
    """Calls the asyncio actor serves at once: a TrainGroup's driver parks one get_step, ranks that pull
    for themselves (TP and PP peers too) one get_shard each, every producer one submit; size it above
    world_size + producers. A parked call costs no thread."""
    retain_until_checkpoint: bool = False
    """Keep each trained step's rollouts (and their ledger entries live) until `checkpointed(n)` says a
    checkpoint holds the step, so `rewind(n)` can train them again after a train group restarts from
    that checkpoint. Without it only steps not yet acknowledged can be rewound."""
    step_record_window: int = 16
    """Records of trained steps kept whole (the newest), besides every step emitted but not yet trained
    (the train side reads a step's record after training it); older steps live on as totals in SchedulerStats."""
    max_staleness: int | None = None
    """Policy versions a trained rollout may lag the step that trains it (step k trains version k);
    None = no staleness rules (synthetic runs: samples without versions). Set: a step drops ready
    rollouts older than that (reason `stale`), takes the oldest first, waits for an admitted rollout
    in flight whose last chance it is, and `admit` runs admission control (vgbs_ray.scheduler.staleness).
    A job fills it from train.loss.off_policy.max_staleness. Each group's size is checked against
    it (check_admission_config) when producers first `admit` the group: the scheduler does not know
    group sizes before."""

    admission_token_budget: int | str | None = None
    """Admission by tokens (vgbs_ray/scheduler/token_budget.py): the tokens the engines hold at once (their KV cache over
    all engines). A group is admitted only while the rollouts in flight, each charged the tokens a rollout is
    expected to hold (corrected by every rollout that completes), fit it; applied with the staleness rule
    (needs max_staleness). "engines": the engines' own KV caches, read from them when they start (a job sets
    it before any producer runs: `SchedulerCore.set_token_budget`). None: no token budget (groups in flight
    are bounded by the producers' count)."""
    admission_tokens_per_rollout: int | None = None
    """The expectation before any rollout completed (a job fills in rollout.engines.max_model_len)."""

    def __post_init__(self):
        if not isinstance(self.batch, BatchConfig):
            raise ConfigError(f"SchedulerConfig.batch must be a BatchConfig, got {type(self.batch).__name__}")
        if self.max_steps_ahead is not None and (not isinstance(self.max_steps_ahead, int) or self.max_steps_ahead < 0):
            raise ConfigError(f"SchedulerConfig.max_steps_ahead must be an int >= 0 or None, got {self.max_steps_ahead!r}")
        if self.max_wait_s is not None and self.max_wait_s <= 0:
            raise ConfigError(f"SchedulerConfig.max_wait_s must be > 0 or None, got {self.max_wait_s}")
        if self.max_hold_s is not None and self.max_hold_s < 0:
            raise ConfigError(f"SchedulerConfig.max_hold_s must be >= 0 seconds or None, got {self.max_hold_s}")
        if self.retry_after_s < 0:
            raise ConfigError(f"SchedulerConfig.retry_after_s must be >= 0, got {self.retry_after_s}")
        if not isinstance(self.intake, IntakeConfig):
            raise ConfigError(f"SchedulerConfig.intake must be an IntakeConfig, got {type(self.intake).__name__}")
        if self.max_concurrency < 4:
            raise ConfigError(f"SchedulerConfig.max_concurrency must be >= 4 (pulls, pushes, stats at once), got {self.max_concurrency}")
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool)
                                               or self.max_staleness < 0):
            raise ConfigError(f"SchedulerConfig.max_staleness must be an int >= 0 (policy versions) or None, "
                              f"got {self.max_staleness!r}")
        for key in ("admission_token_budget", "admission_tokens_per_rollout"):
            value = getattr(self, key)
            if key == "admission_token_budget" and value == ENGINES_BUDGET:
                continue
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                extra = ', "engines" (their KV caches)' if key == "admission_token_budget" else ""
                raise ConfigError(f"scheduler.{key} must be an integer >= 1 (tokens){extra} or null, got {value!r}")
        if self.step_record_window < 1:
            raise ConfigError(f"SchedulerConfig.step_record_window must be >= 1, got {self.step_record_window}")


@dataclass(frozen=True)
class SubmitResult:
    """What one `submit` did with each sample: accepted, rejected (with rule), or deferred.

    Deferred samples were *not* taken (backpressure): resubmit exactly those
    (`samples[i] for i in deferred`) after `retry_after_s`. Nothing is dropped silently:
    accepted + len(rejected) + len(deferred) == the number of samples submitted.
    """

    accepted: int
    rejected: tuple[Rejection, ...] = ()
    deferred: tuple[int, ...] = ()
    retry_after_s: float | None = None
    backpressure_reason: str | None = None
    completed_rollouts: tuple = ()

    @property
    def must_retry(self) -> bool:
        return bool(self.deferred)

    def raise_for_rejections(self) -> None:
        """Raise the first rejection as a RolloutValidationError (rollout id and rule in the message)."""
        if self.rejected:
            raise self.rejected[0].error()


@dataclass(frozen=True)
class Admission(AdmissionDecision):
    """What `admit` decided for a group: AdmissionDecision (admit, landing_step, expected_staleness) plus
    the ids the scheduler already knew.

    known: ids with accepted samples or settled (trained or dropped): never admitted again, and they
    do not count against the group. A resumed producer skips generating them; pushing them again only
    gets their samples rejected (duplicate, already_*). When every id is known, `admit` is True
    and nothing was admitted. Ids admitted earlier and not yet in a step stay admitted (not re-counted).
    """

    known: tuple = ()
    enforced: bool = True
    """False when the scheduler has no max_staleness: every group is admitted, nothing is recorded."""


@dataclass(frozen=True)
class StepRecord:
    step: int
    num_rollouts: int
    num_samples: int
    num_tokens: int
    microbatches_per_rank: tuple[int, ...]
    """Micro-batches each rank runs (all equal: the layout fixes them)."""
    padding_microbatches: int
    """Empty micro-batches over all ranks: the step had fewer samples than the alignment needs.
    They carry no weight; 0 for most steps."""
    samples_per_rank: tuple[int, ...]
    tokens_per_rank: tuple[int, ...]
    trigger: str
    """"full", "flush", "max_wait" or "end_of_input"."""
    partial: bool
    mean_completion_to_emission_s: float
    max_completion_to_emission_s: float
    scheduling_latency_s: float
    """From the moment the step could be formed (its last rollout ready, or the flush) to all shards in the store."""
    rollout_ids: tuple = ()
    policy_version: int = 0
    """The version the step trains (= its step number: step k starts from the weights after k optimizer steps)."""
    staleness_mean: float | None = None
    """Mean over the step's rollouts that carry versions of policy_version - their oldest version; None when none does."""
    staleness_max: int | None = None
    trained: bool = False
    metrics: dict[str, tuple[float, float]] | None = None
    """(sum, count) pairs reduced over every DP rank's ack, once the step is trained."""


@dataclass(frozen=True)
class FlushResult:
    steps: tuple[int, ...]
    """Steps this flush emitted: full steps still formable when it ran, then at most one partial."""
    dropped: tuple = ()
    """Rollout ids dropped by this flush (leftover policy, too small, incomplete at end of input)."""
    kept: int = 0
    """Ready rollouts left buffered (carry, or a partial step too small to lay out)."""


@dataclass(frozen=True)
class SchedulerStats:
    accepted_samples: int
    rejected_samples: int
    deferred_samples: int
    buffered_rollouts: int
    buffered_samples: int
    buffered_tokens: int
    ready_rollouts: int
    steps_emitted: int
    steps_trained: int
    partial_steps: int
    padded_steps: int
    input_closed: bool
    ended: bool
    recent_steps: tuple[StepRecord, ...]
    """The newest `step_record_window` step records (`step_record(k)` reads one by number)."""
    ledger: LedgerSummary
    incomplete_rollouts: tuple[tuple[Hashable, str, str], ...] = ()
    """(rollout_id, reason, detail) of every rollout closed unfinished at end of input."""
    rejections: tuple[Rejection, ...] = ()
    """The latest rejections (bounded; counts by rule are in ledger.rejected_samples_by_rule)."""
    dataset_errors: tuple[str, ...] = ()
    failure: str | None = None
    """Set when the scheduler hit an internal error: every later call raises it."""
    rollout_states: dict | None = field(default=None)
    """rollout_id -> (state, step, reason); only when stats(include_rollouts=True)."""
    policy_version: int = 0
    """The version the next step trains (= steps_emitted; steps are numbered globally across restores)."""
    stale_dropped_rollouts: int = 0
    """Rollouts dropped as too stale to train (also in ledger.dropped_by_reason["stale"])."""
    staleness_pending: int | None = None
    """Admitted rollouts not yet in a step (in flight or buffered); None without max_staleness."""
    staleness_in_flight: int | None = None
    """Admitted rollouts whose samples have not all arrived; None without max_staleness."""
    admitted_rollouts: int = 0
    refused_admissions: int = 0
    """Groups `admit` refused (a producer asks again later)."""
    token_refusals: int = 0
    """Of those, refused by the token budget (admission_token_budget)."""
    tokens_in_use: float | None = None
    """The token budget in use: rollouts in flight x the expected tokens per rollout (None: no budget)."""
    tokens_per_rollout: float | None = None
    """The budget's current expectation of a rollout's tokens (corrected by the rollouts that completed)."""
    token_budget: int | None = None
    """The budget in tokens (admission_token_budget, or the engines' KV caches once set); None: no budget."""

    @property
    def steps_in_flight(self) -> int:
        return self.steps_emitted - self.steps_trained
