"""The rules of recovery, each once: which errors a step loop hands over (`RECOVERABLE_ERRORS`), what kind of
failure each is (`classify_failure`), whether the scheduler retains trained steps until a checkpoint
(`retains_until_checkpoint`, which `job_scheduler_config` and the controller's `checkpointed` calls both
follow), the errors a stopped run raises, and the record of one recovery (`Recovery`).

The single-policy job's controller (jobs/controller.py) and the multi-LoRA tenants' loop (jobs/tenants.py)
act on them; the failure policy (vgbs_ray/failure_policy.py) decides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ray

from vgbs_ray.scheduler.types import SchedulerConfig
from actors.train_group import PlacementGroupTimeoutError, TrainStepError
from jobs.job_config import JobConfig
from vgbs_ray.errors import VgbsError
from vgbs_ray.failure_policy import FailureKind

SCHEDULER_PROBE_TIMEOUT_S = 10.0
"""How long a failure waits for the scheduler to answer before it counts as lost (bounds detection)."""

RECOVERABLE_ERRORS = (TrainStepError, PlacementGroupTimeoutError, ray.exceptions.RayActorError,
                      ray.exceptions.GetTimeoutError)
"""What a step loop hands to the controller's `recover`, which classifies it (`classify_failure`) and asks the
failure policy."""


def retains_until_checkpoint(config: JobConfig) -> bool:
    """The retain rule: `run.max_failures > 0` means the scheduler retains trained rollouts until a
    checkpoint holds their step (a recovery rewinds to the latest checkpoint and trains the steps after
    it again); a fail-fast job (0) settles each step as it trains."""
    return config.run.max_failures > 0


def job_scheduler_config(config: JobConfig) -> SchedulerConfig:
    """The job's SchedulerConfig: the model's limits filled in, `retain_until_checkpoint` set when
    `retains_until_checkpoint` says so (a scheduler restored in the job is made with the same one)."""
    scheduler_config = config.scheduler_with_model_limits()
    if retains_until_checkpoint(config):
        scheduler_config = dataclasses.replace(scheduler_config, retain_until_checkpoint=True)
    return scheduler_config


class JobFailedError(VgbsError, RuntimeError):
    """The run stopped on a failure the policy would not (or could not) recover; the message says why."""


class SchedulerLostError(JobFailedError):
    """The SchedulerActor died or stopped answering, past the failure budget; the message says what was lost."""


@dataclass(frozen=True)
class Recovery:
    """One recovered failure, for the summary. Times in seconds."""

    kind: str
    failed_step: int
    """The step that failed (in flight or being checkpointed)."""
    restored_step: int
    """The step the new group continues from (the checkpoint holds every step before it)."""
    steps_redone: int
    """Steps trained after the checkpoint, undone and trained again (the in-flight one not counted)."""
    rollouts_replayed: int
    """Rollouts the scheduler put back in front of its buffer (trained-after-checkpoint and in-flight)."""
    time_to_recover_s: float
    """From the failure surfacing in the driver to the new group restored and the scheduler rewound."""
    group_start_s: float
    """Of which: starting the new group (placement group, actors, process group, model) and restoring it."""


def classify_failure(error: BaseException, scheduler_alive: bool) -> FailureKind:
    """What failed. The scheduler is asked first (`scheduler_alive`: it answered the controller's probe): every
    failure looks like a rank's once it is gone. An error of RECOVERABLE_ERRORS this cannot place is raised as it
    is (a bug, not a failure the policy knows)."""
    if not scheduler_alive:
        return FailureKind.SCHEDULER_LOST
    if isinstance(error, TrainStepError):
        return error.kind
    if isinstance(error, PlacementGroupTimeoutError):
        return FailureKind.START_FAILED
    if isinstance(error, ray.exceptions.GetTimeoutError):
        return FailureKind.TIMEOUT
    raise error
