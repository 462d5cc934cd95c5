"""Reference producers: fully-async agentic actors that push rollouts, and a Ray Data source.

`AgenticProducer` is what a real agent service looks like to the scheduler: it answers
prompts in GRPO groups, each rollout finishing after a random delay, and pushes finished
rollouts through the push API, whole or sibling by sibling (interleaved with other
rollouts). Deferred samples (backpressure) are resubmitted after the scheduler's
`retry_after_s`; nothing is dropped on the producer side. A share of prompts is "uniform"
(every rollout gets the same reward) so the scheduler's dynamic-sampling filter drops them,
and a share of rollouts is malformed so rejection is exercised while training runs.

Resume. Everything sent for a prompt is a pure function of (seed, agent, prompt index)
(`prompt_rollouts`), under rollout ids that name only those (`agent0/prompt3/r1`), never the
run. `cursor()` is the oldest prompt not yet wholly pushed; a producer started from a saved
cursor regenerates exactly the prompts from there on, so every rollout not pushed before the
cursor was taken is pushed again with the same id and samples, and one pushed twice is rejected
by the scheduler by rule (it knows the id), never trained twice.

`stop()` ends a producer early (the run reached its last step): `run` returns after the push in
progress; rollouts not yet pushed are abandoned (counted in the report), and one whose
siblings were partly pushed ends `incomplete` when the driver then calls `end_of_input`. The
actor is threaded (`max_concurrency=4`) so `stop`, `cursor` and `holding` are served while `run` works.

`rollout_dataset` is the other way in: a Ray Data pipeline whose map stage takes an uneven
time per prompt, so rows reach the scheduler in completion order; its prompts are pure
functions of (seed, prompt) too (ids `dataset/prompt{p}/r{k}`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import ray

from vgbs_ray.errors import ConfigError
from vgbs_ray.synthetic import SyntheticRolloutConfig, synthetic_rollout


@dataclass(frozen=True, kw_only=True)
class ProducerConfig:
    num_agents: int = 2
    """Agentic producer actors pushing concurrently."""
    prompts_per_agent: int = 13
    """Prompts (GRPO groups) each agent answers."""
    group_size: int = 2
    """Rollouts per prompt."""
    dataset_prompts: int = 4
    """Prompts whose rollouts arrive through a Ray Data stream instead of pushes (0 = none)."""
    max_delay_s: float = 0.3
    """A rollout finishes after a uniform random delay in [0, max_delay_s] seconds."""
    sibling_push_fraction: float = 0.5
    """Share of multi-sample rollouts pushed one sample per call instead of whole."""
    uniform_group_fraction: float = 0.1
    """Share of prompts whose rollouts all get the same reward (dropped by the dynamic-sampling filter)."""
    bad_rollout_fraction: float = 0.1
    """Share of extra, malformed rollouts (mask of the wrong length) sent to exercise rejection."""
    seed: int = 0
    rollouts: SyntheticRolloutConfig = field(default_factory=SyntheticRolloutConfig)

    def __post_init__(self):
        for name in ("num_agents", "prompts_per_agent", "group_size", "dataset_prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"ProducerConfig.{name} must be an integer >= 0, got {value!r}")
        if self.group_size < 1:
            raise ConfigError(f"ProducerConfig.group_size must be >= 1, got {self.group_size}")
        for name in ("sibling_push_fraction", "uniform_group_fraction", "bad_rollout_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"ProducerConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.max_delay_s < 0:
            raise ConfigError(f"ProducerConfig.max_delay_s must be >= 0, got {self.max_delay_s}")


@dataclass(frozen=True)
class ProducerReport:
    agent: int
    rollouts: int
    samples: int
    calls: int
    deferred_retries: int
    rejected_samples: int
    abandoned_rollouts: int = 0
    """Rollouts not (wholly) pushed because `stop()` came first."""
    stopped: bool = False


def prompt_group(config: ProducerConfig, prompt_key: str, rng: np.random.Generator) -> list[list[dict]]:
    """The group_size rollouts answering one prompt (uniform reward for a share of prompts)."""
    group = [
        synthetic_rollout(config.rollouts, f"{prompt_key}/r{k}", prompt_key, config.group_size, rng)
        for k in range(config.group_size)
    ]
    if rng.random() < config.uniform_group_fraction:
        group = [[dict(row, reward=1.0) for row in rollout] for rollout in group]
    return group


@dataclass(frozen=True)
class PlannedRollout:
    """One rollout of a prompt, with when it finishes and how it is pushed."""

    prompt: int
    samples: list
    finish_s: float
    """Seconds after the producer's start (relative to its first prompt)."""
    split: bool
    """Siblings pushed one per call (interleaved with later rollouts) instead of whole."""


