"""The closed loop's producer: GRPO groups of the digit task sampled from the policy's engines.

    producer = start_env_producer(config, scheduler, engines.client(), index=0, cursor=None)
    run_ref = producer.run.remote()         # returns after stop(), or when its prompts ran out
    ray.get(producer.cursor.remote())       # {"seed", "next_index"}: resume from here
    ray.get(producer.stop.remote())         # in-flight groups are abandoned (scheduler.abandon)

`EnvProducer` is an asyncio actor (`num_cpus=0`: it only awaits) with `groups_in_flight`
workers. Each worker loops: take a prompt (a Ray Data row if this producer was given a
dataset, else the next prompt of its own `PromptGenerator`), ask the scheduler to admit the
group's rollout ids at the engines' current policy version (`admit`: ids the scheduler already
holds after a resume are skipped; not admitted: wait and ask again), run the group's episodes turn by turn (one batched
`generate` per turn for the group's live episodes; every Generation carries its policy version
and behaviour log-probs), and push the group's samples (`EpisodeGroup.to_samples`) in one
`submit`, resubmitting what was deferred after `retry_after_s`. Uniform-reward groups are pushed
too: the scheduler's dynamic-sampling filter (`intake.drop_uniform_groups`) drops them.

Invariants:
- Rollout ids are `rollout_id_for(prompt, member)`: a pure function of (seed, index, member), so
  a producer resumed from `cursor()` regenerates exactly the groups not pushed, with the same
  ids (the scheduler rejects a re-pushed duplicate).
- `cursor()` is the cursor of the OLDEST generator prompt drawn but not yet fully pushed (or
  the next undrawn one when none is in flight). Dataset prompts are not in it: they are a
  separate, finite stream (their own seed), consumed once.
- A group is pushed whole or not at all (one submit of all its samples; deferred ones are
  resubmitted, not dropped); a stopped producer abandons its unpushed groups and tells the
  scheduler (`abandon`), so admitted-but-never-pushed rollouts do not hold staleness budget.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import ray

from actors.rollout_engine import SamplingConfig
from vgbs_ray.envs.digits import DigitTaskConfig, Prompt, PromptCursor, PromptGenerator, prompt_from_row
from vgbs_ray.envs.episode import EpisodeGroup
from vgbs_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class EnvProducerConfig:
    """One producer's settings (the job builds it from its `closed_loop` section)."""

    task: DigitTaskConfig = field(default_factory=DigitTaskConfig)
    group_size: int = 8
    """Rollouts per prompt (GRPO group)."""
    groups_in_flight: int = 8
    """Groups this producer samples concurrently (each is admitted before it starts)."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_tokens=1, temperature=1.0))
    """Per turn; max_tokens must be 1 (one digit per answer). The seed, if set, is mixed with the
    prompt and turn so that every request samples differently but reproducibly."""
    one_sample_per_turn: bool = True
    """True: a rollout that retried yields 2 samples (context compaction); False: one transcript sample."""
    max_prompts: int | None = None
    """Generator prompts this producer answers before `run` returns; None = until `stop()`."""
    admit_retry_s: float = 0.05
    """Wait before asking the scheduler again when a group was not admitted."""

    def __post_init__(self):
        for name in ("group_size", "groups_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"EnvProducerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.sampling.max_tokens != 1:
            raise ConfigError(f"EnvProducerConfig.sampling.max_tokens must be 1 (the digit task answers one token "
                              f"per turn), got {self.sampling.max_tokens}")
        if self.max_prompts is not None and self.max_prompts < 0:
            raise ConfigError(f"EnvProducerConfig.max_prompts must be >= 0 or None, got {self.max_prompts}")
        if self.admit_retry_s <= 0:
            raise ConfigError(f"EnvProducerConfig.admit_retry_s must be > 0 seconds, got {self.admit_retry_s}")


@dataclass(frozen=True)
class EnvProducerReport:
    """What one producer did (times in seconds, summed over its workers)."""

    agent: int
    groups: int
    """Groups wholly pushed (accepted, rejected or filtered by the scheduler)."""
    rollouts: int
    samples: int
    dataset_groups: int
    """Of `groups`: prompts that came from the Ray Data dataset."""
    deferred_retries: int
    rejected_samples: int
    abandoned_rollouts: int
    """Rollouts of groups started but not pushed when `stop()` came."""
    not_admitted: int
    """Admission refusals (each followed by a wait and a new request)."""
    skipped_known_groups: int
    """Groups not sampled because the scheduler already held all their rollouts (a resumed run)."""
    engine_wait_s: float
    """Awaiting the engines' generate."""
    idle_s: float
    """Awaiting admission or a deferred push's retry (not sampling)."""
    mean_reward: float | None
    """Over every pushed rollout (filtered groups included): the sampling policy's reward."""
    stopped: bool
    in_flight: int
    """Prompts drawn and not yet pushed or abandoned, at the time of the report."""
    cursor: dict


