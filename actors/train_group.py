"""TrainGroup: the driver-side handle on a placement group of Megatron TrainActors.

    group = TrainGroup(TrainGroupConfig(dp_size=2))
    group.register_with(scheduler)          # advertise group.parallel_config
    result = group.train_step(step, scheduler)   # every rank pulls its shard and trains; one ack
    result = group.train_shards(shards)     # the same without a scheduler (tests, benchmarks)
    group.save_checkpoint(path); group.load_checkpoint(path)
    group.shutdown()

Start-up, in order (each with a timeout and an error that says what to change):
1. a placement group, one bundle per rank (`placement_strategy`); waits `placement_timeout_s`
   and names the missing resources when the cluster cannot fit it (Ray itself would wait forever);
2. one TrainActor per bundle;
3. rendezvous: rank 0 picks a free port and publishes host:port; all ranks join
   torch.distributed and Megatron's groups (DP derived) and build the model.

Step failures: if any rank dies or raises, the step raises `TrainStepError` naming the rank;
surviving ranks fail their collective within `collective_timeout_s` (gloo raises as soon as a
peer's connection closes, often before Ray reports the death), so a dead rank is named first
as the root cause ("TrainActor rank k died"). A node removed from the cluster mid-run kills
the ranks on it: the next step fails that way (tests/test_train_placement.py). The group is then
unusable: `shutdown()` it and build a new one (a new process group on a new port).

Importable without Megatron: only the actors import it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.train_actor import train_actor_class
from trainer.config import RankInfo, RankStepResult, StepResult, TrainGroupConfig
from vgbs_ray.config import ParallelConfig
from vgbs_ray.errors import VgbsError
from vgbs_ray.failure_policy import FailureKind
from vgbs_ray.metrics import metric_values, reduce_metric_pairs
from vgbs_ray.layout.shard import StepShard

log = logging.getLogger(__name__)


class PlacementGroupTimeoutError(VgbsError, TimeoutError):
    """The cluster could not fit the train group's placement group in time."""


class TrainStepError(VgbsError, RuntimeError):
    """A rank failed or died during a step, or the step timed out.

    `kind` says which (a `FailureKind`: rank_died, rank_failed, timeout, no_shard), for the
    job's failure policy; the message names the rank and the step.
    """

    def __init__(self, message: str, kind: FailureKind = FailureKind.RANK_FAILED):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):
        return (type(self), (str(self), self.kind))


