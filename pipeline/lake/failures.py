"""Row failures and the array primitives every row check shares (pure numpy/Arrow).

``Failures`` collects every problem of every row of one input (``Reject`` per
bad row, problems of the whole input once); the helpers turn Arrow arrays and
list columns into numpy masks. validate.py (types, columns) and invariants.py
(the cross-column rules of schemas/*.yaml) both report through them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True, kw_only=True)
class Reject:
    row: int
    code: str                        # the first problem's code
    message: str                     # every problem, the first one first
    columns: tuple[str, ...] = ()    # parse rejects: the cells that failed ("*" = the whole row)
    problems: tuple[tuple[str, str], ...] = ()  # every (code, message) of the row


class Failures:
    """Every problem of every row. ``column`` names the cell a problem makes
    unusable: later checks of that cell (and invariants that read it) skip the
    row rather than report a consequence of the same problem."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.bad = np.zeros(n, dtype=bool)
        self.problems: dict[int, list[tuple[str, str]]] = {}
        self.broken: dict[str, np.ndarray] = {}
        self.file: list[tuple[str, str]] = []

    def add_file(self, code: str, message: str, column: str | None = None) -> None:
        """A problem of the whole input: every row fails it, and it is recorded once."""
        self.file.append((code, message))
        self.add(np.ones(self.n, bool), code, message, column=column)

    def broken_rows(self, *columns: str) -> np.ndarray:
        out = self.broken.get("*", np.zeros(self.n, bool)).copy()
        for c in columns:
            if c in self.broken:
                out |= self.broken[c]
        return out

    def add(self, mask: np.ndarray, code: str, message: str | Callable[[int], str],
            column: str | None = None, depends: tuple[str, ...] = ()) -> None:
        mask = np.asarray(mask, dtype=bool)
        skip = self.broken_rows(*((column,) if column else ()), *depends)
        mask = mask & ~skip
        new = np.flatnonzero(mask)
        if not len(new):
            return
        for i in new:
            msg = message(int(i)) if callable(message) else message
            lst = self.problems.setdefault(int(i), [])
            if (code, msg) not in lst:
                lst.append((code, msg))
        self.bad[new] = True
        if column:
            self.broken[column] = self.broken.get(column, np.zeros(self.n, bool)) | mask

    def rejects(self) -> list[Reject]:
        out = []
        for i in sorted(self.problems):
            probs = self.problems[i]
            msg = probs[0][1] + "".join(f"; also: {m}" for _, m in probs[1:])
            if len(probs) > 1:
                msg = f"{len(probs)} problems: {msg}"
            out.append(Reject(row=i, code=probs[0][0], message=msg, problems=tuple(probs)))
        return out


def as_numpy(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The values of ``arr`` as numpy (a copy where Arrow cannot share them)."""
    return arr.to_numpy(zero_copy_only=False)


def bool_mask(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Boolean Arrow array -> numpy bool with nulls as False."""
    return np.asarray(as_numpy(pc.fill_null(arr, False)), dtype=bool)


def rows_with(values_mask: np.ndarray, parents: np.ndarray, n: int) -> np.ndarray:
    """Per-row any() of an element-level mask of a flattened list column."""
    out = np.zeros(n, dtype=bool)
    if values_mask.size:
        out[parents[values_mask]] = True
    return out


def list_parents(arr: pa.Array) -> np.ndarray:
    """Row index of every element of the flattened list column."""
    lengths = as_numpy(pc.list_value_length(arr).fill_null(0)).astype(np.int64)
    return np.repeat(np.arange(len(arr), dtype=np.int64), lengths)


def flat_list(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets[n+1]) of a list column as numpy, zero-copy where possible;
    offsets index into values. Null rows have equal consecutive offsets."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    offs = arr.offsets.to_numpy().astype(np.int64)
    vals = arr.values.to_numpy(zero_copy_only=False)
    return vals, offs


def per_row_any(flags: np.ndarray, offs: np.ndarray) -> np.ndarray:
    """Per-row any() of an element-level boolean array (one pass, no big temporaries)."""
    starts, lengths = offs[:-1], offs[1:] - offs[:-1]
    out = np.zeros(len(starts), bool)
    nz = lengths > 0
    if nz.any() and len(flags):
        # reduceat over non-empty rows only: it misbehaves on empty segments
        out[nz] = np.logical_or.reduceat(np.asarray(flags[: offs[-1]], bool), starts[nz])
    return out
