"""What a person and a machine see of a run: one line and one JSON record per step, a summary, a plot.

The fields' names in the run's metric vocabulary (TensorBoard, W&B, MLflow, Ray) are in jobs/metric_names.py."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class StepLine:
    """One optimizer step as the job reports it (units in the names)."""

    step: int
    num_rollouts: int
    num_samples: int
    microbatches_per_rank: int
    num_tokens: int
    loss: float
    reward: float
    step_time_s: float
    lr: float
    partial: bool
    policy_version: int | None = None
    """The version this step trained from (optimizer steps taken before it); it publishes version + 1."""
    staleness_mean: float | None = None
    """Versions between policy_version and each trained rollout's oldest version, mean over the step's rollouts."""
    staleness_max: int | None = None
    sampled_reward: float | None = None
    """Closed loop: mean reward of every rollout the producers pushed since the previous step, groups
    the dynamic-sampling filter dropped included (the sampling policy's reward; `reward` is the
    trained rollouts')."""
    log_prob_mismatch: float | None = None
    """Mean |trainer - engine| log-prob per response token (the trainer's proximal vs the behaviour log-probs)."""
    weight_sync_s: float | None = None
    """Trainer-side seconds to publish this step's weights (gather, convert, one object-store copy)."""
    shard_wait_s: float | None = None
    """Seconds the train group waited for this step's shards to be formed (trainer idle)."""
    engine_load_s: float | None = None
    """Closed loop: the slowest engine's load time of the newest version whose load had finished by now."""
    engine_idle_share: float | None = None
    """Closed loop: share of the engines' time since start with no request (read every 10 steps, else None)."""
    loss_metrics: dict[str, float] | None = None
    """The policy loss's own metrics and its correction's (clip_fraction, is_weight, correction_masked, ...):
    name -> mean over the step's trained tokens (docs/losses.md lists each loss's)."""

    def text(self) -> str:
        kind = "partial" if self.partial else "full"
        line = (f"step {self.step:>3} | rollouts {self.num_rollouts:>3} ({kind}) | samples {self.num_samples:>3} | "
                f"micro-batches/rank {self.microbatches_per_rank:>3} | tokens {self.num_tokens:>6} | loss {self.loss:+.3e} | "
                f"reward {self.reward:.3f} | lr {self.lr:.2e} | {self.step_time_s:.2f} s")
        if self.policy_version is not None:  # the closed loop's part of the line
            line += f" | v{self.policy_version}"
            if self.staleness_max is not None:
                line += f" stale {_fmt(self.staleness_mean, '.2f')}/{self.staleness_max}"
            line += (f" | sampled reward {_fmt(self.sampled_reward, '.3f')} | lp mismatch "
                     f"{_fmt(self.log_prob_mismatch, '.1e')} | sync {_fmt(self.weight_sync_s, '.2f')} s | "
                     f"waited {_fmt(self.shard_wait_s, '.2f')} s")
        return line


def _fmt(value, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


class StepRecorder:
    """Appends one JSON object per optimizer step to `path` (JSON Lines), flushed each step."""

    def __init__(self, path: str, append: bool):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = open(path, "a" if append else "w")

    def write(self, line: StepLine) -> None:
        self._file.write(json.dumps(line.__dict__) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_records(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_records(records: list[dict], path: str) -> None:
    """Rollouts per step (bars, partial steps orange) and samples (a line), loss, reward (trained and, in the closed loop,
    sampled) and, when recorded, staleness (mean and max) over steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    staleness = [r for r in records if r.get("staleness_max") is not None]
    rows = 4 if staleness else 3
    fig, axes = plt.subplots(rows, 1, figsize=(7, 2.2 * rows), sharex=True)
    top, middle, bottom = axes[:3]
    colors = ["tab:orange" if r["partial"] else "tab:blue" for r in records]
    top.bar(steps, [r["num_rollouts"] for r in records], color=colors, label="rollouts")
    top.plot(steps, [r["num_samples"] for r in records], color="black", linewidth=1, label="samples")
    top.set_ylabel("per step")
    top.set_title("rollouts per step (blue: full step, orange: partial), samples (line)")
    top.legend(loc="upper right", fontsize=8)
    middle.plot(steps, [r["loss"] for r in records], marker="o", markersize=3, color="tab:red")
    middle.set_ylabel("loss")
    bottom.plot(steps, [r["reward"] for r in records], marker="s", markersize=3, color="tab:green",
                label="trained rollouts")
    sampled = [(r["step"], r["sampled_reward"]) for r in records if r.get("sampled_reward") is not None]
    if sampled:
        bottom.plot(*zip(*sampled), color="tab:purple", label="sampled (all rollouts)")
        bottom.legend(loc="lower right", fontsize=8)
    bottom.set_ylabel("reward")
    if staleness:
        axes[3].plot([r["step"] for r in staleness], [r["staleness_mean"] for r in staleness], label="mean")
        axes[3].step([r["step"] for r in staleness], [r["staleness_max"] for r in staleness], where="mid",
                     label="max", color="tab:gray")
        axes[3].set_ylabel("staleness (versions)")
        axes[3].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