class TrainGroup:
    """A placement group of TrainActors forming one Megatron job (see module docstring)."""

    def __init__(self, config: TrainGroupConfig):
        self.config = config
        self._pg = self._create_placement_group()
        try:
            actor_class = train_actor_class(num_cpus=config.num_cpus_per_actor, num_gpus=1 if config.on_gpu else 0)
            self.actors = [
                actor_class.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=rank),
                    name=None,
                ).remote(config, rank)
                for rank in range(config.world_size)
            ]
            host, port = ray.get(self.actors[0].address.remote(), timeout=config.setup_timeout_s)
            log.info("train group: %d ranks (dp=%d tp=%d pp=%d vpp=%d), rendezvous at %s:%d", config.world_size,
                     config.dp_size, config.tp_size, config.pp_size, config.vpp_size, host, port)
            self.rank_infos: list[RankInfo] = self._gather(
                [actor.setup.remote(host, port) for actor in self.actors], config.setup_timeout_s, "set-up")
        except BaseException:
            self.shutdown()
            raise

    def node_ids(self) -> list[str]:
        """The Ray node of each rank, in rank order."""
        return ray.get([a.node_id.remote() for a in self.actors], timeout=self.config.setup_timeout_s)

    @property
    def parallel_config(self) -> ParallelConfig:
        """What the scheduler lays steps out for (dp, cp, vpp, micro-batch group)."""
        return self.config.parallel_config

    def register_with(self, scheduler) -> None:
        """Advertise this group's parallel config to a SchedulerActor: it lays every step out for it.

        The node of each DP rank (its lead rank's) goes along: the scheduler puts one object per node
        and step holding the shards of that node's DP ranks, instead of one per rank.
        """
        nodes = self.node_ids()
        rank_nodes = [node for node, info in sorted(zip(nodes, self.rank_infos), key=lambda pair: pair[1].dp_rank)
                      if info.is_lead]
        ray.get(scheduler.register_train_group.remote(self.parallel_config, rank_nodes), timeout=60)

    # -- steps --------------------------------------------------------------------------

    def train_step(self, step: int, scheduler, *, shard_timeout_s: float | None = None,
                   while_waiting: Callable[[], None] | None = None, adapter: str | None = None) -> StepResult | None:
        """Every rank pulls its shard of `step` and trains it, then this driver acks the step for all of
        them; None when the stream ended. The driver asks the scheduler for every DP rank's ShardRef in
        one call and hands each rank its own (TP peers share their DP rank's): one scheduler call per
        step for the whole group, whatever its size; the shards themselves go from the object store
        straight to the ranks. `while_waiting` is called about every `_WAITING_SLICE_S` seconds until the
        scheduler answers, on this thread, with every rank idle (the closed loop's `catch_up`). Multi-LoRA:
        `adapter` names the tenant whose scheduler this is (its step trains that adapter only)."""
        wait_s = shard_timeout_s if shard_timeout_s is not None else self.config.step_timeout_s
        waiting_since = time.perf_counter()
        answer = scheduler.get_step.remote(step, timeout_s=wait_s)
        deadline = time.monotonic() + wait_s + 30
        if while_waiting is not None:
            while not ray.wait([answer], timeout=_WAITING_SLICE_S)[0] and time.monotonic() < deadline:
                while_waiting()
        try:
            refs = ray.get(answer, timeout=max(deadline - time.monotonic(), 0))
        except ray.exceptions.RayTaskError as error:
            raise TrainStepError(f"step {step}: the scheduler has no shard for it: {error.cause!r}",
                                 FailureKind.NO_SHARD) from error
        shard_wait_s = time.perf_counter() - waiting_since
        if refs is None:
            return None
        return self.train_refs(step, scheduler, refs, wait_s=wait_s, shard_wait_s=shard_wait_s, adapter=adapter)

    def train_refs(self, step: int, scheduler, refs: list, *, wait_s: float, shard_wait_s: float = 0.0,
                   adapter: str | None = None) -> StepResult:
        """Train `step` from the ShardRefs the scheduler answered (`scheduler.get_step`), then ack it; what
        `train_step` does once the answer is in (a multi-tenant job asks every tenant's scheduler at once)."""
        if len(refs) != self.config.dp_size:
            raise TrainStepError(f"step {step}: the scheduler laid it out for {len(refs)} DP ranks, this group has "
                                 f"{self.config.dp_size}", FailureKind.NO_SHARD)
        # The step's rollout count in each rank's task name: the Ray dashboard's task list shows it.
        task_name = f"train_step step={step} rollouts={refs[0].num_rollouts}"
        results = self._gather([actor.train_step.options(name=task_name).remote(refs[info.dp_rank], wait_s, adapter)
                                for actor, info in zip(self.actors, self.rank_infos)],
                               self.config.step_timeout_s + wait_s, f"step {step}")
        self._ack(step, scheduler, results)
        return dataclasses.replace(_combine(results), shard_wait_s=shard_wait_s)

    def _ack(self, step: int, scheduler, results: list[RankStepResult]) -> None:
        """Tell the scheduler every DP rank trained `step`, with each replica's metric pairs (from its lead
        rank): one call per step, not one per rank (each call costs the scheduler ~1 ms of CPU)."""
        metrics_by_rank = {info.dp_rank: result.metrics for info, result in zip(self.rank_infos, results) if info.is_lead}
        try:
            ray.get(scheduler.ack_ranks.remote(step, metrics_by_rank), timeout=_ACK_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            raise TrainStepError(f"step {step}: trained, but the scheduler did not take the ack: {error!r}",
                                 FailureKind.SCHEDULER_LOST) from error

    def train_shards(self, shards: Sequence[StepShard]) -> StepResult:
        """Train one step from given shards, one per DP rank (TP peers of a DP rank share it)."""
        dp_size = self.config.dp_size
        if len(shards) != dp_size or sorted(s.rank for s in shards) != list(range(dp_size)):
            raise ValueError(f"need one shard per DP rank 0..{dp_size - 1}, got ranks {[s.rank for s in shards]}")
        refs_by_dp = {s.rank: ray.put(s) for s in shards}  # put once; TP peers share the object
        step = shards[0].step
        results = self._gather([actor.train_shard.remote(refs_by_dp[info.dp_rank])
                                for actor, info in zip(self.actors, self.rank_infos)],
                               self.config.step_timeout_s, f"step {step}")
        return _combine(results)

    def _gather(self, refs: list, timeout_s: float, what: str) -> list:
        """Results of every rank; raise at the first failed rank, or when `timeout_s` passes.

        A dead rank is the root cause its peers' failed collectives only echo (gloo notices a
        closed connection before Ray reports the death): after a rank raises, the others get
        `_ROOT_CAUSE_GRACE_S` to report a death, and a dead rank is named first.
        """
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, object] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                missing = sorted(rank_of[r] for r in pending)
                raise TrainStepError(f"{what}: ranks {missing} did not finish within {timeout_s:.0f} s "
                                     "(a hung collective or a slow scheduler); shut this group down",
                                     FailureKind.TIMEOUT)
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as error:
                raise _died(what, rank, error) from error
            except ray.exceptions.RayTaskError as error:
                grace = min(_ROOT_CAUSE_GRACE_S, max(deadline - time.monotonic(), 0))
                others, _ = ray.wait(pending, num_returns=len(pending), timeout=grace) if pending else ([], [])
                for other in others:
                    try:
                        ray.get(other)
                    except ray.exceptions.RayActorError as death:
                        raise _died(what, rank_of[other], death, echo=(rank, error.cause)) from death
                    except ray.exceptions.RayTaskError:
                        pass
                raise TrainStepError(f"{what}: TrainActor rank {rank} failed: {error.cause!r}") from error
        return [results[rank] for rank in range(len(refs))]

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> list[dict]:
        """Per rank: model shard, optimizer, LR-schedule position (in memory, for tests)."""
        return self._gather([a.state_dict.remote() for a in self.actors], self.config.step_timeout_s, "state_dict")

    def load_state_dict(self, states: Sequence[dict]) -> None:
        self._gather([a.load_state_dict.remote(s) for a, s in zip(self.actors, states)],
                     self.config.step_timeout_s, "load_state_dict")

    def save_checkpoint(self, path: str) -> list[str]:
        """Model + optimizer + LR position, one file per model-parallel shard, at a step boundary."""
        written = self._gather([a.save_checkpoint.remote(str(path)) for a in self.actors],
                               self.config.step_timeout_s, "save_checkpoint")
        return [w for w in written if w]

    def save_adapters(self, directory: str) -> list[str]:
        """LoRA: each adapter as PEFT files (`adapter_config.json`, `adapter_model.safetensors`) in `directory`
        (train.lora's), or in `directory/<tenant>` (multi-LoRA); loadable by `peft` onto the Hugging Face model and
        by vLLM (docs/lora.md). Returns the directories."""
        if not self.config.adapters:
            raise ValueError("save_adapters: this train group trains every weight (train.lora is not set)")
        written = []
        for name in self.config.adapters:
            target = os.path.join(str(directory), name) if self.config.tenant_adapters else str(directory)
            results = self._gather([a.save_adapter.remote(target, name) for a in self.actors],
                                   self.config.step_timeout_s, "save_adapter")
            written.append(next(w for w in results if w))
        return written

    def load_checkpoint(self, path: str) -> None:
        self._gather([a.load_checkpoint.remote(str(path)) for a in self.actors],
                     self.config.step_timeout_s, "load_checkpoint")

    def load_full_parameters(self, full: dict) -> None:
        """Set every rank's parameters from whole-model arrays (global names, as `full_parameters` gives)."""
        ref = ray.put(full)
        self._gather([a.load_full_parameters.remote(ref) for a in self.actors], self.config.step_timeout_s,
                     "load_full_parameters")

    def full_parameters(self) -> dict:
        """The whole model's parameters (TP shards gathered, PP stages joined, experts
        gathered over EP), as numpy arrays, from rank 0."""
        gathered = self._gather([a.full_parameters.remote() for a in self.actors],
                                self.config.step_timeout_s, "full_parameters")
        return gathered[0]

    def shutdown(self) -> None:
        """Kill the actors and free the placement group (safe after a failure)."""
        for actor in getattr(self, "actors", []):
            ray.kill(actor, no_restart=True)
        self.actors = []
        if getattr(self, "_pg", None) is not None:
            remove_placement_group(self._pg)
            self._pg = None

    # -- start-up -----------------------------------------------------------------------

    def _create_placement_group(self):
        c = self.config
        bundle = {"CPU": c.num_cpus_per_actor, **({"GPU": 1} if c.on_gpu else {})}
        pg = placement_group([dict(bundle) for _ in range(c.world_size)], strategy=c.placement_strategy)
        ready, _ = ray.wait([pg.ready()], timeout=c.placement_timeout_s)
        if not ready:
            available = ray.available_resources()
            remove_placement_group(pg)
            raise PlacementGroupTimeoutError(
                f"placement group of {c.world_size} bundles {bundle} ({c.placement_strategy}) not ready after "
                f"{c.placement_timeout_s:.0f} s; the cluster has {_resources(available)} free. Lower "
                "dp_size/tp_size or num_cpus_per_actor, add nodes, or raise placement_timeout_s"
            )
        return pg


