"""A producer's bookkeeping, synchronous and Ray-free: which prompts it answers, which groups are open,
what it pushed and lost. `actors/agent_producer.py` is the thin actor around it (the awaits: admission,
the agents, the engines, the pushes).

    core = ProducerCore(index, config, source, length=prompts.length(source), cursor=None)
    group = core.draw()                     # the next prompt as a group (None: the source or max_prompts ended)
    core.admitted(group.local, ids_not_yet_held)   # the scheduler admitted it
    core.pushed(rewards, num_samples, metrics, metric_counts)   # ... and it was pushed whole (or failed(reason))
    core.settle(group.local)                # done with it: the cursor may move past it
    core.abandon(group.local)               # or: stopped before it was settled -> the admitted ids to give back

Invariants (tests/test_producer_core.py):
- Producer i of P answers positions i, i+P, ... (`producer_positions`); its k-th own position is its
  `local` index k. Rollout ids are `{prompt key}-r{member}`: a pure function of the position.
- `cursor()` is the oldest local index drawn and not settled (an abandoned one stays unsettled), or the
  next undrawn one: a producer started from it draws every group not settled before, with the same ids.
- A local index is open (drawn, not settled) until `settle`; `abandon` gives back its admitted ids once.
- Metrics average over the rollouts that reported them, never over the rest as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vgbs_ray.agents.generation import SamplingConfig
from vgbs_ray.errors import ConfigError
from vgbs_ray.prompt_source import producer_positions


@dataclass(frozen=True, kw_only=True)
class AgentProducerConfig:
    """One producer's settings (the job builds it from its `rollout` section)."""

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
    """Share of groups pushed one sample per submit call (actors/agent_producer.py). Their rollouts are pushed
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


def member_seed(seed: int, position: int, member: int) -> int:
    """The sampling seed of a group member: a pure function of the run's seed, the prompt position and the member."""
    return (seed * 1_000_003 + position) * 1_024 + member


@dataclass(frozen=True)
class Group:
    """One prompt drawn as a GRPO group: this producer's `local`-th own position, source `position`."""

    local: int
    position: int
    key: str
    row: Any
    rollout_ids: tuple[str, ...]
    one_by_one: bool
    """Its samples are pushed one per submit (`pushes_samples_one_by_one`)."""


