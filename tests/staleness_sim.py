"""A discrete-event model of the closed loop's timing, driving the real staleness rules.

Producers start rollouts in groups (at most `concurrency` in flight); each runs a random time
(a share of them run long); a finished rollout is buffered with its oldest version (the
engine's version when it started). The scheduler forms a step when it can, at most
`max_steps_ahead` steps ahead of the trainer; the trainer trains steps one after another,
publishes version v + 1 after each, and the engine loads it `sync_s` later. When nothing can
happen any more (a group that straddles a step boundary under a tight bound), the scheduler
flushes a partial step, as the real wait policy does.

Rule sets (`rules`):
  full            `StalenessWindow`: admission, last-chance wait, oldest-first fill, stale drops
  admission_only  the window's admission; steps fill in arrival order, never wait; stale drops
  none            producers run flat out; steps fill in arrival order; stale drops

Used by tests/test_staleness.py and benchmarks/bench_staleness.py; no Ray, no clocks.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from vgbs_ray.scheduler.staleness import STALE_REASON, split_stale, staleness
from vgbs_ray.scheduler.staleness_window import StalenessWindow
from vgbs_ray.scheduler.step_choice import StepChoice

RULE_SETS = ("full", "admission_only", "none")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    gbs: int = 16
    group_size: int = 4
    max_staleness: int = 1
    concurrency: int = 32
    """Rollouts in flight at most (engine capacity)."""
    long_fraction: float = 0.2
    short_s: float = 1.0
    long_s: float = 4.0
    train_s: float = 1.0
    sync_s: float = 0.1
    rules: str = "full"
    max_steps_ahead: int = 1
    num_steps: int = 60
    seed: int = 0
    max_events: int = 200_000
    """A model that runs longer than this is livelocked: fail instead of spinning."""


@dataclass
class SimResult:
    started: dict = field(default_factory=dict)
    """rollout id -> True if it runs long."""
    trained: dict = field(default_factory=dict)
    """rollout id -> (step, staleness)."""
    dropped: dict = field(default_factory=dict)
    """rollout id -> reason."""
    buffered_at_end: set = field(default_factory=set)
    in_flight_at_end: int = 0
    trainer_idle_s: float = 0.0
    wall_s: float = 0.0
    trained_versions: list = field(default_factory=list)
    """(step index, version the trainer held when it started the step)."""
    partial_flushes: int = 0

    def stale_drop_rate(self) -> float:
        finished = len(self.trained) + len(self.dropped)
        return len(self.dropped) / finished if finished else 0.0

    def trainer_idle_share(self) -> float:
        return self.trainer_idle_s / self.wall_s if self.wall_s else 0.0

    def long_share(self, ids) -> float:
        ids = list(ids)
        return sum(self.started[r] for r in ids) / len(ids) if ids else 0.0


def _arrival_order_plan(window: StalenessWindow, buffer: dict, allow_partial: bool) -> StepChoice:
    """Steps without the last-chance rule: stale drops, then the first gbs in arrival order."""
    split = split_stale(buffer, trained_version=window.steps_formed, max_staleness=window.max_staleness)
    if not split.fresh or (len(split.fresh) < window.gbs and not allow_partial):
        return StepChoice([], split.stale, 0, len(split.fresh))
    return StepChoice(split.fresh[:window.gbs], split.stale, 0, len(split.fresh))


def simulate(cfg: SimConfig) -> SimResult:
    if cfg.rules not in RULE_SETS:
        raise ValueError(f"rules={cfg.rules!r}: pick one of {RULE_SETS}")
    rng = random.Random(cfg.seed)
    result = SimResult()
    window = StalenessWindow(gbs=cfg.gbs, max_staleness=cfg.max_staleness)
    events: list = []
    sequence = itertools.count()
    now = idle_since = 0.0
    version = engine_version = 0
    in_flight: set = set()
    buffer: dict = {}  # rollout id -> oldest version, in arrival order
    oldest_of: dict = {}
    queue: list = []  # formed steps waiting for the trainer: (step, rollout ids)
    trainer_busy = False
    ids = itertools.count()

    def push(delay, kind, payload=None):
        heapq.heappush(events, (now + delay, next(sequence), kind, payload))

    def try_start():
        while len(in_flight) + cfg.group_size <= cfg.concurrency and window.steps_formed < cfg.num_steps:
            group = [next(ids) for _ in range(cfg.group_size)]
            if cfg.rules != "none" and not window.try_admit(group, engine_version).admit:
                return
            for rid in group:
                is_long = rng.random() < cfg.long_fraction
                result.started[rid] = is_long
                oldest_of[rid] = engine_version
                in_flight.add(rid)
                push((cfg.long_s if is_long else cfg.short_s) * rng.uniform(0.5, 1.5), "finish", rid)

    def form_steps(allow_partial=False):
        while len(queue) < cfg.max_steps_ahead and window.steps_formed < cfg.num_steps:
            if cfg.rules == "full":
                plan = window.next_step(buffer, allow_partial=allow_partial)
            else:
                plan = _arrival_order_plan(window, buffer, allow_partial)
            for rid in plan.stale:
                del buffer[rid]
                result.dropped[rid] = STALE_REASON
            window.discard(plan.stale)
            if not plan.take:
                return
            result.partial_flushes += len(plan.take) < cfg.gbs
            for rid in plan.take:
                del buffer[rid]
            queue.append((window.steps_formed, plan.take))
            window.step_formed(plan.take)
            allow_partial = False

    def start_training():
        nonlocal trainer_busy
        if trainer_busy or not queue:
            return
        result.trainer_idle_s += now - idle_since
        step, taken = queue.pop(0)
        result.trained_versions.append((step, version))
        for rid in taken:
            result.trained[rid] = (step, staleness(version, oldest_of[rid]))
        trainer_busy = True
        push(cfg.train_s * rng.uniform(0.5, 1.5), "trained")

    try_start()
    while version < cfg.num_steps:
        if not events:  # stalled: nothing in flight and no full step; flush a partial one
            form_steps(allow_partial=True)
            start_training()
            if not events:
                break
            continue
        now, count, kind, payload = heapq.heappop(events)
        if count > cfg.max_events:
            raise RuntimeError(f"simulation livelocked after {count} events at version {version}: {cfg}")
        if kind == "finish":
            in_flight.discard(payload)
            window.finished(payload)
            buffer[payload] = oldest_of[payload]
        elif kind == "trained":
            version += 1
            trainer_busy = False
            idle_since = now
            push(cfg.sync_s, "synced", version)
        elif kind == "synced":
            engine_version = max(engine_version, payload)
        form_steps()
        start_training()
        try_start()
    result.buffered_at_end = set(buffer)
    result.in_flight_at_end = len(in_flight)
    result.wall_s = now
    return result
