"""The vgbs-ray training job: agentic producers -> SchedulerActor -> Megatron TrainActors.

    python -m jobs.train                                  # the closed_loop preset, in-process Ray
    python -m jobs.train --preset synthetic               # the synthetic agent instead (no engines)
    python -m jobs.train --config jobs/configs/cluster_16gpu.yaml --set scheduler.batch.global_batch_size=6
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m jobs.train --set run.ray_address=auto

The default is the closed loop (jobs/rollout_source.py): vLLM engines start from the policy's
initial weights, AgentProducers run the configured agent (rollout.agent; the demo's digit
agent by default, docs/agents.md) through them, and after every optimizer
step the train group publishes its weights (policy version = steps trained) and the engines load
them without the trainer waiting. The synthetic preset runs the same producers with the
synthetic agent (examples/synthetic_agent.py: made-up samples, no engines) instead.

Per step it prints one line (rollouts, samples, micro-batches per rank, tokens, loss,
reward, time; in the closed loop also the policy version, staleness, the sampled reward, the
train/engine log-prob mismatch and the weight-sync time) and appends one JSON record to <output_dir>/steps.jsonl; at the end a
summary, <output_dir>/summary.json and a plot <output_dir>/steps.png. Checkpoints hold the
train group's state, the scheduler's state (ledger, buffered rollouts, step, policy version) and
the producers' cursors; --set run.resume=true continues the run from the latest one, exactly
once (jobs/checkpoint.py). With --set run.loggers=[console,jsonl,tensorboard,wandb,mlflow] the steps, the
config and the summary also go to those trackers (jobs/tracking.py; names and units: docs/metrics.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

import ray

from jobs.checkpoint import latest_checkpoint, load_resume_point
from jobs.controller import RunController
from jobs.job_config import PRESETS, JobConfig, load_job_config, options_help
from jobs.job_metrics import JobMetrics
from jobs.metric_names import counters_from_stats, step_values
from jobs.progress import StepLine, StepRecorder, plot_records, read_records
from jobs.summary import closed_loop_summary, input_failure, producers_outcome, step_line, summarize
from jobs.recovery import RECOVERABLE_ERRORS, JobFailedError, job_scheduler_config
from jobs.tracking import Tracker
from vgbs_ray.checkpoint_files import tokenizer_size
from vgbs_ray.errors import ConfigError

log = logging.getLogger("vgbs.job")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.train",
        description="Train a Megatron GPT with a variable global batch counted in rollouts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="options (set in the YAML file or with --set section.key=value):\n" + options_help(),
    )
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="the whole config to start from (default: the YAML's `preset:`, else closed_loop)")
    parser.add_argument("--config", help="YAML file with sections run, rollout, scheduler, train, and optionally "
                                         "`preset: NAME`; its keys change the preset's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one option, e.g. --set scheduler.batch.global_batch_size=6 (repeatable)")
    parser.add_argument("--records", help="JSON Lines file for per-step records (default: <run.output_dir>/steps.jsonl)")
    return parser.parse_args(argv)


def init_ray(config: JobConfig) -> bool:
    """Start an in-process cluster or attach to one; returns whether this job started it.

    A process already connected to Ray (`main` called from a notebook or a test) runs the job on
    that cluster, whatever run.ray_address says. The auth mode is Ray's to decide, never set here:
    an in-process cluster gets Ray's default (token auth), and a job attached to a cluster inherits
    that cluster's RAY_AUTH_MODE and token.
    """
    if ray.is_initialized():
        return False
    if config.run.ray_address == "local":
        ray.init(address="local", num_cpus=config.run.local_num_cpus, include_dashboard=False,
                 object_store_memory=256 << 20, log_to_driver=False)
        return True
    ray.init(address=config.run.ray_address)
    return False


def check_tokenizer_fits(config: JobConfig) -> None:
    """The closed loop's tokenizer must fit the model's vocabulary (every id it makes is a model token)."""
    loop = config.rollout
    if not loop.use_engines:
        return
    if loop.tokenizer_dir is None:
        log.info("rollout.tokenizer_dir is not set: agents get token ids only (ctx.chat needs a tokenizer)")
        return
    if not os.path.isdir(loop.tokenizer_dir):
        raise ConfigError(f"rollout.tokenizer_dir={loop.tokenizer_dir!r} is not a directory (run from the "
                          "project's root, or give an absolute path)")
    size = tokenizer_size(loop.tokenizer_dir)
    if size > config.train.model.vocab_size:
        raise ConfigError(f"rollout.tokenizer_dir={loop.tokenizer_dir!r} has {size} tokens but train.model."
                          f"vocab_size={config.train.model.vocab_size}: raise the vocabulary to at least {size}")


def resolve_loss(config: JobConfig) -> JobConfig:
    """Build the configured policy loss once, here, so a loss that cannot run fails before any actor starts
    (`LossConfig.build`: the import path, its kwargs, its output on a probe, staleness without a correction);
    returns the config with what the loss decides for the scheduler filled in (Dr. GRPO's advantages are
    not divided by the group's reward std)."""
    loss = config.train.loss.build()
    if loss.policy.scale_advantages_by_std is None:
        return config
    intake = dataclasses.replace(config.scheduler.intake, advantage_std=loss.policy.scale_advantages_by_std)
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, intake=intake))


