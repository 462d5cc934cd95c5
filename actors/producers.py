"""Reference producers: fully-async agentic actors that push rollouts, and a Ray Data source.

`AgenticProducer` is what a real agent service looks like to the scheduler: it answers
prompts in GRPO groups, each rollout finishing after a random delay, and pushes finished
rollouts through the push API, whole or sibling by sibling (interleaved with other
rollouts). Deferred samples (backpressure) are resubmitted after the scheduler's
`retry_after_s`; nothing is dropped on the producer side. A share of prompts is "uniform"
(every rollout gets the same reward) so the scheduler's dynamic-sampling filter drops them,
and a share of rollouts is malformed so rejection is exercised while training runs.

`stop()` ends a producer early (the run reached its last step): `run` returns after the push in
progress; rollouts not yet pushed are abandoned (counted in the report), and one whose
siblings were partly pushed ends `incomplete` when the driver then calls `end_of_input`. The
actor is threaded (two calls at once) so `stop` is served while `run` works.

`rollout_dataset` is the other way in: a Ray Data pipeline whose map stage takes an uneven
time per prompt, so rows reach the scheduler in completion order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

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


class AgenticProducer:
    """One agent: answers prompts, pushes each rollout as it finishes (see module docstring)."""

    def __init__(self, agent: int, config: ProducerConfig, scheduler, run_tag: str = "run0"):
        self._agent = agent
        self._config = config
        self._scheduler = scheduler
        self._tag = run_tag
        self._rng = np.random.default_rng([config.seed, agent])
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ask `run` to return after the push in progress (see module docstring)."""
        self._stop.set()

    def run(self) -> ProducerReport:
        """Push every rollout of this agent's prompts; returns when all were accepted or rejected,
        or soon after `stop()`."""
        config, rng = self._config, self._rng
        finished: list[tuple[float, list[dict]]] = []
        for p in range(config.prompts_per_agent):
            key = f"{self._tag}/agent{self._agent}/prompt{p}"
            for rollout in prompt_group(config, key, rng):
                finished.append((float(rng.uniform(0, config.max_delay_s)) + p * config.max_delay_s / 2, rollout))
            if rng.random() < config.bad_rollout_fraction:
                bad = synthetic_rollout(config.rollouts, f"{key}/bad", f"{key}/bad", 1, rng)
                bad[0]["loss_mask"] = bad[0]["loss_mask"][:-1]  # breaks mask_length
                finished.append((float(rng.uniform(0, config.max_delay_s)), bad))
        finished.sort(key=lambda item: item[0])

        counts = dict(rollouts=0, samples=0, calls=0, deferred_retries=0, rejected_samples=0)
        start = time.monotonic()
        pending_siblings: list[dict] = []
        for index, (finish_s, rollout) in enumerate(finished):
            if self._stop.wait(max(0.0, finish_s - (time.monotonic() - start))):
                return self._report(counts, abandoned=len(finished) - index + bool(pending_siblings))
            counts["rollouts"] += 1
            counts["samples"] += len(rollout)
            if len(rollout) > 1 and rng.random() < config.sibling_push_fraction:
                # Siblings go out one per call, interleaved with the next rollouts' pushes.
                self._push([rollout[0]], counts)
                pending_siblings.extend(rollout[1:])
                continue
            self._push(rollout + pending_siblings, counts)
            pending_siblings = []
        if pending_siblings:
            self._push(pending_siblings, counts)
        return self._report(counts, abandoned=0)

    def _report(self, counts: dict, abandoned: int) -> ProducerReport:
        return ProducerReport(agent=self._agent, abandoned_rollouts=abandoned, stopped=self._stop.is_set(), **counts)

    def _push(self, samples: list[dict], counts: dict) -> None:
        while samples and not self._stop.is_set():
            result = ray.get(self._scheduler.submit.remote(samples), timeout=60)
            counts["calls"] += 1
            counts["rejected_samples"] += len(result.rejected)
            if not result.deferred:
                return
            counts["deferred_retries"] += 1
            samples = [samples[i] for i in result.deferred]
            self._stop.wait(result.retry_after_s or 0.05)


def start_producers(config: ProducerConfig, scheduler, run_tag: str = "run0") -> list[ray.ObjectRef]:
    """Start `num_agents` producer actors (num_cpus=0) and their `run`; returns (actor, run ref) pairs."""
    remote = ray.remote(num_cpus=0, max_concurrency=2)(AgenticProducer)  # stop() while run() works
    actors = [
        remote.options(name=f"vgbs-producer-{run_tag}-{i}").remote(i, config, scheduler, run_tag)
        for i in range(config.num_agents)
    ]
    # The refs keep the actors alive only while the caller holds them; keep both together.
    return [(actor, actor.run.remote()) for actor in actors]


def rollout_dataset(config: ProducerConfig, run_tag: str = "run0"):
    """A Ray Data stream of sample rows: one prompt per map task, uneven durations."""
    import ray.data

    prompts = [{"prompt": p} for p in range(config.dataset_prompts)]

    def answer(batch: dict) -> dict:
        columns: dict[str, list] = {}
        for p in batch["prompt"]:
            rng = np.random.default_rng([config.seed, 10_000 + int(p)])
            time.sleep(float(rng.uniform(0, 2 * config.max_delay_s)))
            for rollout in prompt_group(config, f"{run_tag}/dataset/prompt{int(p)}", rng):
                for row in rollout:
                    for key, value in row.items():
                        columns.setdefault(key, []).append(value)
        return columns

    return ray.data.from_items(prompts).map_batches(answer, batch_size=1, num_cpus=0.25)
