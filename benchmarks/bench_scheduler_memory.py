"""SchedulerActor memory over a long run: resident memory after 10k, 100k and 1M rollouts.

    python benchmarks/bench_scheduler_memory.py [--rollouts 1000000]

One-sample rollouts of TOKENS tokens are pushed in batches of BATCH (ids "m<i>": ~8 characters),
at most MAX_BUFFERED samples buffered (backpressure),
while a consumer actor pulls every step's ShardRefs and acks them (it does not fetch the shards),
so every rollout ends trained and settles in the ledger. At each checkpoint the driver reads the
scheduler process's resident memory (/proc, same machine) after the steps drained, and prints the
growth per rollout between checkpoints: what a run keeps per trained rollout (goal: a few tens of
bytes). It reads RssAnon, the process's private memory, after glibc's malloc_trim (heap pages freed
by a million short-lived samples otherwise stay mapped; the untrimmed figure is printed too): VmRSS also counts the pages of the shared
object store that the process has written shards into, which grow to the store's size and say
nothing about what the scheduler keeps (both are printed). The last two columns say where the private
memory is: CPython's small-object allocator (1 MiB arenas mapped, bytes of live blocks in them) and
glibc malloc (bytes in use, free bytes it still holds).

What the growth is (2026-11-30, 2 loaded cores; see docs/benchmarks.md): the scheduler keeps the
settled table per rollout and nothing else. The same RolloutIntake/Ledger loop run in one process
without Ray (same rows, 100k -> 300k) grows by 33.5 bytes per rollout, the table's 33.0; tracemalloc
puts all of it in SettledIds' arrays. In the actor, the gc-tracked object count, pymalloc's live
blocks and Ray's reference table (8 entries: the current step's shards) stay flat; what grows is
pymalloc arenas whose pools are free but cannot be returned because a few live blocks remain in
each (mostly the 64-byte class: rollout ids, tuples, lists of the pushes' short-lived samples), and
with PYTHONMALLOC=malloc the same shows up as glibc free chunks that malloc_trim cannot release.
It is fragmentation of memory already freed, not objects kept: it grows with the push size (200,
500, 1000 samples per push: ~20, ~60, ~220 bytes per rollout above the table over 40k -> 200k) and
varies with load. Ruled out by experiment (40k -> 200k, bytes/rollout above the ~33 of the table,
1000-sample pushes): MALLOC_ARENA_MAX=2, a fixed MALLOC_MMAP_THRESHOLD_, putting one tiny object per
rank instead of the shards, no layout at all, step_record_window=1, default GC thresholds, retrying
a waiting push with its already-read Samples: all within the run-to-run spread (140-250).
It is a high-water mark, not a rate: in two runs to 2M (same pushes) pymalloc held 58 arenas at 1M
and 58-59 at 2M, and the private memory grew 48 and 40 bytes per rollout from 1M to 2M (table: 34).

2026-12-01, after the push path stopped making most of its per-sample temporaries (settled-id lookups
by bisect without numpy scalars, a step's settles in one call, samples built without the frozen __init__,
group advantages in plain floats; which of these matters was not isolated), two runs at load ~2:
300k -> 1M grew 35.9 and 35.4 bytes per rollout (table 32.9), 100k -> 1M 43.7 and 43.3; pymalloc
held 62-63 arenas at 100k and 67-68 at 1M with its live blocks flat (40.7-40.8 MiB). A third run,
beside a CI run (load ~6), grew 158.5 bytes per rollout from 300k to 1M with pymalloc's arenas
73 -> 141 MiB: the starved consumer let emitted, unacknowledged steps pile up (nothing bounded them),
their samples raised the allocator's high-water mark, and freed arenas stay mapped while a few
blocks in each live on. With MAX_STEPS_AHEAD = 2 (since then the setting here; a job sets
`scheduler.max_steps_ahead`, e.g. jobs/configs/cluster_16gpu.yaml), beside the same CI run: 44.5
bytes per rollout from 300k to 1M, arenas 69 -> 72 MiB.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import time

import numpy as np
import ray

from vgbs_ray.scheduler.types import SchedulerConfig
from actors.scheduler_actor import create_scheduler
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.scheduler.intake import IntakeConfig

TOKENS = 16
BATCH = 1000
GBS = 5000
DP_SIZE = 8
MAX_BUFFERED = 4 * GBS
MAX_STEPS_AHEAD = 2
CHECKPOINTS = (10_000, 100_000, 300_000, 1_000_000)
TIMEOUT_S = 600


class Consumer:
    """Pulls every rank's ShardRef of every step and acks it (a train group that trains instantly)."""

    def __init__(self, scheduler):
        self._scheduler = scheduler

    def run(self) -> int:
        step = 0
        while True:
            refs = ray.get([self._scheduler.get_shard.remote(step, r, timeout_s=TIMEOUT_S) for r in range(DP_SIZE)])
            if refs[0] is None:
                return step
            ray.get(self._scheduler.ack_ranks.remote(step, {r: None for r in range(DP_SIZE)}))
            step += 1