def check_cluster_fits(config: JobConfig, resources: dict[str, float]) -> None:
    """Impossible parallel sizes for this cluster fail now, not as a placement group that waits forever."""
    train = config.train
    needed = {"CPU": train.world_size * train.num_cpus_per_actor}
    if train.on_gpu:
        needed["GPU"] = train.world_size
    for kind, amount in needed.items():
        if resources.get(kind, 0) < amount:
            raise ConfigError(
                f"train needs {amount:g} {kind} (world_size = dp*tp*pp*cp = {train.world_size}) but the cluster has "
                f"{resources.get(kind, 0):g}: lower train.dp_size / train.tp_size, or add nodes"
            )


def train(config: JobConfig, records_path: str, on_event=None) -> dict:
    """Run the job on an initialised Ray; returns the summary (see `Job`).

    `on_event(event, step, controller)`, if given, is called with "step_started" before each step
    and "step_trained" after its record is written (step: the run's global step; for tests and tools; a
    multi-tenant job calls `on_event(event, tenant, step, job)`).
    """
    if config.tenants:  # multi-LoRA: one adapter per tenant over one base (jobs/tenants.py)
        from jobs.tenants import train_tenants

        return train_tenants(config, on_event)
    job = Job(config, records_path, on_event)
    try:
        job.build()
        return job.run()
    finally:
        job.close()


