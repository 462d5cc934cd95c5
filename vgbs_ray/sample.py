"""The data contract: a sample, a rollout, and the rules they must keep.

A *sample* is one training sequence; a *rollout* is one execution of a producer and yields
1..N samples that share one `rollout_id` and one reward. Units: `tokens` and
`response_length` in tokens; `loss_mask` has one 0/1 per response token (the response is
the last `response_length` tokens).

Rules (each has a name that errors carry in `RolloutValidationError.rule`):
  missing_field       rollout_id, tokens, response_length, loss_mask, reward are present
  wrong_type          tokens and loss_mask hold integers; response_length, sample_index,
                      rollout_size, group_size are integers; reward and advantage numbers
  empty_tokens        tokens non-empty
  response_length     1 <= response_length <= len(tokens)
  token_range         0 <= token id < vocab_size, when the vocabulary size is known
  sequence_length     len(tokens) <= max_sequence_length, when the model's limit is known
  mask_length         len(loss_mask) == response_length
  mask_values         loss_mask values are 0 or 1
  log_probs_length    len(rollout_log_probs) == response_length, when given
  rollout_size        1 <= rollout_size, sample_index < rollout_size, when given
  group               group_id and group_size come together, group_size >= 1
  policy_version      policy_version_min and _max come together, 0 <= min <= max
  version_runs        policy_version_runs, when given: [k, 2] (version, tokens) runs over the response,
                      tokens >= 1 summing to response_length, versions -1 (not sampled: mask 0) or
                      within [policy_version_min, policy_version_max]
  sibling_rollout_id  siblings share one rollout_id
  sibling_reward      siblings share one reward
  sibling_rollout_size siblings agree on rollout_size
  duplicate_sample    no two samples of a rollout share a sample_index
  incomplete_rollout  a whole rollout has exactly rollout_size samples
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Hashable, Sequence

import numpy as np

from vgbs_ray.errors import RolloutValidationError


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One training sequence of one rollout (see module docstring for units and rules)."""

    rollout_id: Hashable
    tokens: np.ndarray
    """int64 token ids, prompt + response."""
    response_length: int
    loss_mask: np.ndarray
    """int8, one 0/1 per response token."""
    reward: float
    sample_index: int = 0
    """Position of this sample within its rollout (0..rollout_size-1)."""
    rollout_size: int | None = None
    """Number of samples the rollout has; lets siblings arrive in separate calls."""
    advantage: float | None = None
    group_id: Hashable | None = None
    """Rollouts answering the same prompt share a group (GRPO-style advantages)."""
    group_size: int | None = None
    rollout_log_probs: np.ndarray | None = None
    """float32 log-probs of the response tokens under the rollout policy."""
    policy_version_min: int | None = None
    """Oldest policy version (optimizer steps taken) whose weights generated a token of this sample."""
    policy_version_max: int | None = None
    """Newest such version (differs from the oldest when generation spanned a weight update)."""
    policy_version_runs: np.ndarray | None = None
    """int64 [k, 2]: the version that sampled each response token, run-length encoded as (version, tokens)
    rows in order; -1 for tokens the policy did not sample (mask 0: tool replies, template text)."""
    metadata: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def total_length(self) -> int:
        """Tokens (prompt + response). Cached: the intake, the layout and the shards each ask, per sample."""
        return int(len(self.tokens))

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "Sample":
        """Build a sample from a plain dict (a Ray Data row or a producer's payload).

        Arrays are normalised to their dtypes; unknown keys go into metadata. Raises
        RolloutValidationError (missing_field, wrong_type) when the row cannot be read as a
        sample; the other rules are `validate_sample`'s.
        """
        (rollout_id, tokens, response_length, loss_mask, reward, sample_index, rollout_size, advantage, group_id,
         group_size, log_probs, version_min, version_max, version_runs, metadata) = _field_values({**_ABSENT, **row})
        if rollout_id is None or tokens is None or response_length is None or loss_mask is None or reward is None:
            # A Ray Data row carries a missing column as None.
            missing = [k for k in _REQUIRED_FIELDS if row.get(k) is None]
            raise RolloutValidationError(rollout_id, "missing_field", f"sample lacks required field(s) {missing}")
        # Unknown keys are rare: test all keys at once in C, build `extra` only when there are some.
        extra = {} if row.keys() <= _SAMPLE_FIELDS else {k: v for k, v in row.items() if k not in _SAMPLE_FIELDS}
        if not (type(response_length) is int and type(reward) is float and type(rollout_id) in _PLAIN_IDS
                and type(group_id) in _PLAIN_IDS and type(advantage) in _FLOAT_OR_NONE and advantage == advantage
                and {type(sample_index), type(rollout_size), type(group_size), type(version_min),
                     type(version_max)} <= _INT_OR_NONE):
            # Not what producers send (then every scalar already has its type, and no float is NaN):
            # numpy scalars, integral floats and NaN for a missing value (Ray Data columns), wrong types.
            read = _FieldReader(rollout_id, sample_index)
            if isinstance(rollout_id, np.generic):
                rollout_id = rollout_id.item()
            response_length = read.integer(response_length, "response_length")
            reward = read.number(reward, "reward")
            sample_index = read.optional_integer(sample_index, "sample_index")
            rollout_size = read.optional_integer(rollout_size, "rollout_size")
            advantage = read.optional_number(advantage, "advantage")
            group_id = _optional_scalar(group_id)
            group_size = read.optional_integer(group_size, "group_size")
            version_min = read.optional_integer(version_min, "policy_version_min")
            version_max = read.optional_integer(version_max, "policy_version_max")
        if not _is_int_vector(tokens):
            tokens = _FieldReader(rollout_id, sample_index).int_array(tokens, "tokens")
        if tokens.dtype != _INT64:  # not `is`: an unpickled array carries its own dtype instance
            tokens = tokens.astype(np.int64)
        if not _is_int_vector(loss_mask):
            loss_mask = _FieldReader(rollout_id, sample_index).int_array(loss_mask, "loss_mask")
        # Built without the frozen __init__ (15 object.__setattr__ calls, a third of this method,
        # which runs for every pushed sample): every field is given and typed right here.
        sample = object.__new__(cls)
        sample.__dict__.update(
            rollout_id=rollout_id,
            tokens=tokens,
            total_length=len(tokens),  # total_length's cache, set here: 3.11's cached_property takes a lock
            response_length=response_length,
            loss_mask=loss_mask,
            reward=reward,
            sample_index=sample_index or 0,
            rollout_size=rollout_size,
            advantage=advantage,
            group_id=group_id,
            group_size=group_size,
            rollout_log_probs=None if log_probs is None else np.asarray(log_probs, dtype=np.float32).reshape(-1),
            policy_version_min=version_min,
            policy_version_max=version_max,
            policy_version_runs=None if version_runs is None else _version_runs(version_runs, rollout_id, sample_index),
            metadata={**(metadata or {}), **extra},
        )
        return sample

    def to_dict(self) -> dict[str, Any]:
        """The inverse of `from_dict` (a row for Ray Data)."""
        return {
            "rollout_id": self.rollout_id,
            "tokens": self.tokens,
            "response_length": self.response_length,
            "loss_mask": self.loss_mask,
            "reward": self.reward,
            "sample_index": self.sample_index,
            "rollout_size": self.rollout_size,
            "advantage": self.advantage,
            "group_id": self.group_id,
            "group_size": self.group_size,
            "rollout_log_probs": self.rollout_log_probs,
            "policy_version_min": self.policy_version_min,
            "policy_version_max": self.policy_version_max,
            "policy_version_runs": self.policy_version_runs,
            "metadata": self.metadata,
        }

    def with_advantage(self, advantage: float) -> "Sample":
        """A copy with `advantage` set (arrays and metadata shared, as `dataclasses.replace` does).

        Called once per sample of every group-advantaged rollout: copying the instance dict
        skips re-running the 12-field frozen __init__ (~6x cheaper than `replace`).
        """
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.__dict__["advantage"] = float(advantage)
        return clone


