"""One multi-turn episode of the digit task, as a state machine with no I/O.

    episode = DigitEpisode(task, prompt)
    while not episode.done:
        out = engine.generate(episode.context(), max_tokens=episode.max_response_tokens)
        episode.submit(out.token_ids, out.log_probs, out.policy_version)
    rows = episode.to_samples(rollout_id_for(prompt, k), group_id=prompt.prompt_id, group_size=8)

or a whole GRPO group at once (one batched generate per turn for its live episodes):

    group = EpisodeGroup(task, prompt, group_size=8)
    while not group.done:
        live = group.live()
        outs = engine.generate([e.context() for _, e in live], max_tokens=1)
        for (_, e), out in zip(live, outs):
            e.submit(out.token_ids, out.log_probs, out.policy_version)
    rows = group.to_samples()

Turn t: the model answers one token after `context()`. Right: the episode ends with reward
`turn_rewards[t]`. Wrong: the environment replies with one feedback token (HIGHER, LOWER or
NOT_DIGIT) appended to the context, and the model retries; after the last turn a wrong
answer ends the episode with reward 0. The driver (a sync loop, an asyncio producer, a
benchmark) owns the generation; the episode never calls anything, so it runs the same in all.

Samples (`to_samples`): the push API's sample dicts, one reward per rollout.
  - `one_sample_per_turn=True` (context compaction): each turn is its own sample, tokens =
    that turn's context + its answer, loss mask over the answer only. A rollout answered
    right at once yields 1 sample, one that retried yields 2: sample counts vary.
  - `False`: one sample holding the whole transcript; the response is everything after the
    prompt, with loss mask 1 on the model's tokens and 0 on the environment's feedback.
Both give the same per-rollout loss for the same log-probs (a causal model sees the same
context for every answer token, and the rollout's denominator counts the same tokens).

Each sample carries the behaviour log-probs of its response tokens (0.0 under feedback
tokens, which are masked) and `policy_version_min/max`: the oldest and newest policy versions
that generated its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from benchmarks.digit_env.digits import (HIGHER, LOWER, NOT_DIGIT, NUM_DIGITS, DigitTaskConfig, Prompt, render,
                                  rollout_id_for)
from vgbs_ray.errors import VgbsError


@dataclass(frozen=True)
class Turn:
    """One answer and what the environment made of it."""

    context: np.ndarray
    """The tokens the answer was generated after."""
    answer: int
    log_prob: float
    """Behaviour log-prob of the answer token under the weights that sampled it."""
    policy_version: int
    correct: bool
    feedback: int | None
    """The environment's reply token, None when the episode ended on this turn."""


class EpisodeError(VgbsError, ValueError):
    """A driver misused an episode (wrong response length, submit after the end)."""


