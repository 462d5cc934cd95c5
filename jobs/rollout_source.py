"""The job's rollout source: agent producers, and the rollout engines they sample with their weight sync.

    rollouts = RolloutSource.launch(config, scheduler, policy_version=0)  # engines' vLLM, producers start
    rollouts.start(config, group, scheduler)  # the group's weights to the engines, then the producers run
    rollouts.producers                   # (actor, run ref) pairs
    sync_s = rollouts.publish(group, v)  # after the v-th optimizer step: export once, engines load async
    rollouts.restore(group, k)           # after a recovery restored step k's weights: engines back to v = k
    rollouts.catch_up(group)             # while the trainer waits: a replaced engine gets v over a new channel
    rollouts.drain_sampled_reward()      # mean reward of the rollouts pushed since the last call
    rollouts.shutdown()                  # after the producers stopped

Every job has this one rollout source; `rollout.use_engines=false` only leaves the engines out
(`engines` is None, `publish` and `restore` do nothing): its agent makes its samples itself, like
the synthetic preset's (examples/synthetic_agent.py).

Start-up is two calls, so that vLLM and the producers start while the train group does.
`RolloutSource.launch` reads the prompt source (a dataset that cannot be read fails before anything
starts), starts the engines' processes from `<output_dir>/policy_init`: the model's config.json
and the job's tokenizer files (`rollout.tokenizer_dir`), no weights (vLLM starts on
placeholder weights and serves nothing before a load), and creates `num_producers`
AgentProducers (their processes import the agent and load the tokenizer meanwhile: seconds each).
`rollouts.start` publishes the train group's weights (initial or restored) as `policy_version`, waits
until every engine loaded them, then runs the producers on the prompts: the rows of `rollout.dataset` (read once with
Ray Data, shared through the object store) or the generator `rollout.prompts`
(`rollout.num_prompts` of them). Producer i answers positions i, i + n, ... and resumes at
its saved cursor, so dataset rows are answered exactly once across a resume too.

`publish(group, v)` is the per-step weight sync: `publish_weights` (the train group's gather
and one copy into the object store; this is the time the trainer spends) and
`RolloutEnginePool.update_weights` (returns at once: the engines load it with requests in flight while the
trainer goes on). Engine load times are collected when they have finished, never waited for.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field, replace

import ray

from actors.agent_producer import PRODUCER_NAME, PromptSpec, create_agent_producer
from trainer.hf_checkpoint import write_hf_config
from actors.rollout_engine import RolloutEnginePool
from actors.shutdown import live_results, start_named, terminate
from actors.weight_sync import (WeightChannelError, WeightSyncConfig, open_weight_channel, publish_weights,
                                send_weights)
from vgbs_ray.producer_core import AgentProducerConfig
from vgbs_ray.scheduler.types import ENGINES_BUDGET

log = logging.getLogger("vgbs.job")


def read_dataset_rows(dataset) -> list[dict]:
    """Every row of the `rollout.dataset` file(s), in file order (Ray Data, order preserved)."""
    from ray import data as ray_data

    read = ray_data.read_parquet if dataset.resolved_format == "parquet" else ray_data.read_json
    context = ray_data.DataContext.get_current()
    context.execution_options.preserve_order = True
    # Ray 2.60's Parquet reader V2 lists footers with a pool of FooterReader actors and kills the ones it did not
    # need before they started: their creation tasks end FAILED (WORKER_DIED) in the state API of a run that
    # succeeded. V1 reads the same rows with plain tasks that finish (tests/test_prompt_file_tasks.py).
    context.use_datasource_v2 = False
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
    loop = config.rollout
    if loop.dataset is not None:
        rows = read_dataset_rows(loop.dataset)
        return PromptSpec(rows=ray.put(rows), epochs=loop.dataset.epochs, shuffle_seed=loop.dataset.shuffle_seed,
                          keys=loop.dataset.keys, num_prompts=loop.num_prompts)
    return PromptSpec(generator=loop.prompts, generator_kwargs=dict(loop.prompts_kwargs), seed=loop.seed,
                      num_prompts=loop.num_prompts)


def engine_start_dir(config) -> str:
    """The directory the engines start from (`<output_dir>/policy_init`): the model's config.json and the
    job's tokenizer files, no weights (the engines serve once the train group's first weights reached them)."""
    model_dir = os.path.abspath(os.path.join(config.run.output_dir, "policy_init"))
    shutil.rmtree(model_dir, ignore_errors=True)  # an earlier run's files, weights included, never serve
    write_hf_config(model_dir, config.train.model, tokenizer_dir=config.rollout.tokenizer_dir)
    return model_dir


def cursor_at(cursors: list[dict | None] | None, index: int) -> dict | None:
    """Producer `index`'s saved cursor, or None (from its first prompt) when none was saved."""
    return cursors[index] if cursors and index < len(cursors) else None


