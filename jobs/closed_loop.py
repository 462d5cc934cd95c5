"""The job's rollout source: agent producers, and the rollout engines they sample with their weight sync.

    loop = ClosedLoop.start(config, scheduler, group, policy_version=0, cursors=None)
    loop.producers                     # (actor, run ref) pairs
    sync_s = loop.publish(group, v)    # after the v-th optimizer step: export once, engines load async
    loop.restore(group, k)             # after a recovery restored step k's weights: engines go back to v = k
    loop.drain_sampled_reward()        # mean reward of the rollouts pushed since the last call
    loop.shutdown()                    # after the producers stopped

Every job has this one rollout source; `closed_loop.enabled=false` only leaves the engines out
(`engines` is None, `publish` and `restore` do nothing): its agent makes its samples itself, like
the synthetic preset's (examples/synthetic_agent.py).

Start-up: the train group's initial weights (or the restored ones) are exported once as a
Hugging Face Llama directory under `<output_dir>/policy_init` (what vLLM loads), with the job's
tokenizer files beside them (`closed_loop.tokenizer_dir`), the engines start from it at
`policy_version`, then `num_producers` AgentProducers start on the job's prompt source: the
rows of `closed_loop.dataset` (read once here with Ray Data, shared through the object store)
or the generator `closed_loop.prompts` (`closed_loop.num_prompts` of them). Producer i answers positions i, i + n, ... and resumes
at its saved cursor, so dataset rows are answered exactly once across a resume too.

`publish(group, v)` is the per-step weight sync: `publish_weights` (the train group's gather
and one copy into the object store; this is the time the trainer spends) and
`RolloutEnginePool.update_weights` (returns at once: the engines load between batches while the
trainer goes on). Engine load times are collected when they have finished, never waited for.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field

import numpy as np
import ray

from actors.agent_producer import PRODUCER_NAME, AgentProducerConfig, PromptSpec, start_agent_producer
from actors.hf_checkpoint import write_hf_checkpoint
from actors.rollout_engine import RolloutEnginePool
from actors.shutdown import terminate
from actors.weight_sync import WeightSyncConfig, open_weight_channel, publish_weights, send_weights

log = logging.getLogger("vgbs.job")


def read_dataset_rows(dataset) -> list[dict]:
    """Every row of the `closed_loop.dataset` file(s), in file order (Ray Data, order preserved)."""
    from ray import data as ray_data

    read = ray_data.read_parquet if dataset.resolved_format == "parquet" else ray_data.read_json
    context = ray_data.DataContext.get_current()
    context.execution_options.preserve_order = True
    return [dict(row) for row in read(dataset.path).iter_rows()]


def endpoint_token(output_dir: str) -> str:
    """A new token for this run's agent endpoint, also written to <output_dir>/endpoint_token (mode 600) for
    agents started outside the job."""
    token = secrets.token_hex(32)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "endpoint_token")
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # a file left by an earlier run keeps its mode otherwise
    with os.fdopen(descriptor, "w") as file:
        file.write(token)
    return token


def prompt_spec(config) -> PromptSpec:
    """Where the producers' prompts come from (see module docstring)."""
    loop = config.closed_loop
    if loop.dataset is not None:
        rows = read_dataset_rows(loop.dataset)
        return PromptSpec(rows=ray.put(rows), epochs=loop.dataset.epochs, shuffle_seed=loop.dataset.shuffle_seed,
                          keys=loop.dataset.keys, num_prompts=loop.num_prompts)
    return PromptSpec(generator=loop.prompts, generator_kwargs=dict(loop.prompts_kwargs), seed=loop.seed,
                      num_prompts=loop.num_prompts)


def start_model_dir(config, group, policy_version: int) -> str:
    """The train group's current weights as the Hugging Face directory the engines start from
    (`<output_dir>/policy_init`, with the job's tokenizer files)."""
    published = publish_weights(group, policy_version)
    model_dir = os.path.abspath(os.path.join(config.run.output_dir, "policy_init"))
    weights = ray.get(published.ref)
    import torch

    write_hf_checkpoint(model_dir, config.train.model,
                        {name: torch.from_numpy(np.array(array)) for name, array in weights.items()},
                        tokenizer_dir=config.closed_loop.tokenizer_dir)
    return model_dir


