"""Staleness enforced in the SchedulerActor (issue 10): admission, stale drops, last-chance waits,
records and stats, and a seeded property test over random interleavings of producers and ranks.

Policy versions: step k trains version k (the weights after k optimizer steps); a simulated engine
holds the version of the last trained step, lagging by a random amount.
"""

from __future__ import annotations

import random

import pytest
import ray

from vgbs_ray.scheduler.types import Admission, SchedulerConfig
from actors.scheduler_actor import create_scheduler
from tests.rollout_factory import rollout_rows
from tests.scheduler_harness import call
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.errors import ConfigError, SchedulerTimeoutError


def versioned(rid, version: int, num_samples: int = 1, newest: int | None = None) -> list[dict]:
    return rollout_rows(rid, num_samples, policy_version_min=version,
                        policy_version_max=version if newest is None else newest)


@pytest.fixture
def schedulers(ray_session):
    made = []

    def make(name: str, *, gbs: int, max_staleness: int | None, leftover: str = "partial", **cfg):
        handle = create_scheduler(SchedulerConfig(
            batch=BatchConfig(global_batch_size=gbs, max_tokens_per_gpu=64, leftover=leftover),
            max_staleness=max_staleness, **cfg), name=name)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        ray.kill(handle)


def train(scheduler, step: int, dp: int = 1) -> tuple:
    refs = [call(scheduler.get_shard, step, rank, timeout_s=30) for rank in range(dp)]
    for rank in range(dp):
        call(scheduler.ack_ranks, step, {rank: None})
    return call(scheduler.step_record, step).rollout_ids if refs[0] is not None else None


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="max_staleness must be an int >= 0"):
        SchedulerConfig(batch=BatchConfig(global_batch_size=2, max_tokens_per_gpu=64), max_staleness=-1)


def test_stale_drops_last_chance_wait_oldest_first_admission_and_records(schedulers):
    s = schedulers("sched-stale", gbs=2, max_staleness=1)
    call(s.register_train_group, ParallelConfig(dp_size=1))
    call(s.submit, versioned("s0", 0) + versioned("s1", 0))
    assert train(s, 0) == ("s0", "s1")
    call(s.submit, versioned("s2", 0) + versioned("s3", 0, 2))
    assert set(train(s, 1)) == {"s2", "s3"}
    record = call(s.step_record, 1)
    assert (record.policy_version, record.staleness_mean, record.staleness_max) == (1, 1.0, 1)
    call(s.submit, versioned("old", 0) + versioned("n1", 2) + versioned("n2", 1, newest=2))
    assert train(s, 2) == ("n2", "n1")  # "old" would lag 2 > 1: dropped; oldest version first
    stats = call(s.stats, include_rollouts=True)
    assert stats.rollout_states["old"] == ("dropped", None, "stale")
    assert stats.stale_dropped_rollouts == 1 and stats.ledger.dropped_by_reason == {"stale": 1}
    assert stats.policy_version == 3

    # Rule 2: "slow" started at version 2 has its last chance in step 3; the step waits for it.
    decision = call(s.admit, ["slow"], 2)
    assert isinstance(decision, Admission) and decision.admit and decision.landing_step == 3
    call(s.submit, versioned("f1", 3) + versioned("f2", 3))
    with pytest.raises(SchedulerTimeoutError):  # a full step is ready but waits (nothing else can emit it)
        call(s.get_shard, 3, 0, timeout_s=1.0)
    assert call(s.stats).staleness_in_flight == 1
    call(s.submit, versioned("slow", 2))
    assert train(s, 3) == ("slow", "f1")

    # Admission: known ids are reported, not re-admitted; a lagging engine is refused.
    decision = call(s.admit, ["s0", "f2", "fresh"], 4)
    assert decision.admit and decision.known == ("s0", "f2")
    assert not call(s.admit, ["lagging"], 1).admit  # landing 4 (+1 pending) - 1 > 1
    with pytest.raises(ConfigError, match="group_size=5"):
        call(s.admit, [f"big{i}" for i in range(5)], 4)  # 5 > gbs * (max_staleness + 1)
    assert call(s.admit, ["ghost"], 4).admit
    call(s.abandon, ["fresh"])
    stats = call(s.stats)
    assert (stats.staleness_pending, stats.staleness_in_flight, stats.refused_admissions) == (1, 1, 1)  # "ghost"; f2 was pushed unadmitted
    # End of input never waits for admitted rollouts in flight ("ghost" never arrives).
    flush = call(s.end_of_input, timeout=30)
    assert flush.steps == (4,) and train(s, 4) == ("f2",)
    stats = call(s.stats, check_ledger=True)
    assert (stats.staleness_pending, stats.staleness_in_flight) == (0, 0)
    assert stats.ledger.rollouts_by_state == {"buffered": 0, "scheduled": 0, "trained": 9, "dropped": 1}


