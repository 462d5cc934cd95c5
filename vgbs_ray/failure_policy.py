"""The job's failure policy: after a failure, restart the train group, restore the scheduler, or stop the run.

Ray Train v2's shape: the policy decides (`make_decision(status, max_failures)`), the job's
controller acts (tear the group down, start a new one, restore the latest checkpoint,
rewind the scheduler). Pure: no Ray, no clock; tested without either.

Rules, in order:
1. A failure a new train group cannot cure stops the run at once, whatever the budget: the
   scheduler has no shard to give (input starved, or the scheduler failed inside).
2. A lost scheduler counts against `max_failures` and, within it, is restored in the job from
   the latest checkpoint (`RESTORE`: a new scheduler from its saved state, the train group
   rewound to the same checkpoint, the producers restarted from its cursors): what it buffered
   since that checkpoint is regenerated, never trained twice.
3. Otherwise (a rank died, a rank raised in a step, a step or checkpoint timed out, a new group
   could not start) the failure counts against `max_failures`: the group restarts while fewer
   than `max_failures` failures came before this one; this one past the budget stops the run.
   `max_failures=0` fails fast (the first failure stops the run).

Invariant: a decision to restart or restore implies `failures_before < max_failures` and a
recoverable kind (RECOVERABLE, or SCHEDULER_LOST for a restore).

`FailureBudget` is the run's one budget, shared by every owner of a recovery (the train controller, the
producers' watch, the engines' watch): train-group and scheduler failures count together, each producer
and each engine counts its own replacements, all against `run.max_failures`, for the whole run (a watch
started again after a scheduler restore keeps the counts).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

from vgbs_ray.errors import ConfigError


class FailureKind(str, enum.Enum):
    RANK_DIED = "rank_died"
    """A TrainActor process died (killed, OOM, node lost); its peers' collectives broke."""
    RANK_FAILED = "rank_failed"
    """A rank raised during a step or a checkpoint (the others may be stuck in a collective)."""
    TIMEOUT = "timeout"
    """Ranks did not finish a step or a checkpoint within their timeout (a hung collective)."""
    START_FAILED = "start_failed"
    """A new train group could not start (placement group not ready, set-up failed)."""
    NO_SHARD = "no_shard"
    """The scheduler had no shard for the step: input starved past the shard timeout, or it failed inside."""
    SCHEDULER_LOST = "scheduler_lost"
    """The SchedulerActor died or does not answer."""


RECOVERABLE = frozenset({FailureKind.RANK_DIED, FailureKind.RANK_FAILED, FailureKind.TIMEOUT,
                         FailureKind.START_FAILED})
"""Kinds a new train group restored from the latest checkpoint can cure."""


class FailureAction(str, enum.Enum):
    RESTART = "restart"
    """Tear the train group down, start a new one, restore the latest checkpoint, rewind the scheduler."""
    RESTORE = "restore"
    """The scheduler is gone: a new one from the latest checkpoint, a new train group from it, the producers again."""
    STOP = "stop"
    """Stop the run and raise the failure (with the decision's reason)."""


@dataclass(frozen=True, kw_only=True)
class FailureStatus:
    kind: FailureKind
    failures_before: int
    """Failures this run already recovered from (not counting this one)."""

    def __post_init__(self):
        if not isinstance(self.kind, FailureKind):
            raise ConfigError(f"FailureStatus.kind must be a FailureKind, got {self.kind!r}")
        if self.failures_before < 0:
            raise ConfigError(f"FailureStatus.failures_before must be >= 0, got {self.failures_before}")


@dataclass(frozen=True)
class FailureDecision:
    action: FailureAction
    reason: str
    """One sentence for the log and the error: why, and what setting changes it."""


def make_decision(status: FailureStatus, max_failures: int) -> FailureDecision:
    """Restart or stop after one failure (see module docstring). O(1), pure."""
    if max_failures < 0:
        raise ConfigError(f"max_failures must be >= 0, got {max_failures}")
    kind, before = status.kind, status.failures_before
    if kind is FailureKind.SCHEDULER_LOST:
        if before >= max_failures:
            return FailureDecision(FailureAction.STOP, f"the SchedulerActor is gone and failure {before + 1} exceeds "
                                   f"run.max_failures={max_failures}: the rollouts it buffered and its ledger since the "
                                   "latest checkpoint went with it; resume with run.resume=true")
        return FailureDecision(FailureAction.RESTORE, f"scheduler_lost: failure {before + 1} of at most {max_failures}; "
                               "restoring the scheduler, the train group and the producers from the latest checkpoint")
    if kind not in RECOVERABLE:
        return FailureDecision(FailureAction.STOP, f"{kind.value}: a new train group would get no shard either; "
                               "check the producers and the scheduler (or raise run.shard_timeout_s)")
    if before >= max_failures:
        if max_failures == 0:
            return FailureDecision(FailureAction.STOP, f"{kind.value} with run.max_failures=0 (fail fast); "
                                   "set run.max_failures > 0 to recover in the job")
        return FailureDecision(FailureAction.STOP, f"{kind.value}: failure {before + 1} exceeds "
                               f"run.max_failures={max_failures}; raise it to recover more often")
    return FailureDecision(FailureAction.RESTART, f"{kind.value}: failure {before + 1} of at most {max_failures}; "
                           "restarting the train group from the latest checkpoint")


REPLACEABLE_ACTORS = ("producer", "engine")
"""Actors replaced one by one, each with its own count: a producer (from the latest checkpoint's cursor) and a
rollout engine (on its bundle, serving from the newest version)."""


@dataclass
class FailureBudget:
    """The run's failure budget (see module docstring): `decide_*` answer and count a recovery; thread-safe (the
    watches decide on their own threads)."""

    max_failures: int
    train_failures: int = 0
    """Train-group and scheduler failures recovered so far (they share one count)."""
    replacements: dict = field(default_factory=dict)
    """(actor kind, index) -> times that actor was replaced."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        if not isinstance(self.max_failures, int) or self.max_failures < 0:
            raise ConfigError(f"run.max_failures must be an integer >= 0, got {self.max_failures!r}")

    def decide_train_failure(self, kind: FailureKind) -> FailureDecision:
        """After a train-group or scheduler failure: `make_decision` on the shared count, counted when it recovers."""
        with self._lock:
            decision = make_decision(FailureStatus(kind=kind, failures_before=self.train_failures), self.max_failures)
            if decision.action is not FailureAction.STOP:
                self.train_failures += 1
            return decision

    def decide_replacement(self, actor: str, index: int, cause: str) -> FailureDecision:
        """After producer or engine `index` died or hung (`cause`): RESTART (counted) while it was replaced fewer
        than `max_failures` times, else STOP naming the count and the key."""
        if actor not in REPLACEABLE_ACTORS:
            raise ConfigError(f"FailureBudget: actor must be one of {REPLACEABLE_ACTORS}, got {actor!r}")
        with self._lock:
            before = self.replacements.get((actor, index), 0)
            if before >= self.max_failures:
                return FailureDecision(FailureAction.STOP, f"{actor} {index} {cause} and was replaced {before} times "
                                       f"already (run.max_failures={self.max_failures}); raise run.max_failures "
                                       "to replace it again")
            self.replacements[(actor, index)] = before + 1
            return FailureDecision(FailureAction.RESTART, f"{actor} {index} {cause}: replacement {before + 1} of at "
                                   f"most {self.max_failures}")
