"""Strict JSON-lines parsing into the trajectories contract's Arrow types.

JSON has one number type and no timestamps, so parsing is where a value's
type is decided: an integer field accepts only JSON integers (not 1.0, not
true), a float field accepts integers and floats, a timestamp field accepts
only ISO-8601 strings with a UTC offset (at most microsecond precision), and a
key repeated within one object (a column or a map key) is an error, never
last-one-wins. A value that does not fit makes its
row a reject with the field named; nothing is coerced. Every problem of a
line is reported at once (not only the first), and text that is not valid
Unicode (invalid UTF-8 bytes, a lone surrogate escape such as ``"\\ud800"``)
is a reject, never a traceback.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.lake.validate import Reject, unknown_columns_message
from pipeline.schema import ColumnSpec, table_spec


class _Bad(Exception):
    def __init__(self, code: str, message: str) -> None:
        self.code, self.message = code, message


def _int(v: Any, bits: int, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad("wrong_type", f"{name}={v!r} is not an integer")
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if not lo <= v <= hi:
        raise _Bad("out_of_range", f"{name}={v} does not fit int{bits}")
    return v


def _float(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad("wrong_type", f"{name}={v!r} is not a number")
    return float(v)


def _ts(v: Any, name: str) -> datetime:
    if not isinstance(v, str):
        raise _Bad("wrong_type", f"{name}={v!r} is not an ISO-8601 timestamp string")
    try:
        t = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise _Bad("wrong_type", f"{name}={v!r} is not an ISO-8601 timestamp") from None
    frac = _FRACTION.search(v)
    if frac and frac.group(1)[6:].strip("0"):   # fromisoformat would drop the digits past microseconds
        raise _Bad("out_of_range", f"{name}={v!r} has sub-microsecond precision; round it to µs")
    if t.tzinfo is None:
        raise _Bad("naive_timestamp", f"{name}={v!r} has no UTC offset; write e.g. 2026-01-01T00:00:00Z")
    return t.astimezone(timezone.utc)


_FRACTION = re.compile(r"T[0-9:]+[.,]([0-9]+)")


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: a repeated key (a column, or a map key) is an error, not last-one-wins."""
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise _Bad("bad_json", f"key {k!r} appears twice in one object; each column and map key at most once")
        seen[k] = v
    return seen


def _unicode(v: str, name: str) -> None:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _Bad("bad_utf8", f"{name} holds {v[exc.start:exc.end]!a} at position {exc.start}, a lone surrogate "
                               f"that is not Unicode text; escape pairs must be complete (e.g. \\ud83d\\ude00)") from None


def _convert(v: Any, t: pa.DataType, name: str) -> Any:
    if v is None:
        return None
    if pa.types.is_string(t):
        if not isinstance(v, str):
            raise _Bad("wrong_type", f"{name}={v!r} is not a string")
        _unicode(v, name)
        return v
    if pa.types.is_integer(t):
        return _int(v, t.bit_width, name)
    if pa.types.is_floating(t):
        return _float(v, name)
    if pa.types.is_timestamp(t):
        return _ts(v, name)
    if pa.types.is_list(t):
        if not isinstance(v, list):
            raise _Bad("wrong_type", f"{name} is {type(v).__name__}, expected a list")
        return [_convert(x, t.value_type, f"{name}[{i}]") for i, x in enumerate(v)]
    if pa.types.is_map(t):
        if not isinstance(v, dict):
            raise _Bad("wrong_type", f"{name} is {type(v).__name__}, expected an object of name: number")
        for k in v:
            _unicode(k, f"{name} key")
        return [(k, _convert(x, t.item_type, f"{name}[{k!r}]")) for k, x in v.items()]
    raise _Bad("wrong_type", f"{name}: unsupported type {t}")


def _split_lines(data: bytes) -> tuple[list[str], dict[int, str]]:
    """Non-blank lines split on \\n only (str.splitlines also splits on U+2028 and
    other characters JSON strings may contain raw), decoded strictly: an invalid
    UTF-8 line is kept (as its repr) and reported, never silently replaced."""
    lines, bad = [], {}
    for raw in data.split(b"\n"):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            bad[len(lines)] = str(exc)
            lines.append(raw.decode("utf-8", errors="backslashreplace"))
    return lines, bad


