"""The invariant kinds ``schemas/*.yaml`` may name (``invariants:``), one checker
each: ``INVARIANTS[kind](table, invariant, failures)`` flags the rows that break
it, with a reason a user can act on."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.lake.failures import Failures, as_numpy, bool_mask, flat_list, per_row_any
from pipeline.schema import Invariant


def _inv_same_length(t: pa.Table, inv: Invariant, fails: Failures) -> None:
    cols = inv.params["columns"]
    first = cols[0]
    base = as_numpy(pc.list_value_length(t.column(first)).fill_null(-1))
    for other in cols[1:]:
        lens = pc.list_value_length(t.column(other))
        present = bool_mask(pc.is_valid(lens))
        lens = as_numpy(lens.fill_null(-1))
        bad = present & (base >= 0) & (lens != base)

        def message(i: int, o: str = other, L: np.ndarray = lens) -> str:
            return f"{o} has {L[i]} elements, {first} has {base[i]}"

        fails.add(bad, "length_mismatch", message, depends=(first, other))


def _inv_not_before(t: pa.Table, inv: Invariant, fails: Failures) -> None:
    a, b = inv.params["column"], inv.params["other"]
    bad = bool_mask(pc.less(t.column(a), t.column(b)))
    fails.add(bad, "time_order", lambda i: f"{a} ({t.column(a)[i].as_py()}) is before {b} "
              f"({t.column(b)[i].as_py()})", depends=(a, b))


def _inv_any_equal(t: pa.Table, inv: Invariant, fails: Failures) -> None:
    col = t.column(inv.params["column"]).combine_chunks()
    values, offs = flat_list(col)
    hits = per_row_any(values == inv.params["value"], offs)
    lengths = offs[1:] - offs[:-1]
    fails.add(~hits & (lengths > 0), "no_policy_tokens",
              f"{inv.params['column']} has no {inv.params['value']}: the trajectory has no policy-sampled "
              f"token to learn from", depends=(inv.params["column"],))


def _pair(t: pa.Table, a: str, b: str, fails: Failures,
          check: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """Run element-wise ``check(va, vb) -> bad flags`` over rows where list
    columns a and b are both present and equally long; flag rows with any bad."""
    va, oa = flat_list(t.column(a))
    vb, ob = flat_list(t.column(b))
    la, lb = oa[1:] - oa[:-1], ob[1:] - ob[:-1]
    present = bool_mask(pc.is_valid(t.column(a))) & bool_mask(pc.is_valid(t.column(b)))
    rows = present & (la == lb) & ~fails.broken_rows(a, b)
    if not rows.any():
        return rows
    if rows.all() and len(oa) == len(ob) and np.array_equal(oa - oa[0], ob - ob[0]):
        bad = per_row_any(check(va[oa[0]:oa[-1]], vb[ob[0]:ob[-1]]), oa - oa[0])  # same layout: no gather
    else:  # different layouts (nulls, slices): gather the rows' elements
        idx = np.flatnonzero(rows)
        ga = np.concatenate([np.arange(oa[i], oa[i + 1]) for i in idx]) if len(idx) else np.zeros(0, np.int64)
        gb = np.concatenate([np.arange(ob[i], ob[i + 1]) for i in idx]) if len(idx) else np.zeros(0, np.int64)
        sub_offs = np.concatenate(([0], np.cumsum(la[idx])))
        bad_sub = per_row_any(check(va[ga], vb[gb]), sub_offs)
        bad = np.zeros(t.num_rows, bool)
        bad[idx] = bad_sub
    return bad & rows


def _inv_zero_where(t: pa.Table, inv: Invariant, fails: Failures) -> None:
    col, mask = inv.params["column"], inv.params["mask"]
    bad = _pair(t, col, mask, fails, lambda v, m: (m == 0) & (v != 0))
    fails.add(bad, "nonzero_masked_logprob",
              f"{col} is non-zero where {mask} is 0 (observation tokens carry no behaviour log-prob); "
              f"write 0 there", depends=(col, mask))


def _inv_value_where(t: pa.Table, inv: Invariant, fails: Failures) -> None:
    col, mask, value = inv.params["column"], inv.params["mask"], inv.params["value"]
    bad = _pair(t, col, mask, fails, lambda v, m: ((m == 0) & (v != value)) | ((m == 1) & (v < 0)))
    fails.add(bad, "bad_token_versions",
              f"{col} must be {value} on observation tokens ({mask} 0) and a policy version >= 0 on "
              f"sampled tokens", depends=(col, mask))


def _inv_present_where(t: pa.Table, inv: Invariant, fails: Failures) -> None:
    """``column`` holds a value on every row whose ``where`` column is one of ``values``
    (a judged verdict has a reward: NaN, which pandas writes as a missing value, is not one)."""
    col, where, values = inv.params["column"], inv.params["where"], list(inv.params["values"])
    judged = bool_mask(pc.is_in(t.column(where), value_set=pa.array(values, t.column(where).type)))
    bad = judged & bool_mask(pc.is_null(t.column(col), nan_is_null=True))
    fails.add(bad, code=f"{col}_missing",
              message=lambda i: f"{col} is null or NaN on a row whose {where} is {t.column(where)[i].as_py()}: "
                                f"a judged trajectory carries its {col}; write it, or set {where} UNKNOWN (with "
                                f"status INFRA_FAILED) when the evaluation did not happen",
              depends=(col, where))


INVARIANTS: dict[str, Callable[[pa.Table, Invariant, Failures], None]] = {
    "present_where": _inv_present_where,
    "same_length": _inv_same_length,
    "not_before": _inv_not_before,
    "any_equal": _inv_any_equal,
    "zero_where": _inv_zero_where,
    "value_where": _inv_value_where,
}
