"""The producer: runs a user's agent in GRPO groups through the engine pool and pushes the samples.

    producer, run_ref = start_agent_producer(0, config, scheduler, engines.client(), prompts, cursor=None)
    # engines=None: a job without rollout engines (agents that make their samples: ctx.add_sample)
    ray.get(producer.cursor.remote())       # {"next_index": k}: resume from here
    ray.get(producer.stop.remote())         # in-flight groups are abandoned (scheduler.abandon)

`AgentProducer` is an asyncio actor (`num_cpus=0`: it only awaits) with `groups_in_flight`
workers. Each worker loops: take this producer's next prompt position (`PromptSpec`: a dataset
file's rows or a generator named by import path; producer i of P answers positions i, i+P, ...),
ask the scheduler to admit the group's rollout ids at the engines' current policy version, run
the group (`vgbs_ray.agents.run_group`: `group_size` agent calls on the row, each with its own
`RolloutContext`), and push the group's samples in one `submit`, resubmitting what was deferred.
A share of groups (`sample_push_fraction`) is pushed one sample per `submit` instead, the
members' samples interleaved and other groups' pushes in between: the push API's
sibling-by-sibling path, which the scheduler must complete across calls.
A group an agent failed (raised, hung past `timeout_s`, non-finite reward, too long) is
reported with `fail_rollouts(ids, reason)`: the ledger counts it dropped by that reason, the
producer goes on. Uniform-reward groups are pushed too: the scheduler's dynamic-sampling filter
drops them.

Engine requests issued in the same event-loop pass (a group's members' turns) go to the engines
as one call (`_Batcher`), so a group costs one Ray call per turn, as a batched driver would; the
call streams each request's generation back as it finishes, so a member's short turn is not held
until the group's longest one ends.

Invariants:
- Rollout ids are `{prompt key}-r{member}`: a pure function of the prompt's position, so a
  producer resumed from `cursor()` regenerates exactly the groups not pushed, with the same ids
  (the scheduler rejects a re-pushed duplicate; `admit` names the ids it holds and they are skipped).
- `cursor()` is the oldest of this producer's own positions drawn but not yet settled (pushed or
  failed), or the next undrawn one.
- A group is pushed whole or not at all (but for `sample_push_fraction`'s groups, whose rollouts
  a stopped or killed producer may leave partly pushed: they end `incomplete_rollout`); a stopped
  producer abandons its unpushed groups and tells the scheduler (`abandon`), so
  admitted-but-never-pushed rollouts hold no staleness budget.
- Without engines, groups are admitted at policy version 0: such a job sets no staleness bound
  (its samples carry no policy version).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray

from actors.agent_endpoint import AgentEndpoint, listen_address
from actors.engine_version_watch import EngineVersionWatch
from actors.rollout_engine import EngineError
from vgbs_ray.agents import RequestTooLongError, RolloutContext, SamplingConfig, load_agent, resolve, run_group
from vgbs_ray.agents.sample_record import SampleRecord
from vgbs_ray.checkpoint_files import load_tokenizer
from vgbs_ray.errors import ConfigError
from vgbs_ray.prompt_source import DatasetPrompts, GeneratedPrompts, producer_positions, source_length

log = logging.getLogger("vgbs.producer")

PRODUCER_NAME = "vgbs-producer-{}"
"""Actor name of the job's producer i (one job per cluster namespace; a resumed job reuses the names)."""


@dataclass(frozen=True, kw_only=True)
class PromptSpec:
    """Where a producer's prompts come from: dataset rows (read by the job) or a generator by import path."""

    rows: Any = None
    """The dataset's rows (a list of dicts, or an ObjectRef of one)."""
    epochs: int = 1
    shuffle_seed: int | None = None
    keys: tuple[str, ...] | None = None
    """Columns the agent gets (None: all)."""
    generator: str | None = None
    """Import path of `make(seed, **kwargs) -> (position -> row)`."""
    generator_kwargs: dict = field(default_factory=dict)
    seed: int = 0
    num_prompts: int | None = None
    """Source positions answered, over all producers (None: all of a dataset's, an endless generator's)."""

    def build(self):
        if self.generator is not None:
            return GeneratedPrompts(resolve(self.generator, "closed_loop.prompts")(seed=self.seed,
                                                                                   **self.generator_kwargs))
        rows = ray.get(self.rows) if isinstance(self.rows, ray.ObjectRef) else self.rows
        return DatasetPrompts(rows, epochs=self.epochs, shuffle_seed=self.shuffle_seed, keys=self.keys,
                              name="closed_loop.dataset")

    def length(self, source) -> int | None:
        """Positions of `source` the producers answer (None: endless)."""
        length = source_length(source)
        if self.num_prompts is None:
            return length
        return self.num_prompts if length is None else min(length, self.num_prompts)


