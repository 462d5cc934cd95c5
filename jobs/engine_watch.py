"""The engines' watch: finds a dead or hung rollout engine, as an event for the job's controller.

    watch = EngineWatch(loop.engines, hang_timeout_s=300)
    for event in watch.poll():       # never waits: ActorDied("engine", i, "dead" | "hung")
        controller.handle(event)     # decides (vgbs_ray/failure_policy.py), replaces it, records it

At most every `poll_s` each engine is asked `health()` (seconds its engine thread has spent on the
current batch or load). `verdict` decides, pure: a call that failed because the actor is gone is a
death; no answer for `hang_timeout_s`, or an answer that says one batch has run that long, is a hang.
The watch only observes: the controller replaces the engine (`RolloutSource.replace_engine`: a new actor on
its bundle, loaded with the current policy version before it serves) while the run's failure budget
allows, and stops the run past it. Requests in flight on a dead engine went to the other engines already
(actors/rollout_engine.py, `EngineClient`); with none left, producers wait for the replacement.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import ray

from actors.shutdown import actor_died
from vgbs_ray.failure_policy import ActorDied

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


class EngineWatch:
    """See module docstring. `pool`: the job's RolloutEnginePool (a replacement shows as a new handle)."""

    def __init__(self, pool, *, hang_timeout_s: float, poll_s: float = 1.0):
        self._pool, self._hang_timeout_s, self._poll_s = pool, hang_timeout_s, poll_s
        self._calls: list = [None] * len(pool.engines)  # (health ref, engine handle, when sent)
        self._polled = 0.0
        self.replacements: list[dict] = []
        """One record per replacement (the controller's), for the summary."""
        self.began = time.monotonic()

    def poll(self) -> list[ActorDied]:
        """Engines found dead or hung since the last call (see module docstring); never waits."""
        now = time.monotonic()
        if now - self._polled < self._poll_s:
            return []
        self._polled = now
        events = []
        for index, engine in enumerate(self._pool.engines):
            call = self._calls[index]
            if call is None or call[1] is not engine:  # none yet, or the engine was replaced
                self._calls[index] = (engine.health.remote(), engine, now)
                continue
            state = self._state(*call)
            if state == "waiting":
                continue
            self._calls[index] = None
            if state != "healthy":
                log.warning("rollout engine %s %s", self._pool.names[index], state)
                events.append(ActorDied("engine", index, state))
        return events

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
