"""CPython's cyclic garbage collector, tuned where it costs: the SchedulerActor's own worker process, and the
start of a rollout engine or a train rank.

The scheduler holds many long-lived small containers (buffered samples, ledger entries); under
the default thresholds (700, 10, 10) the collector runs every few pushes and its older
generations rescan them all. Nothing there creates reference cycles in bulk, so collecting less
often only delays freeing a few. Measured with benchmarks/bench_scheduler.py on 2 cores: the push
path went from 0.48 to 0.59 of a no-op actor's rate. The setting is process-wide, so it is
applied only inside the actor's process (a Ray worker that actor owns), never in a driver.

A rollout engine's start imports vLLM: a few million objects that live as long as the process, and few cycles.
The collector's passes over them are a share of the import, and vLLM's own `gc.collect` calls while it builds
its engine walk them all again. So the engine imports vLLM with the collector paused and then freezes what the
import made (`collector_paused(freeze=True)`). Measured with benchmarks/bench_engine_start.py (docs/benchmarks.md).
The engine start is the critical path of every job's start and of every engine replacement. A train rank
imports Megatron the same way (its import 4.5-5.7 s instead of 6.5-7.6 s in three runs each, 2 cores).
"""

from __future__ import annotations

import atexit
import contextlib
import gc

GC_THRESHOLDS = (50_000, 20, 100)


def relax_gc_in_this_process() -> None:
    """Collect garbage less often in this process (call it only in a process of its own)."""
    gc.set_threshold(*GC_THRESHOLDS)


@contextlib.contextmanager
def collector_paused(*, freeze: bool = False):
    """No automatic collection inside the block; the collector's previous state (on or off) after it, also on an
    error. With `freeze`, what exists when the block ends normally moves to the collector's permanent generation
    (`gc.freeze`), so later collections skip it: for objects that live as long as the process (imported modules),
    as vLLM itself does once its engine is built. For a start-up that allocates much and frees little (the module
    docstring); never around a loop."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            gc.freeze()
            # At exit the interpreter's last collections must see them again: extension modules (triton's
            # nanobind) report what is still alive then as leaked.
            atexit.register(gc.unfreeze)
    finally:
        if was_enabled:
            gc.enable()
