"""The engines' watch: a driver thread that finds a dead or hung rollout engine and has it replaced.

    watch = EngineWatch(loop, budget=FailureBudget(max_failures=2), hang_timeout_s=300)
    watch.start()
    ...
    watch.failure        # None, or why the engines could not be kept (the step loop raises it)
    watch.replacements   # one record per replacement, for the summary
    watch.stop()

Every `poll_s` each engine is asked `health()` (seconds its engine thread has spent on the current
batch or load). `verdict` decides, pure: a call that failed because the actor is gone is a death;
no answer for `hang_timeout_s`, or an answer that says one batch has run that long, is a hang. A
dead or hung engine is replaced by `loop.replace_engine(index)` (a new actor on its bundle,
loaded with the current policy version before it serves; jobs/closed_loop.py) while the run's
`FailureBudget` allows (run.max_failures times per engine over the run). Its requests in flight
went to the other engines already (actors/rollout_engine.py, `EngineClient`); with none left,
producers wait for the replacement.

Past the budget, or when a replacement does not start, `failure` says which engine died and why;
the job stops with it instead of ending early on what was buffered.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Literal

import ray

from actors.shutdown import actor_died
from vgbs_ray.failure_policy import FailureAction, FailureBudget

log = logging.getLogger("vgbs.job")

Verdict = Literal["healthy", "waiting", "dead", "hung"]


def verdict(*, answered: bool, died: bool, busy_for_s: float, waited_s: float, hang_timeout_s: float) -> Verdict:
    """One engine's state from its latest health call (see module docstring). Pure.

    answered: the call finished (with an answer or an error); died: it failed because the actor is gone;
    busy_for_s: the answer (seconds on the current batch); waited_s: since the call was made."""
    if answered:
        if died:
            return "dead"
        return "hung" if busy_for_s > hang_timeout_s else "healthy"
    return "hung" if waited_s > hang_timeout_s else "waiting"


class EngineWatch(threading.Thread):
    """See module docstring. `loop`: the job's ClosedLoop (its `engines` pool and `replace_engine`)."""

    def __init__(self, loop, *, budget: FailureBudget, hang_timeout_s: float, poll_s: float = 1.0,
                 on_replace=None):
        super().__init__(name="engine-watch", daemon=True)
        self._loop, self._budget, self._on_replace = loop, budget, on_replace
        self._hang_timeout_s, self._poll_s = hang_timeout_s, poll_s
        self._stopping = threading.Event()
        self.failure: str | None = None
        self.replacements: list[dict] = []
        self._began = time.monotonic()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(timeout_s)

    def run(self) -> None:
        pool = self._loop.engines
        calls: list = [None] * len(pool.engines)  # (health ref, engine handle, when sent)
        while not self._stopping.wait(self._poll_s):
            for index, engine in enumerate(pool.engines):
                if calls[index] is None or calls[index][1] is not engine:
                    calls[index] = (engine.health.remote(), engine, time.monotonic())
                    continue
                state = self._state(*calls[index])
                if state == "waiting":
                    continue
                calls[index] = None
                if state == "healthy":
                    continue
                if self._stopping.is_set():
                    return
                decision = self._budget.decide_replacement("engine", index, "died" if state == "dead" else "hung")
                if decision.action is FailureAction.STOP:
                    self.failure = f"rollout engine {pool.names[index]}: {decision.reason}"
                    log.error("%s", self.failure)
                    return
                if not self._replace(index, state):
                    return

    def _state(self, ref, engine, sent: float) -> Verdict:
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return verdict(answered=False, died=False, busy_for_s=0.0, waited_s=time.monotonic() - sent,
                           hang_timeout_s=self._hang_timeout_s)
        try:
            busy_for_s, died = ray.get(ref), False
        except Exception as error:  # noqa: BLE001 - the verdict tells a death from a failed call
            busy_for_s, died = 0.0, actor_died(error)
            if not died:
                log.warning("engine health call failed: %r", error)
        return verdict(answered=True, died=died, busy_for_s=busy_for_s, waited_s=time.monotonic() - sent,
                       hang_timeout_s=self._hang_timeout_s)

    def _replace(self, index: int, state: Verdict) -> bool:
        name = self._loop.engines.names[index]
        detected = time.monotonic()
        log.warning("rollout engine %s %s; replacing it on its bundle", name, "died" if state == "dead" else "hung")
        try:
            version = self._loop.replace_engine(index)
        except Exception as error:  # noqa: BLE001 - the job stops with it
            self.failure = f"rollout engine {name} {state}; its replacement did not start: {error!r}"
            log.error("%s", self.failure)
            return False
        record = {"engine": name, "cause": state, "at_s": round(detected - self._began, 2),
                  "replace_s": round(time.monotonic() - detected, 2), "serves_from_version": version}
        self.replacements.append(record)
        if self._on_replace is not None:
            self._on_replace("engine")
        print(f"replaced rollout engine {name} ({state}) in {record['replace_s']:.1f} s; it serves from policy "
              f"version {version}", flush=True)
        return True
