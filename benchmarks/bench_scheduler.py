"""SchedulerActor benchmark: push throughput against a no-op actor, and scheduling latency.

    python benchmarks/bench_scheduler.py [--quick]

Payload: what producers send (the synthetic agent's shapes, examples/synthetic_agent.py): batches of sample
dicts with numpy arrays (int64 tokens, int8 loss mask), ~1k tokens each, GRPO groups of
one-sample rollouts carrying group_id/group_size (the scheduler computes the advantages).

Throughput. The driver pushes ROUND_BATCHES batches of BATCH_SAMPLES samples with up to
IN_FLIGHT submits outstanding (a few producers at once) into
  no-op      a threaded Ray actor whose `submit(samples)` returns len(samples)
  scheduler  the real SchedulerActor, train group registered (dp 8 on this node, gbs 512,
             dynamic packing), so steps are laid out and put into the object store (one
             object per step: the node's eight shards, as for a TrainGroup) while pushes
             run; a consumer actor takes every rank's ShardRef (one get_step) and acks the
             step (one ack_ranks), as a TrainGroup's driver does, so the buffer stays bounded
             the way a train group keeps it bounded (it does not fetch the shards: that is
             the trainer's cost, not the scheduler's).
  intake     the same SchedulerActor without a train group (gbs out of reach, flushed with
             leftover="drop" after each round, outside the timing): the push path alone.
No buffer bounds are set: deferrals would measure the consumer, not the push path.
Rounds of the three alternate, so background load on a small machine hits all alike; the
median samples/s of each and its ratio to the no-op are printed (the target is >= 0.5), with the
CPU each round cost the pushed actor's process, the driver and the rest of the machine (raylet,
the consumer, and any unrelated load: read it on a quiet machine) per sample: where the gap to the
no-op is.

Latency. For gbs 512 (dp 8, dynamic packing) the driver pushes a step's rollouts, the
last one alone, then takes all 8 ShardRefs (one get_step): it prints the scheduler's
StepRecord.scheduling_latency_s (last rollout ready -> all shards in the store) and the
driver's view (last submit sent -> every rank's shard gettable), median and max.

Ray's per-call cost. What one empty actor call costs in CPU (the callee's process, the
caller's): an asyncio actor like the SchedulerActor against a threaded one. Every push is
such a call, and so is each of the train side's two calls per step.

Scale. The same at dp 256 x tp 4: 1,024 simulated ranks (async callers in SCALE_POOLS actors)
park their get_shard before the step's last rollout is pushed; the driver's view is last submit
sent -> all 1,024 ShardRefs returned. Twice, side by side: without a node map (one shard object
per DP rank, 256 puts per step) and with every rank's node registered (one object per node).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import psutil
import ray

from vgbs_ray.scheduler.types import SchedulerConfig
from actors.scheduler_actor import create_scheduler
from vgbs_ray.config import BatchConfig, ParallelConfig

BATCH_SAMPLES = 64
PROMPT_TOKENS = 256
RESPONSE_TOKENS = 768           # 1024 tokens per sample
GROUP_SIZE = 8                  # rollouts per prompt
IN_FLIGHT = 4                   # outstanding submits (producers pushing at once)
ROUND_BATCHES = 128             # 8192 samples per round: 16 steps of gbs 512
ROUNDS = 7
GBS = 512
DP_SIZE = 8
MAX_TOKENS_PER_GPU = 16384
LATENCY_STEPS = 8
SCALE_DP, SCALE_TP, SCALE_POOLS, SCALE_STEPS, SCALE_GBS = 256, 4, 4, 5, 1024
TIMEOUT_S = 120


def make_batches(tag: str, num_batches: int, rng: np.random.Generator) -> list[list[dict]]:
    """`num_batches` batches of one-sample rollouts in GRPO groups, fresh rollout ids under `tag`."""
    batches = []
    for b in range(num_batches):
        batch = []
        for i in range(BATCH_SAMPLES):
            group = f"{tag}/b{b}/g{i // GROUP_SIZE}"
            tokens = rng.integers(0, 32_000, PROMPT_TOKENS + RESPONSE_TOKENS, dtype=np.int64)
            batch.append(dict(
                rollout_id=f"{group}/r{i % GROUP_SIZE}", tokens=tokens, response_length=RESPONSE_TOKENS,
                loss_mask=(rng.random(RESPONSE_TOKENS) > 0.1).astype(np.int8), reward=float(rng.random()),
                sample_index=0, rollout_size=1, group_id=group, group_size=GROUP_SIZE,
            ))
        batches.append(batch)
    return batches


class NoOpActor:
    def submit(self, samples):
        return len(samples)


class Consumer:
    """A train group's pull/ack loop, minus training: every rank's ShardRef in one call, then one ack
    for every rank (what TrainGroup's driver does)."""

    def __init__(self, scheduler, dp_size: int):
        self._scheduler, self._dp_size = scheduler, dp_size

    def run(self) -> int:
        step = 0
        while True:
            refs = ray.get(self._scheduler.get_step.remote(step, timeout_s=600))
            if refs is None:
                return step
            ray.get(self._scheduler.ack_ranks.remote(step, {r: None for r in range(self._dp_size)}))
            step += 1


def cpu_seconds_by_process() -> dict[int, float]:
    """user + system CPU seconds of every process on this machine (the cluster is local)."""
    seconds = {}
    for process in psutil.process_iter():
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        seconds[process.pid] = times.user + times.system
    return seconds


def actor_pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=TIMEOUT_S)


