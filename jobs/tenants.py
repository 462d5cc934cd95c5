"""A multi-LoRA job: several tenants train their own adapters over one base, one train group and one engine pool.

    python -m jobs.train --config my_tenants.yaml      # a JobConfig with `tenants:` (docs/lora.md)

Each tenant is a job of its own on the rollout side: its `JobConfig.tenant_view` (agent, prompts, global batch
in its own rollouts, steps, seed), its SchedulerActor (`vgbs-scheduler-<name>`: its steps are formed from its
rollouts only and laid out on the rollout side, so a micro-batch never mixes adapters), its producers
(`vgbs-producer-<name>-i`, sampling with its adapter through the shared engines) and its policy versions (the
steps it trained). The train side is shared: one TrainGroup holds every tenant's adapter with its own optimizer
and LR schedule (`TrainGroupConfig.tenant_adapters`), and a step trains the adapter of the tenant whose step it is.

Which tenant's step comes next: round robin over the tenants whose next step is ready (every tenant's next
`get_step` is asked for at once; of those answered, the one that trained least recently goes). A tenant whose
rollouts carry 4x the samples gets no more steps for it: steps are counted in each tenant's rollouts, and a ready
tenant waits at most one round. A tenant whose step does not come within `run.shard_timeout_s` (its agent fails
everywhere, its prompts ended) ends alone; the others go on. The summary reports per tenant its steps, rollouts
per step, trainer time share and engine share (tokens sampled), and its adapter is written as PEFT files to
`<output_dir>/adapters/<name>/` at the end.

Checkpoints (every `run.checkpoint_every` steps over all tenants, and at the end): `checkpoints/step_N/` holds the
train group's files (every adapter, each tenant's optimizer state and consumed rollouts), `adapter/<name>/`, and
per tenant `tenants/<name>/` (its producers' cursors, taken first, its scheduler's state, ledger and next step).
`run.resume=true` restores each tenant's scheduler and producers from there and the train group from its files:
exactly once per tenant, as the single-policy job (jobs/checkpoint.py). A tenant's end is checkpointed too.

Recovery: a failed train rank (dead, raised, hung) restarts the train group from the latest checkpoint, within
`run.max_failures`; every running tenant's scheduler is rewound to its step there (it retained what trained since)
and its engines' adapter goes back to that version; the producers go on. Not yet: a dead engine is not replaced
(the tenants' steps stop coming and they end failed), a lost scheduler is not restored, the endpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import ray

from actors.rollout_engine import RolloutEnginePool
from actors.scheduler_actor import create_scheduler
from actors.shutdown import terminate
from actors.train_group import TrainGroup, TrainStepError
from jobs.checkpoint import (checkpoint_root, latest_checkpoint, load_resume_point, mark_latest, producer_cursors,
                             save_job_json, save_rollout_state, save_train_state)
from jobs.rollout_source import RolloutSource, engine_start_dir
from jobs.producer_watch import ProducerWatch, close_input, give_up, stop_producers
from jobs.progress import StepLine, StepRecorder
from jobs.recovery import RECOVERABLE_ERRORS, JobFailedError, job_scheduler_config, retains_until_checkpoint
from jobs.summary import closed_loop_summary, producers_outcome, step_line, summarize
from vgbs_ray.failure_policy import ActionKind, FailureKind, RecoveryDone, RunState, TrainFailed, decide

log = logging.getLogger("vgbs.job")

_POLL_S = 1.0
"""How often the tenants' loop looks at their producers while it waits for a step (seconds)."""


@dataclass
class Tenant:
    """One tenant's rollout side and its progress in the run."""

    name: str
    config: object
    """Its JobConfig view (`JobConfig.tenant_view`)."""
    scheduler: object
    rollouts: RolloutSource
    watch: ProducerWatch | None = None
    recorder: StepRecorder | None = None
    next_step: int = 0
    cursors: list = field(default_factory=list)
    """Its producers' cursors at the latest checkpoint (or the one resumed from)."""
    lines: list[StepLine] = field(default_factory=list)
    trainer_s: float = 0.0
    outcome: str = "running"
    """running, then finished (its steps or its input ended) or failed: <why>."""