def prompt_rollouts(config: ProducerConfig, agent: int, index: int, first_index: int = 0) -> list[PlannedRollout]:
    """Everything agent `agent` sends for its prompt `index`: the group's rollouts and, for a share of
    prompts, one malformed extra rollout (rejected by mask_length).

    A pure function of (config, agent, index): its own generator, seeded [seed, agent, index], so
    a resumed producer regenerates the same samples under the same rollout ids
    (`agent{a}/prompt{p}/r{k}`; the malformed one `.../bad`). Only `finish_s` depends on
    `first_index` (the prompt the producer started at), to pace a resumed producer like a fresh one.
    """
    rng = np.random.default_rng([config.seed, agent, index])
    key = f"agent{agent}/prompt{index}"
    group = prompt_group(config, key, rng)
    bad = None
    if rng.random() < config.bad_rollout_fraction:
        bad = synthetic_rollout(config.rollouts, f"{key}/bad", f"{key}/bad", 1, rng)
        bad[0]["loss_mask"] = bad[0]["loss_mask"][:-1]  # breaks mask_length
    offset = (index - first_index) * config.max_delay_s / 2
    planned = [
        PlannedRollout(index, rollout, float(rng.uniform(0, config.max_delay_s)) + offset,
                       len(rollout) > 1 and bool(rng.random() < config.sibling_push_fraction))
        for rollout in group
    ]
    if bad is not None:
        planned.append(PlannedRollout(index, bad, float(rng.uniform(0, config.max_delay_s)) + offset, False))
    return planned


class AgenticProducer:
    """One agent: answers prompts, pushes each rollout as it finishes (see module docstring).

    `cursor` (a `cursor()` dict from an earlier run) makes it start at that prompt: it regenerates
    exactly the prompts not fully pushed then, under the same rollout ids.
    """

    def __init__(self, agent: int, config: ProducerConfig, scheduler, cursor: dict | None = None):
        self._agent = agent
        self._config = config
        self._scheduler = scheduler
        start = 0
        if cursor is not None:
            if int(cursor["seed"]) != config.seed:
                raise ConfigError(f"producer {agent}: the checkpoint's cursor has seed {cursor['seed']} but "
                                  f"producers.seed={config.seed}; resume with the seed the run started with")
            start = int(cursor["next_index"])
        self._start = start
        self._lock = threading.Lock()  # run() updates, cursor() reads from another thread
        self._unpushed: dict[int, int] = {}  # prompt index -> its rollouts not yet wholly pushed
        self._next_unplanned = start
        self._stop = threading.Event()
        self._hold_armed = threading.Event()
        self._holding: list = []  # ids of the partly pushed rollouts while held

    def stop(self) -> None:
        """Ask `run` to return after the push in progress (see module docstring)."""
        self._stop.set()

    def cursor(self) -> dict:
        """{"seed", "next_index"}: the oldest prompt not yet wholly pushed (accepted or rejected), or
        prompts_per_agent when all were. A producer made with this cursor pushes every rollout not
        pushed when it was taken; one pushed since is pushed again and rejected by the scheduler as
        a duplicate (already_scheduled / already_complete / duplicate_sample), never trained twice.
        Monotone: it never moves back."""
        with self._lock:
            pending = [p for p, left in self._unpushed.items() if left > 0]
            index = min(pending) if pending else self._next_unplanned
        return {"seed": self._config.seed, "next_index": index}

    def hold_at_next_partial_push(self) -> None:
        """Fault injection (tests): after the next push that sends only some siblings of a rollout, stop
        pushing and wait (until `stop()` or the actor is killed); `holding()` then names that rollout."""
        self._hold_armed.set()

    def holding(self) -> list:
        """The ids of the partly pushed rollouts while held at a partial push (else [])."""
        with self._lock:
            return list(self._holding)

    def run(self) -> ProducerReport:
        """Push every rollout of this agent's prompts from the start cursor on; returns when all were
        accepted or rejected, or soon after `stop()`."""
        config = self._config
        finished: list[PlannedRollout] = []
        with self._lock:
            for p in range(self._start, config.prompts_per_agent):
                planned = prompt_rollouts(config, self._agent, p, first_index=self._start)
                self._unpushed[p] = len(planned)
                finished += planned
            self._next_unplanned = config.prompts_per_agent
        finished.sort(key=lambda item: item.finish_s)

        counts = dict(rollouts=0, samples=0, calls=0, deferred_retries=0, rejected_samples=0)
        start = time.monotonic()
        pending_siblings: list[dict] = []
        pending_rollouts: list[PlannedRollout] = []
        for index, planned in enumerate(finished):
            if self._stop.wait(max(0.0, planned.finish_s - (time.monotonic() - start))):
                return self._report(counts, abandoned=len(finished) - index + len(pending_rollouts))
            rollout = planned.samples
            counts["rollouts"] += 1
            counts["samples"] += len(rollout)
            if planned.split:
                # Siblings go out one per call, interleaved with the next rollouts' pushes.
                self._push([rollout[0]], counts, ())
                pending_siblings.extend(rollout[1:])
                pending_rollouts.append(planned)
                self._maybe_hold(pending_rollouts)
                continue
            self._push(rollout + pending_siblings, counts, [planned, *pending_rollouts])
            pending_siblings, pending_rollouts = [], []
        if pending_siblings and not self._push(pending_siblings, counts, pending_rollouts):
            return self._report(counts, abandoned=len(pending_rollouts))
        return self._report(counts, abandoned=0)

    def _maybe_hold(self, partly_pushed: list[PlannedRollout]) -> None:
        if not self._hold_armed.is_set() or self._stop.is_set():
            return
        with self._lock:
            self._holding = [p.samples[0]["rollout_id"] for p in partly_pushed]
        self._stop.wait()  # until stop() or ray.kill

    def _report(self, counts: dict, abandoned: int) -> ProducerReport:
        return ProducerReport(agent=self._agent, abandoned_rollouts=abandoned, stopped=self._stop.is_set(), **counts)

    def _push(self, samples: list[dict], counts: dict, completes) -> bool:
        """Submit until nothing is deferred; then every rollout in `completes` is wholly pushed (the
        cursor may pass its prompt). Returns False if `stop()` came first."""
        while samples and not self._stop.is_set():
            result = ray.get(self._scheduler.submit.remote(samples), timeout=60)
            counts["calls"] += 1
            counts["rejected_samples"] += len(result.rejected)
            if not result.deferred:
                with self._lock:
                    for planned in completes:
                        self._unpushed[planned.prompt] -= 1
                return True
            counts["deferred_retries"] += 1
            samples = [samples[i] for i in result.deferred]
            self._stop.wait(result.retry_after_s or 0.05)
        return not samples