def timed_push(actor, pid: int, batches: list[list[dict]]) -> tuple[float, tuple[float, float, float]]:
    """`push`, plus the CPU it cost per sample, in microseconds: (actor's process, driver, all others)."""
    before = cpu_seconds_by_process()
    rate = push(actor, batches)
    after = cpu_seconds_by_process()
    used = {p: t - before.get(p, 0.0) for p, t in after.items()}
    per_sample = 1e6 / (len(batches) * BATCH_SAMPLES)
    mine, driver = used.get(pid, 0.0), used.get(os.getpid(), 0.0)
    return rate, (mine * per_sample, driver * per_sample, (sum(used.values()) - mine - driver) * per_sample)


def push(actor, batches: list[list[dict]]) -> float:
    """Push every batch, at most IN_FLIGHT submits outstanding; returns samples/s."""
    start = time.perf_counter()
    in_flight = []
    for batch in batches:
        if len(in_flight) >= IN_FLIGHT:
            ray.get(in_flight.pop(0), timeout=TIMEOUT_S)
        in_flight.append(actor.submit.remote(batch))
    results = ray.get(in_flight, timeout=TIMEOUT_S)
    elapsed = time.perf_counter() - start
    if results and not isinstance(results[0], int):
        assert all(not r.rejected and not r.deferred for r in results), "the benchmark payload must be accepted"
    return len(batches) * BATCH_SAMPLES / elapsed


