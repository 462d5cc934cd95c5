"""Helpers of the train-step tests: synthetic rollouts, an in-process rank, a naive reference.

`reference_update` is written independently of the packed path on purpose: one sample at a
time, unpacked (sbhd, no cu_seqlens), the loss spelled out per rollout, so a packing or
accounting bug in the trainer cannot hide in shared code.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from trainer.config import ModelConfig, OptimizerConfig, TrainGroupConfig
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.lr_schedule import LRScheduleConfig
from vgbs_ray.sample import Sample, make_rollout
from vgbs_ray.layout.schedule import build_dp_schedule
from vgbs_ray.layout.shard import StepShard, build_step_shards

VOCAB = ModelConfig().vocab_size


def sgd_config(lr: float = 1.0, **overrides) -> TrainGroupConfig:
    """Plain SGD without clipping: the update is -lr * gradient (what invariance tests compare)."""
    return TrainGroupConfig(
        optimizer=OptimizerConfig(kind="sgd", clip_grad_norm=None, lr_schedule=LRScheduleConfig(lr=lr)),
        **overrides,
    )


def make_samples(seed: int, num_rollouts: int, *, max_siblings: int = 4, min_len: int = 8, max_len: int = 80,
                 with_log_probs: bool = True, id_prefix: str = "r") -> list[Sample]:
    """Rollouts of 1..max_siblings samples with random tokens, masks, advantages, rollout log-probs."""
    rng = np.random.default_rng(seed)
    samples: list[Sample] = []
    for r in range(num_rollouts):
        rows = []
        for _ in range(int(rng.integers(1, max_siblings + 1))):
            length = int(rng.integers(min_len, max_len + 1))
            response = int(rng.integers(1, length))
            row = dict(tokens=rng.integers(0, VOCAB, length), response_length=response,
                       loss_mask=(rng.random(response) < 0.85).astype(np.int8))
            if with_log_probs:  # around log(1/128) = -4.85, so ratios straddle the clip range
                row["rollout_log_probs"] = rng.uniform(-5.3, -4.4, response).astype(np.float32)
            rows.append(row)
        samples += make_rollout(f"{id_prefix}{r}", rows, reward=float(rng.random()), advantage=float(rng.normal()))
    return samples


def layout_shards(samples: Sequence[Sample], *, dp_size: int = 1, max_tokens: int = 1024, step: int = 0,
                  parallel: ParallelConfig | None = None, **batch) -> list[StepShard]:
    """The scheduler's shards of `samples` as one step (all their rollouts): laid out for `parallel` (default:
    `dp_size` ranks) under `max_tokens` per micro-batch; `batch` adds BatchConfig fields (balance, ...)."""
    parallel = parallel or ParallelConfig(dp_size=dp_size)
    num_rollouts = len({s.rollout_id for s in samples})  # fewer than the alignment: a partial step, as the scheduler's
    batch_config = BatchConfig(global_batch_size=max(num_rollouts, parallel.microbatch_alignment),
                               max_tokens_per_gpu=max_tokens, **batch)
    schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                 parallel, batch_config)
    return build_step_shards(samples, schedule.steps[0], step)


_DIST_READY = False


def ensure_single_process_group() -> None:
    """A world-size-1 gloo group and Megatron state in this process (once per process)."""
    global _DIST_READY
    if _DIST_READY:
        return
    torch.set_num_threads(1)
    from trainer.distributed import find_free_port, init_distributed

    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=find_free_port(),
                     backend="gloo", timeout_s=60, tp_size=1, pp_size=1, cp_size=1)
    _DIST_READY = True


def inprocess_trainer(config: TrainGroupConfig):
    """A fresh RankTrainer (dp=1, tp=1) in this process, initialised from config.model.seed."""
    ensure_single_process_group()
    from trainer.config import RankInfo
    from trainer.rank_trainer import RankTrainer

    return RankTrainer(config, RankInfo(rank=0, dp_rank=0, tp_rank=0, pp_rank=0, cp_rank=0))


def update_between(before: dict, after: dict) -> dict:
    return {k: after[k].astype(np.float64) - before[k].astype(np.float64) for k in before}


def relative_difference(a: dict, b: dict) -> float:
    """||a - b|| / ||a|| over every parameter together."""
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a)
    den = sum(float((a[k] ** 2).sum()) for k in a)
    return (num / den) ** 0.5


def assert_same_update(a: dict, b: dict, rtol: float = 1e-5) -> None:
    assert set(a) == set(b)
    rel = relative_difference(a, b)
    assert rel < rtol, f"updates differ: relative difference {rel:.3e} >= {rtol}"
    for name in a:  # every tensor moved the same way, not only the global norm. The 3e-7 is
        # float32 rounding of parameters near 1 (layer norms): an update is after - before.
        scale = float(np.abs(a[name]).max())
        worst = float(np.abs(a[name] - b[name]).max())
        assert worst <= 10 * rtol * scale + 3e-7, f"{name}: max difference {worst:.3e}, update scale {scale:.3e}"


def reference_update(model_config: ModelConfig, model_state: dict | None, samples: Sequence[Sample], *,
                     lr: float, clip_eps: float = 0.2, per_rollout: bool = True) -> dict:
    """The SGD update -lr * grad of the step loss, computed naively (see module docstring).

    per_rollout=True: mean over rollouts of each rollout's token-weighted mean PPO loss.
    per_rollout=False: the classic per-sample token mean, averaged over samples.
    Old log-probs: the samples' rollout log-probs.
    """
    ensure_single_process_group()
    from trainer.model import build_gpt_model

    model = build_gpt_model(model_config)
    if model_state is not None:  # whole-model parameters by name (`full_parameters`)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in model_state.items()}, strict=False)
    per_sample = []  # (rollout id, masked loss sum, mask tokens)
    for s in samples:
        tokens = torch.as_tensor(s.tokens, dtype=torch.long).unsqueeze(0)
        logits = model(tokens, torch.arange(s.total_length).unsqueeze(0), None)[0]  # [L, V]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        start = s.total_length - s.response_length
        positions = torch.arange(start, s.total_length)
        new = log_probs[positions - 1, tokens[0, positions]]
        old = torch.as_tensor(s.rollout_log_probs)
        ratio = torch.exp(new - old)
        losses = -torch.minimum(ratio * s.advantage, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * s.advantage)
        mask = torch.as_tensor(s.loss_mask, dtype=torch.float32)
        per_sample.append((s.rollout_id, (losses * mask).sum(), mask.sum()))
    if per_rollout:
        rollouts: dict = {}
        for rid, total, count in per_sample:
            t, c = rollouts.get(rid, (0.0, 0.0))
            rollouts[rid] = (t + total, c + count)
        loss = sum(t / max(float(c), 1.0) for t, c in rollouts.values()) / len(rollouts)
    else:
        loss = sum(t / max(float(c), 1.0) for _, t, c in per_sample) / len(per_sample)
    loss.backward()
    return {name: (-lr * p.grad.double()).numpy() for name, p in model.named_parameters()}


# -- two spawned gloo ranks ------------------------------------------------------------------

def run_two_ranks(worker, num_groups: int, *args, timeout_s: float = 300) -> list[tuple]:
    """`worker(rank, ports, *args, results)` in two spawned processes that join `num_groups` gloo groups in turn,
    one per port of `ports` (`process_groups_in_turn`); returns each rank's report (a tuple whose first item is the
    rank and whose last is an error or None), in rank order. A rank's error fails the caller's test, naming the
    rank."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = free_ports(num_groups)  # in one call: a port picked apart could repeat one of them (EADDRINUSE)
    procs = [context.Process(target=worker, args=(rank, ports, *args, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for report in reports:
        assert report[-1] is None, f"rank {report[0]}: {report[-1]}"
    return sorted(reports, key=lambda report: report[0])


def process_groups_in_turn(rank: int, ports: list[int], sizes: list[tuple[int, int]]):
    """In a spawned rank of `run_two_ranks`: for each (tp_size, pp_size) of `sizes`, a 2-rank gloo group on its own
    port of `ports` with Megatron's parallel state, yielded as this rank's RankInfo, torn down before the next (one
    spawn for several layouts: a spawn costs more than a step)."""
    from trainer.distributed import destroy_distributed, init_distributed

    for (tp_size, pp_size), port in zip(sizes, ports, strict=True):
        info = init_distributed(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, backend="gloo",
                                timeout_s=60, tp_size=tp_size, pp_size=pp_size, cp_size=1)
        try:
            yield info
        finally:
            destroy_distributed()


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: one rendezvous each for a spawn that makes several process groups in turn (the
    OS may hand the same free port out twice in a row)."""
    from trainer.distributed import find_free_port

    ports: list[int] = []
    while len(ports) < count:
        ports += [port for port in [find_free_port()] if port not in ports]
    return ports


# -- a two-process step that records every collective (used by test_train_step) --------

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "reduce", "barrier", "all_to_all_single", "send", "recv", "isend", "irecv")


def record_collectives_worker(rank: int, ports: list[int], runs: list, results) -> None:
    """Spawned per rank: for each (pp_size, shards_by_phase) of `runs` in turn, join a 2-rank gloo group (dp=2, or
    pp=2; on its port of `ports`), train each phase's shard, record collectives. Reports per run
    ({phase: (calls, micro-batches)}, the rank's parameter count).

    The patch lives only in this spawned process and only around `train_shard`.
    """
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        from trainer.rank_trainer import RankTrainer

        recorded: list = []

        def wrap(name, original):
            def recording(*args, **kwargs):
                op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else None)
                tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
                recorded.append((name, None if op is None else str(op).split(".")[-1],
                                 None if tensor is None else int(tensor.numel())))
                return original(*args, **kwargs)
            return recording

        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        by_run = []
        groups = process_groups_in_turn(rank, ports, [(1, pp_size) for pp_size, _ in runs])
        for (pp_size, shards_by_phase), info in zip(runs, groups):
            trainer = RankTrainer(sgd_config(dp_size=2 // pp_size, pp_size=pp_size), info)
            by_phase = {}
            for phase, shards in shards_by_phase.items():
                recorded.clear()
                for name, original in originals.items():
                    wrapped = wrap(name, original)
                    setattr(dist, name, wrapped)
                    if name in ("isend", "irecv"):  # P2POp accepts only the functions c10d itself names
                        setattr(dist.distributed_c10d, name, wrapped)
                try:
                    result = trainer.train_shard(shards[info.dp_rank])
                finally:
                    for name, original in originals.items():
                        setattr(dist, name, original)
                        if name in ("isend", "irecv"):
                            setattr(dist.distributed_c10d, name, original)
                by_phase[phase] = (list(recorded), result.num_microbatches)
            by_run.append((by_phase, sum(p.numel() for p in trainer.params)))
        results.put((rank, by_run, None))
    except BaseException as error:  # report, never hang the parent
        results.put((rank, None, repr(error)))
    finally:
        results.close()
        results.join_thread()  # flush the result before the hard exit
        os._exit(0)  # skip gloo / Megatron teardown in the child


# -- two spawned ranks that train several loss configs (used by test_policy_loss_ranks) ----------

def loss_cases_worker(rank: int, ports: list[int], runs: list, initial: dict, results) -> None:
    """Spawned per rank: for each (pp_size, cases) of `runs` in turn, join a 2-rank gloo group (dp=2, or pp=2; on
    its port of `ports`); for each (name, LossConfig, shards) of its cases, a fresh rank from `initial` trains
    its shard once. Reports per run and case the update (rank 0) and this rank's metric pairs."""
    try:
        torch.set_num_threads(1)
        from trainer.rank_trainer import RankTrainer

        by_run = []
        groups = process_groups_in_turn(rank, ports, [(1, pp_size) for pp_size, _ in runs])
        for (pp_size, cases), info in zip(runs, groups):
            by_case = {}
            for name, loss, shards in cases:
                trainer = RankTrainer(sgd_config(dp_size=2 // pp_size, pp_size=pp_size, loss=loss), info)
                trainer.load_full_parameters(initial)
                result = trainer.train_shard(shards[info.dp_rank])
                after = trainer.full_parameters()
                by_case[name] = (update_between(initial, after) if rank == 0 else None, result.metrics)
            by_run.append(by_case)
        results.put((rank, by_run, None))
    except BaseException as error:  # report, never hang the parent
        results.put((rank, None, repr(error)))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)