# Built once: `from_dict` runs for every pushed sample.
_REQUIRED_FIELDS = ("rollout_id", "tokens", "response_length", "loss_mask", "reward")
# The order `from_dict` unpacks them in (named here, not taken from the dataclass, so that reordering
# its fields cannot silently swap two values).
_FIELD_ORDER = ("rollout_id", "tokens", "response_length", "loss_mask", "reward", "sample_index", "rollout_size",
                "advantage", "group_id", "group_size", "rollout_log_probs", "policy_version_min",
                "policy_version_max", "policy_version_runs", "metadata")
assert set(_FIELD_ORDER) == set(Sample.__dataclass_fields__), "_FIELD_ORDER must list every Sample field"
_SAMPLE_FIELDS = frozenset(_FIELD_ORDER)
_ABSENT = dict.fromkeys(_FIELD_ORDER)                 # a row's missing keys read as None
_field_values = operator.itemgetter(*_FIELD_ORDER)    # every field's value in one C call
_INT64 = np.dtype(np.int64)
_PLAIN_IDS = frozenset({str, int, type(None)})
_INT_OR_NONE = frozenset({int, type(None)})
_FLOAT_OR_NONE = frozenset({float, type(None)})


def _is_int_vector(value) -> bool:
    """A non-empty 1-d numpy array of integers (or bools): what producers send for tokens and masks."""
    return type(value) is np.ndarray and value.ndim == 1 and value.size > 0 and value.dtype.kind in "iub"