PRODUCER_NAME = "vgbs-producer-{}"
"""Actor name of producer i (one job per cluster namespace; a resumed job reuses the names)."""


def start_producers(config: ProducerConfig, scheduler, cursors: list[dict | None] | None = None) -> list[tuple]:
    """Start `num_agents` producer actors (num_cpus=0) and their `run`; returns (actor, run ref) pairs.

    `cursors[i]` (from a checkpoint; None = from the first prompt) is where producer i starts."""
    # Threaded: stop(), cursor() and holding() are served while run() works.
    remote = ray.remote(num_cpus=0, max_concurrency=4)(AgenticProducer)
    cursors = list(cursors or [])
    cursors += [None] * (config.num_agents - len(cursors))
    actors = [
        remote.options(name=PRODUCER_NAME.format(i)).remote(i, config, scheduler, cursors[i])
        for i in range(config.num_agents)
    ]
    # The refs keep the actors alive only while the caller holds them; keep both together.
    return [(actor, actor.run.remote()) for actor in actors]


def dataset_rollout_ids(config: ProducerConfig, prompt: int) -> list[str]:
    """The rollout ids the Ray Data source sends for dataset prompt `prompt` (stable across runs)."""
    return [f"dataset/prompt{prompt}/r{k}" for k in range(config.group_size)]


def rollout_dataset(config: ProducerConfig, prompts: Sequence[int] | None = None):
    """A Ray Data stream of sample rows: one prompt per map task, uneven durations.

    `prompts`: the dataset prompt indices to answer (default: all `dataset_prompts`); a resumed job
    passes the ones whose rollouts the restored scheduler does not know yet. Each prompt's rows
    are a pure function of (seed, prompt): the same rollout ids and samples in every run.
    """
    import ray.data

    if prompts is None:
        prompts = range(config.dataset_prompts)
    items = [{"prompt": int(p)} for p in prompts]

    def answer(batch: dict) -> dict:
        columns: dict[str, list] = {}
        for p in batch["prompt"]:
            rng = np.random.default_rng([config.seed, 10_000 + int(p)])
            time.sleep(float(rng.uniform(0, 2 * config.max_delay_s)))
            for rollout in prompt_group(config, f"dataset/prompt{int(p)}", rng):
                for row in rollout:
                    for key, value in row.items():
                        columns.setdefault(key, []).append(value)
        return columns

    return ray.data.from_items(items).map_batches(answer, batch_size=1, num_cpus=0.25)