_ROOT_CAUSE_GRACE_S = 10.0
"""After one rank raises, how long the others get to report that one of them died (the root cause)."""
_ACK_TIMEOUT_S = 30.0
_WAITING_SLICE_S = 0.5
"""How often `train_step` calls its `while_waiting` while the scheduler forms the step (seconds)."""


def _died(what: str, rank: int, error: BaseException, echo: tuple | None = None) -> TrainStepError:
    also = "" if echo is None else f"; rank {echo[0]}'s collective failed as a consequence: {echo[1]!r}"
    return TrainStepError(f"{what}: TrainActor rank {rank} died ({type(error).__name__}); the group's "
                          f"collectives are broken: shut it down and start a new one{also}", FailureKind.RANK_DIED)


def _resources(available: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(available.items()) if k in ("CPU", "GPU")) or "none"


def _combine(results: list[RankStepResult]) -> StepResult:
    """One step's result: the lead ranks' metric pairs summed (count-weighted), the slowest rank's time."""
    first = results[0]
    pairs = reduce_metric_pairs([r.metrics for r in results if r.metrics])
    return StepResult(
        step=first.step,
        num_rollouts=first.num_rollouts,
        metrics=metric_values(pairs),
        metric_pairs=pairs,
        lr=first.lr,
        grad_norm=first.grad_norm,
        step_time_s=max(r.step_time_s for r in results),
        num_microbatches=first.num_microbatches,
        consumed_rollouts=first.consumed_rollouts,
    )
