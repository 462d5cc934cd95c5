"""SettledIds: an exact, compact table of ids that reached a final state, with that state.

    settled = SettledIds()
    settled.add("rollout-7", step=3)                  # trained in step 3
    settled.add("rollout-8", reason="stale")          # dropped, with its reason
    settled.get("rollout-7")  -> ("trained", 3, None)
    settled.get("fresh")      -> None

Why: the scheduler must refuse a late or re-sent sample of a rollout that was trained or
dropped, for the whole run and exactly (a fresh rollout must never be refused because of
a hash collision), while a million settled rollouts must cost a few tens of bytes each,
not the ~150 bytes of a Python set entry plus its string.

Layout (no Python object per id):
  - every id is encoded to bytes (`encode_id`: str and int by value, anything else pickled)
    and appended to one bytearray; `_ends[i]` is where id i ends;
  - `_steps[i]` (int32, -1 for none) and `_reasons[i]` (uint8 code into `_reason_names`,
    code 0 = trained) hold its final state;
  - the lookup index maps a 64-bit hash of the encoded bytes to the id's position: a
    sorted numpy pair (`_hashes`, `_positions`) plus a dict of recent additions, merged
    into the sorted pair every `MERGE_EVERY` additions (one O(n) insert, amortised).
A lookup hashes the encoded id, finds the candidate positions and compares bytes, so the
answer is exact. Memory per id: its encoded length + 8 (end) + 4 (step) + 1 (reason)
+ 12 (index) bytes, e.g. ~45 bytes for a 20-character id.

Invariants: an id is added at most once (`add` raises KeyError otherwise); `get` returns
exactly what `add` stored; iteration yields ids in the order they were added.

Checkpoints: `to_bytes()` writes the arrays as they are (no Python object per id) and
`from_bytes()` reads them back and rebuilds the lookup index. The index is not written: it
holds Python's `hash()` of bytes, which is salted per process (PYTHONHASHSEED), so a
restored table in another process must hash its ids again (one pass, O(n)).
"""

from __future__ import annotations

import bisect
import json
import pickle
import struct
from array import array
from collections import Counter
from typing import Hashable, Iterable, Iterator

import numpy as np

TRAINED = "trained"
DROPPED = "dropped"
MERGE_EVERY = 4096
_MAGIC = b"VGBS-SETTLED-1\n"
_HEADER = struct.Struct("<QQ")  # number of ids, bytes of the reason-name table
_MASK64 = (1 << 64) - 1


def encode_id(value: Hashable) -> bytes:
    """Bytes that identify `value`: str and int by value (tagged), anything else pickled."""
    if type(value) is str:
        return b"s" + value.encode("utf-8", "surrogatepass")
    if type(value) is int:
        return b"i" + str(value).encode("ascii")
    return b"p" + pickle.dumps(value, protocol=5)


def decode_id(data: bytes) -> Hashable:
    tag, body = data[:1], data[1:]
    if tag == b"s":
        return body.decode("utf-8", "surrogatepass")
    if tag == b"i":
        return int(body)
    return pickle.loads(body)


