"""The digit task: a verifiable one-digit answer to a short digit prompt, and its prompt streams.

Vocabulary (`VOCAB_SIZE` = 16 token ids; a tiny Llama with hidden 128 and 4 heads fits it):

    0..9      the digits
    BOS       start of a prompt
    SEP       end of the prompt: the model answers after it
    HIGHER    feedback: wrong, the answer is higher than your guess
    LOWER     feedback: wrong, the answer is lower than your guess
    NOT_DIGIT feedback: your answer was not a digit
    PAD       never produced by the environment (a spare id for engines that want one)

A prompt is `BOS d_1 .. d_n SEP` with n in [min_digits, max_digits]; its answer is one digit
given by the task's `rule` (a pure function of the digits, `ANSWER_RULES`). The default rule,
the successor of the last digit mod 10, is the one a from-scratch 2-layer model learns by RL
in well under a hundred steps (measured: `benchmarks/bench_env_learning.py`); the leading
digits are distractors, so the model must find *which* digit matters.

Prompt streams are pure functions of `(seed, index)`: `prompt_at(config, seed, index)` is
the same prompt on every machine and after every resume, so a producer that saves its
`PromptCursor` and restores it yields the same prompts and the same rollout ids again
(`rollout_id_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from vgbs_ray.errors import ConfigError

NUM_DIGITS = 10
BOS, SEP, HIGHER, LOWER, NOT_DIGIT, PAD = range(NUM_DIGITS, NUM_DIGITS + 6)
VOCAB_SIZE = NUM_DIGITS + 6
TOKEN_NAMES = {BOS: "<bos>", SEP: "=", HIGHER: "<higher>", LOWER: "<lower>", NOT_DIGIT: "<not-digit>", PAD: "<pad>"}


def _successor_of_last(digits: Sequence[int]) -> int:
    return (digits[-1] + 1) % NUM_DIGITS


def _first(digits: Sequence[int]) -> int:
    return digits[0]


def _largest(digits: Sequence[int]) -> int:
    return max(digits)


def _sum_mod_10(digits: Sequence[int]) -> int:
    return sum(digits) % NUM_DIGITS


ANSWER_RULES: dict[str, Callable[[Sequence[int]], int]] = {
    "successor_of_last": _successor_of_last,
    "first": _first,
    "largest": _largest,
    "sum_mod_10": _sum_mod_10,
}
"""Task rules by name: digits -> the one correct digit. `sum_mod_10` is the hard control
(no structure to find from sparse reward: measured flat at chance)."""


@dataclass(frozen=True, kw_only=True)
class DigitTaskConfig:
    """What is asked, and what a right answer earns on each turn."""

    rule: str = "successor_of_last"
    """Name of the answer rule (see `ANSWER_RULES`)."""
    min_digits: int = 1
    """Fewest digits in a prompt."""
    max_digits: int = 3
    """Most digits in a prompt (prompt lengths vary, so sequence lengths vary)."""
    turn_rewards: tuple[float, ...] = (1.0, 0.5)
    """Reward for a right answer on turn 1, 2, ...; its length is the number of turns. A wrong
    answer on the last turn earns 0. A later turn earns less: retrying is worth learning, but
    answering right at once is worth more."""

    def __post_init__(self):
        if self.rule not in ANSWER_RULES:
            raise ConfigError(f"DigitTaskConfig.rule={self.rule!r} is unknown; pick one of {sorted(ANSWER_RULES)}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ConfigError(f"DigitTaskConfig needs 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if not self.turn_rewards:
            raise ConfigError("DigitTaskConfig.turn_rewards needs at least one entry (one per turn)")
        if not all(np.isfinite(r) and 0 <= r <= 1 for r in self.turn_rewards):
            raise ConfigError(f"DigitTaskConfig.turn_rewards must lie in [0, 1], got {self.turn_rewards}")

    @property
    def max_turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def max_sequence_length(self) -> int:
        """Longest token sequence an episode can produce (prompt, every answer and feedback)."""
        prompt = self.max_digits + 2  # BOS ... SEP
        return prompt + self.max_turns + (self.max_turns - 1)  # one token per answer and per feedback

    def chance_reward(self, vocab_size: int = VOCAB_SIZE) -> float:
        """Expected reward of a policy that samples uniformly over `vocab_size` tokens each turn."""
        p = 1.0 / vocab_size
        return float(sum(r * p * (1 - p) ** t for t, r in enumerate(self.turn_rewards)))


@dataclass(frozen=True)
class Prompt:
    """One question of the stream `seed`, at position `index`."""

    seed: int
    index: int
    digits: tuple[int, ...]
    answer: int

    @property
    def prompt_id(self) -> str:
        """Unique per (seed, index); the GRPO group id of the rollouts that answer it."""
        return f"s{self.seed}-p{self.index}"

    @property
    def tokens(self) -> np.ndarray:
        return np.array([BOS, *self.digits, SEP], dtype=np.int64)


def prompt_at(config: DigitTaskConfig, seed: int, index: int) -> Prompt:
    """The `index`-th prompt of stream `seed` (a pure function: no state, same on every machine)."""
    if index < 0:
        raise ValueError(f"prompt index must be >= 0, got {index}")
    rng = np.random.default_rng([seed, index])
    count = int(rng.integers(config.min_digits, config.max_digits + 1))
    digits = tuple(int(d) for d in rng.integers(0, NUM_DIGITS, count))
    return Prompt(seed=seed, index=index, digits=digits, answer=ANSWER_RULES[config.rule](digits))


def rollout_id_for(prompt: Prompt, member: int) -> str:
    """The rollout id of group member `member` answering `prompt` (deterministic: resumes repeat it)."""
    return f"{prompt.prompt_id}-r{member}"


@dataclass(frozen=True)
class PromptCursor:
    """Where a prompt stream stands: the next prompt is `prompt_at(config, seed, next_index)`."""

    seed: int
    next_index: int = 0

    def __post_init__(self):
        if self.next_index < 0:
            raise ValueError(f"PromptCursor.next_index must be >= 0, got {self.next_index}")

    def to_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "next_index": self.next_index}

    @classmethod
    def from_dict(cls, state: dict) -> "PromptCursor":
        return cls(seed=int(state["seed"]), next_index=int(state["next_index"]))


class PromptGenerator:
    """A producer's own prompt stream; `cursor` is its whole state (save it, restore it, resume).

    Invariant: a generator restored from `cursor` after k prompts yields exactly the prompts
    the original yielded from its (k+1)-th on.
    """

    def __init__(self, config: DigitTaskConfig, cursor: PromptCursor):
        self.config = config
        self._cursor = cursor

    @property
    def cursor(self) -> PromptCursor:
        return self._cursor

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        prompt = prompt_at(self.config, self._cursor.seed, self._cursor.next_index)
        self._cursor = PromptCursor(self._cursor.seed, self._cursor.next_index + 1)
        return prompt


def prompt_rows(config: DigitTaskConfig, seed: int, start: int, count: int) -> list[dict]:
    """Prompts `start .. start+count-1` of stream `seed` as plain rows (for `ray.data.from_items`)."""
    rows = []
    for index in range(start, start + count):
        prompt = prompt_at(config, seed, index)
        rows.append({"seed": seed, "index": index, "digits": list(prompt.digits), "answer": prompt.answer})
    return rows


def prompt_from_row(config: DigitTaskConfig, row: dict) -> Prompt:
    """The inverse of `prompt_rows`; the answer is recomputed from the digits and must agree."""
    digits = tuple(int(d) for d in row["digits"])
    answer = ANSWER_RULES[config.rule](digits)
    if "answer" in row and int(row["answer"]) != answer:
        raise ValueError(f"prompt row s{row['seed']}-p{row['index']}: answer {row['answer']} disagrees with "
                         f"rule {config.rule!r} on digits {digits} (expected {answer}); was it made with another rule?")
    return Prompt(seed=int(row["seed"]), index=int(row["index"]), digits=digits, answer=answer)


def render(tokens: Sequence[int]) -> str:
    """Human-readable tokens, e.g. `<bos> 3 7 = 8` (for logs and error messages)."""
    return " ".join(TOKEN_NAMES.get(int(t), str(int(t))) for t in tokens)
