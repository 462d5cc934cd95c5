"""The SchedulerActor's state at a step boundary, for a checkpoint and a resume across job restarts.

    state = ray.get(scheduler.export_state.remote(next_step=4))   # every step < 4 trained
    pickle.dump(state, f)                                          # the job's checkpoint holds it
    ...                                                            # a new job, a new Ray cluster
    scheduler = create_scheduler(config, name=..., restore=pickle.load(f))

What a resumed run needs from the scheduler, and nothing else:
  - `next_step`: steps are numbered globally; the restored scheduler's first step is `next_step`
    (the train side's step counter and the policy version continue from the same checkpoint).
  - `settled`: every rollout trained (in a step < next_step) or dropped, with its step or
    reason, as `SettledIds.to_bytes()` (~30 bytes per rollout, no Python object per id), so a
    re-sent sample of one is rejected by its existing rule, naming the rollout.
  - `intake`: every accepted rollout not trained before `next_step`, in the order it trains:
    first the rollouts of steps >= next_step already emitted (their original step order, as
    `rewind` puts them back), then the buffered complete rollouts, then rollouts waiting for
    their group and partly received ones (their accepted samples). Samples keep their arrays.
  - counts that outlive a restart: rejected samples by rule (drops by reason live in `settled`).

Invariants (checked at construction): `next_step >= 0`; `policy_version == next_step` (step k
trains version k); a rollout id appears once over the intake's parts and is not settled (the
latter is checked on restore, where the table is read). Pure: no Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vgbs_ray.errors import ConfigError
from vgbs_ray.scheduler.intake import IntakeSnapshot

FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class SchedulerState:
    """A scheduler's state at a step boundary (see module docstring). Pickles; samples as their arrays."""

    next_step: int
    """The first step the restored scheduler emits; every step < next_step was trained."""
    settled: bytes
    """`SettledIds.to_bytes()`: trained (with step) and dropped (with reason) rollouts."""
    intake: IntakeSnapshot
    """Untrained accepted rollouts in training order (emitted steps >= next_step first), open groups."""
    policy_version: int
    """The version step `next_step` trains (= next_step: step k trains the weights after k optimizer steps)."""
    replay_rollouts: int = 0
    """How many of the first ready rollouts come from emitted steps >= next_step: they form the next
    steps first, in this order (also under the staleness rules' oldest-first fill)."""
    rejected_samples_by_rule: dict = field(default_factory=dict)
    dropped_by_reason: dict = field(default_factory=dict)
    """For reports only (the settled table is the truth and restores these counts exactly)."""
    accepted_samples: int = 0
    rejected_samples: int = 0
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if not isinstance(self.next_step, int) or self.next_step < 0:
            raise ConfigError(f"SchedulerState.next_step must be an int >= 0, got {self.next_step!r}")
        if self.policy_version != self.next_step:
            raise ConfigError(f"SchedulerState.policy_version {self.policy_version} != next_step {self.next_step}: "
                              "step k trains version k, so both counters resume from the same checkpoint")
        if self.format_version != FORMAT_VERSION:
            raise ConfigError(f"SchedulerState format {self.format_version} is not this code's {FORMAT_VERSION}")
        if not isinstance(self.settled, (bytes, bytearray)):
            raise ConfigError(f"SchedulerState.settled must be SettledIds.to_bytes() output, got {type(self.settled).__name__}")
        if not isinstance(self.intake, IntakeSnapshot):
            raise ConfigError(f"SchedulerState.intake must be an IntakeSnapshot, got {type(self.intake).__name__}")
        if not 0 <= self.replay_rollouts <= len(self.intake.ready):
            raise ConfigError(f"SchedulerState.replay_rollouts {self.replay_rollouts} is not within the "
                              f"{len(self.intake.ready)} ready rollouts")
        ids = self.intake.rollout_ids
        if len(set(ids)) != len(ids):
            seen: set = set()
            twice = next(rid for rid in ids if rid in seen or seen.add(rid))
            raise ConfigError(f"SchedulerState lists rollout {twice!r} twice among its untrained rollouts")

    @property
    def untrained_rollout_ids(self) -> list:
        """Complete untrained rollouts in the order they train after a restore."""
        return [rid for rid, _ in self.intake.ready]

    @property
    def num_live_rollouts(self) -> int:
        """Accepted rollouts the restored scheduler holds again (complete, waiting for a group, partial)."""
        return len(self.intake.rollout_ids)
