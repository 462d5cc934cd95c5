"""The rollout ledger: legal transitions only, its invariants, and memory that stays bounded."""

from __future__ import annotations

import sys

import pytest

from vgbs_ray.scheduler.ledger import Ledger, LedgerError, Rejection, RolloutState
from vgbs_ray.scheduler.settled_ids import SettledIds, decode_id, encode_id


def test_lifecycle_and_summary():
    ledger = Ledger()
    for rid in "abcd":
        ledger.accept_sample(rid)
    ledger.accept_sample("a")
    ledger.schedule(["a", "b"], 0)
    ledger.drop("c", "leftover")
    ledger.reject(Rejection("x", 0, "mask_length", "bad mask"))
    ledger.reject(Rejection("a", 1, "duplicate_sample", "again"))  # an event only: a stays scheduled
    assert ledger.state("a") is RolloutState.SCHEDULED and ledger.state("x") is None
    assert ledger.train_step(0) == ("a", "b")
    ledger.check()
    summary = ledger.summary()
    assert summary.rollouts_by_state == {"buffered": 1, "scheduled": 0, "trained": 2, "dropped": 1}
    assert summary.dropped_by_reason == {"leftover": 1} and summary.num_rollouts_accepted == 4
    assert summary.rejected_samples_by_rule == {"mask_length": 1, "duplicate_sample": 1}
    assert ledger.get("a").step == 0 and ledger.get("c").reason == "leftover"
    assert dict(ledger.entries()) == {
        "a": ledger.get("a"), "b": ledger.get("b"), "c": ledger.get("c"), "d": ledger.get("d")}


def test_recent_rejections_are_bounded_and_counts_exact():
    ledger = Ledger(recent_rejections_limit=3)
    for i in range(10):
        ledger.reject(Rejection(f"r{i}", 0, "empty_tokens", "no tokens"))
    assert [r.rollout_id for r in ledger.recent_rejections] == ["r7", "r8", "r9"]
    assert ledger.summary().rejected_samples_by_rule == {"empty_tokens": 10}


@pytest.mark.parametrize("illegal", ["train_twice", "schedule_twice", "step_reused", "drop_scheduled", "drop_dropped",
                                     "schedule_unknown"])
def test_illegal_transitions_raise_and_change_nothing(illegal):
    ledger = Ledger()
    ledger.accept_sample("a")
    ledger.accept_sample("b")
    ledger.schedule(["a"], 0)
    with pytest.raises(LedgerError):
        if illegal == "train_twice":
            ledger.train_step(0)
            ledger.train_step(0)
        elif illegal == "schedule_twice":
            ledger.schedule(["b", "a"], 1)
        elif illegal == "step_reused":
            ledger.schedule(["b"], 0)
        elif illegal == "drop_scheduled":
            ledger.drop("a", "leftover")
        elif illegal == "drop_dropped":
            ledger.drop("b", "leftover")
            ledger.drop("b", "leftover")
        else:
            ledger.schedule(["zzz"], 1)
    ledger.check()  # a refused transition changed nothing
    assert ledger.state("b") in (RolloutState.BUFFERED, RolloutState.DROPPED)


def test_check_catches_a_settled_rollout_accepted_again():
    ledger = Ledger()
    ledger.accept_sample("a")
    ledger.schedule(["a"], 0)
    ledger.train_step(0)
    ledger.accept_sample("a")  # the intake looks a rollout up before; the hot path does not re-check
    with pytest.raises(LedgerError, match="both"):
        ledger.check()


def test_check_catches_a_disappeared_rollout():
    ledger = Ledger()
    ledger.accept_sample("a")
    del ledger._live["a"]  # simulate a bug
    with pytest.raises(LedgerError, match="disagree|disappeared"):
        ledger.check()


@pytest.mark.parametrize("value", ["r-1", "", "ünï", 0, -7, 2**70, ("p", 3), b"raw", 1.5])
def test_id_encoding_round_trips(value):
    assert decode_id(encode_id(value)) == value


