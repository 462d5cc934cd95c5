"""In-job recovery: the train group's owner, checkpoints the scheduler knows about, restarts.

    scheduler = create_scheduler(job_scheduler_config(config))   # retains trained steps when the job may recover
    controller = TrainController(config, scheduler, first_step=0, restore_from=None)
    controller.start()                                   # the first group (restored if resuming)
    controller.attach_producers(producers, cursors)      # their cursors go into each checkpoint
    try:
        result = controller.group.train_step(step, scheduler)
        controller.checkpoint(step + 1)                  # durable; the scheduler may settle those steps
    except RECOVERABLE_ERRORS as error:                  # what a step loop hands over
        step = controller.recover(error, step).restored_step   # or raises JobFailedError / SchedulerLostError
    controller.shutdown()

The rules that belong to recovery live here, each once: which errors a step loop hands to
`recover` (`RECOVERABLE_ERRORS`), what kind of failure each is (`TrainController._classify`),
and whether the scheduler retains trained steps until a checkpoint (`retains_until_checkpoint`:
the job's scheduler config, `job_scheduler_config`, and the controller's `checkpointed` calls
both follow it).

Recovery (the failure policy in `vgbs_ray/failure_policy.py` decides, this acts):
1. classify the error; first ask the scheduler whether it is alive (bounded by
   `SCHEDULER_PROBE_TIMEOUT_S`): a dead scheduler is never "recovered" by a new group;
2. tear the group down (its collectives are broken), start a new one (new placement group,
   new process group on a new port), restore the latest checkpoint this run wrote (or the one it
   resumed from; a run with none starts from the seeded initial weights, which is the same state);
3. `scheduler.rewind(n)`: every step after the checkpoint goes back in front of the buffer in
   its original order and trains again exactly once, numbered from n.
   A lost scheduler is restored instead (`restore_scheduler`, the job's: producers stopped, a new
   SchedulerActor from the checkpoint's `scheduler.pkl`, or an empty one before any checkpoint),
   then the new group registers with it; the job restarts the producers from the checkpoint's
   cursors. This is an in-job `run.resume`, and exactly once for the same reason.

Invariants: the scheduler is told `checkpointed(n)` only after the checkpoint of steps < n is
durably written (`latest` points at it), so a rewind never needs a settled step. The LR
schedule's consumed-rollout count lives in the checkpoint, so it comes back with the weights.
Steps are global: the run's step numbers, which the scheduler, the records and the checkpoints
share; a resumed job's scheduler is restored at its checkpoint's step (`first_step`) and
continues the numbering from there. A checkpoint holds the producers' cursors (taken first) and
the scheduler's exported state (jobs/checkpoint.py), so a later job resumes exactly once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import ray

from vgbs_ray.scheduler.types import SchedulerConfig
from actors.train_group import PlacementGroupTimeoutError, TrainGroup, TrainStepError
from jobs.checkpoint import load_job_state, producer_cursors, save_job_state
from jobs.job_config import JobConfig
from vgbs_ray.errors import VgbsError
from vgbs_ray.failure_policy import FailureAction, FailureBudget, FailureKind

log = logging.getLogger("vgbs.job")

SCHEDULER_PROBE_TIMEOUT_S = 10.0
"""How long a failure waits for the scheduler to answer before it counts as lost (bounds detection)."""

RECOVERABLE_ERRORS = (TrainStepError, PlacementGroupTimeoutError, ray.exceptions.RayActorError,
                      ray.exceptions.GetTimeoutError)
"""What a step loop hands to `TrainController.recover`, which classifies it (`_classify`: an error of
these the scheduler's probe and the policy cannot place is raised as it is) and asks the failure policy."""


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


class _SchedulerGone(Exception):
    """Inside a recovery: the scheduler stopped answering (the cause is chained)."""


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

    @property
    def restored_scheduler(self) -> bool:
        """The scheduler was lost and a new one restored (the job restarts its producers on it)."""
        return self.kind == FailureKind.SCHEDULER_LOST.value
    group_start_s: float
    """Of which: starting the new group (placement group, actors, process group, model) and restoring it."""


class TrainController:
    """Owns the train group across restarts (see module docstring)."""

    def __init__(self, config: JobConfig, scheduler, *, first_step: int, restore_from: str | None,
                 restore_scheduler=None, on_recovery=None, budget: FailureBudget | None = None):
        self.config = config
        self.budget = budget if budget is not None else FailureBudget(config.run.max_failures)
        """The run's failure budget, shared with the watches (vgbs_ray/failure_policy.py)."""
        self.scheduler = scheduler
        self.restore_scheduler = restore_scheduler
        """`restore_scheduler(checkpoint path or None) -> (scheduler, untrained rollouts it holds)`: the job's (a
        new SchedulerActor from that checkpoint's state, the producers stopped first); None: a lost scheduler
        stops the run."""
        self.on_recovery = on_recovery
        """`on_recovery(actor kind)`, called after each recovery (the job's Ray metric)."""
        self.first_step = first_step
        self.group: TrainGroup | None = None
        self.recoveries: list[Recovery] = []
        self.last_stats = None
        """The scheduler's latest stats seen (at a checkpoint or a probe): what a lost scheduler took with it."""
        self.consumed_rollouts: int | None = None
        """The LR schedule's consumed-rollout count after the latest step (the step loop sets it)."""
        self._restore_path = restore_from
        self._restore_step = first_step  # the step the restore point holds every step before
        self._producers: list = []
        self._cursors: list = []  # the producers' latest cursors (a dead producer keeps its last one)

    def attach_producers(self, producers: list, cursors: list | None = None) -> None:
        """The job's producers ((actor, run ref) pairs, in producer-index order) whose cursors each
        checkpoint saves; `cursors`: where they started (None: from their first prompt)."""
        self._producers = producers  # the job's list: a restarted producer replaces its entry
        self._cursors = list(cursors or [None] * len(producers))

    @property
    def retains(self) -> bool:
        """Whether trained steps stay rewindable until a checkpoint (`retains_until_checkpoint`; the job's
        scheduler is made so by `job_scheduler_config`)."""
        return retains_until_checkpoint(self.config)

    @property
    def checkpointed_step(self) -> int:
        """The step the latest checkpoint (or the resumed one) continues at."""
        return self._restore_step

    def start(self) -> None:
        self.group = self._new_group()

    def checkpoint(self, next_step: int) -> str:
        """Save every step < next_step (producers' cursors first, then the scheduler's state, then the
        train group); then the scheduler may settle those steps for good."""
        path = save_job_state(self.config.run.output_dir, next_step, self.group, self.scheduler, self._take_cursors)
        self._restore_path, self._restore_step = path, next_step
        self.last_stats = ray.get(self.scheduler.stats.remote(), timeout=60)
        if self.retains:
            ray.get(self.scheduler.checkpointed.remote(next_step), timeout=60)
        return path

    def cursor_of(self, index: int) -> dict | None:
        """Producer `index`'s cursor at the latest checkpoint (None: from its first prompt), where a
        restarted producer starts."""
        return self._cursors[index] if index < len(self._cursors) else None

    def _take_cursors(self) -> list:
        self._cursors = producer_cursors(self._producers, self._cursors)
        return self._cursors

    def recover(self, error: BaseException, failed_step: int) -> Recovery:
        """Restart the group from the latest checkpoint and rewind the scheduler (or, when the scheduler is
        gone, restore a new one from that checkpoint first: `restore_scheduler`); returns what happened: the
        step to continue from (`restored_step`) and whether the scheduler was restored (`restored_scheduler`).
        Raises JobFailedError when the policy says stop."""
        detected = time.monotonic()
        kind = self._classify(error)
        self._decide(kind, error, failed_step)
        log.warning("step %d failed (%s): %s; restarting the train group%s", failed_step, kind.value, error,
                    " and restoring the scheduler" if kind is FailureKind.SCHEDULER_LOST else "")
        started = time.monotonic()
        while True:
            try:
                replayed = self._restart(kind, failed_step)
                break
            except _SchedulerGone as lost:  # it died during the restart: restore it too, if the budget allows
                kind = FailureKind.SCHEDULER_LOST
                self._decide(kind, lost.__cause__ or lost, failed_step)
        group_start_s = time.monotonic() - started
        restored = self._restore_step
        recovery = Recovery(kind=kind.value, failed_step=failed_step, restored_step=restored,
                            steps_redone=failed_step - restored, rollouts_replayed=replayed,
                            time_to_recover_s=round(time.monotonic() - detected, 3),
                            group_start_s=round(group_start_s, 3))
        self.recoveries.append(recovery)
        if self.on_recovery is not None:
            self.on_recovery("scheduler" if kind is FailureKind.SCHEDULER_LOST else "train_group")
        what = "restored the scheduler and a new train group" if kind is FailureKind.SCHEDULER_LOST else "new train group"
        print(f"recovered from {kind.value} at step {failed_step}: {what} from "
              f"{self._restore_path or 'the initial weights'}, {recovery.steps_redone} steps redone, "
              f"{replayed} rollouts replayed, {recovery.time_to_recover_s:.1f} s (new group {group_start_s:.1f} s)",
              flush=True)
        return recovery

    def _restart(self, kind: FailureKind, failed_step: int) -> int:
        """A new group from the latest checkpoint, the scheduler rewound to it (or restored from it when lost);
        returns the rollouts put back to train again. Raises _SchedulerGone when the scheduler is lost."""
        if kind is FailureKind.SCHEDULER_LOST:
            if self.restore_scheduler is None:
                raise JobFailedError(f"step {failed_step}: the scheduler is gone and this job cannot restore it")
            self.scheduler, restored_rollouts = self.restore_scheduler(self._restore_path)
            self.last_stats = None
        if self.group is not None:
            self.group.shutdown()
        while True:
            try:
                self.group = self._new_group()
                break
            except (PlacementGroupTimeoutError, TrainStepError, ray.exceptions.RayError) as start_error:
                if not self._scheduler_alive():
                    raise _SchedulerGone() from start_error
                self._decide(FailureKind.START_FAILED, start_error, failed_step)
        if kind is FailureKind.SCHEDULER_LOST:  # restored at the checkpoint: what it holds untrained trains again
            return restored_rollouts
        try:
            return ray.get(self.scheduler.rewind.remote(self._restore_step), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as lost:
            raise _SchedulerGone() from lost

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()

    # -- internals ----------------------------------------------------------------------

    def _new_group(self) -> TrainGroup:
        group = TrainGroup(self.config.train)
        try:
            if self._restore_path is not None:
                load_job_state(self._restore_path, group)
            group.register_with(self.scheduler)
        except BaseException:
            group.shutdown()
            raise
        return group

    def _scheduler_alive(self) -> bool:
        """Whether the scheduler answers within SCHEDULER_PROBE_TIMEOUT_S and has not failed inside."""
        try:
            stats = ray.get(self.scheduler.stats.remote(), timeout=SCHEDULER_PROBE_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
        if stats.failure is not None:
            return False
        self.last_stats = stats
        return True

    def _classify(self, error: BaseException) -> FailureKind:
        """What failed. The scheduler is asked first: every failure looks like a rank's once it is gone."""
        if not self._scheduler_alive():
            return FailureKind.SCHEDULER_LOST
        if isinstance(error, TrainStepError):
            return error.kind
        if isinstance(error, PlacementGroupTimeoutError):
            return FailureKind.START_FAILED
        if isinstance(error, ray.exceptions.GetTimeoutError):
            return FailureKind.TIMEOUT
        raise error  # not a failure the policy knows: a bug, raised as it is

    def _decide(self, kind: FailureKind, error: BaseException, failed_step: int) -> None:
        """Return if the budget recovers the failure (it counts it); raise if it stops the run."""
        decision = self.budget.decide_train_failure(kind)
        if decision.action is FailureAction.STOP:
            if kind is FailureKind.SCHEDULER_LOST:
                raise SchedulerLostError(self._what_was_lost(failed_step, decision.reason)) from error
            raise JobFailedError(f"step {failed_step}: {error}; {decision.reason}") from error

    def _what_was_lost(self, failed_step: int, reason: str) -> str:
        seen = self.last_stats
        held = ("nothing buffered is known" if seen is None else
                f"at its last report it held {seen.buffered_rollouts} buffered rollouts and "
                f"{seen.steps_in_flight} steps emitted but not trained")
        since = failed_step - self._restore_step
        where = self._restore_path or "no checkpoint (the run restarts from the beginning)"
        return (f"the SchedulerActor died at step {failed_step}: {held}; those rollouts and the "
                f"ledger of the {since} steps trained since the latest checkpoint are lost to this job; in-flight "
                f"producer pushes fail. The latest checkpoint is {where} (step {self._restore_step}); a resume "
                f"from it gets back the rollouts it held and regenerates what producers pushed after it. {reason}")