class _FieldReader:
    """Reads one row's fields, raising `wrong_type` (with the rollout and field) for a bad type.

    Integers may come as Python or numpy ints, or as integral floats (a Ray Data column with
    missing values turns into floats); numbers as anything real but a string or bool.
    """

    def __init__(self, rollout_id, sample_index):
        self.rollout_id = rollout_id
        self.sample_index = sample_index if isinstance(sample_index, (int, np.integer)) else None

    def fail(self, name: str, detail: str):
        raise RolloutValidationError(self.rollout_id, "wrong_type", f"{name} {detail}", sample_index=self.sample_index)

    def int_array(self, value, name: str) -> np.ndarray:
        if isinstance(value, (str, bytes, dict)):
            self.fail(name, f"must be a sequence of integers, got {type(value).__name__}")
        try:
            array = np.asarray(value)
        except ValueError as e:  # ragged nesting
            self.fail(name, f"must be a flat sequence of integers ({e})")
        if array.size == 0:
            return np.zeros(0, dtype=np.int64)
        if array.dtype.kind not in "iub" or array.ndim != 1:
            self.fail(name, f"must be a flat sequence of integers, got {array.ndim}-d dtype {array.dtype}")
        return array

    def integer(self, value, name: str) -> int:
        if type(value) is int:  # the common case, checked first: this runs for every field of every sample
            return value
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer, float, np.floating)):
            self.fail(name, f"must be an integer, got {type(value).__name__} {value!r}")
        if isinstance(value, (float, np.floating)) and not float(value).is_integer():
            self.fail(name, f"must be an integer, got {value!r}")
        return int(value)

    def optional_integer(self, value, name: str) -> int | None:
        if value is None or type(value) is int:
            return value
        return None if _is_nan(value) else self.integer(value, name)

    def number(self, value, name: str) -> float:
        if type(value) is float:
            return value
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            self.fail(name, f"must be a number, got {type(value).__name__} {value!r}")
        return float(value)

    def optional_number(self, value, name: str) -> float | None:
        if value is None:
            return None
        return None if _is_nan(value) else self.number(value, name)


