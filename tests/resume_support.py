"""Helpers of the failure and resume tests: job overrides that select the synthetic producers (the
job's control flow, fast, without vLLM), and a recording stand-in for the scheduler's push API.

Ray workers import a test helper class by its module name, so it lives here (`tests.resume_support`)
rather than in a test module that pytest imports under another name."""

from __future__ import annotations

import time
from dataclasses import fields

import ray

from actors.producers import PRODUCER_NAME
from actors.scheduler_actor import DEFAULT_NAME
from actors.scheduler_api import SubmitResult
from actors.train_config import LossConfig
from jobs.job_config import JobConfig


def synthetic_producers() -> list[str]:
    """`--set` items for synthetic producers where the job defaults to the closed loop. Synthetic
    samples carry no behaviour log-probs, so the loss is on-policy PPO with no staleness."""
    if "closed_loop" not in {f.name for f in fields(JobConfig)}:
        return []
    extra = ["closed_loop.enabled=false"]
    if "off_policy" in {f.name for f in fields(LossConfig)}:
        extra += ["train.loss.off_policy.max_staleness=0", "train.loss.off_policy.policy_loss=ppo"]
    return extra


class RecordingScheduler:
    """Accepts every sample and records (rollout id, sample index, tokens) of each, in push order."""

    def __init__(self):
        self.samples: list[tuple] = []

    def submit(self, samples, wait_s: float = 0.0) -> SubmitResult:
        self.samples += [(s["rollout_id"], s["sample_index"], tuple(int(t) for t in s["tokens"])) for s in samples]
        return SubmitResult(accepted=len(samples))

    def seen(self) -> list[tuple]:
        return list(self.samples)


def names_free(num_agents: int = 2, timeout_s: float = 60.0) -> None:
    """Wait until the previous run's named actors are gone (the next run reuses the names)."""
    names = [DEFAULT_NAME] + [PRODUCER_NAME.format(i) for i in range(num_agents)]
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            assert time.monotonic() < deadline, f"actor {name} still alive after {timeout_s} s"
            time.sleep(0.1)
