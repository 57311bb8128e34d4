"""Validate incoming rows against a table spec (schemas/). Pure: Arrow in, Arrow out.

``validate_table(raw)`` takes rows as read from a file (any Arrow types) and
returns the rows that satisfy the contract, normalized to the table's types
with ``content_hash`` filled, plus one :class:`Reject` per bad row with a
reason a user can act on. Every problem of a row is found in one pass (the
reject's ``problems``; its ``code`` is the first): a producer fixes a file
once, not once per retry. A check that depends on a value that already
failed (a null left by a failed conversion, a list with a null element) is
skipped for that row instead of reported twice.

Nothing is coerced silently: a type is accepted only when the conversion is
exact (int64 -> int32 and uint64 -> int64 when every value fits, integral
float64 -> int64 (pandas' nullable ints), float32 -> float64, a
timezone-aware timestamp of any unit -> UTC microseconds when no precision is
lost, large_string / string_view -> string, large_list -> list,
dictionary -> its values, struct<name: number, ...> (pandas/pyarrow's form of
a dict column) -> map<string,float64> with null fields left out, float64 ->
float32 when every value is exactly a float32, as log-probs from a float32
tensor's ``tolist()`` are). A float64 value that narrowing would change is
rejected: cast explicitly if that is intended. Invalid UTF-8, duplicate column names and duplicate map
keys are rejects, never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.lake.contenthash import content_hashes
from pipeline.lake.failures import Failures, Reject, as_numpy, bool_mask, flat_list, list_parents, per_row_any, rows_with
from pipeline.lake.invariants import INVARIANTS
from pipeline.schema import ColumnSpec, table_spec

@dataclass(kw_only=True)
class Validated:
    valid: pa.Table                 # ingest schema (content_hash filled), valid rows only
    valid_rows: np.ndarray          # their indices in the input
    rejects: list[Reject] = field(default_factory=list)
    # problems of the whole input (a missing, unknown, repeated or derived column, a column of a type that
    # cannot be converted): every row fails them alike, so they are reported once for the file
    file_problems: list[tuple[str, str]] = field(default_factory=list)


# -- type normalization ---------------------------------------------------------------
def _int_out_of_range(arr: pa.Array, target: pa.DataType) -> np.ndarray:
    """Per element: the integer (or bool) value does not fit ``target``. Compares
    in the source type, so uint64 above 2^63 is reported, never a cast error."""
    src = arr.type
    if pa.types.is_boolean(src) or len(arr) == 0:
        return np.zeros(len(arr), bool)
    lo, hi = np.iinfo(target.to_pandas_dtype()).min, np.iinfo(target.to_pandas_dtype()).max
    slo, shi = np.iinfo(src.to_pandas_dtype()).min, np.iinfo(src.to_pandas_dtype()).max
    bad = np.zeros(len(arr), bool)
    if shi > hi:
        bad |= bool_mask(pc.greater(arr, pa.scalar(hi, src)))
    if slo < lo:
        bad |= bool_mask(pc.less(arr, pa.scalar(lo, src)))
    return bad


def _narrowing_inexact(values: pa.Array, target: pa.DataType) -> np.ndarray:
    """Per element: narrowing the float to ``target`` would change it (NaN is
    left to the finite checks)."""
    v = np.asarray(as_numpy(values.cast(pa.float64()).fill_null(0.0)), dtype=np.float64)
    back = v.astype(target.to_pandas_dtype()).astype(np.float64)
    with np.errstate(invalid="ignore"):
        return (back != v) & ~np.isnan(v)


def _null_where(arr: pa.Array, bad: np.ndarray) -> pa.Array:
    return pc.if_else(pa.array(bad), pa.nulls(len(arr), arr.type), arr) if bad.any() else arr


def _float_to_int(arr: pa.Array, target: pa.DataType, name: str, fails: Failures) -> pa.Array:
    """Integral floats (pandas turns an int column with a missing value into
    float64 with NaN, written as null) -> ints, exactly; anything else rejected."""
    v = arr.cast(pa.float64())
    vals = np.asarray(as_numpy(v.fill_null(0.0)), dtype=np.float64)
    info = np.iinfo(target.to_pandas_dtype())
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(vals) | (np.floor(vals) != vals) | (np.abs(vals) > 2.0**53) \
            | (vals < info.min) | (vals > info.max)
    fails.add(bad, "wrong_type", lambda i: f"{name}={vals[i]!r} is a float where the contract says an integer "
              f"({target}); write integers (pandas: use the nullable 'Int64' dtype for columns with missing values)",
              column=name)
    vals = np.where(bad, 0, vals)
    return pa.array(vals.astype(np.int64), mask=~bool_mask(v.is_valid()) | bad).cast(target)


_TS_PER_US = {"s": 10**6, "ms": 10**3, "us": 1}


def _timestamp(arr: pa.Array, spec: ColumnSpec, fails: Failures) -> pa.Array | None:
    src = arr.type
    name = spec.name
    if src.tz is None:
        fails.add(np.ones(len(arr), bool), "naive_timestamp",
                  f"{name} has no time zone ({src}); write timezone-aware UTC timestamps "
                  f"(timestamp[us, tz=UTC]; pandas: tz_localize('UTC')) so instants are unambiguous", column=name)
        return None
    as_int = arr.cast(pa.timestamp(src.unit, tz="UTC")).cast(pa.int64())
    vals = np.asarray(as_numpy(as_int.fill_null(0)), dtype=np.int64)
    valid = ~bool_mask(as_int.is_null())
    if src.unit == "ns":
        lossy = vals % 1000 != 0
        fails.add(lossy, "out_of_range", f"{name} has sub-microsecond precision; round it to µs", column=name)
        us = vals // 1000
    else:
        k = _TS_PER_US[src.unit]
        lim = (2**63 - 1) // k
        over = (vals > lim) | (vals < -lim)
        fails.add(over, "out_of_range", lambda i: f"{name} is outside the representable range in µs", column=name)
        us = np.where(over, 0, vals) * k
        lossy = over
    return pa.array(us, mask=~valid | lossy).cast(pa.timestamp("us", tz="UTC"))


def _struct_to_map(arr: pa.Array, spec: ColumnSpec, fails: Failures) -> pa.Array | None:
    """struct<k1: number, k2: number, ...> (how pyarrow writes a column of Python
    dicts) -> map<string,float64>; null fields are absent keys."""
    t = spec.arrow_type
    if not all(pa.types.is_floating(f.type) or pa.types.is_integer(f.type) for f in arr.type):
        return None
    out: list = []
    inexact = np.zeros(len(arr), bool)
    for i, row in enumerate(arr.to_pylist()):
        if row is None:
            out.append(None)
            continue
        items = []
        for k, v in row.items():
            if v is None:
                continue
            if isinstance(v, int) and abs(v) > 2**53:
                inexact[i] = True
            items.append((k, float(v)))
        out.append(items)
    fails.add(inexact, "out_of_range", f"{spec.name} holds integers beyond 2^53, not exact as float64",
              column=spec.name)
    return pa.array(out, t)


def _normalize(arr: pa.Array, spec: ColumnSpec, fails: Failures) -> pa.Array | None:
    """Convert ``arr`` exactly to ``spec``'s type, rejecting rows that cannot be.
    Returns None when the whole column has the wrong type (every row rejected)."""
    target = spec.arrow_type
    src = arr.type
    name = spec.name
    if src == target:
        return arr
    if pa.types.is_null(src):  # all-null column (e.g. JSON with only nulls)
        return pa.nulls(len(arr), target)
    if pa.types.is_dictionary(src):
        arr = arr.dictionary_decode()
        return _normalize(arr, spec, fails)
    wrong = f"{name} has type {src}; the contract says {spec.type_text}"
    if pa.types.is_string(target):
        if pa.types.is_large_string(src) or pa.types.is_string_view(src):
            return arr.cast(target)
    elif pa.types.is_integer(target):
        if pa.types.is_integer(src):
            bad = _int_out_of_range(arr, target)
            fails.add(bad, "out_of_range", lambda i: f"{name}={arr[i].as_py()} does not fit {spec.type_text}",
                      column=name)
            return _null_where(arr, bad).cast(target)
        if pa.types.is_floating(src):
            return _float_to_int(arr, target, name, fails)
    elif pa.types.is_floating(target):
        if pa.types.is_floating(src) and src.bit_width <= target.bit_width:
            return arr.cast(target)
        if pa.types.is_floating(src):
            bad = _narrowing_inexact(arr, target)
            fails.add(bad, "wrong_type", lambda i: f"{name}={arr[i].as_py()!r} is not exactly representable as "
                      f"{target}; cast explicitly before ingest if the narrowing is intended", column=name)
            return _null_where(arr, bad).cast(target, safe=False)
        if pa.types.is_integer(src) and target.bit_width == 64:
            big = _int_out_of_range(arr, pa.int64())
            big |= bool_mask(pc.greater(pc.abs(_null_where(arr, big).cast(pa.int64())), 2**53))
            fails.add(big, "out_of_range", lambda i: f"{name}={arr[i].as_py()} is not exact as float64",
                      column=name)
            return _null_where(arr, big).cast(target, safe=False)
    elif pa.types.is_timestamp(target):
        if pa.types.is_timestamp(src):
            return _timestamp(arr, spec, fails)
        if pa.types.is_string(src) or pa.types.is_large_string(src):
            return _parse_timestamps(arr, spec, fails)
    elif pa.types.is_list(target):
        if pa.types.is_list(src) or pa.types.is_large_list(src) or pa.types.is_fixed_size_list(src) \
                or pa.types.is_list_view(src) or pa.types.is_large_list_view(src):
            vt, svt = target.value_type, src.value_type
            if not pa.types.is_list(src):
                arr = arr.cast(pa.list_(svt))
            ok = svt == vt or (pa.types.is_integer(vt) and (pa.types.is_integer(svt) or pa.types.is_boolean(svt))) \
                or (pa.types.is_floating(vt) and pa.types.is_floating(svt))
            if ok:
                if pa.types.is_floating(vt) and svt.bit_width > vt.bit_width:
                    inexact = _narrowing_inexact(pc.list_flatten(arr), vt)
                    bad = rows_with(inexact, list_parents(arr), len(arr))
                    fails.add(bad, "wrong_type", f"{name} has {svt} elements that are not exactly representable "
                              f"as {vt}; the contract says {spec.type_text}: cast explicitly before ingest if the "
                              f"narrowing is intended", column=name)
                    arr = _null_where(arr, bad)
                if pa.types.is_integer(vt) and svt != vt:
                    values = pc.list_flatten(arr)
                    bad_vals = _int_out_of_range(values, vt)
                    bad = rows_with(bad_vals, list_parents(arr), len(arr))
                    fails.add(bad, "out_of_range", f"{name} has elements that do not fit {vt}", column=name)
                    arr = _null_where(arr, bad)
                return arr.cast(target, safe=False)
            wrong = (f"{name} has type {src}; the contract says {spec.type_text}"
                     + ("; cast explicitly before ingest if the narrowing is intended"
                        if pa.types.is_floating(svt) and pa.types.is_floating(vt) else ""))
    elif pa.types.is_map(target):
        if pa.types.is_map(src):
            if (pa.types.is_floating(src.item_type) or pa.types.is_integer(src.item_type)) and \
                    (pa.types.is_string(src.key_type) or pa.types.is_large_string(src.key_type)):
                return arr.cast(target)
        if pa.types.is_struct(src):
            out = _struct_to_map(arr, spec, fails)
            if out is not None:
                return out
            wrong += "; a struct converts only when every field is a number"
    fails.add(np.ones(len(arr), bool), "wrong_type", wrong, column=name)
    return None


def _parse_timestamps(arr: pa.Array, spec: ColumnSpec, fails: Failures) -> pa.Array:
    """ISO-8601 strings (JSON) -> timestamp[us, UTC]; naive strings rejected per row."""
    from datetime import datetime, timezone

    out: list = []
    naive, bad = np.zeros(len(arr), bool), np.zeros(len(arr), bool)
    for i, s in enumerate(arr.to_pylist()):
        if s is None:
            out.append(None)
            continue
        try:
            t = datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            bad[i] = True
            out.append(None)
            continue
        if t.tzinfo is None:
            naive[i] = True
            out.append(None)
            continue
        out.append(t.astimezone(timezone.utc))
    fails.add(naive, "naive_timestamp", lambda i: f"{spec.name}={arr[i].as_py()!r} has no UTC offset; "
              f"write e.g. 2026-01-01T00:00:00Z", column=spec.name)
    fails.add(bad, "wrong_type", lambda i: f"{spec.name}={arr[i].as_py()!r} is not an ISO-8601 timestamp",
              column=spec.name)
    return pa.array(out, pa.timestamp("us", tz="UTC"))


# -- column checks ----------------------------------------------------------------------
_NULL_ELEMENT_HINT = {
    "token_policy_versions": "write -1 on observation tokens",
    "response_logprobs": "write 0.0 where loss_mask is 0",
    "loss_mask": "write 0 on observation tokens",
}


def _check_column(arr: pa.Array, spec: ColumnSpec, fails: Failures) -> None:
    n = len(arr)
    name = spec.name
    if spec.required:
        fails.add(bool_mask(arr.is_null()), "null_required",
                  f"{name} is null but required; every row must carry it", column=name)
    t = spec.arrow_type
    if spec.enum:
        bad = bool_mask(pc.invert(pc.is_in(arr, value_set=pa.array(list(spec.enum))))) & ~bool_mask(arr.is_null())
        choices = ", ".join(spec.enum)
        fails.add(bad, "bad_enum", lambda i: f"{name}={arr[i].as_py()!r} is not one of {choices}",
                  column=name)
    if pa.types.is_floating(t) and spec.finite:
        bad = bool_mask(pc.invert(pc.is_finite(arr)))
        fails.add(bad, "not_finite", lambda i: f"{name}={arr[i].as_py()} is not finite; use null for "
                  f"'no valid evaluation'" if name == "reward" else f"{name}={arr[i].as_py()} is not finite",
                  column=name)
    if (pa.types.is_integer(t) or pa.types.is_floating(t)) and (spec.min is not None or spec.max is not None):
        bad = np.zeros(n, bool)
        if spec.min is not None:
            bad |= bool_mask(pc.less(arr, spec.min))
        if spec.max is not None:
            bad |= bool_mask(pc.greater(arr, spec.max))
        rng = f"[{spec.min if spec.min is not None else '-inf'}, {spec.max if spec.max is not None else 'inf'}]"
        fails.add(bad, "out_of_range", lambda i: f"{name}={arr[i].as_py()} is outside {rng}", column=name)
    if pa.types.is_list(t):
        lengths = as_numpy(pc.list_value_length(arr).fill_null(-1))
        if spec.non_empty:
            fails.add(lengths == 0, "empty_list", f"{name} is empty; it needs at least one token", column=name)
        if arr.values.null_count:  # a null element has no meaning (and no hash): every list column
            flat_null = bool_mask(pc.list_flatten(arr).is_null())
            parents = list_parents(arr)
            starts = np.concatenate(([0], np.cumsum(np.maximum(lengths, 0))))[:-1]
            first_null = {}
            for e in np.flatnonzero(flat_null)[::-1]:
                first_null[int(parents[e])] = int(e - starts[parents[e]])
            hint = _NULL_ELEMENT_HINT.get(name, "lists hold no nulls")
            fails.add(rows_with(flat_null, parents, n), "null_element",
                      lambda i: f"{name}[{first_null[i]}] is null; {hint}", column=name)
        if (spec.min is not None or spec.max is not None) and (
                pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
            values, offs = flat_list(arr)     # a list column's range applies to every element (token ids >= 0)
            bad_v = np.zeros(len(values), bool)
            if spec.min is not None:
                bad_v |= values < spec.min
            if spec.max is not None:
                bad_v |= values > spec.max
            if bad_v.any():
                rows = per_row_any(bad_v, offs)
                first_bad = {int(r): int(np.flatnonzero(bad_v[offs[r]:offs[r + 1]])[0]) for r in np.flatnonzero(rows)}
                lo = spec.min if spec.min is not None else "-inf"
                hi = spec.max if spec.max is not None else "inf"
                fails.add(rows, "out_of_range",
                          lambda i: f"{name}[{first_bad[i]}]={values[offs[i] + first_bad[i]]} is outside [{lo}, {hi}]"
                          + ("; token ids are vocabulary indices (>= 0): a padding or ignore-index value "
                             "(e.g. -100) must be removed before ingest" if name.endswith("_ids") else ""),
                          column=name)
        if spec.enum_values or (spec.finite and pa.types.is_floating(t.value_type)):
            values, offs = flat_list(arr)
            if spec.enum_values:
                bad_v = np.ones(len(values), bool)
                for allowed in spec.enum_values:  # a few passes beat np.isin's sort on 1e7 elements
                    bad_v &= values != allowed
                fails.add(per_row_any(bad_v, offs), "bad_enum",
                          f"{name} holds values other than {', '.join(map(str, spec.enum_values))}", column=name)
            if spec.finite and pa.types.is_floating(t.value_type):
                fails.add(per_row_any(~np.isfinite(values), offs), "not_finite",
                          f"{name} holds NaN or ±inf elements", column=name)
    if pa.types.is_map(t):
        offs = arr.offsets.to_numpy().astype(np.int64)
        vals = arr.items.slice(int(offs[0]), int(offs[-1] - offs[0]))
        if len(vals):
            parents = np.repeat(np.arange(n), np.diff(offs))
            bad_v = bool_mask(pc.invert(pc.is_finite(vals))) | bool_mask(vals.is_null())
            fails.add(rows_with(bad_v, parents, n), "not_finite", f"{name} holds NaN, ±inf or null values",
                      column=name)
            keys = arr.keys.slice(int(offs[0]), int(offs[-1] - offs[0])).dictionary_encode()
            codes = keys.indices.to_numpy(zero_copy_only=False).astype(np.int64)
            pair = np.sort(parents * max(1, len(keys.dictionary)) + codes)
            rep = pair[1:][pair[1:] == pair[:-1]]  # (row, key) seen twice
            if len(rep):
                rows = rep // max(1, len(keys.dictionary))
                keyname = dict(zip(rows.tolist(), keys.dictionary.take(pa.array(rep % max(1, len(keys.dictionary))))
                                   .to_pylist()))
                m = np.zeros(n, bool)
                m[rows] = True
                fails.add(m, "duplicate_key", lambda i: f"{name} repeats key {keyname[i]!r}; map keys must be unique",
                          column=name)


# -- entry points -----------------------------------------------------------------------
def _utf8_problems(raw: pa.Table, idx: int, fails: Failures, name: str) -> pa.Array:
    """String cells (and map keys) that are not valid UTF-8 (Parquet and Arrow IPC
    readers do not check): reject the row, null the cell. Returns the column."""
    col = raw.column(idx).combine_chunks()
    t = col.type
    strings = (pa.types.is_string(t) or pa.types.is_large_string(t))
    keys = pa.types.is_map(t) and (pa.types.is_string(t.key_type) or pa.types.is_large_string(t.key_type))
    if not (strings or keys):
        return col
    try:
        (col.keys if keys else col).validate(full=True)
        return col
    except pa.ArrowInvalid:
        pass
    bad = np.zeros(len(col), bool)
    if strings:
        for i, v in enumerate(col.cast(pa.binary() if pa.types.is_string(t) else pa.large_binary()).to_pylist()):
            if v is not None:
                try:
                    v.decode("utf-8")
                except UnicodeDecodeError:
                    bad[i] = True
    else:
        offs = col.offsets.to_numpy()
        kb = col.keys.cast(pa.binary() if pa.types.is_string(t.key_type) else pa.large_binary()).to_pylist()
        for i in range(len(col)):
            for v in kb[offs[i]:offs[i + 1]]:
                try:
                    v.decode("utf-8")
                except UnicodeDecodeError:
                    bad[i] = True
    fails.add(bad, "bad_utf8", f"{name} holds bytes that are not valid UTF-8; re-export the text as UTF-8",
              column=name)
    if strings:
        return pc.if_else(pa.array(bad), pa.nulls(len(col), t), col)
    return col.take(pa.array(np.where(bad, -1, np.arange(len(col))), mask=bad))  # null the bad rows


def safe_raw(raw: pa.Table) -> pa.Table:
    """``raw`` made safe to render in quarantine (``to_pylist``): repeated column
    names get a ``#k`` suffix, text that is not valid UTF-8 is shown with
    backslash escapes. For display only: validation reads the original."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for c in raw.column_names:
        seen[c] = seen.get(c, 0) + 1
        names.append(c if seen[c] == 1 else f"{c}#{seen[c]}")
    cols = []
    for i in range(raw.num_columns):
        col = raw.column(i)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            try:
                col.validate(full=True)
            except pa.ArrowInvalid:
                b = col.cast(pa.binary() if pa.types.is_string(col.type) else pa.large_binary()).to_pylist()
                col = pa.array([None if v is None else v.decode("utf-8", "backslashreplace") for v in b], col.type)
        cols.append(col)
    return pa.Table.from_arrays(cols, names=names)