def _trim_heap(actor) -> None:
    """Give freed heap pages back to the OS (glibc), so RSS shows what is held, not what was churned."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _allocator_stats(actor) -> tuple[int, int, int, int]:
    """(pymalloc arena bytes, pymalloc bytes in live blocks, glibc bytes in use, glibc free bytes held)
    in the actor's process: sys._debugmallocstats (it writes to fd 2, read back from a temp file) and
    glibc's mallinfo2 (all arenas; mmapped chunks count as in use)."""
    import re
    import sys
    import tempfile
    with tempfile.TemporaryFile() as out:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode()
    arenas = int(re.search(r"# arenas allocated current\s*=\s*([\d,]+)", text).group(1).replace(",", ""))
    live = int(re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", text).group(1).replace(",", ""))
    class MallInfo2(ctypes.Structure):  # defined here: the function is shipped to the actor, ctypes classes do not pickle
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    # arenas are 1 MiB (CPython 3.10+ on 64-bit)
    return arenas << 20, live, info.uordblks + info.hblkhd, info.fordblks


def rss_bytes(pid: int, field: str = "RssAnon") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=CHECKPOINTS[-1])
    args = parser.parse_args()
    checkpoints = [c for c in CHECKPOINTS if c <= args.rollouts]
    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=512 << 20,
             logging_level="ERROR", log_to_driver=False)
    try:
        # Backpressure bounds the buffer and the steps emitted ahead of the consumer as in a real run, so
        # what grows is what the scheduler keeps per settled rollout, not a backlog: without
        # max_steps_ahead a consumer slowed by a loaded machine lets unacknowledged steps (their
        # samples) pile up, and the allocator's high-water mark with them.
        scheduler = create_scheduler(SchedulerConfig(
            batch=BatchConfig(global_batch_size=GBS, max_tokens_per_gpu=4096, leftover="drop"),
            intake=IntakeConfig(max_buffered_samples=MAX_BUFFERED), max_steps_ahead=MAX_STEPS_AHEAD),
            name="bench-memory")
        ray.get(scheduler.register_train_group.remote(ParallelConfig(dp_size=DP_SIZE)), timeout=TIMEOUT_S)
        pid = ray.get(scheduler.__ray_call__.remote(lambda self: os.getpid()), timeout=TIMEOUT_S)
        consumer = ray.remote(Consumer).options(num_cpus=0).remote(scheduler)
        consumer_run = consumer.run.remote()
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 1000, TOKENS, dtype=np.int64)
        mask = np.ones(TOKENS // 2, dtype=np.int8)
        print(f"{'rollouts':>10} {'private MiB':>12} {'bytes/rollout since last':>26} {'settled-table bytes/rollout':>28} "
              f"{'untrimmed MiB':>14} {'VmRSS MiB':>10} {'pymalloc arenas/live MiB':>25} {'malloc used/free MiB':>21} "
              f"{'push s':>7}")
        pushed, last_rss, last_count, start = 0, rss_bytes(pid), 0, time.perf_counter()
        for checkpoint in checkpoints:
            in_flight = []
            while pushed < checkpoint:
                batch = [dict(rollout_id=f"m{pushed + i}", tokens=tokens, response_length=TOKENS // 2, loss_mask=mask,
                              reward=1.0, advantage=0.5) for i in range(min(BATCH, checkpoint - pushed))]
                pushed += len(batch)
                in_flight.append(scheduler.submit.remote(batch, wait_s=TIMEOUT_S))  # waits for room
                if len(in_flight) >= 4:
                    assert not ray.get(in_flight.pop(0), timeout=2 * TIMEOUT_S).deferred
            assert not any(r.deferred for r in ray.get(in_flight, timeout=2 * TIMEOUT_S))
            deadline = time.monotonic() + TIMEOUT_S
            while (stats := ray.get(scheduler.stats.remote(), timeout=TIMEOUT_S)).steps_trained < pushed // GBS:
                assert time.monotonic() < deadline, "steps did not drain"
                time.sleep(0.05)
            ray.get(scheduler.__ray_call__.remote(lambda self: gc.collect()), timeout=TIMEOUT_S)
            untrimmed = rss_bytes(pid)
            ray.get(scheduler.__ray_call__.remote(_trim_heap), timeout=TIMEOUT_S)
            rss = rss_bytes(pid)
            table = ray.get(scheduler.__ray_call__.remote(lambda self: self.ledger.settled_nbytes()), timeout=TIMEOUT_S)
            arenas, live, used, free = ray.get(scheduler.__ray_call__.remote(_allocator_stats), timeout=TIMEOUT_S)
            trained = stats.ledger.rollouts_by_state["trained"]
            print(f"{pushed:>10} {rss / 2**20:>12.1f} {(rss - last_rss) / (pushed - last_count):>26.1f} "
                  f"{table / max(trained, 1):>28.1f} {untrimmed / 2**20:>14.1f} {rss_bytes(pid, 'VmRSS') / 2**20:>10.1f} "
                  f"{f'{arenas / 2**20:.1f} / {live / 2**20:.1f}':>25} {f'{used / 2**20:.1f} / {free / 2**20:.1f}':>21} "
                  f"{time.perf_counter() - start:>7.0f}", flush=True)
            last_rss, last_count = rss, pushed
        print("goal: growth per rollout of a few tens of bytes (the settled table, plus noise of the allocator)")
        ray.get(scheduler.end_of_input.remote(), timeout=TIMEOUT_S)
        ray.get(consumer_run, timeout=TIMEOUT_S)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