class EnvProducer:
    """See module docstring. Made remote by `start_env_producer`."""

    def __init__(self, agent: int, config: EnvProducerConfig, scheduler, engines, *, cursor: dict | None = None,
                 seed: int = 0, dataset=None):
        self._agent, self._config, self._scheduler, self._engines = agent, config, scheduler, engines
        start = PromptCursor.from_dict(cursor) if cursor is not None else PromptCursor(seed=seed)
        self._prompts = PromptGenerator(config.task, start)
        self._drawn = 0
        self._in_flight: dict[str, tuple[Prompt, bool]] = {}  # prompt id -> (prompt, from the dataset)
        self._unpushed: dict[str, int] = {}  # generator prompts drawn, not pushed (abandoned ones too): id -> index
        self._admitted: dict[str, list[str]] = {}  # prompt id -> rollout ids admitted, not yet pushed
        self._stop = asyncio.Event()
        self._dataset = dataset
        self._dataset_rows: asyncio.Queue | None = None
        self._dataset_done = dataset is None
        self._counts = dict(groups=0, rollouts=0, samples=0, dataset_groups=0, deferred_retries=0,
                            rejected_samples=0, abandoned_rollouts=0, not_admitted=0, skipped_known_groups=0)
        self._times = dict(engine_wait_s=0.0, idle_s=0.0)
        self._reward_sum, self._reward_count = 0.0, 0
        self._unreported = (0.0, 0)  # (sum, count) since the last `drain_rewards`
        self._running = False
        self._finished = asyncio.Event()

    # -- the actor's API -----------------------------------------------------------------

    async def run(self) -> EnvProducerReport:
        """Sample and push groups until `stop()` (or `max_prompts` and the dataset ran out)."""
        self._running = True
        if self._dataset is not None:
            self._start_dataset_reader(asyncio.get_running_loop())
        workers = [asyncio.create_task(self._worker(i)) for i in range(self._config.groups_in_flight)]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            # One worker failed (e.g. an engine died): the others stop too and abandon their groups,
            # then the error goes to the caller (the job counts a failed producer).
            self._stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        finally:
            self._running = False
            self._finished.set()
        return self.report()

    async def stop(self) -> EnvProducerReport:
        """Stop: workers return at their next await; unpushed groups are abandoned (and the scheduler told)."""
        self._stop.set()
        if self._running:
            await self._finished.wait()
        return self.report()

    def cursor(self) -> dict:
        """The generator cursor to resume from (see module docstring)."""
        cursor = self._prompts.cursor
        return PromptCursor(cursor.seed, min(self._unpushed.values(), default=cursor.next_index)).to_dict()

    def drain_rewards(self) -> tuple[float, int]:
        """(sum, count) of the rewards of rollouts pushed since the previous call (filtered ones too)."""
        drained, self._unreported = self._unreported, (0.0, 0)
        return drained

    def report(self) -> EnvProducerReport:
        mean = self._reward_sum / self._reward_count if self._reward_count else None
        return EnvProducerReport(agent=self._agent, **self._counts, **{k: round(v, 3) for k, v in self._times.items()},
                                 mean_reward=mean, stopped=self._stop.is_set(), in_flight=len(self._in_flight),
                                 cursor=self.cursor())

    # -- workers -----------------------------------------------------------------------

    async def _worker(self, worker: int) -> None:
        while not self._stop.is_set():
            item = await self._next_prompt()
            if item is None:
                return
            prompt, from_dataset = item
            self._in_flight[prompt.prompt_id] = (prompt, from_dataset)
            if not from_dataset:
                self._unpushed[prompt.prompt_id] = prompt.index
            try:
                pushed = await self._answer(prompt, from_dataset)
            finally:
                del self._in_flight[prompt.prompt_id]
            if not pushed:
                return
            self._unpushed.pop(prompt.prompt_id, None)

    async def _next_prompt(self) -> tuple[Prompt, bool] | None:
        """A dataset row while the dataset has some, else the generator's next prompt; None when out of both."""
        while self._dataset_rows is not None and not self._stop.is_set():
            try:
                row = self._dataset_rows.get_nowait()
            except asyncio.QueueEmpty:
                if self._dataset_done or self._generator_left():  # never idle while the dataset warms up
                    break
                try:  # only dataset rows are left to answer: wait for the next one
                    row = await asyncio.wait_for(self._dataset_rows.get(), timeout=0.1)
                except asyncio.TimeoutError:
                    continue
            if row is not None:  # None: the end-of-dataset marker
                return prompt_from_row(self._config.task, row), True
        if self._stop.is_set() or not self._generator_left():
            return None
        self._drawn += 1
        return next(self._prompts), False

    def _generator_left(self) -> bool:
        return self._config.max_prompts is None or self._drawn < self._config.max_prompts

    async def _answer(self, prompt: Prompt, from_dataset: bool) -> bool:
        """One group from admission to push; False when stopped before it was pushed (abandoned)."""
        config = self._config
        group = EpisodeGroup(config.task, prompt, group_size=config.group_size)
        try:
            return await self._sample_and_push(prompt, from_dataset, group)
        except BaseException:  # an engine or the scheduler failed: admitted rollouts must not hold room
            self._abandon(prompt.prompt_id, group)
            raise

    async def _sample_and_push(self, prompt: Prompt, from_dataset: bool, group: EpisodeGroup) -> bool:
        config = self._config
        known = await self._admit(prompt.prompt_id, group.rollout_ids)
        if known is None:
            return self._abandon(prompt.prompt_id, group)
        if len(known) == len(group.rollout_ids):  # a resumed producer: the scheduler holds this group already
            self._counts["skipped_known_groups"] += 1
            return True
        turn = 0
        while not group.done:
            live = group.live()
            sampling = config.sampling
            if sampling.seed is not None:  # request i gets seed + i: distinct per prompt, turn and member
                seed = (sampling.seed * 1_000_003 + prompt.seed * 7_919 + prompt.index * 31 + turn) * config.group_size
                sampling = _with_seed(sampling, seed % (1 << 31))
            started = time.perf_counter()
            generations = await self._engines.generate([episode.context() for _, episode in live], sampling)
            self._times["engine_wait_s"] += time.perf_counter() - started
            if self._stop.is_set():
                return self._abandon(prompt.prompt_id, group)
            for (_, episode), generation in zip(live, generations):
                episode.submit(generation.response_token_ids, generation.response_log_probs, generation.policy_version)
            turn += 1
        samples = [row for row in group.to_samples(one_sample_per_turn=config.one_sample_per_turn)
                   if row["rollout_id"] not in known]  # known ones were pushed before a resume
        if not await self._push(samples):
            return self._abandon(prompt.prompt_id, group)
        self._admitted.pop(prompt.prompt_id, None)
        rewards = list(group.rewards().values())
        self._counts["groups"] += 1
        self._counts["dataset_groups"] += from_dataset
        self._counts["rollouts"] += len(rewards)
        self._counts["samples"] += len(samples)
        self._reward_sum += sum(rewards)
        self._reward_count += len(rewards)
        self._unreported = (self._unreported[0] + sum(rewards), self._unreported[1] + len(rewards))
        return True

    async def _admit(self, prompt_id: str, rollout_ids: list[str]) -> frozenset | None:
        """Wait until the scheduler admits the group at the engines' version; returns the ids the
        scheduler already holds (pushed before a resume), or None if stopped first."""
        while not self._stop.is_set():
            decision = await self._scheduler.admit.remote(rollout_ids, await self._engine_version())
            if decision.admit:
                known = frozenset(decision.known)
                self._admitted[prompt_id] = [rid for rid in rollout_ids if rid not in known]
                return known
            self._counts["not_admitted"] += 1
            await self._idle(self._config.admit_retry_s)
        return None

    async def _engine_version(self) -> int:
        """The oldest policy version any engine holds (a rollout may be sampled by any of them)."""
        versions = await asyncio.gather(*[e.current_policy_version.remote() for e in self._engines.engines])
        return min(versions)

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

    async def _idle(self, seconds: float) -> None:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass
        self._times["idle_s"] += time.perf_counter() - started

    def _abandon(self, prompt_id: str, group: EpisodeGroup) -> bool:
        self._counts["abandoned_rollouts"] += len(group.rollout_ids)
        admitted = self._admitted.pop(prompt_id, None)
        if admitted:
            self._scheduler.abandon.remote(admitted)  # fire and forget: the scheduler may be going away too
        return False

    # -- the dataset -------------------------------------------------------------------

    def _start_dataset_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        """A thread iterates the dataset (Ray Data's iterator blocks) and hands rows to the loop."""
        self._dataset_rows = asyncio.Queue()

        def read() -> None:
            try:
                for row in self._dataset.iter_rows():
                    if self._stop.is_set():
                        break
                    loop.call_soon_threadsafe(self._dataset_rows.put_nowait, dict(row))
            finally:
                loop.call_soon_threadsafe(self._end_dataset)

        threading.Thread(target=read, name=f"env-producer-{self._agent}-dataset", daemon=True).start()

    def _end_dataset(self) -> None:
        self._dataset_done = True
        self._dataset_rows.put_nowait(None)


def _with_seed(sampling: SamplingConfig, seed: int) -> SamplingConfig:
    from dataclasses import replace

    return replace(sampling, seed=seed)


def mean_reward(reports: list[EnvProducerReport]) -> float | None:
    """Rollout-weighted mean reward over producers' reports."""
    pairs = [(r.mean_reward * r.rollouts, r.rollouts) for r in reports if r.mean_reward is not None]
    total = sum(count for _, count in pairs)
    return sum(s for s, _ in pairs) / total if total else None


def start_env_producer(agent: int, config: EnvProducerConfig, scheduler, engines, *, cursor: dict | None = None,
                       seed: int = 0, dataset=None, name: str | None = None):
    """One EnvProducer actor (num_cpus=0, asyncio) and its `run` ref, as an (actor, ref) pair."""
    remote = ray.remote(num_cpus=0, max_concurrency=64)(EnvProducer)
    actor = remote.options(name=name).remote(agent, config, scheduler, engines, cursor=cursor, seed=seed,
                                             dataset=dataset)
    return actor, actor.run.remote()


__all__ = ["EnvProducer", "EnvProducerConfig", "EnvProducerReport", "mean_reward", "start_env_producer"]