def test_settled_ids_are_exact_across_merges_and_collisions(monkeypatch):
    import vgbs_ray.scheduler.settled_ids as module

    monkeypatch.setattr(module, "MERGE_EVERY", 7)  # many merges on a small table
    table = SettledIds()
    for i in range(100):
        table.add(f"r{i}", step=i // 10) if i % 3 else table.add(i, reason=f"why{i % 2}")
    for i in range(100):
        expected = ("trained", i // 10, None) if i % 3 else ("dropped", None, f"why{i % 2}")
        assert table.get(f"r{i}" if i % 3 else i) == expected
    assert table.get("r0") is None and table.get(1) is None and table.get("0") is None  # types are part of the id
    with pytest.raises(KeyError):
        table.add("r1", step=0)
    assert [rid for rid, _ in table][:3] == [0, "r1", "r2"]
    # add_many (a step's ids at once) refuses, adding none, an id settled before or listed twice.
    size = len(table)
    for bad in (["n1", "r5"], ["n1", "r98"], ["n1", "n2", "n1"]):  # r5 in the sorted index, r98 in the recent ones
        with pytest.raises(KeyError):
            table.add_many(bad, step=11)
        assert len(table) == size and table.get("n1") is None
    table.add_many([f"n{i}" for i in range(10)], step=11)
    table.add_many([f"m{i}" for i in range(3)], reason="stale")
    assert [table.get(f"n{i}") for i in range(10)] == [("trained", 11, None)] * 10
    assert table.get("m2") == ("dropped", None, "stale") and len(table) == size + 13
    # Force every id onto one hash: exactness comes from the byte comparison, not the hash.
    monkeypatch.setattr(module, "hash", lambda data: 42, raising=False)
    colliding = SettledIds()
    for i in range(20):
        colliding.add(f"c{i}", step=i)
    assert [colliding.get(f"c{i}") for i in range(20)] == [("trained", i, None) for i in range(20)]
    assert colliding.get("c20") is None


def test_settled_ledger_grows_a_few_tens_of_bytes_per_rollout():
    """100k rollouts trained through the ledger: its settled table costs < 64 bytes each."""
    ledger = Ledger()
    n, gbs = 100_000, 500
    for step in range(n // gbs):
        ids = [f"prompt-{step}/rollout-{i}" for i in range(gbs)]
        for rid in ids:
            ledger.accept_sample(rid)
        ledger.schedule(ids, step)
        ledger.train_step(step)
    assert ledger.summary().rollouts_by_state["trained"] == n and not ledger._live
    per_rollout = ledger.settled_nbytes() / n
    assert per_rollout < 64, per_rollout
    assert ledger.get("prompt-7/rollout-3").step == 7 and ledger.get("prompt-7/rollout-500") is None
    assert sys.getsizeof(ledger._live) < 50_000  # bounded by the live (in-flight) rollouts, not the run


def test_rewind_puts_unsettled_steps_back_and_they_train_once():
    ledger = Ledger()
    for rid in "abcdef":
        ledger.accept_sample(rid)
    for step, ids in enumerate([("a", "b"), ("c", "d"), ("e", "f")]):
        ledger.schedule(ids, step)
    ledger.train_step(0, settle=False)
    ledger.train_step(1, settle=False)  # step 2 is scheduled, not trained (the group died mid-step)
    ledger.settle_through(1)            # a checkpoint holds step 0
    ledger.check()
    assert ledger.rewind(1) == [("c", "d"), ("e", "f")]
    assert [ledger.state(r) for r in "abcdef"] == [RolloutState.TRAINED] * 2 + [RolloutState.BUFFERED] * 4
    ledger.check()
    ledger.schedule(["c", "d", "e"], 1)  # the rewound rollouts train again, once, in new steps
    ledger.train_step(1)
    assert ledger.get("c").step == 1 and ledger.summary().rollouts_by_state["trained"] == 5
    with pytest.raises(LedgerError, match="already settled"):
        ledger.rewind(1)
    ledger.check()


def test_settled_ids_round_trip_through_bytes_in_another_process():
    """to_bytes/from_bytes keeps every id, step and reason; the index is rebuilt under the reader's hash salt."""
    import subprocess

    table = SettledIds()
    for i in range(5000):  # > MERGE_EVERY: part sorted index, part recent additions
        table.add(f"r{i}", step=i // 7) if i % 4 else table.add(i, reason=("stale", "incomplete_rollout")[i % 8 == 0])
    data = table.to_bytes()
    assert len(data) < table.nbytes()  # the index is not written
    back = SettledIds.from_bytes(data)
    assert list(back) == list(table) and back.counts() == table.counts()
    assert back.counts() == (3750, {"stale": 625, "incomplete_rollout": 625})
    assert back.get("r9") == ("trained", 1, None) and back.get(8) == ("dropped", None, "incomplete_rollout")
    assert back.get("r4") is None and back.get(9) is None
    back.add("new", reason="stale")  # a restored table goes on growing, and stays exact
    with pytest.raises(KeyError):
        back.add("r1", step=0)
    copy = table.copy()
    copy.add("only-in-copy", step=1)
    assert "only-in-copy" not in table and len(copy) == len(table) + 1
    with pytest.raises(ValueError, match="truncated"):
        SettledIds.from_bytes(data[:-3])
    with pytest.raises(ValueError, match="not a SettledIds"):
        SettledIds.from_bytes(b"nope")
    # Another interpreter hashes bytes with another salt: the reader must rebuild its index.
    code = ("import sys; from vgbs_ray.scheduler.settled_ids import SettledIds; t = SettledIds.from_bytes(sys.stdin.buffer.read()); "
            "print(t.get('r4999'), t.get(4096), t.get('r4'))")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONHASHSEED": "12345"}).stdout.decode().strip()
    assert out == "('trained', 714, None) ('dropped', None, 'incomplete_rollout') None"


def test_export_settled_holds_trained_unsettled_steps_and_leaves_the_ledger_alone():
    ledger = Ledger()
    for step in range(3):
        ids = [f"s{step}-{i}" for i in range(2)]
        for rid in ids:
            ledger.accept_sample(rid)
        ledger.schedule(ids, step)
        if step < 2:
            ledger.train_step(step, settle=step == 0)
    ledger.accept_sample("buffered")
    ledger.drop("buffered", "stale")
    with pytest.raises(LedgerError, match="step 2 < 3 is scheduled but not trained"):
        ledger.export_settled(3)
    table = ledger.export_settled(2)
    assert table.get("s1-0") == ("trained", 1, None) and table.get("s2-0") is None
    assert table.counts() == (4, {"stale": 1})
    assert ledger.state("s1-0").value == "trained" and ledger.get("s1-0") == ledger._live["s1-0"]  # still live here
    restored = Ledger.restored(SettledIds.from_bytes(table.to_bytes()), next_step=2,
                               rejected_samples_by_rule={"duplicate_sample": 3})
    for rid in ("s2-0", "s2-1"):
        restored.accept_sample(rid)
    restored.schedule(["s2-0", "s2-1"], 2)
    with pytest.raises(LedgerError, match="already scheduled"):
        restored.schedule(["x"], 1)
    restored.check()
    summary = restored.summary()
    assert summary.rollouts_by_state == {"buffered": 0, "scheduled": 2, "trained": 4, "dropped": 1}
    assert summary.dropped_by_reason == {"stale": 1} and summary.num_rollouts_accepted == 7
    assert summary.rejected_samples_by_rule == {"duplicate_sample": 3}