def _is_unicode(k: str) -> bool:
    try:
        _unicode(k, "a column name")
    except _Bad:
        return False
    return True


def parse_jsonl(data: bytes, path: Path | str, table: str = "trajectories") -> tuple[pa.Table, list[str], list[Reject]]:
    spec = table_spec(table)
    cols: list[ColumnSpec] = spec.ingest_columns
    derived = {c.name for c in spec.derived_columns}
    names = {c.name for c in cols}
    lines, undecodable = _split_lines(data)
    values: dict[str, list[Any]] = {c.name: [] for c in cols}
    present: dict[str, np.ndarray] = {c.name: np.zeros(len(lines), bool) for c in cols}
    rejects: list[Reject] = []
    extras: list[set[str] | None] = []     # per line: its keys the contract lacks (None: not an object)
    row_problems: list[tuple[list[tuple[str, str]], list[str]]] = []
    for i, line in enumerate(lines):
        problems: list[tuple[str, str]] = []
        broken: list[str] = []
        try:
            if i in undecodable:
                raise _Bad("bad_json", f"line {i + 1} is not valid UTF-8 ({undecodable[i]}); "
                                       f"re-export the file as UTF-8")
            obj = json.loads(line, object_pairs_hook=_no_repeated_keys)
            if not isinstance(obj, dict):
                raise _Bad("bad_json", f"line {i + 1} is a JSON {type(obj).__name__}, expected an object")
        except json.JSONDecodeError as exc:
            obj = {}
            # json's own messages may end in "at" ("Unterminated string starting at"): no "at at column"
            where = f"{exc.msg} column {exc.colno}" if exc.msg.endswith(" at") else f"{exc.msg} at column {exc.colno}"
            problems.append(("bad_json", f"line {i + 1} is not valid JSON: {where}"))
            broken.append("*")
        except _Bad as b:
            obj = {}
            problems.append((b.code, b.message))
            broken.append("*")
        extra = sorted(set(obj) - names)
        extras.append(None if "*" in broken else set(extra))
        for k in extra:
            try:
                _unicode(k, "a column name")
            except _Bad as b:
                problems.append((b.code, b.message))
        for c in cols:
            v = obj.get(c.name)
            present[c.name][i] = c.name in obj
            try:
                values[c.name].append(_convert(v, c.arrow_type, c.name))
            except _Bad as b:
                values[c.name].append(None)
                problems.append((b.code, b.message))
                broken.append(c.name)
        if "*" not in broken:
            missing = [c.name for c in cols if c.required and c.ingest != "optional" and c.name not in obj]
            if missing:
                problems.append(("missing_column", f"required field(s) {missing} are missing"))
                broken.extend(missing)
        row_problems.append((problems, broken))
    # a key every line carries is a column of the file: one quarantine entry for the file, as for
    # Parquet (validate_table sees it as a column); a key only some lines carry rejects those lines
    parsed = [e for e in extras if e is not None]
    file_extra = sorted(k for k in (set.intersection(*parsed) if parsed and len(parsed) == len(lines) else ())
                        if _is_unicode(k))
    for i, (problems, broken) in enumerate(row_problems):
        extra = sorted((extras[i] or set()) - set(file_extra))
        if extra:
            code = "derived_column" if set(extra) <= derived else "unknown_column"
            problems.insert(0, (code, unknown_columns_message(extra, table) if code == "unknown_column"
                                else f"column(s) {extra} are computed by the lake; drop them"))
        if problems:
            rejects.append(Reject(row=i, code=problems[0][0], message=problems[0][1], columns=tuple(broken),
                                  problems=tuple(problems)))
    arrays = {}
    for c in cols:
        vals = values[c.name]
        if pa.types.is_floating(c.arrow_type):
            vals = [float("nan") if isinstance(v, float) and math.isnan(v) else v for v in vals]
        arrays[c.name] = pa.array(vals, type=c.arrow_type)
    t = pa.table(arrays, schema=pa.schema([c.arrow_field().with_nullable(True) for c in cols]))
    for name in file_extra:     # its values are not read: the file is refused for the column's presence
        t = t.append_column(pa.field(name, pa.null()), pa.nulls(len(lines)))
    return t, lines, rejects
