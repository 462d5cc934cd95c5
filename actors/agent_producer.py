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

The bookkeeping (prompt cursor, open groups, counts, reports) is `vgbs_ray.producer_core.ProducerCore`,
Ray-free and tested in milliseconds; this actor keeps the awaits. Invariants:
- Rollout ids are `{prompt key}-r{member}` and `cursor()` is the oldest own position not yet settled
  (the core's), so a producer resumed from `cursor()` regenerates exactly the groups not pushed, with the
  same ids (the scheduler rejects a re-pushed duplicate; `admit` names the ids it holds and they are skipped).
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

import ray

from actors.agent_endpoint import AgentEndpoint, listen_address
from actors.engine_version_watch import EngineVersionWatch
from actors.rollout_engine import EngineError
from vgbs_ray.agents import RequestTooLongError, RolloutContext, SamplingConfig, load_agent, resolve, run_group
from vgbs_ray.agents.sample_record import SampleRecord
from vgbs_ray.checkpoint_files import load_tokenizer
from vgbs_ray.producer_core import AgentProducerConfig, AgentProducerReport, Group, ProducerCore, member_seed
from vgbs_ray.prompt_source import DatasetPrompts, GeneratedPrompts, source_length

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
            return GeneratedPrompts(resolve(self.generator, "rollout.prompts")(seed=self.seed,
                                                                                   **self.generator_kwargs))
        rows = ray.get(self.rows) if isinstance(self.rows, ray.ObjectRef) else self.rows
        return DatasetPrompts(rows, epochs=self.epochs, shuffle_seed=self.shuffle_seed, keys=self.keys,
                              name="rollout.dataset")

    def length(self, source) -> int | None:
        """Positions of `source` the producers answer (None: endless)."""
        length = source_length(source)
        if self.num_prompts is None:
            return length
        return self.num_prompts if length is None else min(length, self.num_prompts)


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
        source = prompts.build()
        self._core = ProducerCore(index, config, source, length=prompts.length(source), cursor=cursor)
        self._tokenizer = load_tokenizer(config.tokenizer_dir) if config.tokenizer_dir is not None else None
        self._sampling = config.sampling
        eos = getattr(self._tokenizer, "eos_token_id", None)
        if eos is not None and not self._sampling.stop_token_ids:  # the tokenizer's end of turn ends a reply
            self._sampling = replace(self._sampling, stop_token_ids=(int(eos),))
        self._stop = asyncio.Event()
        self._batcher = _Batcher(engines, self._core.times)
        self._engine_versions = None if engines is None else EngineVersionWatch(engines.policy_version, config.admit_retry_s)
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
        """{"next_index": k}: the oldest own position not yet settled (vgbs_ray/producer_core.py)."""
        return self._core.cursor()

    def drain_rewards(self) -> tuple[float, int]:
        """(sum, count) of the rewards of rollouts pushed since the previous call (filtered ones too)."""
        return self._core.drain_rewards()

    def report(self) -> AgentProducerReport:
        endpoint = self._endpoint
        if endpoint is None:
            return self._core.report(stopped=self._stop.is_set())
        return self._core.report(stopped=self._stop.is_set(), endpoint_outcomes=endpoint.outcomes,
                                 endpoint_refused=endpoint.refused, endpoint_after_end=endpoint.after_end)

    # -- workers -----------------------------------------------------------------------

    async def _worker(self) -> None:
        while not self._stop.is_set():
            group = self._core.draw()
            if group is None:
                return
            try:
                settled = await self._answer(group)
            except BaseException:
                self._abandon(group.local)
                raise
            finally:
                self._core.release(group.local)
            if not settled:
                self._abandon(group.local)
                return
            self._core.settle(group.local)

    async def _answer(self, group: Group) -> bool:
        """One group from admission to push (or to its failure report); False when stopped first."""
        config, local, key, ids = self._config, group.local, group.key, list(group.rollout_ids)
        known = await self._admit(local, ids)
        if known is None:
            return False
        if len(known) == len(ids) and not group.one_by_one:  # a resumed producer: the scheduler holds them already
            self._core.skipped_known(local)
            return True

        def generate(rollout_id: str):
            if self._engines is None:
                return self._no_engines
            return lambda ids, sampling: self._generate(local, rollout_id, ids, sampling)

        contexts = [RolloutContext(rollout_id=rid, group_id=key, member=m, group_size=config.group_size,
                                   engine_generate=generate(rid),
                                   tokenizer=self._tokenizer,
                                   default_sampling=self._sampling,
                                   seed=member_seed(config.seed, group.position, m))
                    for m, rid in enumerate(ids)]
        sessions = [self._endpoint.open(ctx) for ctx in contexts] if self._endpoint is not None else []
        try:
            outcome = await self._unless_stopped(run_group(
                self._agent, group.row, contexts, timeout_s=config.timeout_s,
                max_sequence_length=config.max_sequence_length, fatal_errors=(EngineError,)))
        finally:
            for session in sessions:
                self._endpoint.close(session)
            self._batcher.forget(ids)
        if outcome is None or self._stop.is_set():
            return False
        if outcome.failure is not None:
            reason, member, detail = outcome.failure
            log.warning("producer %d: group %s lost (%s, member %d): %s", self._index, key, reason, member, detail)
            await self._scheduler.fail_rollouts.remote([rid for rid in ids if rid not in known], reason)
            self._core.failed(local, reason)
            return True
        if group.one_by_one:  # a known rollout may be partly pushed: all again, the scheduler rejects what it holds
            samples = outcome.samples
            pushed = await self._push_one_by_one(samples)
        else:
            samples = [s for s in outcome.samples if s["rollout_id"] not in known]
            pushed = await self._push(samples)
        if not pushed:
            return False
        if self._record is not None:
            self._record.write(samples)
        self._core.pushed(local, outcome.rewards.values(), len(samples), outcome.metrics, outcome.metric_counts)
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
        raise EngineError("this job runs no rollout engines (rollout.use_engines=false, as in the synthetic preset): "
                          "an agent here makes its samples itself (ctx.add_sample); set rollout.use_engines=true "
                          "to sample the policy")

    async def _generate(self, local: int, rollout_id: str, token_ids, sampling: SamplingConfig):
        self._core.engine_request(local, +1)
        try:
            return await self._batcher.generate(rollout_id, token_ids, sampling)
        finally:
            self._core.engine_request(local, -1)

    async def _admit(self, local: int, rollout_ids: list) -> frozenset | None:
        """Wait until the scheduler admits the group at the engines' version; returns the ids the
        scheduler already holds (pushed before a resume), or None if stopped first. A refused group
        asks again once the engines' version changed, or after `admit_recheck_s`."""
        while not self._stop.is_set():
            version = await self._engine_version()
            decision = await self._scheduler.admit.remote(rollout_ids, version, self._index)
            if decision.admit:
                known = frozenset(decision.known)
                self._core.admitted(local, [rid for rid in rollout_ids if rid not in known])
                return known
            self._core.counts["not_admitted"] += 1
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
            self._core.counts["rejected_samples"] += len(result.rejected)
            if not result.deferred:
                return True
            self._core.counts["deferred_retries"] += 1
            samples = [samples[i] for i in result.deferred]
            await self._idle(result.retry_after_s or 0.05)
        return True

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
        self._core.times["idle_s"] += time.perf_counter() - started

    def _abandon(self, local: int) -> None:
        admitted = self._core.abandon(local)
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


__all__ = ["AgentProducer", "PRODUCER_NAME", "PromptSpec", "create_agent_producer", "start_agent_producer"]
