"""The job's controller: the one owner of the run's actors and of every recovery (Ray Train v2's shape).

    controller = RunController(config, scheduler_config, on_recovery=metrics.on_recovery)
    controller.build(resume_from, resume)      # scheduler, rollout source (engines, producers), train group
    try:
        controller.poll()                      # the watches' events, decided and acted on
        result = controller.group.train_step(step, controller.scheduler, while_waiting=controller.poll)
        controller.checkpoint(step + 1)        # durable; the scheduler may settle those steps
    except RECOVERABLE_ERRORS as error:        # what a step loop hands over
        step = controller.recover(error, step).restored_step   # or raises JobFailedError / SchedulerLostError
    controller.stop_producers()                # the run ends: producers first, the input closed
    controller.shutdown()

It alone holds the run's handles: the scheduler, the train group, the rollout source (jobs/rollout_source.py:
engines and producers) and the watches. The watches only post events (jobs/producer_watch.py: a producer died
or failed; jobs/engine_watch.py: an engine died or hung); the step loop posts a train failure (`recover`).
`decide(state, event)` (vgbs_ray/failure_policy.py, pure) answers each with the next `RunState` (its phase and
the failure budget spent) and an `Action`, which the controller carries out. All of it runs on the driver's
thread: the controller polls at every step and while a step waits for its shard (`train_step`'s
`while_waiting`), so no replacement races a weight publish, a checkpoint or a recovery. The price: an engine
replacement (a new vLLM process) runs while the trainer waits for a shard or between steps, not beside a step.

Recovery of the train group (what `recover` does):
1. classify the error (`classify_failure`); first ask the scheduler whether it is alive (bounded by
   `SCHEDULER_PROBE_TIMEOUT_S`): a dead scheduler is never "recovered" by a new group;
2. tear the group down (its collectives are broken), start a new one (new placement group, new process group
   on a new port), restore the latest checkpoint this run wrote (or the one it resumed from; a run with none
   starts from the seeded initial weights, which is the same state);
3. `scheduler.rewind(n)`: every step after the checkpoint goes back in front of the buffer in its original
   order and trains again exactly once, numbered from n. A lost scheduler is restored instead: producers
   stopped, a new SchedulerActor from the checkpoint's `scheduler.pkl` (or an empty one before any
   checkpoint), the new group registered with it, the producers started again from the checkpoint's cursors.
   This is an in-job `run.resume`, and exactly once for the same reason;
4. the engines go back to the restored weights (`RolloutSource.restore`).

Invariants: the scheduler is told `checkpointed(n)` only after the checkpoint of steps < n is durably written
(`latest` points at it), so a rewind never needs a settled step. Steps are global: the run's step numbers,
which the scheduler, the records and the checkpoints share. A checkpoint holds the producers' cursors (taken
first) and the scheduler's exported state (jobs/checkpoint.py), so a later job resumes exactly once.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import ray

from actors.scheduler_actor import create_scheduler
from actors.shutdown import start_named, terminate
from actors.train_group import PlacementGroupTimeoutError, TrainGroup, TrainStepError
from jobs.checkpoint import load_job_state, load_resume_point, producer_cursors, save_job_state
from jobs.rollout_source import RolloutSource
from jobs.engine_watch import EngineWatch
from jobs.producer_watch import ProducerWatch, close_input, free_admitted, give_up, stop_producers
from jobs.recovery import (SCHEDULER_PROBE_TIMEOUT_S, JobFailedError, Recovery, SchedulerLostError,
                           classify_failure, retains_until_checkpoint)
from vgbs_ray.failure_policy import (
    ActionKind, FailureKind, RecoveryDone, ReplacementFailed, RunEnding, RunPhase, RunState, TrainFailed,
    decide,
)

log = logging.getLogger("vgbs.job")


class _SchedulerGone(Exception):
    """Inside a recovery: the scheduler stopped answering (the cause is chained)."""


class RunController:
    """See module docstring. `on_recovery(actor kind)` is called after each recovery (the job's Ray metric)."""

    def __init__(self, config, scheduler_config, *, on_recovery=None):
        self.config = config
        self.scheduler_config = scheduler_config
        """The config a restored scheduler is made with (the engines' KV budget filled in at build)."""
        self.on_recovery = on_recovery or (lambda actor: None)
        self.state = RunState(config.run.max_failures)
        self.scheduler = None
        self.group: TrainGroup | None = None
        self.rollouts: RolloutSource | None = None
        self.producer_watch: ProducerWatch | None = None
        self.finished_watches: list[ProducerWatch] = []
        """Producer watches of schedulers that were lost (their reports and counts stay in the summary)."""
        self.engine_watch: EngineWatch | None = None
        self.first_step = 0
        self.recoveries: list[Recovery] = []
        self.last_stats = None
        """The scheduler's latest stats seen (at a checkpoint or a probe): what a lost scheduler took with it."""
        self.consumed_rollouts: int | None = None
        """The LR schedule's consumed-rollout count after the latest step (the step loop sets it)."""
        self._restore_path: str | None = None
        self._restore_step = 0  # the step the restore point holds every step before
        self._cursors: list = []  # the producers' cursors at the latest checkpoint (a dead producer keeps its last)
        self._cursors_after_restore: list | None = None

    # -- build ------------------------------------------------------------------------------

    def build(self, resume_from: str | None, resume) -> None:
        """The scheduler (restored from `resume`, a ResumePoint, when given), the rollout source (its engines and
        producers start while the train group does), the train group (restored from `resume_from`), the group's
        weights to the engines, the producers running, the watches."""
        config = self.config
        self.scheduler = create_scheduler(self.scheduler_config, restore=resume.scheduler_state if resume else None)
        self.first_step = self._restore_step = resume.next_step if resume is not None else 0
        self._restore_path = resume_from
        cursors = resume.cursors if resume is not None else None
        self.rollouts = RolloutSource.launch(config, self.scheduler, policy_version=self.first_step, cursors=cursors)
        self.group = self._new_group()
        self.rollouts.start(config, self.group, self.scheduler)
        if self.rollouts.kv_cache_tokens is not None:  # admission_token_budget=engines: a restored scheduler's too
            self.scheduler_config = dataclasses.replace(self.scheduler_config,
                                                        admission_token_budget=self.rollouts.kv_cache_tokens)
        self._cursors = list(cursors or [None] * len(self.rollouts.producers))
        self.producer_watch = ProducerWatch(self.rollouts.producers)
        if self.rollouts.engines is not None:
            self.engine_watch = EngineWatch(self.rollouts.engines, hang_timeout_s=config.rollout.engines.call_timeout_s)

    # -- events -----------------------------------------------------------------------------

    def poll(self) -> None:
        """The watches' events, decided and acted on; the input closed once every producer ended; a replaced
        engine sent the newest weights over a collective (`RolloutSource.catch_up`). Never waits for the watches.
        Raises JobFailedError when the run must stop."""
        events = self.producer_watch.poll() + (self.engine_watch.poll() if self.engine_watch is not None else [])
        for event in events:
            self.handle(event)
        close_input(self.scheduler, self.producer_watch)
        self._raise_if_failed()
        self.rollouts.catch_up(self.group)

    def handle(self, event) -> None:
        """`decide` on `event`, then carry out the action (a train failure goes through `recover`)."""
        self.state, action = decide(self.state, event)
        if action.kind is ActionKind.STOP:
            log.error("the run stops: %s", action.reason)
        elif action.kind is ActionKind.GIVE_UP_PRODUCER:
            give_up(self.producer_watch, self.scheduler, event, action.reason)
        elif action.kind is ActionKind.RESTART_PRODUCER:
            free_admitted(self.scheduler, action.index)
            self._restart_producer(action.index)
        elif action.kind is ActionKind.REPLACE_ENGINE:
            self._replace_engine(action.index, event.cause)
        elif action.kind is not ActionKind.NONE:
            raise AssertionError(f"{action.kind} after {event!r}: train failures go through recover()")

    def _raise_if_failed(self) -> None:
        if self.state.phase is RunPhase.FAILED:
            raise JobFailedError(f"the run could not be kept going: {self.state.failure}")

    def _restart_producer(self, index: int) -> None:
        started = time.monotonic()
        try:
            cursor = self._cursors[index] if index < len(self._cursors) else None
            _, run_ref = self.rollouts.restart_producer(index, cursor, self.scheduler)
        except Exception as error:  # noqa: BLE001 - e.g. the scheduler is gone too
            self.handle(ReplacementFailed("producer", index, repr(error)))
            return
        self.producer_watch.track(index, run_ref)
        record = {"producer": index, "at_s": round(started - self.producer_watch.began, 2),
                  "restart_s": round(time.monotonic() - started, 2), "cause": "died"}
        self.producer_watch.restarts.append(record)
        self.on_recovery("producer")
        log.warning("producer %d died (actor gone); restarted from the latest checkpoint's cursor in %.1f s", index,
                    record["restart_s"])
        self.handle(RecoveryDone())

    def _replace_engine(self, index: int, cause: str) -> None:
        name = self.rollouts.engines.names[index]
        detected = time.monotonic()
        log.warning("rollout engine %s %s; replacing it on its bundle", name, cause)
        try:
            version = self.rollouts.replace_engine(index)
        except Exception as error:  # noqa: BLE001 - the run stops with it
            self.handle(ReplacementFailed("engine", index, f"rollout engine {name} {cause}: {error!r}"))
            return
        record = {"engine": name, "cause": cause, "at_s": round(detected - self.engine_watch.began, 2),
                  "replace_s": round(time.monotonic() - detected, 2), "serves_from_version": version}
        self.engine_watch.replacements.append(record)
        self.on_recovery("engine")
        print(f"replaced rollout engine {name} ({cause}) in {record['replace_s']:.1f} s; it serves from policy "
              f"version {version}", flush=True)
        self.handle(RecoveryDone())

    # -- checkpoints --------------------------------------------------------------------------

    @property
    def checkpointed_step(self) -> int:
        """The step the latest checkpoint (or the resumed one) continues at."""
        return self._restore_step

    def checkpoint(self, next_step: int) -> str:
        """Save every step < next_step (producers' cursors first, then the scheduler's state, then the
        train group); then the scheduler may settle those steps for good."""
        path = save_job_state(self.config.run.output_dir, next_step, self.group, self.scheduler, self._take_cursors)
        self._restore_path, self._restore_step = path, next_step
        self.last_stats = ray.get(self.scheduler.stats.remote(), timeout=60)
        if retains_until_checkpoint(self.config):
            ray.get(self.scheduler.checkpointed.remote(next_step), timeout=60)
        return path

    def _take_cursors(self) -> list:
        self._cursors = producer_cursors(self.rollouts.producers, self._cursors)
        return self._cursors

    # -- train failures ----------------------------------------------------------------------

    def recover(self, error: BaseException, failed_step: int) -> Recovery:
        """Restart the group from the latest checkpoint and rewind the scheduler (or, when the scheduler is
        gone, restore a new one from that checkpoint first, and the producers on it), then the engines go back
        to the restored weights; returns what happened (`restored_step`: the step to continue from). Raises
        JobFailedError when the policy says stop."""
        detected = time.monotonic()
        kind = classify_failure(error, self._scheduler_alive())
        self._decide_train(kind, error, failed_step)
        log.warning("step %d failed (%s): %s; restarting the train group%s", failed_step, kind.value, error,
                    " and restoring the scheduler" if kind is FailureKind.SCHEDULER_LOST else "")
        started = time.monotonic()
        while True:
            try:
                replayed = self._restart(kind, failed_step)
                break
            except _SchedulerGone as lost:  # it died during the restart: restore it too, if the budget allows
                kind = FailureKind.SCHEDULER_LOST
                self._decide_train(kind, lost.__cause__ or lost, failed_step)
        group_start_s = time.monotonic() - started
        restored = self._restore_step
        if kind is FailureKind.SCHEDULER_LOST:  # the producers again, on the new scheduler
            self._restart_producers()
        self.rollouts.restore(self.group, restored)
        recovery = Recovery(kind=kind.value, failed_step=failed_step, restored_step=restored,
                            steps_redone=failed_step - restored, rollouts_replayed=replayed,
                            time_to_recover_s=round(time.monotonic() - detected, 3),
                            group_start_s=round(group_start_s, 3))
        self.recoveries.append(recovery)
        self.on_recovery("scheduler" if kind is FailureKind.SCHEDULER_LOST else "train_group")
        self.handle(RecoveryDone())
        restored_scheduler = kind is FailureKind.SCHEDULER_LOST
        what = "restored the scheduler and a new train group" if restored_scheduler else "new train group"
        print(f"recovered from {kind.value} at step {failed_step}: {what} from "
              f"{self._restore_path or 'the initial weights'}, {recovery.steps_redone} steps redone, "
              f"{replayed} rollouts replayed, {recovery.time_to_recover_s:.1f} s (new group {group_start_s:.1f} s)",
              flush=True)
        return recovery

    def _decide_train(self, kind: FailureKind, error: BaseException, failed_step: int) -> None:
        """Return if the budget recovers the failure (`decide` counts it); raise if it stops the run."""
        self.state, action = decide(self.state, TrainFailed(kind))
        if action.kind is ActionKind.STOP:
            if kind is FailureKind.SCHEDULER_LOST:
                raise SchedulerLostError(self._what_was_lost(failed_step, action.reason)) from error
            raise JobFailedError(f"step {failed_step}: {error}; {action.reason}") from error

    def _restart(self, kind: FailureKind, failed_step: int) -> int:
        """A new group from the latest checkpoint, the scheduler rewound to it (or restored from it when lost);
        returns the rollouts put back to train again. Raises _SchedulerGone when the scheduler is lost."""
        if kind is FailureKind.SCHEDULER_LOST:
            restored_rollouts = self._restore_scheduler(self._restore_path)
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
                self._decide_train(FailureKind.START_FAILED, start_error, failed_step)
        if kind is FailureKind.SCHEDULER_LOST:  # restored at the checkpoint: what it holds untrained trains again
            return restored_rollouts
        try:
            return ray.get(self.scheduler.rewind.remote(self._restore_step), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as lost:
            raise _SchedulerGone() from lost

    def _restore_scheduler(self, checkpoint: str | None) -> int:
        """The scheduler died: stop the producers (they pushed to it), start a new one from `checkpoint`'s state
        (None: before the first checkpoint, an empty one: the run starts over); returns the untrained rollouts it
        holds. The producers start again from that checkpoint's cursors once the new group is up."""
        stop_producers(self.rollouts.producers, self.producer_watch, self.scheduler, self.handle, timeout_s=30)
        self.finished_watches.append(self.producer_watch)
        self.rollouts.producers.clear()
        terminate([self.scheduler])  # frees its name
        resume = load_resume_point(checkpoint) if checkpoint is not None else None
        self.scheduler = start_named(lambda: create_scheduler(self.scheduler_config,
                                                              restore=resume.scheduler_state if resume else None))
        self._cursors_after_restore = resume.cursors if resume is not None else None
        return resume.scheduler_state.num_live_rollouts if resume is not None else 0

    def _restart_producers(self) -> None:
        """After a scheduler restore: every producer again, on the new scheduler, from the checkpoint's cursors."""
        cursors = self._cursors_after_restore
        self.rollouts.restart_producers(self.scheduler, cursors)
        self._cursors = list(cursors or [None] * len(self.rollouts.producers))
        self.producer_watch = ProducerWatch(self.rollouts.producers)

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

    # -- the end ------------------------------------------------------------------------------

    @property
    def producer_watches(self) -> list[ProducerWatch]:
        """Every producer watch of the run, one per scheduler it had."""
        return [*self.finished_watches, *([self.producer_watch] if self.producer_watch is not None else [])]

    def recovery_count(self) -> int:
        """Every actor recovered so far: train groups, schedulers, producers, engines."""
        engines = len(self.engine_watch.replacements) if self.engine_watch is not None else 0
        return len(self.recoveries) + sum(len(w.restarts) for w in self.producer_watches) + engines

    def stop_producers(self, timeout_s: float = 60.0) -> None:
        """The run ends: nothing is replaced from here on; the producers stop and the input is closed."""
        self.handle(RunEnding())
        if self.rollouts is not None and self.producer_watch is not None:
            stop_producers(self.rollouts.producers, self.producer_watch, self.scheduler, self.handle, timeout_s)
            self.rollouts.producers.clear()  # stopped and ended once

    def shutdown(self) -> None:
        """Everything the run started goes, producers first (also after a failure; safe to call twice)."""
        if self.rollouts is not None and self.rollouts.producers:  # a failed run: stop them before the scheduler goes
            self.stop_producers(timeout_s=10)
        if self.rollouts is not None:
            self.rollouts.shutdown()
        if self.group is not None:
            self.group.shutdown()
        if self.scheduler is not None:
            try:
                ray.get(self.scheduler.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            terminate([self.scheduler])