def _version_runs(value, rollout_id, sample_index) -> np.ndarray:
    """(version, tokens) runs as int64 [k, 2] (a Ray Data row may carry them as a list of pairs)."""
    try:
        runs = np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError) as error:
        raise RolloutValidationError(rollout_id, "wrong_type", f"policy_version_runs must be (version, tokens) integer "
                                     f"pairs ({error})", sample_index=sample_index) from None
    if runs.size == 0 or runs.ndim != 2 or runs.shape[1] != 2:
        raise RolloutValidationError(rollout_id, "wrong_type", "policy_version_runs must be a non-empty list of "
                                     f"(version, tokens) pairs, got shape {runs.shape}", sample_index=sample_index)
    return runs


def _optional_scalar(value):
    if value is None or _is_nan(value):
        return None
    return value.item() if isinstance(value, np.generic) else value


def _is_nan(value) -> bool:
    return isinstance(value, (float, np.floating)) and np.isnan(value)


def validate_sample(sample: Sample, *, vocab_size: int | None = None, max_sequence_length: int | None = None) -> None:
    """Raise RolloutValidationError if `sample` breaks a per-sample rule.

    `vocab_size` and `max_sequence_length` (tokens) are the model's limits, when known.
    """

    def fail(rule: str, detail: str):
        raise RolloutValidationError(sample.rollout_id, rule, detail, sample_index=sample.sample_index)

    if sample.tokens.size == 0:
        fail("empty_tokens", "tokens must be non-empty")
    if not 1 <= sample.response_length <= sample.tokens.size:
        fail(
            "response_length",
            f"response_length={sample.response_length} must be in [1, len(tokens)={sample.tokens.size}]",
        )
    if max_sequence_length is not None and sample.tokens.size > max_sequence_length:
        fail("sequence_length", f"{sample.tokens.size} tokens exceed the model's max_sequence_length={max_sequence_length}")
    if vocab_size is not None:
        low, high = int(sample.tokens.min()), int(sample.tokens.max())
        if low < 0 or high >= vocab_size:
            fail("token_range", f"token id {low if low < 0 else high} is outside the vocabulary [0, {vocab_size})")
    if sample.loss_mask.size != sample.response_length:
        fail(
            "mask_length",
            f"len(loss_mask)={sample.loss_mask.size} must equal response_length={sample.response_length}",
        )
    if sample.loss_mask.size and not _is_zero_one(sample.loss_mask):
        bad = sample.loss_mask[~np.isin(sample.loss_mask, (0, 1))][0]
        fail("mask_values", f"loss_mask values must be 0 or 1, found {bad!r}")
    if sample.rollout_log_probs is not None and sample.rollout_log_probs.size != sample.response_length:
        fail(
            "log_probs_length",
            f"len(rollout_log_probs)={sample.rollout_log_probs.size} must equal response_length={sample.response_length}",
        )
    if not math.isfinite(sample.reward):
        fail("reward", f"reward must be finite, got {sample.reward}")
    if sample.rollout_size is not None and not 0 <= sample.sample_index < sample.rollout_size:
        fail(
            "rollout_size",
            f"sample_index={sample.sample_index} must be in [0, rollout_size={sample.rollout_size})",
        )
    if sample.sample_index < 0:
        fail("rollout_size", f"sample_index={sample.sample_index} must be >= 0")
    if (sample.group_id is None) != (sample.group_size is None) or (sample.group_size is not None and sample.group_size < 1):
        fail("group", f"group_id and group_size come together with group_size >= 1, got {sample.group_id!r}/{sample.group_size!r}")
    low, high = sample.policy_version_min, sample.policy_version_max
    if (low is None) != (high is None) or (low is not None and not 0 <= low <= high):
        fail("policy_version", f"policy_version_min/max come together with 0 <= min <= max, got {low!r}/{high!r}")
    runs = sample.policy_version_runs
    if runs is not None:
        versions, counts = runs[:, 0], runs[:, 1]
        sampled = versions[versions != -1]
        if counts.min() < 1 or int(counts.sum()) != sample.response_length:
            fail("version_runs", f"policy_version_runs' token counts must be >= 1 and sum to response_length="
                                 f"{sample.response_length}, got {counts.tolist()}")
        if sampled.size and (low is None or int(sampled.min()) < low or int(sampled.max()) > high) \
                or (versions < -1).any():
            fail("version_runs", f"policy_version_runs' versions {sorted(set(versions.tolist()))} must be -1 or within "
                                 f"policy_version_min/max {low!r}/{high!r}")


