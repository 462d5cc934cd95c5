"""The vgbs-ray training job: agentic producers -> SchedulerActor -> Megatron TrainActors.

    python -m jobs.train                                  # embedded default: in-process Ray, tiny GPT
    python -m jobs.train --config jobs/configs/local.yaml --set scheduler.batch.global_batch_size=6
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m jobs.train --set run.ray_address=auto

Per step it prints one line (rollouts, samples, micro-batches per rank, tokens, loss,
reward, time) and appends one JSON record to <output_dir>/steps.jsonl; at the end a
summary, <output_dir>/summary.json and a plot <output_dir>/steps.png. Checkpoints hold the
train group's state and the scheduler's ledger; --set run.resume=true continues from the
latest one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time

import ray

from actors.producers import rollout_dataset, start_producers
from actors.scheduler_actor import create_scheduler
from actors.train_group import TrainGroup
from jobs.checkpoint import latest_checkpoint, load_job_state, save_job_state
from jobs.job_config import JobConfig, load_job_config, options_help
from jobs.progress import StepLine, StepRecorder, plot_records, read_records
from vgbs_ray.errors import ConfigError

log = logging.getLogger("vgbs.job")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.train",
        description="Train a Megatron GPT with a variable global batch counted in rollouts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="options (set in the YAML file or with --set section.key=value):\n" + options_help(),
    )
    parser.add_argument("--config", help="YAML file with sections run, producers, scheduler, train (default: embedded)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one option, e.g. --set scheduler.batch.global_batch_size=6 (repeatable)")
    parser.add_argument("--records", help="JSON Lines file for per-step records (default: <run.output_dir>/steps.jsonl)")
    return parser.parse_args(argv)


def init_ray(config: JobConfig) -> bool:
    """Start an in-process cluster or attach to one; returns whether this job started it.

    The auth mode is Ray's to decide, never set here: an in-process cluster gets Ray's default
    (token auth), and a job attached to a cluster inherits that cluster's RAY_AUTH_MODE and token.
    """
    if config.run.ray_address == "local":
        ray.init(address="local", num_cpus=config.run.local_num_cpus, include_dashboard=False,
                 object_store_memory=256 << 20, log_to_driver=False)
        return True
    ray.init(address=config.run.ray_address)
    return False


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


def close_input_when_producers_finish(scheduler, producers, timeout_s: float) -> threading.Thread:
    """A driver thread: once every producer returned, tell the scheduler no more input comes."""

    def wait_and_close():
        try:
            reports = ray.get([ref for _, ref in producers], timeout=timeout_s)
            log.info("producers done: %s", [(r.rollouts, r.samples, r.rejected_samples) for r in reports])
        except Exception as error:  # noqa: BLE001 - a failed producer ends its input; training goes on
            log.error("a producer failed: %r", error)
        ray.get(scheduler.end_of_input.remote(), timeout=timeout_s)

    thread = threading.Thread(target=wait_and_close, name="close-input", daemon=True)
    thread.start()
    return thread


def step_line(result, record) -> StepLine:
    return StepLine(
        step=result.step, num_rollouts=result.num_rollouts, num_samples=record.num_samples,
        microbatches_per_rank=record.microbatches_per_rank[0], num_tokens=record.num_tokens,
        loss=result.metrics.get("loss", float("nan")), reward=result.metrics.get("reward", float("nan")),
        step_time_s=result.step_time_s, lr=result.lr, layout=record.layout, partial=record.partial,
    )


def train(config: JobConfig, records_path: str) -> dict:
    """Run the job on an initialised Ray; returns the summary."""
    out = config.run.output_dir
    resume_from = latest_checkpoint(out) if config.run.resume else None
    scheduler = create_scheduler(config.scheduler_with_model_limits())
    group = None
    try:
        group = TrainGroup(config.train)
        first_step = 0
        if resume_from is not None:
            first_step = load_job_state(resume_from, group)["next_step"]
            print(f"resumed from {resume_from} at step {first_step}", flush=True)
        group.register_with(scheduler)
        run_tag = f"from-step{first_step}"  # fresh rollout ids after a resume
        producers = start_producers(config.producers, scheduler, run_tag)
        if config.producers.dataset_prompts:
            ray.get(scheduler.consume_dataset.remote(rollout_dataset(config.producers, run_tag)), timeout=60)
        close_input_when_producers_finish(scheduler, producers, timeout_s=600)

        start = time.monotonic()
        recorder = StepRecorder(records_path, append=resume_from is not None)
        try:
            trained = run_steps(config, group, scheduler, recorder, first_step)
        finally:
            recorder.close()
        elapsed = time.monotonic() - start
        if trained:
            save_job_state(out, first_step + len(trained), group, scheduler)
        return summarize(ray.get(scheduler.stats.remote(), timeout=60), trained, elapsed)
    finally:
        if group is not None:
            group.shutdown()
        try:
            ray.get(scheduler.close.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        ray.kill(scheduler)


def run_steps(config: JobConfig, group: TrainGroup, scheduler, recorder: StepRecorder, first_step: int) -> list[StepLine]:
    """Train up to run.num_steps steps, or until the input ends; returns one StepLine per step.

    The scheduler numbers its steps from 0; the job's step (records, checkpoints) continues
    a resumed run from `first_step`.
    """
    trained: list[StepLine] = []
    for scheduler_step in range(config.run.num_steps):
        result = group.train_step(scheduler_step, scheduler, shard_timeout_s=config.run.shard_timeout_s)
        if result is None:
            print(f"input ended after {len(trained)} steps", flush=True)
            break
        record = ray.get(scheduler.step_record.remote(scheduler_step), timeout=60)
        line = dataclasses.replace(step_line(result, record), step=first_step + scheduler_step)
        print(line.text(), flush=True)
        recorder.write(line)
        trained.append(line)
        every = config.run.checkpoint_every
        if every and len(trained) % every == 0:
            save_job_state(config.run.output_dir, first_step + len(trained), group, scheduler)
    return trained


def summarize(stats, trained: list[StepLine], elapsed_s: float) -> dict:
    """The run's summary: rollouts per step, what the ledger says became of every rollout, throughput."""
    rollouts = sum(line.num_rollouts for line in trained)
    return {
        "steps": len(trained),
        "rollouts_per_step": [line.num_rollouts for line in trained],
        "rollouts_trained": rollouts,
        "rollouts_by_state": stats.ledger.rollouts_by_state,
        "dropped_by_reason": stats.ledger.dropped_by_reason,
        "rejected_samples_by_rule": stats.ledger.rejected_samples_by_rule,
        "incomplete_rollouts": len(stats.incomplete_rollouts),
        "elapsed_s": round(elapsed_s, 2),
        "rollouts_per_s": round(rollouts / elapsed_s, 3) if elapsed_s > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    config = load_job_config(args.config, args.set)  # a wrong config fails here, before any actor exists
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
    if config.run.plot and os.path.exists(records_path):
        plot_records(read_records(records_path), os.path.join(out, "steps.png"))
        print(f"plot: {os.path.join(out, 'steps.png')}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)