def pandas_index_columns(raw: pa.Table) -> list[str]:
    """``__index_level_N__`` columns pandas writes for a non-default index:
    row labels, not data (a named index is a real column and stays)."""
    import json
    import re

    meta = (raw.schema.metadata or {}).get(b"pandas")
    if not meta:
        return []
    try:
        idx = json.loads(meta).get("index_columns") or []
    except ValueError:
        return []
    return [c for c in idx if isinstance(c, str) and re.fullmatch(r"__index_level_\d+__", c)
            and c in raw.column_names]


def unknown_columns_message(unknown: list[str], table: str = "trajectories") -> str:
    """The reason for columns the contract lacks, with "did you mean" for a close name (Parquet, IPC, JSONL)."""
    import difflib

    spec = table_spec(table)
    ingestable = [c.name for c in spec.ingest_columns]
    close = {u: m[0] for u in unknown if isinstance(u, str)
             and (m := difflib.get_close_matches(u, ingestable, n=1, cutoff=0.6))}
    mean = ", ".join(f"{m!r} for {u!r}" for u, m in close.items())
    return (f"unknown column(s) {unknown}; the {table} contract has no such column "
            f"(see docs/how-to/land-rollouts.md, Ingest contract): drop or rename them" + (f" (did you mean {mean}?)" if mean else ""))