def round_robin_choice(order: list[str], ready: set[str]) -> str | None:
    """The tenant to train next: the first of `order` (least recently trained first) with a ready step."""
    return next((name for name in order if name in ready), None)


class TenantJob:
    """build, run, close (as jobs.train.Job), for `config.tenants` (see module docstring).

    `on_event(event, tenant, step, job)`, if given, is called with "step_started" before a tenant's step trains
    and "step_trained" after its record is written (for tests: a kill at a known point, never a sleep)."""

    def __init__(self, config, on_event=None):
        self.config, self.on_event = config, on_event
        self.engines = self.group = None
        self.tenants: list[Tenant] = []
        self.restore_path: str | None = None
        """The latest checkpoint (or the one resumed from); None: a recovery restarts from the initial weights."""
        self.restore_steps: dict[str, int] = {}
        """Each tenant's next step in that checkpoint: a recovery rewinds it there."""
        self.recoveries: list[dict] = []
        self.state = RunState(config.run.max_failures)
        """The run's state and failure budget (vgbs_ray/failure_policy.py), as in the single-policy job."""

    def build(self) -> None:
        config = self.config
        train = config.train_with_tenants()
        adapters = tuple((name, adapter.lora) for name, adapter in train.adapters.items())
        self.engines = RolloutEnginePool(dataclasses.replace(config.rollout.engines, lora_adapters=adapters),
                                         engine_start_dir(config), policy_version=0, wait=False)
        resume_from = latest_checkpoint(config.run.output_dir) if config.run.resume else None
        for index, tenant in enumerate(config.tenants):
            view = config.tenant_view(index)
            point = load_resume_point(tenant_checkpoint(resume_from, tenant.name)) if resume_from else None
            # With run.max_failures > 0 it retains trained rollouts until a checkpoint holds them (a recovery rewinds).
            scheduler = create_scheduler(job_scheduler_config(view), name=f"vgbs-scheduler-{tenant.name}",
                                         restore=point.scheduler_state if point else None)
            first = point.next_step if point else 0
            cursors = point.cursors if point else None
            loop = RolloutSource.launch(view, scheduler, policy_version=first, tenant=tenant.name, engines=self.engines,
                                     cursors=cursors)
            self.tenants.append(Tenant(tenant.name, view, scheduler, loop, next_step=first,
                                       cursors=list(cursors or [])))
        self.restore_path = resume_from
        self.restore_steps = {tenant.name: tenant.next_step for tenant in self.tenants}
        self.group = self._new_group()
        if resume_from is not None:
            print(f"resumed from {resume_from}: " + ", ".join(f"{t.name} at step {t.next_step}" for t in self.tenants),
                  flush=True)
        self.resumed = resume_from is not None
        for tenant in self.tenants:  # its adapter (the base with the first) to the engines, then its producers run
            tenant.rollouts.start(tenant.config, self.group, tenant.scheduler)
            tenant.watch = ProducerWatch(tenant.rollouts.producers)
            if "jsonl" in config.run.loggers:
                tenant.recorder = StepRecorder(os.path.join(tenant.config.run.output_dir, "steps.jsonl"),
                                               append=self.resumed)
        print(f"tenants: {', '.join(t.name for t in self.tenants)} over one base, "
              f"{config.rollout.engines.num_engines} rollout engine(s)", flush=True)

    def run(self) -> dict:
        started = time.monotonic()
        pending = self._ask_running()
        order = [tenant.name for tenant in self.tenants]
        by_name = {tenant.name: tenant for tenant in self.tenants}
        every = self.config.run.checkpoint_every
        trained = 0
        while pending:
            refs = list(pending.values())
            while not ray.wait(refs, num_returns=1, timeout=_POLL_S)[0]:
                self._poll_producers()
            answered, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            name = round_robin_choice(order, {n for n, ref in pending.items() if ref in answered})
            order.remove(name)
            order.append(name)
            tenant = by_name[name]
            try:
                stepped = self._train(tenant, pending.pop(name))
            except RECOVERABLE_ERRORS as error:
                self._recover(error, tenant)
                pending = self._ask_running()
                continue
            if stepped:
                trained += 1
                if tenant.next_step < tenant.config.run.num_steps:
                    pending[name] = self._ask(tenant)
                    if every and trained % every == 0 and not self._checkpoint_or_recover(tenant):
                        pending = self._ask_running()
                    continue
            # A tenant's end is checkpointed before its producers stop: a recovery never rewinds a tenant whose
            # producers have stopped, and one whose end checkpoint failed is still running (rewound, asked again).
            checkpointed = self._checkpoint_or_recover(tenant)
            if not checkpointed:
                pending = self._ask_running()
                if tenant.outcome == "running":
                    continue
            if tenant.outcome == "running":
                tenant.outcome = "finished"
            _stop_producers(tenant)
        return self._summary(time.monotonic() - started)

    def _poll_producers(self) -> None:
        """Each tenant's producers as they end (one that dies or fails is not restarted here: it ends, the others
        go on), and its input closed once they all ended."""
        for tenant in self.tenants:
            if tenant.watch is None:
                continue
            for event in tenant.watch.poll():
                give_up(tenant.watch, tenant.scheduler, event, f"tenant {tenant.name}'s producers are not restarted")
            close_input(tenant.scheduler, tenant.watch)

    def _checkpoint_or_recover(self, tenant: Tenant) -> bool:
        """A checkpoint; False when a train rank failed during it (a rank killed right after a step fails the next
        collective, which may be this checkpoint's): then the group is recovered from the previous one."""
        try:
            self._checkpoint()
        except RECOVERABLE_ERRORS as error:
            self._recover(error, tenant)
            return False
        return True

    def _ask_running(self) -> dict:
        return {tenant.name: self._ask(tenant) for tenant in self.tenants
                if tenant.outcome == "running" and tenant.next_step < tenant.config.run.num_steps}

    def _new_group(self) -> TrainGroup:
        """A train group at the latest checkpoint (or the initial weights), registered with every tenant's
        scheduler."""
        group = TrainGroup(self.config.train_with_tenants())
        try:
            if self.restore_path is not None:
                group.load_checkpoint(self.restore_path)
            for tenant in self.tenants:
                group.register_with(tenant.scheduler)
        except BaseException:
            group.shutdown()
            raise
        return group

    def _recover(self, error: BaseException, failed: Tenant) -> None:
        """A train rank failed during `failed`'s step: a new group from the latest checkpoint, every running
        tenant's scheduler rewound to its step there (the rollouts trained since train again, exactly once), its
        engines' adapter back to that version. Raises JobFailedError when run.max_failures is spent."""
        kind = error.kind if isinstance(error, TrainStepError) else FailureKind.TIMEOUT
        self.state, action = decide(self.state, TrainFailed(kind))
        if action.kind is ActionKind.STOP:
            raise JobFailedError(f"tenant {failed.name}, step {failed.next_step}: {error}; {action.reason}") from error
        started = time.monotonic()
        log.warning("tenant %s, step %d failed (%s): %s; restarting the train group", failed.name, failed.next_step,
                    kind.value, error)
        self.group.shutdown()
        self.group = self._new_group()
        redone = {}
        for tenant in self.tenants:
            if tenant.outcome != "running":
                continue  # checkpointed at its end: nothing of it to redo
            step = self.restore_steps[tenant.name]
            ray.get(tenant.scheduler.rewind.remote(step), timeout=60)
            redone[tenant.name] = tenant.next_step - step
            tenant.next_step = step
            tenant.lines = [line for line in tenant.lines if line.step < step]
            tenant.rollouts.restore(self.group, step)
        self.recoveries.append({"kind": kind.value, "tenant": failed.name, "steps_redone": redone,
                                "restored_from": self.restore_path, "time_to_recover_s":
                                round(time.monotonic() - started, 2)})
        self.state, _ = decide(self.state, RecoveryDone())
        print(f"recovered from {kind.value} in tenant {failed.name}'s step: a new train group from "
              f"{self.restore_path or 'the initial weights'}, steps redone {redone}", flush=True)

    def _checkpoint(self) -> str:
        """Every tenant's rollout side (its producers' cursors first, then its scheduler at its next step), then the
        train group (every adapter, each tenant's optimizer and consumed rollouts); `latest` last. Taken between
        two steps on this thread, so it is one consistent cut over the tenants."""
        total = sum(tenant.next_step for tenant in self.tenants)
        path = os.path.join(checkpoint_root(self.config.run.output_dir), f"step_{total:06d}")
        for tenant in self.tenants:
            def cursors(tenant=tenant):
                tenant.cursors = producer_cursors(tenant.rollouts.producers, tenant.cursors)
                return tenant.cursors

            where = tenant_checkpoint(path, tenant.name)
            save_job_json(where, save_rollout_state(where, tenant.next_step, tenant.scheduler, cursors),
                          tenant.next_step)
        save_train_state(path, self.group)
        mark_latest(self.config.run.output_dir, path)
        self.restore_path = path
        self.restore_steps = {tenant.name: tenant.next_step for tenant in self.tenants}
        if retains_until_checkpoint(self.config):  # the steps it holds are settled for good
            for tenant in self.tenants:
                ray.get(tenant.scheduler.checkpointed.remote(tenant.next_step), timeout=60)
        return path

    def _ask(self, tenant: Tenant):
        return tenant.scheduler.get_step.remote(tenant.next_step, timeout_s=self.config.run.shard_timeout_s)

    def _train(self, tenant: Tenant, answer) -> bool:
        """Train the tenant's answered step; False when it has no more (input ended, or it failed)."""
        step = tenant.next_step
        try:
            refs = ray.get(answer)
        except ray.exceptions.RayTaskError as error:  # no step within run.shard_timeout_s: this tenant ends alone
            tenant.outcome = f"failed: step {step} did not come: {error.cause!r}"
            log.error("tenant %s: %s; the other tenants go on", tenant.name, tenant.outcome)
            _stop_producers(tenant, timeout_s=30)
            return False
        if self.on_event is not None:
            self.on_event("step_started", tenant, step, self)
        if refs is None:  # its input ended: by design once its steps are done, else its agent or prompts failed it
            wanted = tenant.config.run.num_steps
            if step < wanted:
                _stop_producers(tenant)
                failed = {reason: n for report in tenant.watch.reports for reason, n in report.failed_groups.items()}
                tenant.outcome = f"failed: its input ended after {step} of {wanted} steps (failed groups: {failed})"
                log.error("tenant %s: %s; the other tenants go on", tenant.name, tenant.outcome)
            return False
        result = self.group.train_refs(step, tenant.scheduler, refs, wait_s=self.config.run.shard_timeout_s,
                                       adapter=tenant.name)
        record = ray.get(tenant.scheduler.step_record.remote(step), timeout=60)
        sync_s = tenant.rollouts.publish(self.group, step + 1)
        line = dataclasses.replace(step_line(result, record), policy_version=step, weight_sync_s=sync_s,
                                   sampled_reward=tenant.rollouts.drain_sampled_reward())
        tenant.lines.append(line)
        tenant.trainer_s += result.step_time_s
        tenant.next_step = step + 1
        if "console" in self.config.run.loggers:
            print(f"[{tenant.name}] {line.text()}", flush=True)
        if tenant.recorder is not None:
            tenant.recorder.write(line)
        if self.on_event is not None:
            self.on_event("step_trained", tenant, step, self)
        return True

    def _summary(self, elapsed_s: float) -> dict:
        for tenant in self.tenants:
            _stop_producers(tenant)
        usage = self.engines.utilization()
        tokens = {tenant.name: sum(u.response_tokens_by_adapter.get(tenant.name, 0) for u in usage)
                  for tenant in self.tenants}
        trainer_total = sum(t.trainer_s for t in self.tenants) or 1.0
        token_total = sum(tokens.values()) or 1
        per_tenant = {}
        for tenant in self.tenants:
            ray.get(tenant.scheduler.drop_untrained.remote(tenant.next_step), timeout=60)
            stats = ray.get(tenant.scheduler.stats.remote(check_ledger=True), timeout=60)
            per_tenant[tenant.name] = {
                "outcome": tenant.outcome,
                **summarize(stats, tenant.lines, elapsed_s),
                "producers": producers_outcome([tenant.watch]),
                "closed_loop": closed_loop_summary(tenant.lines, tenant.watch.reports, tenant.rollouts, stats=stats,
                                                   elapsed_s=elapsed_s),
                "trainer_time_share": round(tenant.trainer_s / trainer_total, 3),
                "engine_tokens": tokens[tenant.name],
                "engine_token_share": round(tokens[tenant.name] / token_total, 3),
                "samples_per_rollout": round(sum(line.num_samples for line in tenant.lines)
                                             / max(sum(line.num_rollouts for line in tenant.lines), 1), 3),
            }
        adapters = self.group.save_adapters(os.path.join(self.config.run.output_dir, "adapters"))
        rollouts = sum(s["rollouts_trained"] for s in per_tenant.values())
        return {"tenants": per_tenant, "adapters": adapters, "recoveries": self.recoveries,
                "elapsed_s": round(elapsed_s, 2),
                "rollouts_trained": rollouts, "rollouts_per_s": round(rollouts / elapsed_s, 3) if elapsed_s else None,
                "steps_by_tenant": {name: s["steps"] for name, s in per_tenant.items()}}

    def close(self) -> None:
        for tenant in self.tenants:
            if tenant.recorder is not None:
                tenant.recorder.close()
                tenant.recorder = None
            _stop_producers(tenant, timeout_s=10)
            tenant.rollouts.shutdown()
        if self.engines is not None:
            self.engines.shutdown()
        if self.group is not None:
            self.group.shutdown()
        for tenant in self.tenants:
            try:
                ray.get(tenant.scheduler.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            terminate([tenant.scheduler])


def tenant_checkpoint(path: str, name: str) -> str:
    """Where a tenant's rollout side lives in a multi-tenant checkpoint (its scheduler state, cursors, ledger)."""
    return os.path.join(path, "tenants", name)


def _stop_producers(tenant: Tenant, timeout_s: float = 60.0) -> None:
    """The tenant's producers stop (once) and its input is closed; the other tenants' go on."""
    if tenant.rollouts.producers:
        def ended(event) -> None:
            give_up(tenant.watch, tenant.scheduler, event, "it ended while the producers stopped")

        stop_producers(tenant.rollouts.producers, tenant.watch, tenant.scheduler, ended, timeout_s=timeout_s)
        tenant.rollouts.producers.clear()


def train_tenants(config, on_event=None) -> dict:
    """Run a multi-tenant job on an initialised Ray; returns its summary."""
    job = TenantJob(config, on_event)
    try:
        job.build()
        return job.run()
    finally:
        job.close()


def tenants_failure(summary: dict) -> str | None:
    """Why a multi-tenant run failed although it ended: every tenant failed."""
    outcomes = {name: tenant["outcome"] for name, tenant in summary["tenants"].items()}
    if all(outcome.startswith("failed") for outcome in outcomes.values()):
        return f"every tenant failed: {outcomes}"
    return None


__all__ = ["TenantJob", "round_robin_choice", "tenants_failure", "train_tenants"]
