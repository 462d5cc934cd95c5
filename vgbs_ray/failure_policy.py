"""The job's failure policy: after a failure, restart the train group, restore the scheduler, or stop the run.

Ray Train v2's shape: the job's one controller (jobs/controller.py) holds every handle and acts;
this module decides. Watches only post events (`TrainFailed`, `ActorDied`, `ProducerFailed`, ...);
`decide(state, event) -> (next state, action)` answers each one from the typed `RunState` (its
`RunPhase` and the failure budget spent so far). Pure: no Ray, no clock, no thread; tested without
any of them.

Rules for a train-group or scheduler failure (`make_decision`), in order:
1. A failure a new train group cannot cure stops the run at once, whatever the budget: the
   scheduler has no shard to give (input starved, or the scheduler failed inside).
2. A lost scheduler counts against `max_failures` and, within it, is restored in the job from
   the latest checkpoint (`RESTORE_SCHEDULER`: a new scheduler from its saved state, the train group
   rewound to the same checkpoint, the producers restarted from its cursors): what it buffered
   since that checkpoint is regenerated, never trained twice.
3. Otherwise (a rank died, a rank raised in a step, a step or checkpoint timed out, a new group
   could not start) the failure counts against `max_failures`: the group restarts while fewer
   than `max_failures` failures came before this one; this one past the budget stops the run.
   `max_failures=0` fails fast (the first failure stops the run).

Invariant: a decision to restart or restore implies `failures_before < max_failures` and a
recoverable kind (RECOVERABLE, or SCHEDULER_LOST for a restore).

The budget is one, in `RunState`: train-group and scheduler failures count together, each producer
and each engine counts its own replacements, all against `run.max_failures`, for the whole run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

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


class ActionKind(str, enum.Enum):
    NONE = "none"
    RESTART_TRAIN_GROUP = "restart_train_group"
    """Tear the train group down, start a new one from the latest checkpoint, rewind the scheduler to it."""
    RESTORE_SCHEDULER = "restore_scheduler"
    """A new scheduler from the latest checkpoint, a new train group from it, every producer again from its cursor."""
    RESTART_PRODUCER = "restart_producer"
    """Producer `index` again, from its cursor at the latest checkpoint."""
    GIVE_UP_PRODUCER = "give_up_producer"
    """Producer `index` ends (counted as failed); the others go on, and the input closes once all have ended."""
    REPLACE_ENGINE = "replace_engine"
    """Engine `index` again, on its bundle, serving from the newest policy version."""
    STOP = "stop"
    """Stop the run with `reason`."""


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    reason: str = ""
    """One sentence for the log and the error: why, and what setting changes it."""
    index: int | None = None
    """The producer or engine acted on."""


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


def make_decision(status: FailureStatus, max_failures: int) -> Action:
    """Restart or stop after one failure (see module docstring). O(1), pure."""
    if max_failures < 0:
        raise ConfigError(f"max_failures must be >= 0, got {max_failures}")
    kind, before = status.kind, status.failures_before
    if kind is FailureKind.SCHEDULER_LOST:
        if before >= max_failures:
            return Action(ActionKind.STOP, f"the SchedulerActor is gone and failure {before + 1} exceeds "
                          f"run.max_failures={max_failures}: the rollouts it buffered and its ledger since the "
                          "latest checkpoint went with it; resume with run.resume=true")
        return Action(ActionKind.RESTORE_SCHEDULER, f"scheduler_lost: failure {before + 1} of at most {max_failures}; "
                      "restoring the scheduler, the train group and the producers from the latest checkpoint")
    if kind not in RECOVERABLE:
        return Action(ActionKind.STOP, f"{kind.value}: a new train group would get no shard either; "
                      "check the producers and the scheduler (or raise run.shard_timeout_s)")
    if before >= max_failures:
        if max_failures == 0:
            return Action(ActionKind.STOP, f"{kind.value} with run.max_failures=0 (fail fast); "
                          "set run.max_failures > 0 to recover in the job")
        return Action(ActionKind.STOP, f"{kind.value}: failure {before + 1} exceeds "
                      f"run.max_failures={max_failures}; raise it to recover more often")
    return Action(ActionKind.RESTART_TRAIN_GROUP, f"{kind.value}: failure {before + 1} of at most {max_failures}; "
                  "restarting the train group from the latest checkpoint")


REPLACEABLE_ACTORS = ("producer", "engine")
"""Actors replaced one by one, each with its own count: a producer (from the latest checkpoint's cursor) and a
rollout engine (on its bundle, serving from the newest version)."""


# -- the run's controller: typed states, events, actions, and `decide` --------------------------------------------


class RunPhase(str, enum.Enum):
    """What the job's controller (jobs/controller.py) is doing."""

    RUNNING = "running"
    RECOVERING_TRAIN_GROUP = "recovering_train_group"
    RESTORING_SCHEDULER = "restoring_scheduler"
    REPLACING_ENGINE = "replacing_engine"
    RESTARTING_PRODUCER = "restarting_producer"
    FINISHED = "finished"
    """The run is ending (its producers are stopping): a producer or engine that dies now is not replaced."""
    FAILED = "failed"
    """The run stopped on a failure (`RunState.failure` says why); nothing is recovered any more."""


@dataclass(frozen=True)
class TrainFailed:
    """The step loop: a train step or checkpoint failed (`kind`: what `classify_failure` found it to be), or a
    recovery's new group did not start (START_FAILED), or the scheduler is gone (SCHEDULER_LOST)."""

    kind: FailureKind


@dataclass(frozen=True)
class ActorDied:
    """A watch: producer or engine `index` died (its actor is gone) or, for an engine, hung."""

    actor: str
    index: int
    cause: str = "died"


@dataclass(frozen=True)
class ProducerFailed:
    """The producers' watch: producer `index`'s `run` raised (a dead engine, an agent that does not import): it
    would fail again, so it is not restarted."""

    index: int


@dataclass(frozen=True)
class RecoveryDone:
    """The controller: the action it was given is done; the run goes on."""


@dataclass(frozen=True)
class ReplacementFailed:
    """The controller: producer or engine `index`'s replacement did not start (`error`)."""

    actor: str
    index: int
    error: str


@dataclass(frozen=True)
class RunEnding:
    """The step loop is done: the producers stop next."""


Event = TrainFailed | ActorDied | ProducerFailed | RecoveryDone | ReplacementFailed | RunEnding


@dataclass(frozen=True)
class RunState:
    """The controller's state: its phase and the run's failure budget as spent so far. Immutable: `decide`
    returns the next one.

    Budget: train-group and scheduler failures share one count (`train_failures`); each producer and each
    engine counts its own replacements (`replacements`); all against `max_failures` (run.max_failures), for the
    whole run (a scheduler restore keeps the counts)."""

    max_failures: int
    phase: RunPhase = RunPhase.RUNNING
    train_failures: int = 0
    """Train-group and scheduler failures recovered so far."""
    replacements: tuple = ()
    """((actor, index), times replaced) pairs, sorted."""
    failure: str | None = None
    """Why the run stopped (phase FAILED)."""

    def __post_init__(self):
        if not isinstance(self.max_failures, int) or self.max_failures < 0:
            raise ConfigError(f"run.max_failures must be an integer >= 0, got {self.max_failures!r}")
        if not isinstance(self.phase, RunPhase):
            raise ConfigError(f"RunState.phase must be a RunPhase, got {self.phase!r}")

    def replaced(self, actor: str, index: int) -> int:
        """Times producer or engine `index` was replaced so far."""
        return dict(self.replacements).get((actor, index), 0)

    def _with_replacement(self, actor: str, index: int, phase: RunPhase) -> "RunState":
        counts = dict(self.replacements)
        counts[(actor, index)] = counts.get((actor, index), 0) + 1
        return replace(self, phase=phase, replacements=tuple(sorted(counts.items())))


_PRODUCERS_STOPPING = frozenset({RunPhase.FINISHED, RunPhase.RESTORING_SCHEDULER})
"""Phases in which the producers are being stopped (the run ends, or they restart on a restored scheduler)."""
_REPLACING = {"producer": RunPhase.RESTARTING_PRODUCER, "engine": RunPhase.REPLACING_ENGINE}


def decide(state: RunState, event: Event) -> tuple[RunState, Action]:
    """The controller's one decision: after `event` in `state`, the next state and the action to take. Pure, O(1).

    Rules:
    - FAILED is final: every event is answered with NONE.
    - `TrainFailed`: `make_decision` on the shared count (restart the group, restore the scheduler, or stop).
    - `ActorDied`: a producer or engine is replaced while it was replaced fewer than `max_failures` times; past
      that a producer is given up (the run goes on with the others) and an engine stops the run (its requests
      would wait forever on the others' capacity and a shorter run would pass for a finished one). While the
      producers stop (the run is ending, or a restored scheduler gets new ones) a producer that dies is given
      up; once the run is ending (FINISHED) an engine is left alone.
    - `ProducerFailed`: given up (it would fail again).
    - `ReplacementFailed`: an engine's stops the run; a producer's gives it up.
    - `RecoveryDone` returns to RUNNING (or stays FINISHED); `RunEnding` goes to FINISHED.
    """
    if state.phase is RunPhase.FAILED:
        return state, Action(ActionKind.NONE, "the run already stopped")

    def stop(reason: str) -> tuple[RunState, Action]:
        return replace(state, phase=RunPhase.FAILED, failure=reason), Action(ActionKind.STOP, reason)

    if isinstance(event, TrainFailed):
        action = make_decision(FailureStatus(kind=event.kind, failures_before=state.train_failures),
                               state.max_failures)
        if action.kind is ActionKind.STOP:
            return stop(action.reason)
        restore = action.kind is ActionKind.RESTORE_SCHEDULER
        phase = RunPhase.RESTORING_SCHEDULER if restore else RunPhase.RECOVERING_TRAIN_GROUP
        return replace(state, phase=phase, train_failures=state.train_failures + 1), action
    if isinstance(event, ActorDied):
        if event.actor not in REPLACEABLE_ACTORS:
            raise ConfigError(f"ActorDied.actor must be one of {REPLACEABLE_ACTORS}, got {event.actor!r}")
        what = f"{event.actor} {event.index} {event.cause}"
        if state.phase in _PRODUCERS_STOPPING and event.actor == "producer":
            return state, Action(ActionKind.GIVE_UP_PRODUCER, f"{what} while the producers stop", event.index)
        if state.phase is RunPhase.FINISHED:
            return state, Action(ActionKind.NONE, f"{what} while the run ends")
        before = state.replaced(event.actor, event.index)
        if before >= state.max_failures:
            reason = (f"{what} and was replaced {before} times already (run.max_failures={state.max_failures}); "
                      "raise run.max_failures to replace it again")
            if event.actor == "producer":
                return state, Action(ActionKind.GIVE_UP_PRODUCER, reason, event.index)
            return stop(reason)
        kind = ActionKind.RESTART_PRODUCER if event.actor == "producer" else ActionKind.REPLACE_ENGINE
        return (state._with_replacement(event.actor, event.index, _REPLACING[event.actor]),
                Action(kind, f"{what}: replacement {before + 1} of at most {state.max_failures}", event.index))
    if isinstance(event, ProducerFailed):
        return state, Action(ActionKind.GIVE_UP_PRODUCER, f"producer {event.index} failed (it would fail again)",
                             event.index)
    if isinstance(event, ReplacementFailed):
        reason = f"{event.actor} {event.index}'s replacement did not start: {event.error}"
        if event.actor == "engine":
            return stop(reason)
        return replace(state, phase=_after_recovery(state)), Action(ActionKind.GIVE_UP_PRODUCER, reason, event.index)
    if isinstance(event, RecoveryDone):
        return replace(state, phase=_after_recovery(state)), Action(ActionKind.NONE)
    if isinstance(event, RunEnding):
        return replace(state, phase=RunPhase.FINISHED), Action(ActionKind.NONE)
    raise ConfigError(f"decide: not an event: {event!r}")


def _after_recovery(state: RunState) -> RunPhase:
    return RunPhase.FINISHED if state.phase is RunPhase.FINISHED else RunPhase.RUNNING