def test_without_max_staleness_everything_is_admitted_and_nothing_recorded(schedulers):
    s = schedulers("sched-no-stale", gbs=2, max_staleness=None)
    call(s.register_train_group, ParallelConfig(dp_size=1))
    decision = call(s.admit, ["a", "b"], 0)
    assert decision.admit and not decision.enforced
    call(s.submit, versioned("a", 0) + versioned("b", 0))
    train(s, 0)
    call(s.submit, versioned("c", 0) + versioned("d", 0))
    train(s, 1)
    call(s.submit, versioned("e", 0) + rollout_rows("f", 1))  # lags 2: trained anyway, the record says so
    assert set(train(s, 2)) == {"e", "f"}
    record = call(s.step_record, 2)
    assert (record.staleness_mean, record.staleness_max) == (2.0, 2)
    stats = call(s.stats)
    assert stats.staleness_pending is None and stats.admitted_rollouts == 0 and stats.stale_dropped_rollouts == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleavings_keep_the_bound_and_close_the_ledger(schedulers, seed):
    """Producers admit groups at a lagging engine version, push siblings in random order, sometimes
    abandon or send a bad sample; ranks train whatever is emitted. Every decision is a seeded draw;
    the only waits are the scheduler's own events (get_shard returns once a step exists)."""
    rng = random.Random(seed)
    gbs, dp, group = 4, 2, 2
    max_staleness = rng.choice([0, 1, 2])
    s = schedulers(f"sched-stale-prop-{seed}", gbs=gbs, max_staleness=max_staleness)
    call(s.register_train_group, ParallelConfig(dp_size=dp))
    version: dict = {}          # rollout id -> the engine version it started with
    unpushed: dict = {}         # rollout id -> sample rows not yet pushed
    abandoned, trained = set(), {}
    trained_steps = 0
    next_group = 0

    def train_ready_steps() -> None:
        nonlocal trained_steps
        while call(s.stats).steps_emitted > trained_steps:
            step = trained_steps
            ids = train(s, step, dp)
            for rid in ids:
                assert rid not in trained, f"{rid} trained twice"
                trained[rid] = step
            trained_steps += 1

    for _ in range(160):
        action = rng.random()
        if action < 0.3:  # a producer asks to start a group at an engine that lags the trainer
            engine = max(0, trained_steps - rng.choice([0, 0, 1, 2, 3]))
            ids = [f"g{next_group}-{k}" for k in range(group)]
            if call(s.admit, ids, engine).admit:
                next_group += 1
                for rid in ids:
                    version[rid] = engine
                    newest = engine + rng.choice([0, 1])  # generation may span a weight update
                    unpushed[rid] = versioned(rid, engine, rng.randint(1, 3), newest=min(newest, trained_steps))
        elif action < 0.75 and unpushed:  # push one sample of a random in-flight rollout
            rid = rng.choice(sorted(unpushed))
            rows = unpushed[rid]
            row = rows.pop(rng.randrange(len(rows)))
            if rng.random() < 0.05:
                bad = dict(row, loss_mask=row["loss_mask"][:-1])  # mask_length: rejected, the rollout stays open
                assert call(s.submit, [bad]).rejected[0].rule == "mask_length"
            result = call(s.submit, [row])
            assert result.accepted == 1, result
            if not rows:
                del unpushed[rid]
        elif action < 0.8 and unpushed:  # a producer gives up a rollout (engine died)
            rid = rng.choice(sorted(unpushed))
            del unpushed[rid]
            abandoned.add(rid)
            call(s.abandon, [rid])
        else:
            train_ready_steps()
    # The rest arrives, then input ends: nothing waits, nothing times out.
    for rid in sorted(unpushed):
        call(s.submit, unpushed[rid])
    flush = call(s.end_of_input, timeout=60)
    while True:
        refs = [call(s.get_shard, trained_steps, rank, timeout_s=30) for rank in range(dp)]
        if refs[0] is None:
            break
        train_ready_steps()

    stats = call(s.stats, include_rollouts=True, check_ledger=True)
    assert (stats.staleness_pending, stats.staleness_in_flight) == (0, 0)
    assert stats.steps_trained == trained_steps and stats.ledger.rollouts_by_state["buffered"] == 0
    for rid, step in trained.items():
        assert step - version[rid] <= max_staleness, (rid, step, version[rid])
    states = stats.rollout_states
    for rid in version:
        state = states.get(rid)
        if rid in trained:
            assert state == ("trained", trained[rid], None)
        elif rid in abandoned:
            assert state is None or state == ("dropped", None, "incomplete_rollout") or state[0] == "trained", (rid, state)
        else:
            assert state is not None and state[0] == "dropped" and state[2] in ("stale", "incomplete_group"), (rid, state)
    assert set(flush.dropped) <= set(states)
    assert trained, "the run trained nothing"


def test_staleness_metrics_reach_the_metrics_endpoint(schedulers):
    """Exported like the other scheduler metrics: ray_vgbs_scheduler_* tagged with the scheduler's name."""
    import re
    import time
    import urllib.request

    name = "sched-stale-metrics"
    s = schedulers(name, gbs=1, max_staleness=1)
    call(s.register_train_group, ParallelConfig(dp_size=1))
    for step, (rid, version) in enumerate([("m0", 0), ("m1", 0), ("m2", 1)]):
        call(s.submit, versioned(rid, version))
        train(s, step)
    call(s.submit, versioned("m-old", 1) + versioned("m3", 3))  # m-old lags 2 at step 3: dropped
    assert train(s, 3) == ("m3",)
    port = ray.nodes()[0]["MetricsExportPort"]
    pattern = re.compile(r'^ray_vgbs_scheduler_(policy_version|step_staleness_max|step_staleness_mean|'
                         r'stale_dropped_rollouts_total)\{[^}]*scheduler="%s"[^}]*\} ([0-9.e+]+)$' % name, re.M)
    want = {"policy_version": 4.0, "step_staleness_max": 0.0, "step_staleness_mean": 0.0, "stale_dropped_rollouts_total": 1.0}
    found: dict = {}
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline and found != want:  # the export is periodic: poll until it shows the values
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = {metric: float(value) for metric, value in pattern.findall(text)}
        if found != want:
            time.sleep(1.0)
    assert found == want
