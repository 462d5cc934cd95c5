"""One error base class for vgbs-ray, and its kinds.

Every error names the setting, rollout or sample involved and the rule it broke, so the
message alone tells the user what to change. All are plain picklable exceptions (they cross
Ray actor boundaries).
"""

from __future__ import annotations


class VgbsError(Exception):
    """Base class of every error vgbs-ray raises on purpose."""


class ConfigError(VgbsError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class ScheduleError(VgbsError, ValueError):
    """A set of rollouts cannot be laid out under the given configs."""


class RolloutValidationError(VgbsError, ValueError):
    """A sample or rollout breaks the data contract.

    Attributes:
        rollout_id: the offending rollout.
        rule: short machine-readable name of the broken rule (e.g. ``"mask_length"``).
        sample_index: the offending sample inside the rollout, when one is to blame.
    """

    def __init__(self, rollout_id, rule: str, detail: str, sample_index: int | None = None):
        self.rollout_id = rollout_id
        self.rule = rule
        self.detail = detail
        self.sample_index = sample_index
        where = f"rollout {rollout_id!r}"
        if sample_index is not None:
            where += f", sample {sample_index}"
        super().__init__(f"{where}: {rule}: {detail}")

    def __reduce__(self):
        return (type(self), (self.rollout_id, self.rule, self.detail, self.sample_index))


class SchedulerTimeoutError(VgbsError, TimeoutError):
    """A scheduler call waited past its timeout (no shard yet, no room, flush not done); the message says why."""


class SchedulerStateError(VgbsError, RuntimeError):
    """A scheduler call that its current state forbids (input closed, step released, a rank acked twice)."""