def validate_table(raw: pa.Table, *, table: str = "trajectories",
                   pre_rejected: list[Reject] | None = None) -> Validated:
    """Validate ``raw`` against ``schemas/<table>.yaml``.

    ``pre_rejected`` carries per-row failures found while parsing (JSONL); a
    reject's ``columns`` name the cells it makes unusable ("*": the row)."""
    spec = table_spec(table)
    n = raw.num_rows
    fails = Failures(n)
    for r in pre_rejected or []:
        m = np.zeros(n, bool)
        m[r.row] = True
        for code, msg in (r.problems or ((r.code, r.message),)):
            fails.add(m, code, msg)
        for broken in r.columns:
            fails.broken[broken] = fails.broken.get(broken, np.zeros(n, bool)) | m
    names = [c for c in raw.column_names if c not in set(pandas_index_columns(raw))]
    dup = sorted({c for c in names if names.count(c) > 1})
    if dup:
        fails.add_file("duplicate_column",
                  f"column(s) {dup} appear more than once; every column must be unique")
    known = {c.name for c in spec.columns}
    derived = [c for c in dict.fromkeys(names) if c in {d.name for d in spec.derived_columns}]
    if derived:
        fails.add_file("derived_column",
                  f"column(s) {derived} are computed by the lake; drop them from the input")
    unknown = [c for c in dict.fromkeys(names) if c not in known]
    if unknown:
        fails.add_file("unknown_column", unknown_columns_message(unknown, table))
    cols: dict[str, pa.Array] = {}
    for c in spec.ingest_columns:
        if c.name not in names:
            if c.required and c.ingest != "optional":
                fails.add_file("missing_column", f"required column {c.name} is missing", column=c.name)
            cols[c.name] = pa.nulls(n, c.arrow_type)
            continue
        arr = _utf8_problems(raw, raw.column_names.index(c.name), fails, c.name)
        try:
            norm = _normalize(arr, c, fails)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError) as exc:
            fails.add_file("wrong_type", f"{c.name} has type {arr.type} and cannot be converted "
                      f"exactly to {c.type_text} ({str(exc).splitlines()[0]})", column=c.name)
            norm = None
        cols[c.name] = norm if norm is not None else pa.nulls(n, c.arrow_type)
    norm_t = pa.table(cols, schema=pa.schema([c.arrow_field().with_nullable(True) for c in spec.ingest_columns]))
    for c in spec.ingest_columns:
        if c.ingest == "optional":
            continue
        _check_column(norm_t.column(c.name).combine_chunks(), c, fails)
    for inv in spec.invariants:
        if inv.kind == "content_hash":
            continue
        INVARIANTS[inv.kind](norm_t, inv, fails)
    keep = np.flatnonzero(~fails.bad)
    valid = norm_t.take(pa.array(keep, pa.int64())) if len(keep) < n else norm_t
    if table == "trajectories" and valid.num_rows:
        computed = content_hashes(valid, table)
        given = valid.column("content_hash").combine_chunks()
        mismatch = bool_mask(pc.and_(pc.is_valid(given), pc.not_equal(given, computed)))
        if mismatch.any():
            m = np.zeros(n, bool)
            m[keep[mismatch]] = True

            def message(i: int, g: pa.Array = given, h: pa.Array = computed, k: np.ndarray = keep) -> str:
                return (f"content_hash {g[int(np.searchsorted(k, i))].as_py()} does not match the canonical hash "
                        f"{h[int(np.searchsorted(k, i))].as_py()}; recompute it with pipeline.lake.content_hash "
                        f"(schemas/README.md) or omit the column")

            fails.add(m, "hash_mismatch", message)
            sel = pa.array(~mismatch)
            valid = valid.filter(sel)
            computed = computed.filter(sel)
            keep = keep[~mismatch]
        valid = valid.set_column(valid.schema.get_field_index("content_hash"), "content_hash", computed)
    valid = valid.cast(pa.schema([c.arrow_field() for c in spec.ingest_columns]))  # content_hash filled
    return Validated(valid=valid, valid_rows=keep, rejects=fails.rejects(), file_problems=fails.file)


def validate_trajectories(raw: pa.Table) -> Validated:
    return validate_table(raw, table="trajectories")