class SettledIds:
    """Exact, compact id -> (state, step, reason) table (see module docstring)."""

    def __init__(self) -> None:
        self._blob = bytearray()
        self._ends = array("q")
        self._steps = array("i")
        self._reasons = array("B")
        self._reason_names: list[str | None] = [None]   # code 0: trained (no reason)
        self._reason_codes: dict[str | None, int] = {None: 0}
        self._hashes = np.zeros(0, dtype=np.uint64)
        self._positions = np.zeros(0, dtype=np.uint32)
        self._recent: dict[int, list[int]] = {}
        self._num_recent = 0

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, value: Hashable, *, step: int | None = None, reason: str | None = None) -> None:
        """Record `value` as trained in `step` (reason None) or dropped with `reason`."""
        data = encode_id(value)
        key = hash(data) & _MASK64
        if self._find(data, key) is not None:
            raise KeyError(f"id {value!r} is already settled")
        code = self._reason_code(reason)
        position = len(self._ends)
        self._blob += data
        self._ends.append(len(self._blob))
        self._steps.append(-1 if step is None else step)
        self._reasons.append(code)
        self._recent.setdefault(key, []).append(position)
        self._num_recent += 1
        if self._num_recent >= MERGE_EVERY:
            self._merge_recent()

    def get(self, value: Hashable) -> tuple[str, int | None, str | None] | None:
        """(state, step, reason) of `value`, or None if it never settled. Exact."""
        data = encode_id(value)
        position = self._find(data, hash(data) & _MASK64)
        return None if position is None else self._state_at(position)

    def add_many(self, values: Iterable[Hashable], *, step: int | None = None, reason: str | None = None) -> None:
        """`add` for many ids with one state (a step's rollouts). Raises KeyError, adding none of
        them, if one is settled already or listed twice."""
        values = list(values)
        encoded = [encode_id(v) for v in values]
        keys = [hash(data) & _MASK64 for data in encoded]
        if len(set(encoded)) != len(encoded):
            raise KeyError(f"ids listed twice in one add_many: {[v for v, n in Counter(values).items() if n > 1][:3]!r}")
        candidates = self._maybe_present(keys)
        again = [v for v, data, key in zip(values, encoded, keys) if key in candidates and self._find(data, key) is not None]
        if again:
            raise KeyError(f"id {again[0]!r} is already settled")
        code = self._reason_code(reason)
        first = len(self._ends)
        end = len(self._blob)
        for data in encoded:
            end += len(data)
            self._ends.append(end)
        self._blob += b"".join(encoded)
        self._steps.extend([-1 if step is None else step] * len(values))
        self._reasons.extend([code] * len(values))
        for offset, key in enumerate(keys):
            self._recent.setdefault(key, []).append(first + offset)
        self._num_recent += len(values)
        if self._num_recent >= MERGE_EVERY:
            self._merge_recent()

    def __contains__(self, value: Hashable) -> bool:
        return self.get(value) is not None

    def __iter__(self) -> Iterator[tuple[Hashable, tuple[str, int | None, str | None]]]:
        """(id, (state, step, reason)) in the order added. O(n); for reports and checkpoints."""
        start = 0
        for position, end in enumerate(self._ends):
            yield decode_id(bytes(self._blob[start:end])), self._state_at(position)
            start = end

    def copy(self) -> "SettledIds":
        """An independent table with the same ids (arrays copied; O(n) memcpy, no rehashing)."""
        other = SettledIds()
        other._blob = bytearray(self._blob)
        other._ends, other._steps, other._reasons = array("q", self._ends), array("i", self._steps), array("B", self._reasons)
        other._reason_names = list(self._reason_names)
        other._reason_codes = dict(self._reason_codes)
        other._hashes, other._positions = self._hashes.copy(), self._positions.copy()
        other._recent = {k: list(v) for k, v in self._recent.items()}
        other._num_recent = self._num_recent
        return other

    def counts(self) -> tuple[int, dict[str, int]]:
        """(trained ids, dropped ids by reason), from the arrays: O(n) in numpy, no Python object per id."""
        per_code = np.bincount(np.frombuffer(self._reasons, dtype=np.uint8), minlength=len(self._reason_names))
        dropped = {name: int(per_code[code]) for code, name in enumerate(self._reason_names)
                   if code and per_code[code]}
        return int(per_code[0]) if per_code.size else 0, dropped

    def to_bytes(self) -> bytes:
        """The table as bytes (for a checkpoint): ids, steps and reasons; ~the table's nbytes minus its index."""
        names = json.dumps(self._reason_names).encode("utf-8")
        return b"".join([_MAGIC, _HEADER.pack(len(self._ends), len(names)), names, self._ends.tobytes(),
                         self._steps.tobytes(), self._reasons.tobytes(), bytes(self._blob)])

    @classmethod
    def from_bytes(cls, data: bytes) -> "SettledIds":
        """Read `to_bytes()` output back (in any process); rebuilds the lookup index. Raises ValueError
        on bytes that are not such a table (truncated, other format)."""
        view = memoryview(data)
        if bytes(view[:len(_MAGIC)]) != _MAGIC:
            raise ValueError("not a SettledIds table (to_bytes output expected)")
        at = len(_MAGIC)
        count, names_len = _HEADER.unpack_from(view, at)
        at += _HEADER.size
        table = cls()
        names = json.loads(bytes(view[at:at + names_len]).decode("utf-8"))
        at += names_len
        for what, typecode, itemsize in (("_ends", "q", 8), ("_steps", "i", 4), ("_reasons", "B", 1)):
            part = array(typecode)
            part.frombytes(bytes(view[at:at + count * itemsize]))
            if len(part) != count:
                raise ValueError(f"truncated SettledIds table: {what} holds {len(part)} of {count} entries")
            setattr(table, what, part)
            at += count * itemsize
        table._blob = bytearray(view[at:])
        if count and table._ends[-1] != len(table._blob):
            raise ValueError(f"truncated SettledIds table: ids end at byte {table._ends[-1]}, "
                             f"{len(table._blob)} bytes present")
        table._reason_names = names
        table._reason_codes = {name: code for code, name in enumerate(names)}
        table._rebuild_index()
        return table

    def nbytes(self) -> int:
        """Bytes held by the table's arrays (what grows with the number of ids)."""
        return (len(self._blob) + self._ends.itemsize * len(self._ends) + self._steps.itemsize * len(self._steps)
                + len(self._reasons) + self._hashes.nbytes + self._positions.nbytes)

    # -- internals -------------------------------------------------------------------
    def _state_at(self, position: int) -> tuple[str, int | None, str | None]:
        step = self._steps[position]
        reason = self._reason_names[self._reasons[position]]
        return (TRAINED if reason is None else DROPPED), (None if step < 0 else step), reason

    def _bytes_at(self, position: int) -> bytes:
        start = self._ends[position - 1] if position else 0
        return bytes(self._blob[start:self._ends[position]])

    def _find(self, data: bytes, key: int) -> int | None:
        for position in self._recent.get(key, ()):
            if self._bytes_at(position) == data:
                return position
        # bisect over a memoryview (Python ints, GIL held) rather than np.searchsorted: 5x cheaper for one
        # key, and numpy drops the GIL, which on the scheduler's event loop can cost a whole switch
        # interval (5 ms) while its layout thread runs.
        hashes = memoryview(self._hashes)
        index = bisect.bisect_left(hashes, key)
        while index < len(hashes) and hashes[index] == key:  # more than one only on a collision
            position = int(self._positions[index])
            if self._bytes_at(position) == data:
                return position
            index += 1
        return None

    def _maybe_present(self, keys: list[int]) -> set[int]:
        """Of `keys`, those that some settled id hashes to (a superset of the settled ones among
        them): one vectorised search for a whole step's ids instead of one bisect per id."""
        found = self._recent.keys() & set(keys)
        if self._hashes.size:
            wanted = np.array(keys, dtype=np.uint64)
            at = np.minimum(np.searchsorted(self._hashes, wanted), self._hashes.size - 1)
            found.update(wanted[self._hashes[at] == wanted].tolist())
        return found

    def _reason_code(self, reason: str | None) -> int:
        code = self._reason_codes.get(reason)
        if code is None:
            if len(self._reason_names) == 256:
                raise ValueError("more than 255 distinct drop reasons")
            code = self._reason_codes[reason] = len(self._reason_names)
            self._reason_names.append(reason)
        return code

    def _rebuild_index(self) -> None:
        """Hash every id (this process's salt) into the sorted index, in one pass."""
        keys = np.fromiter((hash(self._bytes_at(p)) & _MASK64 for p in range(len(self._ends))),
                           dtype=np.uint64, count=len(self._ends))
        order = np.argsort(keys, kind="stable")
        self._hashes, self._positions = keys[order], order.astype(np.uint32)
        self._recent.clear()
        self._num_recent = 0

    def _merge_recent(self) -> None:
        keys = np.array([k for k, positions in self._recent.items() for _ in positions], dtype=np.uint64)
        positions = np.array([p for ps in self._recent.values() for p in ps], dtype=np.uint32)
        order = np.argsort(keys, kind="stable")
        keys, positions = keys[order], positions[order]
        at = np.searchsorted(self._hashes, keys)
        self._hashes = np.insert(self._hashes, at, keys)
        self._positions = np.insert(self._positions, at, positions)
        self._recent.clear()
        self._num_recent = 0
