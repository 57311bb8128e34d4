"""Validate incoming rows against a table spec (schemas/). Pure: Arrow in, Arrow out.

``validate_table(raw)`` takes rows as read from a file (any Arrow types) and
returns the rows that satisfy the contract, normalized to the table's types
with ``content_hash`` filled, plus one :class:`Reject` per bad row with a
reason a user can act on. Nothing is coerced silently: a type is accepted only
when the conversion is exact (int64 -> int32 when every value fits, a
timezone-aware timestamp -> UTC microseconds when no precision is lost,
large_string -> string). A float64 column where the contract says float32 is
rejected: the narrowing would change the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.lake.contenthash import content_hashes
from pipeline.schema import ColumnSpec, Invariant, table_spec


@dataclass(frozen=True)
class Reject:
    row: int
    code: str
    message: str


@dataclass
class Validated:
    valid: pa.Table                 # ingest schema (content_hash filled), valid rows only
    valid_rows: np.ndarray          # their indices in the input
    rejects: list[Reject] = field(default_factory=list)

    @property
    def num_rejected(self) -> int:
        return len(self.rejects)


class _Failures:
    """First failure per row wins; later checks never overwrite it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.bad = np.zeros(n, dtype=bool)
        self.codes: dict[int, str] = {}
        self.messages: dict[int, str] = {}

    def add(self, mask: np.ndarray, code: str, message: str | Callable[[int], str]) -> None:
        new = np.flatnonzero(mask & ~self.bad)
        for i in new:
            self.codes[int(i)] = code
            self.messages[int(i)] = message(int(i)) if callable(message) else message
        self.bad[new] = True

    def rejects(self) -> list[Reject]:
        return [Reject(i, self.codes[i], self.messages[i]) for i in sorted(self.codes)]


