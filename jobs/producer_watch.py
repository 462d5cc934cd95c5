"""The producers' watch: how each producer's `run` ended, as events for the job's controller.

    watch = ProducerWatch(loop.producers)     # (actor, run ref) pairs, in producer-index order
    for event in watch.poll():                # never waits: ActorDied("producer", i) or ProducerFailed(i)
        controller.handle(event)              # decides (vgbs_ray/failure_policy.py) and acts
    watch.track(i, new_run_ref)               # after the controller restarted producer i
    watch.all_ended                           # every producer returned, failed or was given up
    watch.outcome()                           # how the producers ended, for the summary

The watch only observes: it holds no scheduler, restarts nothing and runs no thread; the controller
polls it from the driver's step loop (also while a step waits for its shard). A producer whose actor
died (`RayActorError`: killed, OOM, node lost) is posted as `ActorDied`; one whose `run` raised (a dead
engine, an agent module that does not import) as `ProducerFailed`; a `run` that returned leaves its
report here.
"""

from __future__ import annotations

import logging
import time

import ray

from actors.shutdown import actor_died, terminate
from vgbs_ray.failure_policy import ActorDied, ProducerFailed

log = logging.getLogger("vgbs.job")


class ProducerWatch:
    """See module docstring."""

    def __init__(self, producers: list):
        self._running = {index: ref for index, (_, ref) in enumerate(producers)}
        self.reports: list = []
        self.failed = 0
        """Producers that failed or died and were not restarted."""
        self.restarts: list[dict] = []
        self.input_closed = False
        self.close_tried = False
        """Whether `close_input` asked the scheduler (once, even when it failed)."""
        self.began = time.monotonic()

    def track(self, index: int, run_ref) -> None:
        """Producer `index` runs again (restarted): watch its new `run`."""
        self._running[index] = run_ref

    @property
    def all_ended(self) -> bool:
        return not self._running

    @property
    def running_refs(self) -> list:
        return list(self._running.values())

    def poll(self) -> list:
        """The producers that ended since the last call, as events (see module docstring); never waits."""
        if not self._running:
            return []
        index_of = {ref: index for index, ref in self._running.items()}
        ready, _ = ray.wait(list(index_of), num_returns=len(index_of), timeout=0)
        events = []
        for ref in ready:
            index = index_of[ref]
            del self._running[index]
            try:
                self.reports.append(ray.get(ref))
            except Exception as error:  # noqa: BLE001 - a failed producer ends its input; training goes on
                if actor_died(error):
                    log.warning("producer %d died: %r", index, error)
                    events.append(ActorDied("producer", index))
                else:  # its `run` raised (e.g. the scheduler died): a failure, not a death
                    log.error("producer %d failed: %r", index, error)
                    events.append(ProducerFailed(index))
        return events

    def outcome(self) -> dict:
        return {"finished": sum(not r.stopped for r in self.reports), "stopped": sum(r.stopped for r in self.reports),
                "failed": self.failed, "abandoned_rollouts": sum(r.abandoned_rollouts for r in self.reports),
                "input_closed": self.input_closed, "restarts": list(self.restarts)}


def free_admitted(scheduler, index: int, timeout_s: float = 60.0) -> None:
    """Producer `index` died: no step may wait for what it had in flight (a restart admits it again)."""
    try:
        ray.get(scheduler.producer_lost.remote(index), timeout=timeout_s)
    except Exception as error:  # noqa: BLE001 - the scheduler is gone too: the controller restores it
        log.error("producer %d died; the scheduler did not take it: %r", index, error)


def give_up(watch: ProducerWatch, scheduler, event, reason: str) -> None:
    """Producer `event.index` ends for good (counted failed): what a dead one had in flight is freed."""
    if isinstance(event, ActorDied):
        free_admitted(scheduler, event.index)
    watch.failed += 1
    log.error("producer %d is not restarted: %s", event.index, reason)


def close_input(scheduler, watch: ProducerWatch, timeout_s: float = 60.0) -> None:
    """Once every producer ended: tell the scheduler no more input comes (once)."""
    if watch.close_tried or not watch.all_ended:
        return
    watch.close_tried = True
    try:
        ray.get(scheduler.end_of_input.remote(), timeout=timeout_s)
        watch.input_closed = True
    except ray.exceptions.RayActorError:
        log.error("end of input not recorded: the scheduler is gone")
    except Exception as error:  # noqa: BLE001 - reported; the driver decides the run's outcome
        log.error("end of input failed: %r", error)


def stop_producers(producers: list, watch: ProducerWatch, scheduler, on_event, timeout_s: float = 60.0) -> None:
    """The end of a run, producers first: ask each to stop (abandoned rollouts end incomplete at end of
    input), wait for their `run`s to return, hand what the watch saw to `on_event` (the run is ending: none
    is restarted), then close the input, so none pushes into a dead scheduler."""
    stops = [actor.stop.remote() for actor, _ in producers]
    running = watch.running_refs
    ready, _ = ray.wait(running, num_returns=len(running), timeout=timeout_s)
    if len(ready) < len(running):
        log.error("producers did not stop within %.0f s; ending the run anyway", timeout_s)
    for event in watch.poll():
        on_event(event)
    close_input(scheduler, watch, timeout_s)
    ray.wait(stops, num_returns=len(stops), timeout=timeout_s)  # a stop() still running when killed fails
    terminate([actor for actor, _ in producers])  # idle now (their run and stop returned)