def wait_drained(scheduler) -> None:
    """Outside the timing: every formable step emitted and acked, so no work spills into the next round."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        s = ray.get(scheduler.stats.remote(), timeout=TIMEOUT_S)
        if s.steps_trained == s.accepted_samples // GBS:  # one-sample rollouts: every full step trained
            return
        time.sleep(0.02)
    raise TimeoutError("the scheduler did not drain its steps")


def register_on_this_node(scheduler) -> None:
    """The train group a TrainGroup on this one node registers: dp 8, every rank's node named (so one
    shard object per step holds all eight shards)."""
    node = ray.get_runtime_context().get_node_id()
    ray.get(scheduler.register_train_group.remote(ParallelConfig(dp_size=DP_SIZE), [node] * DP_SIZE),
            timeout=TIMEOUT_S)


def batch_config() -> BatchConfig:
    return BatchConfig(global_batch_size=GBS, max_tokens_per_gpu=MAX_TOKENS_PER_GPU, leftover="drop")


def throughput(rounds: int, round_batches: int, rng) -> None:
    noop = ray.remote(NoOpActor).options(num_cpus=0, max_concurrency=64).remote()
    scheduler = create_scheduler(SchedulerConfig(batch=batch_config()), name="bench-throughput")
    register_on_this_node(scheduler)
    consumer = ray.remote(Consumer).options(num_cpus=0).remote(scheduler, DP_SIZE)
    consumer_run = consumer.run.remote()
    # Warm-up: actor start, worker imports, first serialisation paths.
    push(noop, make_batches("warm-noop", 8, rng))
    push(scheduler, make_batches("warm", 8, rng))
    wait_drained(scheduler)

    unreachable = BatchConfig(global_batch_size=1 << 30, max_tokens_per_gpu=MAX_TOKENS_PER_GPU, leftover="drop")
    intake = create_scheduler(SchedulerConfig(batch=unreachable), name="bench-intake-only")
    push(intake, make_batches("warm-intake", 8, rng))

    actors = {"no-op": noop, "intake": intake, "scheduler": scheduler}
    pids = {name: actor_pid(actor) for name, actor in actors.items()}
    rates: dict[str, list[float]] = {name: [] for name in actors}
    cpu: dict[str, list[tuple[float, float, float]]] = {name: [] for name in actors}
    for k in range(rounds):
        # The same arrays for all three, fresh rollout ids for the schedulers each round.
        batches = make_batches(f"round{k}", round_batches, rng)
        for name, actor in actors.items():
            rate, used = timed_push(actor, pids[name], batches)
            rates[name].append(rate)
            cpu[name].append(used)
            if actor is intake:
                ray.get(intake.flush.remote(), timeout=TIMEOUT_S)  # drops what it buffered: memory stays flat
            elif actor is scheduler:
                wait_drained(scheduler)
        print(f"round {k}: " + "   ".join(f"{name} {r[-1]:>6.0f}/s" for name, r in rates.items()))
    stats = ray.get(scheduler.stats.remote(), timeout=TIMEOUT_S)
    noop_med = statistics.median(rates["no-op"])
    mb = round_batches * BATCH_SAMPLES * (PROMPT_TOKENS + RESPONSE_TOKENS) * 9 / 2**20
    print(f"\n== push throughput: {rounds} interleaved rounds of {round_batches} x {BATCH_SAMPLES} samples "
          f"({PROMPT_TOKENS + RESPONSE_TOKENS} tokens, ~{mb:.0f} MiB per round), {IN_FLIGHT} submits in flight")
    print(f"{'':<11} {'median samples/s':>17} {'min':>7} {'max':>7} {'/ no-op':>8} {'per-round median':>17}"
          f"   CPU us/sample: {'actor':>5} {'driver':>6} {'rest':>5}")
    for name, r in rates.items():
        per_round = statistics.median(x / n for x, n in zip(r, rates["no-op"]))
        actor_us, driver_us, rest_us = (statistics.median(c) for c in zip(*cpu[name]))
        print(f"{name:<11} {statistics.median(r):>17.0f} {min(r):>7.0f} {max(r):>7.0f} "
              f"{statistics.median(r) / noop_med:>8.2f} {per_round:>17.2f}"
              f"   {'':<14} {actor_us:>5.0f} {driver_us:>6.0f} {rest_us:>5.0f}")
    print("target: scheduler / no-op >= 0.50 (intake: the push path with no steps formed)")
    print(f"steps emitted while pushing: {stats.steps_emitted}, all acked: {stats.steps_trained == stats.steps_emitted}")
    ray.get(scheduler.end_of_input.remote(), timeout=TIMEOUT_S)
    ray.get(consumer_run, timeout=TIMEOUT_S)
    for actor in (scheduler, intake):
        ray.get(actor.close.remote(), timeout=TIMEOUT_S)
    for actor in (noop, scheduler, intake, consumer):
        ray.kill(actor)


def latency(num_steps: int, rng) -> None:
    scheduler = create_scheduler(SchedulerConfig(batch=batch_config()), name="bench-latency")
    register_on_this_node(scheduler)
    driver_s = []
    for step in range(num_steps):
        samples = [s for b in make_batches(f"lat{step}", GBS // BATCH_SAMPLES, rng) for s in b]
        head = samples[:-1]
        push(scheduler, [head[i:i + BATCH_SAMPLES] for i in range(0, len(head), BATCH_SAMPLES)])
        # The step's last rollout (it completes its group) arrives alone.
        start = time.perf_counter()
        ray.get(scheduler.submit.remote([samples[-1]]), timeout=TIMEOUT_S)
        refs = ray.get(scheduler.get_step.remote(step, timeout_s=TIMEOUT_S), timeout=TIMEOUT_S)
        driver_s.append(time.perf_counter() - start)
        ray.get(scheduler.ack_ranks.remote(step, {r: None for r in range(DP_SIZE)}), timeout=TIMEOUT_S)
        assert len(refs) == DP_SIZE and all(r.step == step for r in refs)
    records = ray.get(scheduler.stats.remote(), timeout=TIMEOUT_S).recent_steps
    sched_ms = [1e3 * r.scheduling_latency_s for r in records]
    driver_ms = [1e3 * s for s in driver_s]
    print(f"\n== scheduling latency: {num_steps} steps of gbs {GBS} ({GBS} samples, "
          f"{GBS * (PROMPT_TOKENS + RESPONSE_TOKENS)} tokens), dp {DP_SIZE}, dynamic packing "
          f"({MAX_TOKENS_PER_GPU} tokens/GPU, {records[0].microbatches_per_rank[0]} micro-batches/rank)")
    print(f"{'':<44} {'median ms':>10} {'max ms':>8}")
    print(f"{'scheduler: last rollout ready -> shards put':<44} {statistics.median(sched_ms):>10.1f} {max(sched_ms):>8.1f}")
    print(f"{'driver: last submit -> 8 ShardRefs returned':<44} {statistics.median(driver_ms):>10.1f} {max(driver_ms):>8.1f}")
    ray.get(scheduler.close.remote(), timeout=TIMEOUT_S)
    ray.kill(scheduler)


class RankPool:
    """Simulated ranks: parks one get_shard per (dp, tp) rank for a step; returns when all returned."""

    def __init__(self, scheduler):
        self._scheduler = scheduler

    async def pull(self, step: int, dp_ranks: list[int]) -> float:
        import asyncio

        refs = await asyncio.gather(*(self._scheduler.get_shard.remote(step, r, timeout_s=TIMEOUT_S) for r in dp_ranks))
        assert all(ref.step == step for ref in refs)
        return time.perf_counter()


def scale_run(num_steps: int, rng, *, node_objects: bool) -> tuple[list[float], list[float]]:
    """(scheduler ms, driver ms) per step at dp 256 x tp 4; `node_objects`: the ranks' node is registered
    (all on this one), so each step is one object instead of 256."""
    scheduler = create_scheduler(SchedulerConfig(batch=BatchConfig(
        global_batch_size=SCALE_GBS, max_tokens_per_gpu=MAX_TOKENS_PER_GPU, leftover="drop")), name="bench-scale")
    rank_nodes = [ray.get_runtime_context().get_node_id()] * SCALE_DP if node_objects else None
    ray.get(scheduler.register_train_group.remote(ParallelConfig(dp_size=SCALE_DP), rank_nodes), timeout=TIMEOUT_S)
    pools = [ray.remote(RankPool).options(num_cpus=0, max_concurrency=4096).remote(scheduler) for _ in range(SCALE_POOLS)]
    ranks = [dp for dp in range(SCALE_DP) for _ in range(SCALE_TP)]
    driver_ms = []
    for step in range(num_steps):
        samples = [s for b in make_batches(f"scale{step}", SCALE_GBS // BATCH_SAMPLES, rng) for s in b]
        parked = [pool.pull.remote(step, ranks[i::SCALE_POOLS]) for i, pool in enumerate(pools)]
        head = samples[:-1]
        push(scheduler, [head[i:i + BATCH_SAMPLES] for i in range(0, len(head), BATCH_SAMPLES)])
        time.sleep(0.5)  # let every pull park (outside the timing)
        start = time.perf_counter()
        ray.get(scheduler.submit.remote([samples[-1]]), timeout=TIMEOUT_S)
        done = max(ray.get(parked, timeout=TIMEOUT_S))
        driver_ms.append(1e3 * (done - start))
        ray.get(scheduler.ack_ranks.remote(step, {r: None for r in range(SCALE_DP)}), timeout=TIMEOUT_S)
    records = ray.get(scheduler.stats.remote(), timeout=TIMEOUT_S).recent_steps
    ray.get(scheduler.close.remote(), timeout=TIMEOUT_S)
    for actor in [scheduler, *pools]:
        ray.kill(actor)
    return [1e3 * r.scheduling_latency_s for r in records], driver_ms


class AsyncEcho:
    async def echo(self, value):
        return value


class ThreadedEcho:
    def echo(self, value):
        return value


class EchoCaller:
    def run(self, callee, num_calls: int) -> None:
        for i in range(num_calls):
            ray.get(callee.echo.remote(i))


def call_cost(num_calls: int) -> None:
    print(f"\n== Ray's per-call cost: {num_calls} sequential empty calls from an actor, CPU per call")
    print(f"{'callee':<16} {'callee ms':>10} {'caller ms':>10} {'wall ms':>8}")
    for name, cls, concurrency in (("asyncio actor", AsyncEcho, 1000), ("threaded actor", ThreadedEcho, 64)):
        callee = ray.remote(cls).options(num_cpus=0, max_concurrency=concurrency).remote()
        caller = ray.remote(EchoCaller).options(num_cpus=0).remote()
        ray.get(caller.run.remote(callee, num_calls // 10), timeout=TIMEOUT_S)  # warm-up
        callee_pid, caller_pid = actor_pid(callee), actor_pid(caller)
        before = cpu_seconds_by_process()
        start = time.perf_counter()
        ray.get(caller.run.remote(callee, num_calls), timeout=TIMEOUT_S)
        wall = time.perf_counter() - start
        after = cpu_seconds_by_process()
        used = {pid: 1e3 * (after[pid] - before.get(pid, 0.0)) / num_calls for pid in (callee_pid, caller_pid)}
        print(f"{name:<16} {used[callee_pid]:>10.2f} {used[caller_pid]:>10.2f} {1e3 * wall / num_calls:>8.2f}")
        for actor in (callee, caller):
            ray.kill(actor)


def scale_latency(num_steps: int, rng) -> None:
    per_rank = scale_run(num_steps, rng, node_objects=False)
    per_node = scale_run(num_steps, rng, node_objects=True)
    print(f"\n== scale: {num_steps} steps of gbs {SCALE_GBS}, dp {SCALE_DP} x tp {SCALE_TP} = "
          f"{SCALE_DP * SCALE_TP} parked get_shard calls per step; shards as one object per rank (256 puts) / "
          "per node (1 put)")
    print(f"{'':<48} {'median ms':>10} {'max ms':>8} {'per node':>9} {'max':>8} {'median ratio':>13}")
    for label, rank_ms, node_ms in (("scheduler: last rollout ready -> shards put", per_rank[0], per_node[0]),
                                    ("driver: last submit -> 1,024 ShardRefs returned", per_rank[1], per_node[1])):
        print(f"{label:<48} {statistics.median(rank_ms):>10.1f} {max(rank_ms):>8.1f} {statistics.median(node_ms):>9.1f} "
              f"{max(node_ms):>8.1f} {statistics.median(rank_ms) / statistics.median(node_ms):>12.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller rounds (a smoke run)")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=512 << 20,
             logging_level="ERROR", log_to_driver=False)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    try:
        if args.quick:
            throughput(2, 16, rng)
            call_cost(200)
            latency(2, rng)
            scale_latency(2, rng)
        else:
            throughput(ROUNDS, ROUND_BATCHES, rng)
            call_cost(2000)
            latency(LATENCY_STEPS, rng)
            scale_latency(SCALE_STEPS, rng)
    finally:
        ray.shutdown()
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