class Job:
    """One run: build, run, close (torchtitan's shape).

    build: the run's controller (jobs/controller.py) builds the scheduler (restored when resuming), the
    rollout source (jobs/rollout_source.py: engines, producers) and the train group, and owns them from then on,
    with every recovery. run: the step loop (`run_steps`), then, in this order, producers stop and the input is
    closed, what never trained is dropped (run_ended), the ledger is checked; returns the summary. close:
    everything the controller started goes, also after a failure.
    """

    def __init__(self, config: JobConfig, records_path: str, on_event=None):
        config = resolve_loss(config)
        self.config, self.records_path, self.on_event = config, records_path, on_event
        self.metrics = JobMetrics(config.run.output_dir)
        self.controller = RunController(config, job_scheduler_config(config), on_recovery=self.metrics.on_recovery)
        self.tracker = None
        self.first_step = 0

    # -- build ------------------------------------------------------------------------------

    def build(self) -> None:
        config, out = self.config, self.config.run.output_dir
        resume_from = latest_checkpoint(out) if config.run.resume else None
        resume = load_resume_point(resume_from) if resume_from is not None else None
        self.first_step = resume.next_step if resume is not None else 0
        self.resumed = resume_from is not None
        # run.loggers' trackers (TensorBoard, W&B, MLflow): open off this thread, the config logged once.
        self.tracker = Tracker.start(config, first_step=self.first_step, resumed=resume is not None)
        # A resume restores the scheduler (global step numbers continue at the checkpoint's step, settled rollout
        # ids stay known, untrained ones train first) and starts producers at their cursors. The engines' and
        # producers' processes start while the train group does; the engines serve once the group's weights
        # (version = steps trained so far) reached them, and the producers run then.
        started = time.monotonic()
        self.controller.build(resume_from, resume)
        if resume is not None:
            print(f"resumed from {resume_from} at step {self.first_step} (policy version {resume.policy_version}, "
                  f"{resume.scheduler_state.num_live_rollouts} untrained rollouts restored)", flush=True)
        loop = self.controller.rollouts
        engines = (f"{config.rollout.engines.num_engines} rollout engine(s) at policy version {self.first_step}"
                   if loop.engines is not None else "no rollout engines")
        print(f"rollouts: {engines}, {len(loop.producers)} producers of {config.rollout.agent} "
              f"({time.monotonic() - started:.1f} s to start them and the train group)", flush=True)

    # -- run --------------------------------------------------------------------------------

    def run(self) -> dict:
        config, controller = self.config, self.controller
        start = time.monotonic()
        recorder = StepRecorder(self.records_path, append=self.resumed) if "jsonl" in config.run.loggers else None
        try:
            trained = self.run_steps(recorder)
        finally:
            if recorder is not None:
                recorder.close()
        elapsed = time.monotonic() - start
        controller.stop_producers()
        scheduler = controller.scheduler
        # Steps emitted past the last trained one (run.num_steps reached) never train: dropped as run_ended.
        ray.get(scheduler.drop_untrained.remote(self.first_step + len(trained)), timeout=60)
        stats = ray.get(scheduler.stats.remote(check_ledger=True), timeout=60)
        watches = controller.producer_watches
        summary = {**summarize(stats, trained, elapsed, controller), "producers": producers_outcome(watches)}
        reports = [report for watch in watches for report in watch.reports]
        if controller.rollouts.engines is not None:
            summary["closed_loop"] = closed_loop_summary(
                trained, reports, controller.rollouts, stats=stats, elapsed_s=elapsed,
                engine_replacements=controller.engine_watch.replacements)
        self.tracker.finish(trained, summary, counters_from_stats(stats, controller.recovery_count()))
        self.tracker.close()
        if self.tracker.active:
            summary["loggers"] = self.tracker.status()
        return summary

    def run_steps(self, recorder: StepRecorder | None) -> list[StepLine]:
        """Train up to run.num_steps steps, or until the input ends; returns the line of each step in
        the final model's history.

        Closed loop (engines): after each trained step k the group publishes its weights as policy
        version k + 1 and the engines load them without the trainer waiting; after a recovery the
        restored weights are published as the restored step's version.

        A train-group or scheduler failure is recovered by the controller: the steps after the latest
        checkpoint train again, their lines replaced by the replay's (the records file keeps both, in
        time order). Steps are global: a resumed run's scheduler, records and checkpoints continue at
        its checkpoint's step, and run.num_steps counts the whole run's steps (a resumed run stops
        where the uninterrupted one would). The run ends with a checkpoint. A run the controller could
        not keep going (an engine past its budget) stops with JobFailedError, never a quietly shorter one.
        """
        run, controller = self.config.run, self.controller
        lines: dict[int, StepLine] = {}
        step = self.first_step
        while True:
            try:
                controller.poll()
                if step < run.num_steps:
                    line = self.train_step(step, recorder)
                    if line is not None:
                        lines[step] = line
                        step += 1
                        continue
                    controller.poll()
                    print(f"input ended after {step - self.first_step} steps", flush=True)
                    if step != self.first_step:  # again even at a cadence step: rollouts dropped at the end belong in it
                        controller.checkpoint(step)
                elif step != self.first_step and controller.checkpointed_step != step:
                    controller.checkpoint(step)
                return [lines[s] for s in sorted(lines)]
            except RECOVERABLE_ERRORS as error:
                step = controller.recover(error, step).restored_step
                for undone in [s for s in lines if s >= step]:
                    del lines[undone]

    def train_step(self, step: int, recorder: StepRecorder | None) -> StepLine | None:
        """Train `step`, publish its weights, report it, checkpoint at the cadence; None when the input ended."""
        run, controller, on_event = self.config.run, self.controller, self.on_event
        if on_event is not None:
            on_event("step_started", step, controller)
        result = controller.group.train_step(step, controller.scheduler, shard_timeout_s=run.shard_timeout_s,
                                             while_waiting=controller.poll)
        if result is None:
            return None
        record = ray.get(controller.scheduler.step_record.remote(step), timeout=60)
        line = step_line(result, record)
        loop = controller.rollouts
        if loop.engines is not None:
            sync_s = loop.publish(controller.group, step + 1)
            line = dataclasses.replace(
                line, policy_version=step, weight_sync_s=sync_s, sampled_reward=loop.drain_sampled_reward(),
                engine_load_s=loop.load_times_s[-1][1] if loop.load_times_s else None,
                engine_idle_share=loop.engine_idle_share() if step % 10 == 0 else None)
        self.metrics.on_step(step, step_values(line))  # the dashboard's per-step gauges (jobs/job_metrics.py)
        if "console" in run.loggers:
            print(line.text(), flush=True)
        if recorder is not None:
            recorder.write(line)
        controller.consumed_rollouts = result.consumed_rollouts
        if on_event is not None:
            on_event("step_trained", step, controller)
        if run.checkpoint_every and (step + 1) % run.checkpoint_every == 0:
            controller.checkpoint(step + 1)
        # Hands over the steps a checkpoint now holds to the trackers (off this thread).
        self.tracker.on_step(line, final_before=controller.checkpointed_step,
                             counters=counters_from_stats(controller.last_stats, controller.recovery_count())
                             if controller.last_stats is not None else None)
        return line

    # -- close ------------------------------------------------------------------------------

    def close(self) -> None:
        """Everything this job started goes, producers first (also after a failure; safe to call twice)."""
        if self.tracker is not None:  # a failed run: what is final so far stays logged, the runs marked failed
            self.tracker.close(failed=True)
        self.controller.shutdown()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    config = load_job_config(args.config, args.set, preset=args.preset)  # a wrong config fails here, before any actor exists
    check_tokenizer_fits(config)
    out = config.run.output_dir
    os.makedirs(out, exist_ok=True)
    records_path = args.records or os.path.join(out, "steps.jsonl")
    started_ray = init_ray(config)
    try:
        check_cluster_fits(config, ray.cluster_resources())
        summary = train(config, records_path)
    finally:
        if started_ray:
            ray.shutdown()
    print("summary: " + json.dumps(summary), flush=True)
    with open(os.path.join(out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    if config.run.plot and os.path.exists(records_path) and not config.tenants:
        plot_records(read_records(records_path), os.path.join(out, "steps.png"))
        print(f"plot: {os.path.join(out, 'steps.png')}", flush=True)
    if config.tenants:
        from jobs.tenants import tenants_failure

        failure = tenants_failure(summary)
    else:
        failure = input_failure(summary, config.run.num_steps)
    if failure is not None:  # the summary and records are written: the run's outputs say what happened
        raise JobFailedError(failure)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)
    except JobFailedError as error:  # the policy stopped the run: its message says why and what was lost
        print(f"job failed: {error}", file=sys.stderr)
        sys.exit(1)
