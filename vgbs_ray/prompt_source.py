"""Prompt sources: the rows agents answer, as a pure function of a position, so a resume is a number.

    source = DatasetPrompts(rows, epochs=2, shuffle_seed=0)     # rows read from a file (Ray Data)
    source = GeneratedPrompts(make_row)                         # make_row(position) -> dict, endless
    key, row = source.prompt(position)                          # key names the prompt: the group id

A job's producers split one source: producer i of P answers positions i, i + P, i + 2P, ...
(`producer_positions`), and its cursor is how many of its own positions lie wholly behind it.

Invariants:
- `prompt(p)` is the same (key, row) on every machine and in every run of the same source: the
  key is the GRPO group id and the stem of its rollout ids, so a resumed producer regenerates
  exactly the prompts it had not pushed, under the same ids.
- A dataset of N rows over E epochs has E * N positions; epoch e visits every row once, in the
  order of a permutation seeded by (shuffle_seed, e) (file order when shuffle_seed is None).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np

from vgbs_ray.errors import ConfigError


class DatasetPrompts:
    """A finite source over rows already read (see module docstring)."""

    def __init__(self, rows: Sequence[dict], *, epochs: int = 1, shuffle_seed: int | None = None,
                 keys: Sequence[str] | None = None, name: str = "dataset"):
        if not rows:
            raise ConfigError(f"{name}: the prompt dataset has no rows")
        if not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"{name}: epochs must be an integer >= 1, got {epochs!r}")
        missing = [k for k in (keys or ()) if k not in rows[0]]
        if missing:
            raise ConfigError(f"{name}: rows have no column(s) {missing}; the columns are {sorted(rows[0])}")
        self._rows = list(rows)
        self._keys = list(keys) if keys else None
        self._epochs, self._shuffle_seed = epochs, shuffle_seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._rows) * self._epochs

    def prompt(self, position: int) -> tuple[str, dict]:
        epoch, offset = divmod(position, len(self._rows))
        if not 0 <= epoch < self._epochs:
            raise IndexError(f"position {position} is past the dataset's {len(self)} positions")
        index = int(self._order(epoch)[offset])
        row = self._rows[index]
        if self._keys is not None:
            row = {k: row[k] for k in self._keys}
        return f"e{epoch}-row{index}", dict(row)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self._rows)
            self._orders[epoch] = (np.arange(n) if self._shuffle_seed is None
                                   else np.random.default_rng([self._shuffle_seed, epoch]).permutation(n))
        return self._orders[epoch]


class GeneratedPrompts:
    """An endless source: `make_row(position)` (a pure function) gives each row."""

    def __init__(self, make_row: Callable[[int], dict]):
        self._make_row = make_row

    def __len__(self) -> int:
        raise TypeError("a generated prompt source is endless")

    def prompt(self, position: int) -> tuple[str, dict]:
        return f"p{position}", dict(self._make_row(position))


def source_length(source) -> int | None:
    """Positions in `source`, or None when it is endless."""
    return None if isinstance(source, GeneratedPrompts) else len(source)


def producer_positions(producer: int, num_producers: int, start: int = 0, length: int | None = None) -> Iterator[int]:
    """The source positions producer `producer` answers, from its `start`-th own position on."""
    k = start
    while True:
        position = producer + k * num_producers
        if length is not None and position >= length:
            return
        yield position
        k += 1
