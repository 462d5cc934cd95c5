"""The demo's learning bar, shared by its run at staleness 2, stopped and resumed
(tests/test_closed_loop_learning.py), and its run as `make demo` runs it, under kills (tests/test_chaos_job.py)."""

from __future__ import annotations

WINDOW = 10
STEPS = 100  # run.num_steps' default: the demo as `make demo` runs it


def mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values)


def assert_the_demo_learned(history: list[dict], summary: dict, max_staleness: int,
                            allowed_rejections: frozenset[str] = frozenset()) -> None:
    """`history`: one step record per step, in step order (a replayed step's last record). `summary`: the
    (last) run's; `allowed_rejections`: the rules its rejected samples may have broken (a resumed run's
    producers send again what the checkpoint already held: duplicate rules; none otherwise)."""
    assert [r["step"] for r in history] == list(range(STEPS))
    assert [r["policy_version"] for r in history] == list(range(STEPS))  # one published version per step
    assert all(r["staleness_max"] <= max_staleness for r in history)
    assert max(r["staleness_max"] for r in history) >= 1  # sampling ran ahead of training: asynchronous
    assert all(r["weight_sync_s"] is not None for r in history)

    sampled = [r["sampled_reward"] for r in history]
    first, last = mean(sampled[:WINDOW]), mean(sampled[-WINDOW:])
    curve = " ".join(f"{mean(sampled[i:i + WINDOW]):.2f}" for i in range(0, len(sampled), WINDOW))
    print("10-step means of the sampled reward:", curve)
    # Step 0's sampled reward is the initial policy's alone (every rollout pushed before version 1
    # existed): chance, 0.08-0.09 measured. The first 10 steps already learn a little (0.14-0.22).
    assert sampled[0] < 0.2, f"the initial policy should be at chance (0.09), got {sampled[0]:.2f}"
    assert first < 0.35, f"the first {WINDOW} steps should be near chance; 10-step means: {curve}"
    assert last >= 0.8, f"mean sampled reward {last:.2f} over the last {WINDOW} steps; 10-step means: {curve}"
    assert last >= first + 0.3, curve

    # The variable batch: every step 64 rollouts, its samples more while retries (a sample each) are common.
    samples = [r["num_samples"] for r in history]
    assert all(r["num_samples"] >= r["num_rollouts"] for r in history)
    assert mean(samples[:WINDOW]) > mean(samples[-WINDOW:]) + 10, samples
    assert summary["closed_loop"]["failed_groups"] == {}  # the digit agent never fails
    assert 1.0 <= summary["closed_loop"]["agent_metrics"]["turns"] <= 2.0
    assert summary["dropped_by_reason"].get("uniform_group_reward", 0) > 0  # dynamic sampling filtered groups
    assert set(summary["rejected_samples_by_rule"]) <= allowed_rejections, summary["rejected_samples_by_rule"]
