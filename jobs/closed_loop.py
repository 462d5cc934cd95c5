"""The job's closed loop: rollout engines on the policy's weights, env producers sampling them, weight sync.

    loop = ClosedLoop.start(config, scheduler, group, policy_version=0, first_step=0, cursors=None)
    loop.producers                     # (actor, run ref) pairs, like the synthetic producers'
    sync_s = loop.publish(group, v)    # after the v-th optimizer step: export once, engines load async
    loop.restore(group, k)             # after a recovery restored step k's weights: engines go back to v = k
    loop.drain_sampled_reward()        # mean reward of the rollouts pushed since the last call
    loop.shutdown()                    # after the producers stopped

Start-up: the train group's initial weights (or the restored ones) are exported once as a
Hugging Face Llama directory under `<output_dir>/policy_init` (what vLLM loads), the engines
start from it at `policy_version`, then `num_producers` EnvProducers start, one of them also
reading `dataset_prompts` prompt rows from a Ray Data dataset. Producers resume at their saved
cursors; the dataset does not: a (re)started run reads a fresh dataset stream (its seed mixes in
the step the run starts at), so dataset prompts unanswered when a run stopped are not sent again.

`publish(group, v)` is the per-step weight sync: `publish_weights` (the train group's gather
and one copy into the object store; this is the time the trainer spends) and
`RolloutEnginePool.update_weights` (returns at once: the engines load between batches while the
trainer goes on). Engine load times are collected when they have finished, never waited for.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import ray

from actors.env_producer import EnvProducerConfig, start_env_producer
from actors.hf_checkpoint import write_hf_checkpoint
from actors.rollout_engine import RolloutEnginePool
from actors.weight_sync import publish_weights
from vgbs_ray.envs.digits import prompt_rows

log = logging.getLogger("vgbs.job")

DATASET_STREAM = 99
"""Producer-stream offset of the dataset's prompts (producer i's generator uses offset i)."""


def stream_seed(seed: int, stream: int, first_step: int = 0) -> int:
    """The prompt-stream seed of producer `stream` (or DATASET_STREAM): distinct per producer, and a
    fresh stream after a resume from step `first_step` unless a saved cursor says where to continue."""
    return (seed * 1_000_000_000 + first_step) * 1_000 + stream


@dataclass
class ClosedLoop:
    """The running closed loop of one job (see module docstring)."""

    engines: RolloutEnginePool
    producers: list = field(default_factory=list)
    """(actor, run ref) pairs."""
    loads: list = field(default_factory=list)
    """Engine loads not yet seen finished: (policy version, refs)."""
    load_times_s: list = field(default_factory=list)
    """Finished engine loads: (policy version, slowest engine's load time)."""
    restored_versions: list = field(default_factory=list)
    """Versions published again after a recovery restored the train group (`restore`)."""

    @classmethod
    def start(cls, config, scheduler, group, *, policy_version: int, first_step: int = 0,
              cursors: list[dict | None] | None = None) -> "ClosedLoop":
        """Engines from `group`'s current weights at `policy_version`, then the producers.

        `config` is the JobConfig; `cursors[i]`, when given, is producer i's saved `cursor()`.
        """
        loop_config = config.closed_loop
        published = publish_weights(group, policy_version)
        model_dir = os.path.join(config.run.output_dir, "policy_init")
        weights = ray.get(published.ref)
        import torch

        write_hf_checkpoint(model_dir, config.train.model,
                            {name: torch.from_numpy(np.array(array)) for name, array in weights.items()})
        loop = cls(engines=RolloutEnginePool(loop_config.engines, model_dir, policy_version=policy_version))
        try:
            client = loop.engines.client()
            producer_config = EnvProducerConfig(
                task=loop_config.task, group_size=loop_config.group_size, groups_in_flight=loop_config.groups_in_flight,
                sampling=loop_config.sampling, one_sample_per_turn=loop_config.one_sample_per_turn)
            for index in range(loop_config.num_producers):
                dataset = None
                if index == 0 and loop_config.dataset_prompts:
                    from ray import data as ray_data

                    rows = prompt_rows(loop_config.task, stream_seed(loop_config.seed, DATASET_STREAM, first_step),
                                       0, loop_config.dataset_prompts)
                    dataset = ray_data.from_items(rows)
                cursor = cursors[index] if cursors and index < len(cursors) else None
                loop.producers.append(start_env_producer(
                    index, producer_config, scheduler, client, cursor=cursor, dataset=dataset,
                    seed=stream_seed(loop_config.seed, index, first_step)))
        except BaseException:
            loop.shutdown()
            raise
        return loop

    def publish(self, group, policy_version: int) -> float:
        """Weight sync after a step (or a restore): returns the trainer-side seconds (export + store)."""
        started = time.perf_counter()
        published = publish_weights(group, policy_version)
        self.loads.append((policy_version, self.engines.update_weights(published)))
        self._collect_loads()
        return time.perf_counter() - started

    def restore(self, group, policy_version: int) -> float:
        """After a recovery: the engines go back to the restored weights (version = the restored step)."""
        self.restored_versions.append(policy_version)
        return self.publish(group, policy_version)

    def _collect_loads(self) -> None:
        """Record the engine loads that finished; never waits."""
        pending = []
        for version, refs in self.loads:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) < len(refs):
                pending.append((version, refs))
                continue
            try:
                loads = ray.get(refs, timeout=10)
                self.load_times_s.append((version, max(load.load_time_s for load in loads)))
            except Exception as error:  # noqa: BLE001 - a failed load shows in the next generate as an engine error
                log.error("engine load of policy version %d failed: %r", version, error)
        self.loads = pending

    def drain_sampled_reward(self) -> float | None:
        """Mean reward of every rollout the producers pushed since the previous call (filtered groups
        included: the sampling policy's own reward), or None when none was pushed."""
        pairs = ray.get([actor.drain_rewards.remote() for actor, _ in self.producers], timeout=60)
        count = sum(c for _, c in pairs)
        return sum(s for s, _ in pairs) / count if count else None

    def engine_idle_share(self) -> float:
        """Share of the engines' time since start spent with nothing to do (spare sampling capacity)."""
        usage = self.engines.utilization()
        total = sum(u.busy_s + u.idle_s for u in usage)
        return sum(u.idle_s for u in usage) / total if total > 0 else 0.0

    def shutdown(self) -> None:
        for actor, _ in self.producers:
            ray.kill(actor)
        self.producers = []
        self.engines.shutdown()