def _np(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return arr.to_numpy(zero_copy_only=False)


def _mask(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Boolean Arrow array -> numpy bool with nulls as False."""
    return np.asarray(_np(pc.fill_null(arr, False)), dtype=bool)


def _rows_with(values_mask: np.ndarray, parents: np.ndarray, n: int) -> np.ndarray:
    """Per-row any() of an element-level mask of a flattened list column."""
    out = np.zeros(n, dtype=bool)
    if values_mask.size:
        out[parents[values_mask]] = True
    return out


def _parents(arr: pa.Array) -> np.ndarray:
    """Row index of every element of the flattened list column."""
    lengths = _np(pc.list_value_length(arr).fill_null(0)).astype(np.int64)
    return np.repeat(np.arange(len(arr), dtype=np.int64), lengths)


def _flat(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets[n+1]) of a list column as numpy, zero-copy where possible;
    offsets index into values. Null rows have equal consecutive offsets."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    offs = arr.offsets.to_numpy().astype(np.int64)
    vals = arr.values.to_numpy(zero_copy_only=False)
    return vals, offs


def _per_row_any(flags: np.ndarray, offs: np.ndarray) -> np.ndarray:
    """Per-row any() of an element-level boolean array (one pass, no big temporaries)."""
    starts, lengths = offs[:-1], offs[1:] - offs[:-1]
    out = np.zeros(len(starts), bool)
    nz = lengths > 0
    if nz.any() and len(flags):
        # reduceat over non-empty rows only: it misbehaves on empty segments
        out[nz] = np.logical_or.reduceat(np.asarray(flags[: offs[-1]], bool), starts[nz])
    return out


# -- type normalization ---------------------------------------------------------------
def _int_fits(arr: pa.Array, target: pa.DataType) -> pa.Array:
    info = np.iinfo(target.to_pandas_dtype())
    v = arr.cast(pa.int64()) if not pa.types.is_boolean(arr.type) else arr
    return pc.or_(pc.less(v, info.min), pc.greater(v, info.max))


def _normalize(arr: pa.Array, spec: ColumnSpec, fails: _Failures) -> pa.Array | None:
    """Convert ``arr`` exactly to ``spec``'s type, rejecting rows that cannot be.
    Returns None when the whole column has the wrong type (every row rejected)."""
    target = spec.arrow_type
    src = arr.type
    if src == target:
        return arr
    if pa.types.is_null(src):  # all-null column (e.g. JSON with only nulls)
        return pa.nulls(len(arr), target)
    if pa.types.is_dictionary(src):
        arr = arr.dictionary_decode()
        return _normalize(arr, spec, fails)
    wrong = f"{spec.name} has type {src}; the contract says {spec.type_text}"
    if pa.types.is_string(target):
        if pa.types.is_large_string(src) or pa.types.is_string_view(src):
            return arr.cast(target)
    elif pa.types.is_integer(target):
        if pa.types.is_integer(src):
            bad = _mask(_int_fits(arr, target))
            fails.add(bad, "out_of_range", lambda i: f"{spec.name}={arr[i].as_py()} does not fit {spec.type_text}")
            return pc.if_else(pa.array(bad), pa.nulls(len(arr), src), arr).cast(target)
    elif pa.types.is_floating(target):
        if pa.types.is_floating(src) and src.bit_width <= target.bit_width:
            return arr.cast(target)
        if pa.types.is_integer(src) and target.bit_width == 64:
            big = _mask(pc.greater(pc.abs(arr.cast(pa.int64())), 2**53))
            fails.add(big, "out_of_range", lambda i: f"{spec.name}={arr[i].as_py()} is not exact as float64")
            return arr.cast(target, safe=False)
    elif pa.types.is_timestamp(target):
        if pa.types.is_timestamp(src):
            if src.tz is None:
                fails.add(np.ones(len(arr), bool), "naive_timestamp",
                          f"{spec.name} has no time zone ({src}); write timezone-aware UTC timestamps "
                          f"(timestamp[us, tz=UTC]) so instants are unambiguous")
                return None
            as_int = arr.cast(pa.timestamp(src.unit, tz="UTC")).cast(pa.int64())
            factor = {"s": 10**-6, "ms": 10**-3, "us": 1, "ns": 1000}[src.unit]
            if factor == 1000:
                lossy = _mask(pc.not_equal(pc.remainder(as_int, 1000) if hasattr(pc, "remainder") else
                                           pc.subtract(as_int, pc.multiply(pc.divide(as_int, 1000), 1000)), 0))
                fails.add(lossy, "out_of_range", f"{spec.name} has sub-microsecond precision; round to µs")
                return pc.divide(as_int, 1000).cast(pa.timestamp("us", tz="UTC"))
            return arr.cast(pa.timestamp("us", tz="UTC"))
        if pa.types.is_string(src) or pa.types.is_large_string(src):
            return _parse_timestamps(arr, spec, fails)
    elif pa.types.is_list(target) or pa.types.is_large_list(target):
        if pa.types.is_list(src) or pa.types.is_large_list(src) or pa.types.is_fixed_size_list(src):
            vt, svt = target.value_type, src.value_type
            values = pc.list_flatten(arr)
            parents = _parents(arr)
            ok = svt == vt or (pa.types.is_integer(vt) and (pa.types.is_integer(svt) or pa.types.is_boolean(svt))) \
                or (pa.types.is_floating(vt) and pa.types.is_floating(svt) and svt.bit_width <= vt.bit_width)
            if ok:
                if pa.types.is_integer(vt) and svt != vt:
                    bad_vals = _mask(_int_fits(values, vt)) if not pa.types.is_boolean(svt) else np.zeros(len(values), bool)
                    bad = _rows_with(bad_vals, parents, len(arr))
                    fails.add(bad, "out_of_range", f"{spec.name} has elements that do not fit {vt}")
                    if bad.any():
                        arr = pc.if_else(pa.array(bad), pa.nulls(len(arr), arr.type), arr)
                return arr.cast(target, safe=False)
            wrong = (f"{spec.name} has type {src}; the contract says {spec.type_text}"
                     + ("; cast explicitly before ingest if the narrowing is intended"
                        if pa.types.is_floating(svt) and pa.types.is_floating(vt) else ""))
    elif pa.types.is_map(target):
        if pa.types.is_map(src):
            if pa.types.is_floating(src.item_type) or pa.types.is_integer(src.item_type):
                return arr.cast(target)
    fails.add(np.ones(len(arr), bool), "wrong_type", wrong)
    return None


def _parse_timestamps(arr: pa.Array, spec: ColumnSpec, fails: _Failures) -> pa.Array:
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
              f"write e.g. 2026-01-01T00:00:00Z")
    fails.add(bad, "wrong_type", lambda i: f"{spec.name}={arr[i].as_py()!r} is not an ISO-8601 timestamp")
    return pa.array(out, pa.timestamp("us", tz="UTC"))


# -- column checks ----------------------------------------------------------------------
def _check_column(arr: pa.Array, spec: ColumnSpec, fails: _Failures) -> None:
    n = len(arr)
    if spec.required:
        fails.add(_mask(arr.is_null()), "null_required",
                  f"{spec.name} is null but required; every row must carry it")
    t = spec.arrow_type
    if spec.enum:
        bad = _mask(pc.invert(pc.is_in(arr, value_set=pa.array(list(spec.enum))))) & ~_mask(arr.is_null())
        fails.add(bad, "bad_enum", lambda i: f"{spec.name}={arr[i].as_py()!r} is not one of {', '.join(spec.enum)}")
    if pa.types.is_floating(t) and spec.finite:
        bad = _mask(pc.invert(pc.is_finite(arr)))
        fails.add(bad, "not_finite", lambda i: f"{spec.name}={arr[i].as_py()} is not finite; use null for "
                  f"'no valid evaluation'" if spec.name == "reward" else f"{spec.name}={arr[i].as_py()} is not finite")
    if (pa.types.is_integer(t) or pa.types.is_floating(t)) and (spec.min is not None or spec.max is not None):
        bad = np.zeros(n, bool)
        if spec.min is not None:
            bad |= _mask(pc.less(arr, spec.min))
        if spec.max is not None:
            bad |= _mask(pc.greater(arr, spec.max))
        rng = f"[{spec.min if spec.min is not None else '-inf'}, {spec.max if spec.max is not None else 'inf'}]"
        fails.add(bad, "out_of_range", lambda i: f"{spec.name}={arr[i].as_py()} is outside {rng}")
    if pa.types.is_list(t):
        lengths = _np(pc.list_value_length(arr).fill_null(-1))
        if spec.non_empty:
            fails.add(lengths == 0, "empty_list", f"{spec.name} is empty; it needs at least one token")
        if spec.enum_values or (spec.finite and pa.types.is_floating(t.value_type)):
            if arr.values.null_count:
                fails.add(_rows_with(_mask(pc.list_flatten(arr).is_null()), _parents(arr), n), "null_required",
                          f"{spec.name} holds null elements")
            values, offs = _flat(arr)
            if spec.enum_values:
                bad_v = np.ones(len(values), bool)
                for allowed in spec.enum_values:  # a few passes beat np.isin's sort on 1e7 elements
                    bad_v &= values != allowed
                fails.add(_per_row_any(bad_v, offs), "bad_enum",
                          f"{spec.name} holds values other than {', '.join(map(str, spec.enum_values))}")
            if spec.finite and pa.types.is_floating(t.value_type):
                fails.add(_per_row_any(~np.isfinite(values), offs), "not_finite",
                          f"{spec.name} holds NaN or ±inf elements")
    if pa.types.is_map(t):
        offs = arr.offsets.to_numpy().astype(np.int64)
        vals = arr.items.slice(int(offs[0]), int(offs[-1] - offs[0]))
        if len(vals):
            parents = np.repeat(np.arange(n), np.diff(offs))
            bad_v = _mask(pc.invert(pc.is_finite(vals))) | _mask(vals.is_null())
            fails.add(_rows_with(bad_v, parents, n), "not_finite", f"{spec.name} holds NaN, ±inf or null values")


# -- invariants (the kinds schemas/*.yaml may name) --------------------------------------------
def _inv_same_length(t: pa.Table, inv: Invariant, fails: _Failures) -> None:
    cols = inv.params["columns"]
    first = cols[0]
    base = _np(pc.list_value_length(t.column(first)).fill_null(-1))
    for other in cols[1:]:
        lens = pc.list_value_length(t.column(other))
        present = _mask(pc.is_valid(lens))
        lens = _np(lens.fill_null(-1))
        bad = present & (base >= 0) & (lens != base)
        fails.add(bad, "length_mismatch",
                  lambda i, o=other, L=lens: f"{o} has {L[i]} elements, {first} has {base[i]}")


def _inv_not_before(t: pa.Table, inv: Invariant, fails: _Failures) -> None:
    a, b = inv.params["column"], inv.params["other"]
    bad = _mask(pc.less(t.column(a), t.column(b)))
    fails.add(bad, "time_order", lambda i: f"{a} ({t.column(a)[i].as_py()}) is before {b} "
              f"({t.column(b)[i].as_py()})")


def _inv_any_equal(t: pa.Table, inv: Invariant, fails: _Failures) -> None:
    col = t.column(inv.params["column"]).combine_chunks()
    values, offs = _flat(col)
    hits = _per_row_any(values == inv.params["value"], offs)
    lengths = offs[1:] - offs[:-1]
    fails.add(~hits & (lengths > 0), "no_policy_tokens",
              f"{inv.params['column']} has no {inv.params['value']}: the trajectory has no policy-sampled "
              f"token to learn from")


def _pair(t: pa.Table, a: str, b: str, fails: _Failures, check) -> None:
    """Run element-wise ``check(va, vb) -> bad flags`` over rows where list
    columns a and b are both present and equally long; flag rows with any bad."""
    va, oa = _flat(t.column(a))
    vb, ob = _flat(t.column(b))
    la, lb = oa[1:] - oa[:-1], ob[1:] - ob[:-1]
    present = _mask(pc.is_valid(t.column(a))) & _mask(pc.is_valid(t.column(b)))
    rows = present & (la == lb) & ~fails.bad
    if not rows.any():
        return rows
    if rows.all() and len(oa) == len(ob) and np.array_equal(oa - oa[0], ob - ob[0]):
        bad = _per_row_any(check(va[oa[0]:oa[-1]], vb[ob[0]:ob[-1]]), oa - oa[0])  # same layout: no gather
    else:  # different layouts (nulls, slices): gather the rows' elements
        idx = np.flatnonzero(rows)
        ga = np.concatenate([np.arange(oa[i], oa[i + 1]) for i in idx]) if len(idx) else np.zeros(0, np.int64)
        gb = np.concatenate([np.arange(ob[i], ob[i + 1]) for i in idx]) if len(idx) else np.zeros(0, np.int64)
        sub_offs = np.concatenate(([0], np.cumsum(la[idx])))
        bad_sub = _per_row_any(check(va[ga], vb[gb]), sub_offs)
        bad = np.zeros(t.num_rows, bool)
        bad[idx] = bad_sub
    return bad & rows


def _inv_zero_where(t: pa.Table, inv: Invariant, fails: _Failures) -> None:
    col, mask = inv.params["column"], inv.params["mask"]
    bad = _pair(t, col, mask, fails, lambda v, m: (m == 0) & (v != 0))
    fails.add(bad, "nonzero_masked_logprob",
              f"{col} is non-zero where {mask} is 0 (observation tokens carry no behaviour log-prob); "
              f"write 0 there")


def _inv_value_where(t: pa.Table, inv: Invariant, fails: _Failures) -> None:
    col, mask, value = inv.params["column"], inv.params["mask"], inv.params["value"]
    bad = _pair(t, col, mask, fails, lambda v, m: ((m == 0) & (v != value)) | ((m == 1) & (v < 0)))
    fails.add(bad, "bad_token_versions",
              f"{col} must be {value} on observation tokens ({mask} 0) and a policy version >= 0 on "
              f"sampled tokens")


INVARIANTS: dict[str, Callable[[pa.Table, Invariant, _Failures], None]] = {
    "same_length": _inv_same_length,
    "not_before": _inv_not_before,
    "any_equal": _inv_any_equal,
    "zero_where": _inv_zero_where,
    "value_where": _inv_value_where,
}


# -- entry points -----------------------------------------------------------------------
def validate_table(raw: pa.Table, *, table: str = "trajectories",
                   pre_rejected: list[Reject] | None = None) -> Validated:
    """Validate ``raw`` against ``schemas/<table>.yaml``.

    ``pre_rejected`` carries per-row failures found while parsing (JSONL)."""
    spec = table_spec(table)
    n = raw.num_rows
    fails = _Failures(n)
    for r in pre_rejected or []:
        m = np.zeros(n, bool)
        m[r.row] = True
        fails.add(m, r.code, r.message)
    known = {c.name for c in spec.columns}
    derived = [c for c in raw.column_names if c in {d.name for d in spec.derived_columns}]
    if derived:
        fails.add(np.ones(n, bool), "derived_column",
                  f"column(s) {derived} are computed by the lake; drop them from the input")
    unknown = [c for c in raw.column_names if c not in known]
    if unknown:
        fails.add(np.ones(n, bool), "unknown_column",
                  f"unknown column(s) {unknown}; the trajectories contract has no such column "
                  f"(see README, Ingest contract): drop or rename them")
    cols: dict[str, pa.Array] = {}
    for c in spec.ingest_columns:
        if c.name not in raw.column_names:
            if c.required and c.ingest != "optional":
                fails.add(np.ones(n, bool), "missing_column", f"required column {c.name} is missing")
            cols[c.name] = pa.nulls(n, c.arrow_type)
            continue
        arr = raw.column(c.name).combine_chunks()
        norm = _normalize(arr, c, fails)
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
        mismatch = _mask(pc.and_(pc.is_valid(given), pc.not_equal(given, computed)))
        if mismatch.any():
            m = np.zeros(n, bool)
            m[keep[mismatch]] = True
            fails.add(m, "hash_mismatch",
                      lambda i, g=given, c=computed, k=keep: (
                          f"content_hash {g[int(np.searchsorted(k, i))].as_py()} does not match the canonical hash "
                          f"{c[int(np.searchsorted(k, i))].as_py()}; recompute it with pipeline.lake.content_hash "
                          f"(schemas/README.md) or omit the column"))
            sel = pa.array(~mismatch)
            valid = valid.filter(sel)
            computed = computed.filter(sel)
            keep = keep[~mismatch]
        valid = valid.set_column(valid.schema.get_field_index("content_hash"), "content_hash", computed)
    valid = valid.cast(spec.ingest_schema())
    return Validated(valid=valid, valid_rows=keep, rejects=fails.rejects())


def validate_trajectories(raw: pa.Table) -> Validated:
    return validate_table(raw, table="trajectories")