@dataclass
class RolloutSource:
    """The running rollout source of one job (see module docstring)."""

    engines: RolloutEnginePool | None
    """None when rollout.use_engines=false."""
    prompts: PromptSpec | None = None
    """Where the producers' prompts come from (read by `launch`)."""
    producers: list = field(default_factory=list)
    """(actor, run ref) pairs."""
    loads: list = field(default_factory=list)
    """Engine loads not yet seen finished: (policy version, refs)."""
    load_times_s: list = field(default_factory=list)
    """Finished engine loads: (policy version, slowest engine's load time)."""
    load_bytes: list = field(default_factory=list)
    """Finished engine loads: (policy version, bytes one engine loaded; with LoRA the adapter alone after the
    first)."""
    restored_versions: list = field(default_factory=list)
    """Versions published again after a recovery restored the train group (`restore`)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    channel_group: object = None
    """The train group the engines' weight channel connects to (transport=collective); None: a new channel first."""
    channel_failures: int = 0
    """Sends over the weight channel that found an engine gone (each answered by a new channel, not a recovery)."""
    producer_config: AgentProducerConfig | None = None
    """What every producer starts with (set by `launch`); the scheduler they push to is the caller's, passed to each
    call that starts one (the job's controller holds it)."""
    launched_producers: list = field(default_factory=list)
    """Producer actors `launch` created, not yet running (`start` runs them)."""
    replacement_timeout_s: float = 600.0
    """How long a producer's requests wait for a replacement when every engine is dead."""
    policy_version: int = 0
    """The newest version published to the engines (a replacement engine serves from it)."""
    published: object = None
    """That version's PublishedWeights (transport=object_store), which a replacement engine loads first."""
    base_published: object = None
    """With LoRA (object store): the publish that carried the frozen base (the first); a replacement engine loads
    it before `published`, which carries the adapter alone."""
    adapter: str | None = None
    """With LoRA, the adapter this loop's publishes carry and its producers sample with (train.lora's `policy`, or
    its tenant's); every publish after the first carries it alone."""
    kv_cache_tokens: int | None = None
    """With scheduler.admission_token_budget=engines: the engines' KV caches in tokens, the scheduler's budget."""
    owns_engines: bool = True
    """False for a multi-LoRA tenant's loop: the engines are the job's, shared by every tenant (jobs/tenants.py);
    the loop does not shut them down."""
    producer_name: str = PRODUCER_NAME
    """Actor name of producer i ({} = i); a tenant's producers carry its name."""

    @classmethod
    def launch(cls, config, scheduler, *, policy_version: int, cursors: list[dict | None] | None = None,
               tenant: str | None = None, engines: RolloutEnginePool | None = None) -> "RolloutSource":
        """The engines' processes start (rollout.use_engines) from `engine_start_dir`, serving from
        `policy_version` once it is loaded, and the producers' actors are created, pushing to `scheduler`
        once `start` runs them (producer i from `cursors[i]`, its saved `cursor()`, when given). Returns
        without waiting for either, so they start while the train group does. `config` is the JobConfig.
        A multi-LoRA tenant's loop: `tenant` names its adapter, `engines` are the job's shared pool."""
        loop_config = config.rollout
        prompts = prompt_spec(config)  # a dataset that cannot be read fails before anything starts
        if not loop_config.use_engines:
            loop = cls(engines=None, prompts=prompts)
        elif tenant is not None:
            loop = cls(engines=engines, prompts=prompts, weight_sync=loop_config.weight_sync, adapter=tenant,
                       owns_engines=False, producer_name=f"vgbs-producer-{tenant}-{{}}", policy_version=policy_version,
                       replacement_timeout_s=loop_config.engines.startup_timeout_s + 60)
        else:
            adapters = tuple((name, adapter.lora) for name, adapter in config.train.adapters.items())
            engines = RolloutEnginePool(replace(loop_config.engines, lora_adapters=adapters),
                                        engine_start_dir(config), policy_version=policy_version, wait=False)
            loop = cls(engines=engines, prompts=prompts, weight_sync=loop_config.weight_sync,
                       adapter=next(iter(config.train.adapters), None),
                       policy_version=policy_version, replacement_timeout_s=loop_config.engines.startup_timeout_s + 60)
        try:
            loop.producer_config = loop._producer_config(config)
            for index in range(loop_config.num_producers):
                loop.launched_producers.append(start_named(
                    functools.partial(loop._create_producer, index, cursor_at(cursors, index), scheduler), 60.0))
        except BaseException:
            loop.shutdown()
            raise
        return loop

    def _producer_config(self, config) -> AgentProducerConfig:
        loop_config = config.rollout
        tokenizer_dir = os.path.abspath(loop_config.tokenizer_dir) if loop_config.tokenizer_dir is not None else None
        if self.engines is not None and tokenizer_dir is not None:
            tokenizer_dir = self.engines.model_dir  # the engines' copy
        endpoint = loop_config.endpoint
        return AgentProducerConfig(
            agent=loop_config.agent, agent_kwargs=dict(loop_config.agent_kwargs), group_size=loop_config.group_size,
            groups_in_flight=loop_config.groups_in_flight, num_producers=loop_config.num_producers,
            sampling=loop_config.sampling, timeout_s=loop_config.timeout_s,
            tokenizer_dir=tokenizer_dir, sample_push_fraction=loop_config.sample_push_fraction,
            max_sequence_length=config.train.model.max_position_embeddings, seed=loop_config.seed,
            endpoint_host=endpoint.host if endpoint.enabled else None,
            endpoint_token=endpoint_token(config.run.output_dir) if endpoint.enabled else None,
            tool_parser=endpoint.resolved_tool_parser(config.train.model.family),
            record_samples_dir=(os.path.join(os.path.abspath(config.run.output_dir), "samples")
                                if loop_config.record_samples else None))

    def start(self, config, group, scheduler) -> None:
        """`group`'s current weights to the engines as `policy_version` (waits for the engines and the load),
        then the producers `launch` created run (pushing to `scheduler`, whose token budget is set first with
        scheduler.admission_token_budget=engines). On an error everything started is shut down."""
        loop_config = config.rollout
        try:
            if self.engines is not None:
                self.engines.wait_started()
                self.publish(group, self.policy_version)
                for _, refs in self.loads:  # the one load just published
                    self.engines.wait_for_weights(refs, loop_config.engines.startup_timeout_s)
                self._collect_loads()
                if config.scheduler.admission_token_budget == ENGINES_BUDGET and self.owns_engines:
                    # the engines' real KV caches, before any producer asks for admission
                    self.kv_cache_tokens = self.engines.kv_cache_tokens()
                    ray.get(scheduler.set_token_budget.remote(self.kv_cache_tokens), timeout=60)
            self.producers = [(actor, actor.run.remote()) for actor in self.launched_producers]
            self.launched_producers = []
        except BaseException:
            self.shutdown()
            raise

    def restart_producers(self, scheduler, cursors: list[dict | None] | None) -> None:
        """Every producer (rollout.num_producers), pushing to `scheduler`, producer i from `cursors[i]`
        (None: from its first prompt); at the start, and after a scheduler restore (the old ones stopped)."""
        self.producers.clear()
        for index in range(self.producer_config.num_producers):
            self.producers.append(self.restart_producer(index, cursor_at(cursors, index), scheduler))

    def _create_producer(self, index: int, cursor: dict | None, scheduler):
        # The engines as they are now: a handle of an engine that was replaced would hang a new producer's calls.
        client = self.engines.client(self.replacement_timeout_s, self.adapter) if self.engines is not None else None
        return create_agent_producer(index, self.producer_config, scheduler, client, self.prompts, cursor=cursor,
                                     name=self.producer_name.format(index))

    def _start_producer(self, index: int, cursor: dict | None, scheduler) -> tuple:
        actor = self._create_producer(index, cursor, scheduler)
        return actor, actor.run.remote()

    def restart_producer(self, index: int, cursor: dict | None, scheduler, timeout_s: float = 60.0) -> tuple:
        """Producer `index` again, pushing to `scheduler`, from `cursor` (its cursor at the latest checkpoint:
        what it pushed since is pushed again and the scheduler rejects what it holds); replaces it in `producers`.
        The dead actor is killed first: a process that died by a signal keeps its name taken until Ray is told."""
        if index < len(self.producers):
            try:
                ray.kill(self.producers[index][0], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        pair = start_named(lambda: self._start_producer(index, cursor, scheduler), timeout_s)
        if index < len(self.producers):
            self.producers[index] = pair
        return pair

    def publish(self, group, policy_version: int) -> float | None:
        """Weight sync after a step (or a restore): returns the trainer-side seconds (export + store), or
        None without engines."""
        if self.engines is None:
            return None
        started = time.perf_counter()
        if self.weight_sync.transport == "collective":
            self._send_over_channel(group, policy_version)
        else:
            include_base = self.adapter is None or self.base_published is None
            self.published = publish_weights(group, policy_version, include_base=include_base, adapter=self.adapter)
            if include_base:
                self.base_published = self.published
            self.loads.append((policy_version, self.engines.update_weights(self.published)))
        self.policy_version = policy_version
        self._collect_loads()
        return time.perf_counter() - started

    def _send_over_channel(self, group, policy_version: int) -> None:
        """Over the weight channel. A channel needs every engine: while one is dead, or when
        the send finds one gone (`WeightChannelError`: it died during the update), nothing is sent and no train
        rank is blamed; the job's controller replaces the engine and `catch_up` sends the newest version over a new
        channel. The live engines keep serving the version they hold whole until then."""
        new_channel = group is not self.channel_group
        if new_channel:  # the first sync, a recovery's new group, or a replaced engine
            dead = self.engines.dead_engines()
            if dead:
                log.info("policy version %d waits for rollout engine(s) %s to be replaced (a weight channel needs "
                         "every engine)", policy_version, ", ".join(dead))
                return
            open_weight_channel(group, self.engines, self.weight_sync)
            self.channel_group = group
        try:  # with LoRA the base goes only over a new channel (which may reach an engine without it)
            send_weights(group, policy_version, self.weight_sync, include_base=self.adapter is None or new_channel,
                         adapter=self.adapter)
        except WeightChannelError as error:
            log.warning("%s; the engine is replaced, then this version goes again over a new channel",
                        error)
            self.channel_group = None
            self.channel_failures += 1
            return
        self.loads.append((policy_version, self.engines.weight_loads(policy_version)))

    def replace_engine(self, index: int) -> int:
        """Engine `index` (dead or hung) again, on its bundle, serving from the newest published version:
        loaded from the object store before it serves, or, over a collective, sent again over a channel
        that includes it (`catch_up`, or the next publish). Called by the job's controller; returns that version."""
        version, published, base = self.policy_version, self.published, self.base_published
        collective = self.weight_sync.transport == "collective"
        # with LoRA the newest publish may carry the adapter alone: the base's publish goes first
        if collective or published is None:
            weights = ()
        else:
            weights = (published,) if base is None or base is published else (base, published)
        self.engines.replace(index, serve_from_version=version, weights=weights)
        if collective:
            self.channel_group = None
        return version

    def catch_up(self, group) -> None:
        """Over a collective, after an engine was replaced: send the newest version again, over a new channel
        that includes the replacement. Called while the trainer waits for a step (its ranks idle, so they can
        send): the next version needs that step, and the step may need the replacement's rollouts. Does
        nothing otherwise (the object store transport loads a replacement by itself)."""
        if self.engines is None or self.weight_sync.transport != "collective" or self.channel_group is group:
            return
        log.info("sending policy version %d again, to the replaced engine(s)", self.policy_version)
        self.publish(group, self.policy_version)

    def restore(self, group, policy_version: int) -> float | None:
        """After a recovery: the engines go back to the restored weights (version = the restored step)."""
        if self.engines is None:
            return None
        self.restored_versions.append(policy_version)
        self.base_published = None  # the base's publish belonged to the previous group's rank 0, maybe gone with it
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
                self.load_bytes.append((version, max(load.num_bytes for load in loads)))
            except Exception as error:  # noqa: BLE001 - a dead engine is the controller's; others show in generate
                log.warning("engine load of policy version %d failed: %r", version, error)
        self.loads = pending

    def drain_sampled_reward(self) -> float | None:
        """Mean reward of every rollout the producers pushed since the previous call (filtered groups
        included: the sampling policy's own reward), or None when none was pushed."""
        # A dead producer (the controller restarts it) has nothing to say.
        pairs = live_results([actor.drain_rewards.remote() for actor, _ in self.producers], 60)
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
        terminate([actor for actor, _ in self.producers] + self.launched_producers)
        self.producers, self.launched_producers = [], []
        if self.engines is not None and self.owns_engines:
            self.engines.shutdown()
