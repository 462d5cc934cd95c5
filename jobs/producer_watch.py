"""The producers' watch: restarts a producer that died, and closes the input once every producer is done.

    watch = ProducerWatch(scheduler, loop.producers, restart=restart, budget=FailureBudget(max_failures=2))
    watch.start()                 # a driver thread
    ...
    watch.stopping.set()          # the run ends: no restart from here on (stop_producers does it)
    watch.outcome()               # how the producers ended, for the summary

Policy. A producer whose actor died (its `run` raised `RayActorError`: killed, OOM, node lost)
is started again by `restart(index)` (the job's: from the cursor of the latest checkpoint, so
its prompts from there are answered again under the same rollout ids; the scheduler skips or
rejects what it already holds, so nothing is trained twice), while the run's `FailureBudget`
allows (run.max_failures times per producer over the whole run; no budget: never). A producer that *failed* (its `run` raised: a dead engine, an agent module that does
not import) is not restarted: it would fail again. Once every producer returned, was stopped
or is given up, `end_of_input` tells the scheduler no more input comes.

Each restart is a line in the job log and a record in `outcome()["restarts"]`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import ray

from actors.shutdown import actor_died, terminate
from vgbs_ray.failure_policy import FailureAction, FailureBudget

log = logging.getLogger("vgbs.job")

_POLL_S = 1.0


class ProducerWatch(threading.Thread):
    """See module docstring. `producers`: the job's (actor, run ref) list, in producer-index order; a restart
    replaces an entry (`restart` does)."""

    def __init__(self, scheduler, producers: list, *, restart: Callable[[int], tuple] | None = None,
                 budget: FailureBudget | None = None, timeout_s: float = 60.0,
                 on_restart: Callable[[], None] | None = None):
        super().__init__(name="producer-watch", daemon=True)
        self._scheduler, self._producers, self._timeout_s = scheduler, producers, timeout_s
        self._on_restart = on_restart
        self._restart, self._budget = restart, budget
        self.stopping = threading.Event()
        self.reports: list = []
        self.failed = 0
        self.restarts: list[dict] = []
        self.input_closed = False
        self._began = time.monotonic()

    def run(self) -> None:
        running = {index: ref for index, (_, ref) in enumerate(self._producers)}
        while running:
            index_of = {ref: index for index, ref in running.items()}
            ready, _ = ray.wait(list(index_of), num_returns=1, timeout=_POLL_S)
            if not ready:
                continue
            index = index_of[ready[0]]
            del running[index]
            try:
                self.reports.append(ray.get(ready[0]))
            except Exception as error:  # noqa: BLE001 - a failed producer ends its input; training goes on
                if not actor_died(error):  # its `run` raised (e.g. the scheduler died): a failure, not a death
                    self.failed += 1
                    log.error("producer %d failed: %r", index, error)
                    continue
                self._free_admitted(index)
                if self._restart is None or self._budget is None or self.stopping.is_set():
                    self.failed += 1
                    log.error("producer %d died and is not restarted (the run is ending, or no restarts): %r",
                              index, error)
                    continue
                decision = self._budget.decide_replacement("producer", index, "died")
                if decision.action is FailureAction.STOP:
                    self.failed += 1
                    log.error("%s: %r", decision.reason, error)
                    continue
                started = time.monotonic()
                try:
                    actor, running[index] = self._restart(index)
                except Exception as restart_error:  # noqa: BLE001 - e.g. the scheduler is gone too
                    self.failed += 1
                    log.error("producer %d died; its restart failed: %r", index, restart_error)
                    continue
                if self.stopping.is_set():  # the run ended while it restarted: stop_producers did not see it
                    actor.stop.remote()
                record = {"producer": index, "at_s": round(started - self._began, 2),
                          "restart_s": round(time.monotonic() - started, 2), "cause": type(error).__name__}
                self.restarts.append(record)
                if self._on_restart is not None:
                    self._on_restart()
                log.warning("producer %d died (%s); restarted from the latest checkpoint's cursor in %.1f s", index,
                            record["cause"], record["restart_s"])
        try:
            ray.get(self._scheduler.end_of_input.remote(), timeout=self._timeout_s)
            self.input_closed = True
        except ray.exceptions.RayActorError:
            log.error("end of input not recorded: the scheduler is gone")
        except Exception as error:  # noqa: BLE001 - reported; the driver decides the run's outcome
            log.error("end of input failed: %r", error)

    def _free_admitted(self, index: int) -> None:
        """No step may wait for what the dead producer had in flight (its restart admits it again)."""
        try:
            ray.get(self._scheduler.producer_lost.remote(index), timeout=self._timeout_s)
        except Exception as error:  # noqa: BLE001 - the scheduler is gone too: the job restores it
            log.error("producer %d died; the scheduler did not take it: %r", index, error)

    def outcome(self) -> dict:
        return {"finished": sum(not r.stopped for r in self.reports), "stopped": sum(r.stopped for r in self.reports),
                "failed": self.failed, "abandoned_rollouts": sum(r.abandoned_rollouts for r in self.reports),
                "input_closed": self.input_closed, "restarts": list(self.restarts)}


def stop_producers(producers: list, watch: ProducerWatch | None, timeout_s: float = 60.0) -> None:
    """The end of a run, producers first: no more restarts, ask each to stop (abandoned rollouts end
    incomplete at end of input), then wait for their input to be closed, so none pushes into a dead
    scheduler."""
    if watch is not None:
        watch.stopping.set()
    stops = [actor.stop.remote() for actor, _ in producers]
    if watch is not None:
        watch.join(timeout_s)
        if watch.is_alive():
            log.error("producers did not stop within %.0f s; ending the run anyway", timeout_s)
    ray.wait(stops, num_returns=len(stops), timeout=timeout_s)  # a stop() still running when killed fails
    terminate([actor for actor, _ in producers])  # idle now (their run and stop returned)