@dataclass
class ClosedLoop:
    """The running rollout source of one job (see module docstring)."""

    engines: RolloutEnginePool | None
    """None when closed_loop.enabled=false."""
    producers: list = field(default_factory=list)
    """(actor, run ref) pairs."""
    loads: list = field(default_factory=list)
    """Engine loads not yet seen finished: (policy version, refs)."""
    load_times_s: list = field(default_factory=list)
    """Finished engine loads: (policy version, slowest engine's load time)."""
    restored_versions: list = field(default_factory=list)
    """Versions published again after a recovery restored the train group (`restore`)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    channel_group: object = None
    """The train group the engines' weight channel connects to (transport=collective)."""
    producer_args: tuple = ()
    """(AgentProducerConfig, scheduler, engine client, PromptSpec): what every producer starts with (set by `start`)."""

    @classmethod
    def start(cls, config, scheduler, group, *, policy_version: int,
              cursors: list[dict | None] | None = None) -> "ClosedLoop":
        """Engines from `group`'s current weights at `policy_version` (closed_loop.enabled), then the producers.

        `config` is the JobConfig; `cursors[i]`, when given, is producer i's saved `cursor()`.
        """
        loop_config = config.closed_loop
        prompts = prompt_spec(config)  # a dataset that cannot be read fails before any engine starts
        tokenizer_dir = os.path.abspath(loop_config.tokenizer_dir) if loop_config.tokenizer_dir is not None else None
        if loop_config.enabled:
            model_dir = start_model_dir(config, group, policy_version)
            loop = cls(engines=RolloutEnginePool(loop_config.engines, model_dir, policy_version=policy_version),
                       weight_sync=loop_config.weight_sync)
            tokenizer_dir = model_dir if tokenizer_dir is not None else None  # the engines' copy
        else:
            loop = cls(engines=None)
        try:
            client = loop.engines.client() if loop.engines is not None else None
            endpoint = loop_config.endpoint
            producer_config = AgentProducerConfig(
                agent=loop_config.agent, agent_kwargs=dict(loop_config.agent_kwargs), group_size=loop_config.group_size,
                groups_in_flight=loop_config.groups_in_flight, num_producers=loop_config.num_producers,
                sampling=loop_config.sampling, timeout_s=loop_config.timeout_s,
                tokenizer_dir=tokenizer_dir, sample_push_fraction=loop_config.sample_push_fraction,
                max_sequence_length=config.train.model.max_position_embeddings, seed=loop_config.seed,
                endpoint_host=endpoint.host if endpoint.enabled else None,
                endpoint_token=endpoint_token(config.run.output_dir) if endpoint.enabled else None)
            loop.producer_args = (producer_config, scheduler, client, prompts)
            for index in range(loop_config.num_producers):
                cursor = cursors[index] if cursors and index < len(cursors) else None
                loop.producers.append(loop.start_producer(index, cursor))
        except BaseException:
            loop.shutdown()
            raise
        return loop

    def start_producer(self, index: int, cursor: dict | None) -> tuple:
        """Producer `index` (actor named vgbs-producer-{index}) from `cursor`, as an (actor, run ref) pair."""
        config, scheduler, client, prompts = self.producer_args
        return start_agent_producer(index, config, scheduler, client, prompts, cursor=cursor,
                                    name=PRODUCER_NAME.format(index))

    def restart_producer(self, index: int, cursor: dict | None, timeout_s: float = 60.0) -> tuple:
        """Producer `index` again, from `cursor` (its cursor at the latest checkpoint: what it pushed since is
        pushed again and the scheduler rejects what it holds); replaces it in `producers`. The dead actor's
        name may take a moment to free."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pair = self.start_producer(index, cursor)
                break
            except ValueError:  # the name is still the dead actor's
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.producers[index] = pair
        return pair

    def publish(self, group, policy_version: int) -> float | None:
        """Weight sync after a step (or a restore): returns the trainer-side seconds (export + store), or
        None without engines."""
        if self.engines is None:
            return None
        started = time.perf_counter()
        if self.weight_sync.transport == "collective":
            if group is not self.channel_group:  # the first sync, or a recovery's new train group
                open_weight_channel(group, self.engines, self.weight_sync)
                self.channel_group = group
            send_weights(group, policy_version, self.weight_sync)
            self.loads.append((policy_version, self.engines.weight_loads(policy_version)))
        else:
            published = publish_weights(group, policy_version)
            self.loads.append((policy_version, self.engines.update_weights(published)))
        self._collect_loads()
        return time.perf_counter() - started

    def restore(self, group, policy_version: int) -> float | None:
        """After a recovery: the engines go back to the restored weights (version = the restored step)."""
        if self.engines is None:
            return None
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

    def engine_idle_share(self) -> float | None:
        """Share of the engines' time since start spent with nothing to do (spare sampling capacity)."""
        if self.engines is None:
            return None
        usage = self.engines.utilization()
        total = sum(u.busy_s + u.idle_s for u in usage)
        return sum(u.idle_s for u in usage) / total if total > 0 else 0.0

    def shutdown(self) -> None:
        terminate([actor for actor, _ in self.producers])
        self.producers = []
        if self.engines is not None:
            self.engines.shutdown()