@dataclass(frozen=True, kw_only=True)
class AgentProducerConfig:
    """One producer's settings (the job builds it from its `closed_loop` section)."""

    agent: str
    """Import path of the agent factory, e.g. 'my_pkg.agents:make_agent'."""
    agent_kwargs: dict = field(default_factory=dict)
    group_size: int = 8
    """Rollouts per prompt row (GRPO group)."""
    groups_in_flight: int = 8
    """Groups this producer runs concurrently (each is admitted before it starts)."""
    num_producers: int = 1
    """Producers splitting the prompt source (this one takes every num_producers-th position)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """What a request without its own SamplingConfig uses."""
    timeout_s: float = 300.0
    """Seconds one rollout (one agent call) may take before it is lost as `agent_timeout`."""
    tokenizer_dir: str | None = None
    """A Hugging Face tokenizer directory for chat sessions (None: token-id-only agents)."""
    max_sequence_length: int | None = None
    """The model's longest sample in tokens: a longer rollout is lost as `too_long`."""
    max_prompts: int | None = None
    """Prompts this producer answers before `run` returns; None = until the source ends or `stop()`."""
    seed: int = 0
    """Sampling seeds derive from it, the prompt position and the member."""
    endpoint_host: str | None = None
    """'loopback' or 'node': serve the OpenAI-compatible endpoint there (actors/agent_endpoint.py), every rollout
    with its own session (ctx.endpoint); None: no endpoint."""
    endpoint_token: str | None = None
    """The token every endpoint request must carry (the job makes one per run)."""
    tool_parser: str | None = None
    """The vLLM tool parser the endpoint parses replies to requests with `tools` with (None: tools are refused)."""
    record_samples_dir: str | None = None
    """Append every pushed rollout's samples (ids, mask, versions) to producer-<index>.jsonl in this directory
    (vgbs_ray/agents/sample_record.py); None: no record."""
    sample_push_fraction: float = 0.0
    """Share of groups pushed one sample per submit call (see module docstring). Their rollouts are pushed
    again whole by a resumed producer and the scheduler rejects the samples it holds, so the agent must
    give the same samples on every run (the synthetic agent does)."""
    admit_retry_s: float = 0.05
    """Seconds between reads of the engines' version while a refused group waits for a newer one (one read per
    producer serves all of its workers: actors/engine_version_watch.py)."""
    admit_recheck_s: float = 0.5
    """A refused group asks the scheduler again after this long even if the engines' version did not change
    (other rollouts dropped or abandoned may have freed room in the staleness window)."""

    def __post_init__(self):
        for name in ("group_size", "groups_in_flight", "num_producers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"AgentProducerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.timeout_s <= 0 or self.admit_retry_s <= 0 or self.admit_recheck_s < self.admit_retry_s:
            raise ConfigError(f"AgentProducerConfig: timeout_s and admit_retry_s must be > 0 seconds and admit_recheck_s "
                              f">= admit_retry_s, got {self.timeout_s}, {self.admit_retry_s}, {self.admit_recheck_s}")
        if self.endpoint_host is not None and not self.endpoint_token:
            raise ConfigError("AgentProducerConfig: an endpoint (endpoint_host) needs endpoint_token")
        if not 0 <= self.sample_push_fraction <= 1:
            raise ConfigError(f"AgentProducerConfig.sample_push_fraction must be in [0, 1], got "
                              f"{self.sample_push_fraction}")
        if self.max_prompts is not None and self.max_prompts < 0:
            raise ConfigError(f"AgentProducerConfig.max_prompts must be >= 0 or None, got {self.max_prompts}")


@dataclass(frozen=True)
class AgentProducerReport:
    """What one producer did (times in seconds, summed over its workers)."""

    agent: int
    """This producer's index."""
    groups: int
    """Groups wholly pushed (accepted, rejected or filtered by the scheduler)."""
    rollouts: int
    samples: int
    failed_groups: dict
    """Groups an agent lost, by drop reason."""
    deferred_retries: int
    rejected_samples: int
    abandoned_rollouts: int
    """Rollouts of groups started but not pushed when `stop()` came."""
    not_admitted: int
    """Admission refusals (each followed by a wait and a new request)."""
    skipped_known_groups: int
    """Groups not run because the scheduler already held all their rollouts (a resumed run)."""
    engine_wait_s: float
    """Awaiting the engines' generate."""
    idle_s: float
    """Awaiting admission or a deferred push's retry (not sampling)."""
    mean_reward: float | None
    """Over every pushed rollout (filtered groups included): the sampling policy's reward."""
    agent_metrics: dict
    """Mean of each metric the agents reported, over the pushed rollouts that reported it."""
    agent_metric_counts: dict
    """Pushed rollouts that reported each metric."""
    endpoint_outcomes: dict
    """Endpoint tool-call parse outcomes (`tool_calls/<outcome>`) and new samples (a request extending no held conversation), counted."""
    stopped: bool
    in_flight: int
    """Prompts a worker is answering at the time of the report."""
    awaiting_engine: int
    """Of those: prompts with a request at the engines at the time of the report."""
    awaiting_requests: int
    """Their requests at the engines (a group's members each send their own)."""
    endpoint_refused: int
    """Endpoint requests answered with a 4xx, other than those to an ended session (0 without an endpoint)."""
    endpoint_after_end: int
    """Endpoint requests to a session that had ended (an agent still running after its group ended)."""
    cursor: dict


def pushes_samples_one_by_one(seed: int, position: int, sample_push_fraction: float) -> bool:
    """Whether the group at this prompt position is pushed one sample per call: a pure function, so a
    resumed producer pushes each group as the first run did."""
    return sample_push_fraction > 0 and np.random.default_rng([seed, position, 17]).random() < sample_push_fraction


class _Batcher:
    """Engine requests made in one event-loop pass go out as one call per engine (see module docstring), each
    rollout's to the engine that served its previous request while that engine is live and not full
    (session-sticky routing: its prefix cache holds the rollout's history), the others least-loaded."""

    def __init__(self, engines, times: dict):
        self._engines, self._times = engines, times
        self._pending: list[tuple[str, list[int], SamplingConfig, asyncio.Future]] = []
        self._engine_of: dict[str, int] = {}
        """Rollout id -> index of the engine that served its last request; `forget` drops a finished group's."""

    async def generate(self, rollout_id: str, token_ids, sampling: SamplingConfig):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            loop.call_soon(lambda: asyncio.ensure_future(self._flush()))
        self._pending.append((rollout_id, list(token_ids), sampling, future))
        return await future

    def forget(self, rollout_ids) -> None:
        for rollout_id in rollout_ids:
            self._engine_of.pop(rollout_id, None)

    async def _flush(self) -> None:
        batch, self._pending = self._pending, []
        by_engine: dict[int | None, list] = {}
        for request in batch:
            by_engine.setdefault(self._engine_of.get(request[0]), []).append(request)
        started = time.perf_counter()
        try:
            await asyncio.gather(*(self._call(requests, prefer) for prefer, requests in by_engine.items()))
        finally:
            self._times["engine_wait_s"] += time.perf_counter() - started

    async def _call(self, batch: list, prefer: int | None) -> None:
        try:
            try:
                # Each caller is answered as its own request finishes (the engine batches continuously).
                async for position, generation in self._engines.generate_each(
                        [ids for _, ids, _, _ in batch], [s for _, _, s, _ in batch], prefer=prefer):
                    self._answer(batch[position], generation)
            except RequestTooLongError:
                if len(batch) == 1:
                    raise
                # One request does not fit: the engine refused the whole call. Send each alone, so only
                # the rollout that asked too much loses its group.
                await asyncio.gather(*[self._call([request], prefer) for request in batch])
        except BaseException as error:  # noqa: BLE001 - every caller of the batch still waiting gets the error
            for _, _, _, future in batch:
                if not future.done():
                    future.set_exception(error)

    def _answer(self, request: tuple, generation) -> None:
        rollout_id, _, _, future = request
        if generation.engine in self._engines.names:
            self._engine_of[rollout_id] = self._engines.names.index(generation.engine)
        if not future.done():
            future.set_result(generation)


class AgentProducer:
    """See module docstring. Made remote by `start_agent_producer`."""

    def __init__(self, index: int, config: AgentProducerConfig, scheduler, engines, prompts: PromptSpec, *,
                 cursor: dict | None = None):
        self._index, self._config, self._scheduler, self._engines = index, config, scheduler, engines
        self._agent = load_agent(config.agent, config.agent_kwargs)
        self._source = prompts.build()
        self._tokenizer = load_tokenizer(config.tokenizer_dir) if config.tokenizer_dir is not None else None
        self._sampling = config.sampling
        eos = getattr(self._tokenizer, "eos_token_id", None)
        if eos is not None and not self._sampling.stop_token_ids:  # the tokenizer's end of turn ends a reply
            self._sampling = replace(self._sampling, stop_token_ids=(int(eos),))
        start = int(cursor["next_index"]) if cursor is not None else 0
        self._positions = producer_positions(index, config.num_producers, start, prompts.length(self._source))
        self._next_local = start
        self._drawn = 0
        self._unsettled: set[int] = set()  # own indices drawn, not yet pushed or failed (abandoned ones stay)
        self._working: set[int] = set()  # own indices a worker is answering now
        self._awaiting_engine: dict[int, int] = {}  # own index -> its requests at the engines now
        self._admitted: dict[int, list] = {}  # own index -> rollout ids admitted, not yet pushed
        self._stop = asyncio.Event()
        self._counts = dict(groups=0, rollouts=0, samples=0, deferred_retries=0, rejected_samples=0,
                            abandoned_rollouts=0, not_admitted=0, skipped_known_groups=0)
        self._failed: dict[str, int] = {}
        self._times = dict(engine_wait_s=0.0, idle_s=0.0)
        self._batcher = _Batcher(engines, self._times)
        self._engine_versions = None if engines is None else EngineVersionWatch(engines.policy_version, config.admit_retry_s)
        self._reward_sum, self._reward_count = 0.0, 0
        self._metric_sums: dict[str, float] = {}
        self._metric_counts: dict[str, int] = {}
        """Rollouts that reported each metric: its mean is over them."""
        self._unreported = (0.0, 0)
        self._running = False
        self._finished = asyncio.Event()
        self._endpoint: AgentEndpoint | None = None
        self._record = (SampleRecord(os.path.join(config.record_samples_dir, f"producer-{self._index}.jsonl"))
                        if config.record_samples_dir else None)

    # -- the actor's API -----------------------------------------------------------------

    async def run(self) -> AgentProducerReport:
        """Run and push groups until `stop()`, the prompt source ends, or `max_prompts`."""
        self._running = True
        await self.endpoint_address()
        workers = [asyncio.create_task(self._worker()) for _ in range(self._config.groups_in_flight)]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            # One worker failed (every engine died and none came back in time, the scheduler is gone): the
            # others stop too and abandon their groups, then the error goes to the caller (the job counts a
            # failed producer).
            self._stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        finally:
            self._running = False
            self._finished.set()
            if self._endpoint is not None:
                await self._endpoint.stop()
        return self.report()

    async def endpoint_address(self) -> str | None:
        """The endpoint's `http://host:port` (started on first call), or None when this producer serves none."""
        if self._config.endpoint_host is None:
            return None
        if self._endpoint is None:
            self._endpoint = AgentEndpoint(host=listen_address(self._config.endpoint_host),
                                           token=self._config.endpoint_token, tool_parser=self._config.tool_parser)
            await self._endpoint.start()
        return self._endpoint.address

    async def stop(self) -> AgentProducerReport:
        """Stop: workers return at their next await, groups whose agents still run are cancelled, and unpushed
        groups are abandoned (the scheduler is told)."""
        self._stop.set()
        if self._running:
            await self._finished.wait()
        return self.report()

    def cursor(self) -> dict:
        """{"next_index": k}: the oldest own position not yet settled (see module docstring)."""
        return {"next_index": min(self._unsettled, default=self._next_local)}

    def drain_rewards(self) -> tuple[float, int]:
        """(sum, count) of the rewards of rollouts pushed since the previous call (filtered ones too)."""
        drained, self._unreported = self._unreported, (0.0, 0)
        return drained

    def report(self) -> AgentProducerReport:
        count = self._reward_count
        return AgentProducerReport(
            agent=self._index, **self._counts, failed_groups=dict(self._failed),
            **{k: round(v, 3) for k, v in self._times.items()},
            mean_reward=self._reward_sum / count if count else None,
            agent_metrics={k: v / self._metric_counts[k] for k, v in self._metric_sums.items() if self._metric_counts[k]},
            agent_metric_counts=dict(self._metric_counts),
            endpoint_outcomes=dict(self._endpoint.outcomes) if self._endpoint is not None else {},
            stopped=self._stop.is_set(), in_flight=len(self._working),
            endpoint_refused=self._endpoint.refused if self._endpoint is not None else 0,
            endpoint_after_end=self._endpoint.after_end if self._endpoint is not None else 0,
            awaiting_engine=len(self._awaiting_engine), awaiting_requests=sum(self._awaiting_engine.values()),
            cursor=self.cursor())

    # -- workers -----------------------------------------------------------------------

    async def _worker(self) -> None:
        while not self._stop.is_set():
            if self._config.max_prompts is not None and self._drawn >= self._config.max_prompts:
                return
            position = next(self._positions, None)
            if position is None:
                return
            local = self._next_local
            self._next_local += 1
            self._drawn += 1
            self._unsettled.add(local)
            key, row = self._source.prompt(position)
            self._working.add(local)
            try:
                settled = await self._answer(local, position, key, row)
            except BaseException:
                self._abandon(local)
                raise
            finally:
                self._working.discard(local)
            if not settled:
                self._abandon(local)
                return
            self._unsettled.discard(local)

    async def _answer(self, local: int, position: int, key: str, row: dict) -> bool:
        """One group from admission to push (or to its failure report); False when stopped first."""
        config = self._config
        ids = [f"{key}-r{m}" for m in range(config.group_size)]
        known = await self._admit(local, ids)
        if known is None:
            return False
        one_by_one = self._pushes_samples_one_by_one(position)
        if len(known) == len(ids) and not one_by_one:  # a resumed producer: the scheduler holds this group already
            self._counts["skipped_known_groups"] += 1
            return True
        def generate(rollout_id: str):
            if self._engines is None:
                return self._no_engines
            return lambda ids, sampling: self._generate(local, rollout_id, ids, sampling)

        contexts = [RolloutContext(rollout_id=rid, group_id=key, member=m, group_size=config.group_size,
                                   engine_generate=generate(rid),
                                   tokenizer=self._tokenizer,
                                   default_sampling=self._sampling,
                                   seed=(config.seed * 1_000_003 + position) * 1_024 + m)
                    for m, rid in enumerate(ids)]
        sessions = [self._endpoint.open(ctx) for ctx in contexts] if self._endpoint is not None else []
        try:
            outcome = await self._unless_stopped(run_group(
                self._agent, row, contexts, timeout_s=config.timeout_s,
                max_sequence_length=config.max_sequence_length, fatal_errors=(EngineError,)))
        finally:
            for session in sessions:
                self._endpoint.close(session)
            self._batcher.forget(ids)
        if outcome is None or self._stop.is_set():
            return False
        if outcome.failure is not None:
            reason, member, detail = outcome.failure
            self._failed[reason] = self._failed.get(reason, 0) + 1
            log.warning("producer %d: group %s lost (%s, member %d): %s", self._index, key, reason, member, detail)
            await self._scheduler.fail_rollouts.remote([rid for rid in ids if rid not in known], reason)
            self._admitted.pop(local, None)
            return True
        if one_by_one:  # a known rollout may be partly pushed: all again, the scheduler rejects what it holds
            samples = outcome.samples
            pushed = await self._push_one_by_one(samples)
        else:
            samples = [s for s in outcome.samples if s["rollout_id"] not in known]
            pushed = await self._push(samples)
        if not pushed:
            return False
        if self._record is not None:
            self._record.write(samples)
        self._admitted.pop(local, None)
        rewards = list(outcome.rewards.values())
        self._counts["groups"] += 1
        self._counts["rollouts"] += len(rewards)
        self._counts["samples"] += len(samples)
        self._reward_sum += sum(rewards)
        self._reward_count += len(rewards)
        for name, value in outcome.metrics.items():
            if name != "num_samples":
                self._metric_sums[name] = self._metric_sums.get(name, 0.0) + value
                self._metric_counts[name] = self._metric_counts.get(name, 0) + outcome.metric_counts.get(name, 0)
        self._unreported = (self._unreported[0] + sum(rewards), self._unreported[1] + len(rewards))
        return True

    async def _unless_stopped(self, work):
        """`work`'s result, or None when `stop()` came first: the agents' calls are cancelled then, so a stopping
        producer does not wait out a slow tool call or a hung agent (up to `timeout_s`) only to abandon the group."""
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # the agents' own cleanup runs first
        return task.result() if not task.cancelled() else None

    async def _no_engines(self, token_ids, sampling: SamplingConfig):
        raise EngineError("this job runs no rollout engines (closed_loop.enabled=false, as in the synthetic preset): "
                          "an agent here makes its samples itself (ctx.add_sample); set closed_loop.enabled=true "
                          "to sample the policy")

    async def _generate(self, local: int, rollout_id: str, token_ids, sampling: SamplingConfig):
        self._awaiting_engine[local] = self._awaiting_engine.get(local, 0) + 1
        try:
            return await self._batcher.generate(rollout_id, token_ids, sampling)
        finally:
            self._awaiting_engine[local] -= 1
            if not self._awaiting_engine[local]:
                del self._awaiting_engine[local]

    async def _admit(self, local: int, rollout_ids: list) -> frozenset | None:
        """Wait until the scheduler admits the group at the engines' version; returns the ids the
        scheduler already holds (pushed before a resume), or None if stopped first. A refused group
        asks again once the engines' version changed, or after `admit_recheck_s`."""
        while not self._stop.is_set():
            version = await self._engine_version()
            decision = await self._scheduler.admit.remote(rollout_ids, version, self._index)
            if decision.admit:
                known = frozenset(decision.known)
                self._admitted[local] = [rid for rid in rollout_ids if rid not in known]
                return known
            self._counts["not_admitted"] += 1
            recheck_at = time.monotonic() + self._config.admit_recheck_s
            while not self._stop.is_set() and time.monotonic() < recheck_at:
                await self._idle(self._config.admit_retry_s)
                if await self._engine_version() != version:
                    break
        return None

    async def _engine_version(self) -> int:
        """The oldest policy version any engine holds (a rollout may be sampled by any of them), read at most
        `admit_retry_s` ago; 0 without engines."""
        if self._engine_versions is None:
            return 0
        return await self._engine_versions.current()

    async def _push(self, samples: list[dict]) -> bool:
        while samples:
            if self._stop.is_set():
                return False
            result = await self._scheduler.submit.remote(samples)
            self._counts["rejected_samples"] += len(result.rejected)
            if not result.deferred:
                return True
            self._counts["deferred_retries"] += 1
            samples = [samples[i] for i in result.deferred]
            await self._idle(result.retry_after_s or 0.05)
        return True

    def _pushes_samples_one_by_one(self, position: int) -> bool:
        return pushes_samples_one_by_one(self._config.seed, position, self._config.sample_push_fraction)

    async def _push_one_by_one(self, samples: list[dict]) -> bool:
        """Each sample in its own submit, the members' samples interleaved (sample 0 of every member, then
        sample 1, ...)."""
        for sample in sorted(samples, key=lambda s: s["sample_index"]):  # stable: members stay in order
            if not await self._push([sample]):
                return False
            await asyncio.sleep(0)  # other groups' pushes go in between
        return True

    async def _idle(self, seconds: float) -> None:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass
        self._times["idle_s"] += time.perf_counter() - started

    def _abandon(self, local: int) -> None:
        admitted = self._admitted.pop(local, None)
        self._counts["abandoned_rollouts"] += self._config.group_size
        if admitted:
            self._scheduler.abandon.remote(admitted)  # fire and forget: the scheduler may be going away too


def create_agent_producer(index: int, config: AgentProducerConfig, scheduler, engines, prompts: PromptSpec, *,
                          cursor: dict | None = None, name: str | None = None):
    """One AgentProducer actor (num_cpus=0, asyncio), not yet running: `actor.run.remote()` starts it.
    `engines`: a RolloutEnginePool client, or None (agents that make their samples themselves)."""
    remote = ray.remote(num_cpus=0, max_concurrency=1000)(AgentProducer)
    return remote.options(name=name).remote(index, config, scheduler, engines, prompts, cursor=cursor)


def start_agent_producer(index: int, config: AgentProducerConfig, scheduler, engines, prompts: PromptSpec, *,
                         cursor: dict | None = None, name: str | None = None):
    """One AgentProducer actor, running: the (actor, `run` ref) pair (see `create_agent_producer`)."""
    actor = create_agent_producer(index, config, scheduler, engines, prompts, cursor=cursor, name=name)
    return actor, actor.run.remote()


__all__ = ["AgentProducer", "AgentProducerConfig", "AgentProducerReport", "PRODUCER_NAME", "PromptSpec",
           "create_agent_producer", "pushes_samples_one_by_one", "start_agent_producer"]
