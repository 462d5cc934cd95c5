"""Actor life and death: ending actors gracefully (a finished run shows no failed task), telling a dead
actor from a failed call, starting one under a dead one's name.

    terminate(actors, timeout_s=10)
    actor_died(error)                       # the actor is gone (not: its method raised)
    live_results(refs, timeout_s=60)        # the answers of the calls whose actors are alive
    actor = start_named(lambda: ActorClass.options(name="x").remote(), timeout_s=30)

`ray.kill` ends a worker at once: the events of the tasks it finished in its last second are not
yet reported (workers report task events about once a second), and the dashboard then shows
those tasks as FAILED (`WORKER_DIED`) although they returned. `terminate` asks each actor to exit
after the calls queued before it (`__ray_terminate__`: the worker exits as intended and reports
what it ran), waits up to `timeout_s` for every one to be gone, then kills each (a no-op for one that
exited, but it frees a named actor's name at once).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import ray

_EXITED = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError)


def actor_died(error: BaseException) -> bool:
    """Whether a failed call means its actor is gone (killed, OOM, node lost), not that the call raised inside
    it (Ray makes that RayTaskError an instance of its cause's class too)."""
    return isinstance(error, ray.exceptions.RayActorError) and not isinstance(error, ray.exceptions.RayTaskError)


def live_results(refs: Sequence, timeout_s: float) -> list:
    """The results of `refs` (one call each to different actors) that came back within `timeout_s`, in order;
    a call whose actor died, or that did not answer in time, is left out."""
    ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    results = []
    for ref in refs:
        try:
            results.append(ray.get(ref, timeout=0))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue
    return results


def start_named(start: Callable, timeout_s: float = 30.0):
    """`start()` (which creates a named actor), again while the name is still a dead actor's (Ray frees it
    a moment after the death is known; kill the dead handle first to make that moment short)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return start()
        except ValueError:  # ActorAlreadyExistsError: the name is still taken
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def terminate(actors: Sequence, timeout_s: float = 10.0) -> None:
    """End `actors` (handles; dead ones are skipped) as the module docstring says."""
    exits = []
    for actor in actors:
        try:
            exits.append((actor, actor.__ray_terminate__.remote()))
        except _EXITED:
            pass
    deadline = time.monotonic() + timeout_s
    for actor, exit_ref in exits:
        try:
            ray.get(exit_ref, timeout=max(deadline - time.monotonic(), 0.01))
        except (*_EXITED, ray.exceptions.GetTimeoutError):
            pass  # it exited (the call's answer is the actor's end), or it is stuck
        # Exited or not: the kill frees the actor's name now (after a graceful exit alone it stays taken a
        # while, and a next run reusing the name fails), and ends one that is stuck.
        ray.kill(actor, no_restart=True)