def _is_zero_one(mask: np.ndarray) -> bool:
    """Whether every value is 0 or 1: one reduction for integer masks (np.isin is ~10x slower)."""
    kind = mask.dtype.kind
    if kind == "b":
        return True
    if kind in "iu" and mask.itemsize == 1:
        # Byte masks (what producers send): deleting the bytes 0 and 1 must leave nothing (~3x a reduction).
        return not mask.tobytes().translate(None, b"\x00\x01")
    if kind in "iu" and mask.dtype.isnative:
        # Seen unsigned, a negative value is huge: max <= 1 holds exactly for 0/1 masks.
        return int(mask.view(f"u{mask.itemsize}").max()) <= 1
    return bool(((mask == 0) | (mask == 1)).all())


def check_sibling(first: Sample, other: Sample) -> None:
    """Raise if `other` cannot be a sibling of `first` (same rollout id, reward, size, group)."""
    rid = first.rollout_id

    def fail(rule: str, detail: str):
        raise RolloutValidationError(rid, rule, detail, sample_index=other.sample_index)

    if other.rollout_id != rid:
        fail("sibling_rollout_id", f"sample carries rollout_id {other.rollout_id!r}, its siblings {rid!r}")
    if other.reward != first.reward:
        fail("sibling_reward", f"reward {other.reward} differs from its siblings' {first.reward}: a rollout has one reward")
    if other.rollout_size != first.rollout_size:
        fail("sibling_rollout_size", f"rollout_size {other.rollout_size} differs from its siblings' {first.rollout_size}")
    if (other.group_id, other.group_size) != (first.group_id, first.group_size):
        fail("group", f"group {other.group_id!r}/{other.group_size} differs from its siblings' {first.group_id!r}/{first.group_size}")


def validate_rollout(samples: Sequence[Sample], *, require_complete: bool = True) -> None:
    """Validate all samples of one rollout, every rule in the module docstring.

    With `require_complete`, a rollout that declares `rollout_size` must hold exactly that
    many samples.
    """
    if not samples:
        raise RolloutValidationError(None, "empty_rollout", "a rollout needs at least one sample")
    first = samples[0]
    seen: set[int] = set()
    for sample in samples:
        validate_sample(sample)
        check_sibling(first, sample)
        if sample.sample_index in seen:
            raise RolloutValidationError(
                first.rollout_id, "duplicate_sample", f"sample_index {sample.sample_index} appears twice",
                sample_index=sample.sample_index,
            )
        seen.add(sample.sample_index)
    expected = first.rollout_size
    if require_complete and expected is not None and len(samples) != expected:
        raise RolloutValidationError(
            first.rollout_id, "incomplete_rollout", f"has {len(samples)} samples, rollout_size says {expected}"
        )


def make_rollout(rollout_id: Hashable, samples: Sequence[dict[str, Any]], reward: float, **shared) -> list[Sample]:
    """Build and validate a whole rollout from per-sample dicts (tokens, response_length, loss_mask, ...).

    The rollout id, reward, rollout_size (= len(samples)) and `shared` fields (advantage,
    group_id, group_size) are set on every sample, and sample_index by position.
    """
    built = [
        Sample.from_dict(
            {**row, **shared, "rollout_id": rollout_id, "reward": reward, "sample_index": i, "rollout_size": len(samples)}
        )
        for i, row in enumerate(samples)
    ]
    validate_rollout(built)
    return built