class DigitEpisode:
    """A multi-turn attempt at one prompt (see module docstring)."""

    max_response_tokens = 1
    """Tokens the engine generates per turn (the answer is one digit token)."""

    def __init__(self, task: DigitTaskConfig, prompt: Prompt):
        self.task = task
        self.prompt = prompt
        self.turns: list[Turn] = []
        self._context = prompt.tokens
        self.reward = 0.0
        self.done = False

    def context(self) -> np.ndarray:
        """The token ids to generate the next answer after (int64; a copy)."""
        if self.done:
            raise EpisodeError(f"prompt {self.prompt.prompt_id}: the episode is over, there is no next context")
        return self._context.copy()

    def submit(self, response_tokens: Sequence[int], log_probs: Sequence[float], policy_version: int) -> Turn:
        """Record the model's answer for the current turn; the environment checks it and replies."""
        where = f"prompt {self.prompt.prompt_id}, turn {len(self.turns) + 1}"
        if self.done:
            raise EpisodeError(f"{where}: submit after the episode ended")
        if len(response_tokens) != self.max_response_tokens or len(log_probs) != len(response_tokens):
            raise EpisodeError(f"{where}: expected {self.max_response_tokens} response token with one log-prob, "
                               f"got {len(response_tokens)} token(s) and {len(log_probs)} log-prob(s)")
        if policy_version < 0:
            raise EpisodeError(f"{where}: policy_version must be >= 0, got {policy_version}")
        answer = int(response_tokens[0])
        correct = answer == self.prompt.answer
        last_turn = len(self.turns) + 1 == self.task.max_turns
        feedback = None if correct or last_turn else _feedback(answer, self.prompt.answer)
        turn = Turn(context=self._context, answer=answer, log_prob=float(log_probs[0]),
                    policy_version=int(policy_version), correct=correct, feedback=feedback)
        if correct:
            self.reward = self.task.turn_rewards[len(self.turns)]
        self.turns.append(turn)
        if feedback is None:
            self.done = True
        else:
            self._context = np.concatenate([self._context, [answer, feedback]]).astype(np.int64)
        return turn

    def to_samples(self, rollout_id: Hashable, *, group_id: Hashable | None = None, group_size: int | None = None,
                   one_sample_per_turn: bool = True) -> list[dict]:
        """The finished episode as push-API sample dicts (see module docstring)."""
        if not self.done:
            raise EpisodeError(f"prompt {self.prompt.prompt_id}: to_samples before the episode ended "
                               f"({len(self.turns)} of at most {self.task.max_turns} turns)")
        rows = _per_turn_rows(self.turns) if one_sample_per_turn else [_transcript_row(self.prompt, self.turns)]
        shared = dict(rollout_id=rollout_id, reward=float(self.reward), rollout_size=len(rows),
                      group_id=group_id, group_size=group_size)
        return [dict(row, sample_index=i, **shared) for i, row in enumerate(rows)]

    def describe(self) -> str:
        """e.g. `<bos> 3 7 = 2 <higher> 8 -> 0.5` (for logs)."""
        tokens = list(self.prompt.tokens)
        for turn in self.turns:
            tokens += [turn.answer] + ([turn.feedback] if turn.feedback is not None else [])
        return f"{render(tokens)} -> {self.reward}"


class EpisodeGroup:
    """The `group_size` rollouts answering one prompt (a GRPO group), with their rollout ids
    `rollout_id_for(prompt, 0..group_size-1)` and group id `prompt.prompt_id`."""

    def __init__(self, task: DigitTaskConfig, prompt: Prompt, *, group_size: int):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.prompt = prompt
        self.episodes = {rollout_id_for(prompt, m): DigitEpisode(task, prompt) for m in range(group_size)}

    @property
    def rollout_ids(self) -> list[str]:
        return list(self.episodes)

    @property
    def done(self) -> bool:
        return all(e.done for e in self.episodes.values())

    def live(self) -> list[tuple[str, DigitEpisode]]:
        """(rollout id, episode) of every episode that still needs an answer, in member order."""
        return [(rid, e) for rid, e in self.episodes.items() if not e.done]

    def rewards(self) -> dict[str, float]:
        return {rid: e.reward for rid, e in self.episodes.items()}

    def to_samples(self, *, one_sample_per_turn: bool = True) -> list[dict]:
        """Every rollout's sample dicts, grouped (group_id = prompt id, group_size = members)."""
        return [row for rid, e in self.episodes.items()
                for row in e.to_samples(rid, group_id=self.prompt.prompt_id, group_size=len(self.episodes),
                                        one_sample_per_turn=one_sample_per_turn)]


def _feedback(answer: int, expected: int) -> int:
    if not 0 <= answer < NUM_DIGITS:
        return NOT_DIGIT
    return HIGHER if expected > answer else LOWER


def _per_turn_rows(turns: list[Turn]) -> list[dict]:
    return [
        dict(tokens=np.append(t.context, t.answer).astype(np.int64), response_length=1,
             loss_mask=np.ones(1, dtype=np.int8), rollout_log_probs=np.array([t.log_prob], dtype=np.float32),
             policy_version_min=t.policy_version, policy_version_max=t.policy_version)
        for t in turns
    ]


def _transcript_row(prompt: Prompt, turns: list[Turn]) -> dict:
    response, mask, log_probs = [], [], []
    for t in turns:
        response.append(t.answer)
        mask.append(1)
        log_probs.append(t.log_prob)
        if t.feedback is not None:  # the environment's token: context, not trained
            response.append(t.feedback)
            mask.append(0)
            log_probs.append(0.0)
    versions = [t.policy_version for t in turns]
    return dict(tokens=np.concatenate([prompt.tokens, response]).astype(np.int64), response_length=len(response),
                loss_mask=np.array(mask, dtype=np.int8), rollout_log_probs=np.array(log_probs, dtype=np.float32),
                policy_version_min=min(versions), policy_version_max=max(versions))
