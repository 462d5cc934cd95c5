"""The named corpus of bad inputs: each case is a push that breaks exactly one rule.

Used by the pure intake tests and by the SchedulerActor tests (through `submit` and through a
Ray Data stream). Limits the corpus assumes: `CORPUS_LIMITS` (vocabulary, sequence length,
push size). Before the corpus runs, rollout "trained" was trained in a step and rollout
"dropped" was dropped (uniform group), so late samples of them can be sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tests.rollout_factory import sample_row

CORPUS_LIMITS = dict(vocab_size=1000, max_sequence_length=64, max_samples_per_push=50)


@dataclass(frozen=True)
class BadInput:
    rule: str
    rows: Callable[[], list]
    """The push: every sample of it is rejected with `rule`, except `accepted` good siblings first."""
    accepted: int = 0
    in_dataset: bool = True
    """Whether a Ray Data stream can carry it (a row is always a dict; a stream has no pushes)."""


def _one(rid: str, **overrides) -> list[dict]:
    return [sample_row(rid, 0, size=1, **overrides)]


def _siblings(rid: str, **second) -> list[dict]:
    return [sample_row(rid, 0, size=2), sample_row(rid, 1, size=2, **second)]


BAD_INPUTS: dict[str, BadInput] = {
    "mask_length": BadInput("mask_length", lambda: _one("b-mask-length", loss_mask=np.ones(2, dtype=np.int8))),
    "mask_values": BadInput("mask_values", lambda: _one("b-mask-values", loss_mask=np.full(6, 2, dtype=np.int8))),
    "response_length_zero": BadInput("response_length", lambda: _one(
        "b-response-zero", response_length=0, loss_mask=np.zeros(0, dtype=np.int8))),
    "response_length_negative": BadInput("response_length", lambda: _one(
        "b-response-negative", response_length=-3, loss_mask=np.zeros(0, dtype=np.int8))),
    "response_longer_than_tokens": BadInput("response_length", lambda: _one(
        "b-response-long", response=99, loss_mask=np.ones(99, dtype=np.int8))),
    "empty_tokens": BadInput("empty_tokens", lambda: _one(
        "b-empty", tokens=np.zeros(0, dtype=np.int64), response_length=1, loss_mask=np.ones(1, dtype=np.int8))),
    "token_over_vocabulary": BadInput("token_range", lambda: _one("b-vocab", tokens=np.arange(12) + 995)),
    "negative_token": BadInput("token_range", lambda: _one("b-negative-token", tokens=np.arange(12) - 1)),
    "nan_reward": BadInput("reward", lambda: _one("b-nan-reward", reward=float("nan"))),
    "infinite_reward": BadInput("reward", lambda: _one("b-inf-reward", reward=float("inf"))),
    "sibling_reward": BadInput("sibling_reward", lambda: _siblings("b-sibling-reward", reward=0.0), accepted=1),
    "sibling_rollout_size": BadInput("sibling_rollout_size", lambda: [
        sample_row("b-sibling-size", 0, size=2), sample_row("b-sibling-size", 1, size=3)], accepted=1),
    "duplicate_sample_index": BadInput("duplicate_sample", lambda: [
        sample_row("b-duplicate", 0, size=2), sample_row("b-duplicate", 0, size=2)], accepted=1),
    "sample_of_trained_rollout": BadInput("already_scheduled", lambda: [sample_row("trained", 1, size=2)]),
    "sample_of_dropped_rollout": BadInput("already_dropped", lambda: [
        sample_row("dropped", 1, size=2, advantage=None, group=("dropped-group", 1))]),
    "missing_reward": BadInput("missing_field", lambda: [
        {k: v for k, v in sample_row("b-missing", 0, size=1).items() if k != "reward"}]),
    "tokens_not_integers": BadInput("wrong_type", lambda: _one("b-float-tokens", tokens=np.linspace(0, 5, 12))),
    "reward_not_a_number": BadInput("wrong_type", lambda: _one("b-str-reward", reward="high")),
    "fractional_response_length": BadInput("wrong_type", lambda: _one(
        "b-frac-response", response_length=2.5, loss_mask=np.ones(2, dtype=np.int8))),
    "not_a_dict": BadInput("wrong_type", lambda: ["rollout b-str, tokens 1 2 3"], in_dataset=False),
    "longer_than_the_model": BadInput("sequence_length", lambda: _one("b-too-long", length=65)),
    "push_too_large": BadInput("push_size", lambda: [sample_row(f"b-big{i}", 0, size=1) for i in range(51)],
                               in_dataset=False),
    "rollout_size_index": BadInput("rollout_size", lambda: [sample_row("b-index", 4, size=2)]),
    "group_without_size": BadInput("group", lambda: _one("b-group", group_id="g")),
    "missing_advantage": BadInput("missing_advantage", lambda: _one("b-no-advantage", advantage=None)),
}
