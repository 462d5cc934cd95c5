"""The per-step line and plot: the closed loop's fields appear when recorded, old records still plot."""

from __future__ import annotations

from jobs.progress import StepLine, StepRecorder, plot_records, read_records

BASE = dict(step=3, num_rollouts=64, num_samples=90, microbatches_per_rank=1, num_tokens=500, loss=-0.01,
            reward=0.5, step_time_s=0.2, lr=1e-3, partial=False)


def test_synthetic_line_has_no_closed_loop_fields():
    text = StepLine(**BASE).text()
    assert text.startswith("step   3 | rollouts  64 (full)") and " | v" not in text and "sampled" not in text


def test_closed_loop_line_shows_version_staleness_sampled_reward_mismatch_and_sync():
    line = StepLine(**BASE, policy_version=3, staleness_mean=0.75, staleness_max=1, sampled_reward=0.62,
                    log_prob_mismatch=2.5e-3, weight_sync_s=0.012, shard_wait_s=0.5)
    assert line.text().endswith("| v3 stale 0.75/1 | sampled reward 0.620 | lp mismatch 2.5e-03 | sync 0.01 s | "
                                "waited 0.50 s")
    nothing_pushed = StepLine(**BASE, policy_version=4, staleness_mean=None, staleness_max=None, sampled_reward=None,
                              log_prob_mismatch=float("nan"), weight_sync_s=0.01)
    assert nothing_pushed.text().endswith("| v4 | sampled reward - | lp mismatch - | sync 0.01 s | waited - s")


def test_records_round_trip_and_plot_with_and_without_staleness(tmp_path):
    recorder = StepRecorder(str(tmp_path / "steps.jsonl"), append=False)
    for step in range(4):
        recorder.write(StepLine(**{**BASE, "step": step}, policy_version=step, staleness_mean=0.5, staleness_max=1,
                                sampled_reward=0.1 * step, weight_sync_s=0.01))
    recorder.close()
    records = read_records(str(tmp_path / "steps.jsonl"))
    assert [r["policy_version"] for r in records] == [0, 1, 2, 3] and records[2]["sampled_reward"] == 0.2
    plot_records(records, str(tmp_path / "closed.png"))
    old = [{k: v for k, v in r.items() if k in BASE} for r in records]  # a record written before these fields
    plot_records(old, str(tmp_path / "old.png"))
    assert (tmp_path / "closed.png").stat().st_size > (tmp_path / "old.png").stat().st_size > 10_000
