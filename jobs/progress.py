"""What a person and a machine see of a run: one line and one JSON record per step, a summary, a plot."""

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
    microbatches_per_rank: int | None
    num_tokens: int
    loss: float
    reward: float
    step_time_s: float
    lr: float
    layout: str
    partial: bool

    def text(self) -> str:
        micro = "legacy" if self.microbatches_per_rank is None else str(self.microbatches_per_rank)
        kind = "partial" if self.partial else "full"
        return (f"step {self.step:>3} | rollouts {self.num_rollouts:>3} ({kind}) | samples {self.num_samples:>3} | "
                f"micro-batches/rank {micro:>3} | tokens {self.num_tokens:>6} | loss {self.loss:+.3e} | "
                f"reward {self.reward:.3f} | lr {self.lr:.2e} | {self.step_time_s:.2f} s")


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
    """Rollouts per step (bars, partial steps hatched) and loss over steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(7, 6.5), sharex=True)
    colors = ["tab:orange" if r["partial"] else "tab:blue" for r in records]
    top.bar(steps, [r["num_rollouts"] for r in records], color=colors)
    top.set_ylabel("rollouts")
    top.set_title("rollouts per step (orange: partial step)")
    middle.plot(steps, [r["loss"] for r in records], marker="o", color="tab:red")
    middle.set_ylabel("loss")
    bottom.plot(steps, [r["reward"] for r in records], marker="s", color="tab:green")
    bottom.set_ylabel("reward")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