class ProducerCore:
    """See module docstring. `source` answers `prompt(position) -> (key, row)`; `length` is how many source
    positions all producers answer together (None: endless); `cursor` is a previous run's `cursor()`."""

    def __init__(self, index: int, config: AgentProducerConfig, source, *, length: int | None,
                 cursor: dict | None = None):
        self.index, self.config, self._source = index, config, source
        start = int(cursor["next_index"]) if cursor is not None else 0
        self._positions = producer_positions(index, config.num_producers, start, length)
        self._next_local = start
        self._drawn = 0
        self._unsettled: set[int] = set()  # drawn, not yet settled (abandoned ones stay)
        self._working: set[int] = set()  # drawn and not yet let go (`release`)
        self._awaiting_engine: dict[int, int] = {}  # local -> its requests at the engines now
        self._admitted: dict[int, list] = {}  # local -> rollout ids admitted and not yet pushed or reported
        self.counts = dict(groups=0, rollouts=0, samples=0, deferred_retries=0, rejected_samples=0,
                           abandoned_rollouts=0, not_admitted=0, skipped_known_groups=0)
        """Counters the actor adds to as well (deferred_retries, rejected_samples, not_admitted)."""
        self.times = dict(engine_wait_s=0.0, idle_s=0.0)
        """Seconds the actor's awaits spent, by kind."""
        self._failed: dict[str, int] = {}
        self._reward_sum, self._reward_count = 0.0, 0
        self._unreported = (0.0, 0)
        self._metric_sums: dict[str, float] = {}
        self._metric_counts: dict[str, int] = {}

    # -- groups ------------------------------------------------------------------------

    def draw(self) -> Group | None:
        """The next own prompt as a group, open until `settle`; None once the source or `max_prompts` ended."""
        if self.config.max_prompts is not None and self._drawn >= self.config.max_prompts:
            return None
        position = next(self._positions, None)
        if position is None:
            return None
        local = self._next_local
        self._next_local += 1
        self._drawn += 1
        self._unsettled.add(local)
        self._working.add(local)
        key, row = self._source.prompt(position)
        return Group(local=local, position=position, key=key, row=row,
                     rollout_ids=tuple(f"{key}-r{m}" for m in range(self.config.group_size)),
                     one_by_one=pushes_samples_one_by_one(self.config.seed, position, self.config.sample_push_fraction))

    def admitted(self, local: int, rollout_ids) -> None:
        """The scheduler admitted the group; `rollout_ids` are those it did not hold yet (given back on abandon)."""
        self._admitted[local] = list(rollout_ids)

    def skipped_known(self, local: int) -> None:
        """The scheduler held every rollout of the group already (pushed before a resume): nothing to run."""
        self._admitted.pop(local, None)
        self.counts["skipped_known_groups"] += 1

    def failed(self, local: int, reason: str) -> None:
        """An agent lost the group for `reason` (the actor reported its rollouts to the scheduler)."""
        self._failed[reason] = self._failed.get(reason, 0) + 1
        self._admitted.pop(local, None)

    def pushed(self, local: int, rewards, num_samples: int, metrics: dict, metric_counts: dict) -> None:
        """The group's samples were pushed whole: count them, their rewards, the metrics the agents reported."""
        self._admitted.pop(local, None)
        rewards = list(rewards)
        self.counts["groups"] += 1
        self.counts["rollouts"] += len(rewards)
        self.counts["samples"] += num_samples
        self._reward_sum += sum(rewards)
        self._reward_count += len(rewards)
        self._unreported = (self._unreported[0] + sum(rewards), self._unreported[1] + len(rewards))
        for name, value in metrics.items():
            if name != "num_samples":
                self._metric_sums[name] = self._metric_sums.get(name, 0.0) + value
                self._metric_counts[name] = self._metric_counts.get(name, 0) + metric_counts.get(name, 0)

    def settle(self, local: int) -> None:
        """Done with the group (pushed, failed or skipped): the cursor may move past it."""
        self._unsettled.discard(local)

    def abandon(self, local: int) -> list:
        """Stopped before the group was settled: it stays unsettled (a resumed producer draws it again);
        returns its admitted ids, once, to give back to the scheduler's staleness window."""
        self.counts["abandoned_rollouts"] += self.config.group_size
        return self._admitted.pop(local, [])

    def release(self, local: int) -> None:
        """No worker answers the group any more (settled or abandoned)."""
        self._working.discard(local)

    def engine_request(self, local: int, delta: int) -> None:
        """A request of the group went to the engines (+1) or came back (-1)."""
        count = self._awaiting_engine.get(local, 0) + delta
        if count:
            self._awaiting_engine[local] = count
        else:
            self._awaiting_engine.pop(local, None)

    # -- reports -----------------------------------------------------------------------

    def cursor(self) -> dict:
        """{"next_index": k}: the oldest own position not yet settled (see module docstring)."""
        return {"next_index": min(self._unsettled, default=self._next_local)}

    def drain_rewards(self) -> tuple[float, int]:
        """(sum, count) of the rewards of rollouts pushed since the previous call (filtered ones too)."""
        drained, self._unreported = self._unreported, (0.0, 0)
        return drained

    def report(self, *, stopped: bool, endpoint_outcomes: dict | None = None, endpoint_refused: int = 0,
               endpoint_after_end: int = 0) -> AgentProducerReport:
        count = self._reward_count
        return AgentProducerReport(
            agent=self.index, **self.counts, failed_groups=dict(self._failed),
            **{k: round(v, 3) for k, v in self.times.items()},
            mean_reward=self._reward_sum / count if count else None,
            agent_metrics={k: v / self._metric_counts[k] for k, v in self._metric_sums.items() if self._metric_counts[k]},
            agent_metric_counts=dict(self._metric_counts),
            endpoint_outcomes=dict(endpoint_outcomes or {}),
            stopped=stopped, in_flight=len(self._working),
            endpoint_refused=endpoint_refused, endpoint_after_end=endpoint_after_end,
            awaiting_engine=len(self._awaiting_engine), awaiting_requests=sum(self._awaiting_engine.values()),
            cursor=self.cursor())
