"""The one adapter over great_expectations (imported lazily: ~2-4.5 s).

``validate(table, suite_name, key)`` runs the suite built from schemas/ on an
Arrow table through GX's pandas path (docs/dependency-notes.md: the SQLAlchemy + duckdb path
fails silently) and returns the failing rows (key -> first failed expectation)
and a JSON-able summary.

Cost (100k candidate rows, 30 expectations; docs/dependency-notes.md has the
profile): the import dominates, then the validation itself. So:

- the ephemeral context and one pandas batch definition per suite are built
  once per process (each registration re-serialises the context's config);
  the suite goes straight to GX's validator (what ``ValidationDefinition.run``
  runs), never stored: nothing to delete afterwards;
- the whole suite runs with ``BOOLEAN_ONLY`` (which expectations failed);
  only the failed ones run again with ``COMPLETE`` + the key column, on a
  frame of the key and their columns. ``COMPLETE`` on every expectation
  built an index list per expectation by filtering the whole frame, even
  for expectations with no unexpected rows;
- integer columns narrower than 64 bits reach pandas as int64: GX's
  ``between`` check is vectorised for int64/float64 and calls Python per
  row for int32 (same comparisons, same results).
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.errors import MissingExtraError
from pipeline.quality.suites import ExpectationSpec, suite_for


@dataclass
class QualityResult:
    suite: str
    success: bool
    failing: dict[str, str] = field(default_factory=dict)   # key value -> reason
    summary: dict[str, Any] = field(default_factory=dict)


_lock = threading.RLock()
_made: dict[str, Any] = {}  # "context" -> the ephemeral context; suite table -> its batch definition
_suites: dict[tuple, Any] = {}  # (suite name, specs) -> the ExpectationSuite


@functools.cache
def _gx():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    try:
        import great_expectations as gx
    except ImportError:  # pragma: no cover - depends on the install
        raise MissingExtraError("great_expectations", "quality") from None
    return gx


def _camel(type_: str) -> str:
    return "".join(p.capitalize() for p in type_.split("_"))


def _context():
    """The process's ephemeral context (built once)."""
    with _lock:
        if "context" not in _made:
            ctx = _gx().get_context(mode="ephemeral")
            try:
                ctx.variables.progress_bars = {"globally": False, "metric_calculations": False}
            except Exception:  # older/newer GX: progress bars are cosmetic
                pass
            _made["context"] = ctx
        return _made["context"]


def _batch_definition(suite_table: str):
    """A whole-dataframe batch definition for ``suite_table`` (built once; the frame is a batch parameter)."""
    with _lock:
        if suite_table not in _made:
            name = f"pipeline-{suite_table}"
            _made[suite_table] = _context().data_sources.add_pandas(name).add_dataframe_asset(name) \
                .add_batch_definition_whole_dataframe(name)
        return _made[suite_table]


def _suite(name: str, specs: list[ExpectationSpec]):
    """The GX suite of ``specs`` (built once per distinct list: a resident process pays
    for building it once, then only for validating)."""
    key = (name, tuple(specs))
    with _lock:
        if key not in _suites:
            gx = _gx()
            _suites[key] = gx.ExpectationSuite(name=name, expectations=[
                getattr(gx.expectations, _camel(s.type))(column=s.column, **dict(s.kwargs)) for s in specs])
        return _suites[key]


def prepare(suites: dict[str, list[str] | None]) -> None:
    """Import GX and build the context, batch definitions and suites now, for
    each ``{suite table: the columns validate() will see}`` (``pipeline admit
    --follow`` does it once at start), so later validations pay only for
    validating."""
    for t, cols in suites.items():
        _batch_definition(t)
        specs = suite_for(t, cols)
        if specs:
            _suite(t, specs)
    from great_expectations.validator.v1_validator import Validator  # noqa: F401  (its import, once)


def _frame(table: pa.Table, cols: list[str]):
    t = table.select(cols)
    for i, f in enumerate(t.schema):
        if pa.types.is_integer(f.type) and f.type.bit_width < 64:
            t = t.set_column(i, f.name, t.column(i).cast(pa.int64()))
    return t.to_pandas()


def _run(suite_table: str, df, suite, result_format: dict[str, Any]):
    # GX's own validator, as ValidationDefinition.run and Batch.validate build it: it loads the batch
    # once (Batch.validate loads it twice, and each load fingerprints the whole frame)
    from great_expectations.validator.v1_validator import Validator

    v = Validator(batch_definition=_batch_definition(suite_table), batch_parameters={"dataframe": df},
                  result_format=result_format)
    return v.validate_expectation_suite(suite)


def validate(table: pa.Table, suite_table: str, *, key: str) -> QualityResult:
    """Validate ``table`` with the suite generated from schemas/``suite_table``.yaml."""
    specs = suite_for(suite_table, [c for c in table.column_names])
    if table.num_rows == 0 or not specs:
        return QualityResult(suite_table, True, {}, {"suite": suite_table, "rows": table.num_rows,
                                                     "expectations": len(specs), "failed": []})
    df = _frame(table, sorted({s.column for s in specs} | {key}))
    res = _run(suite_table, df, _suite(suite_table, specs), {"result_format": "BOOLEAN_ONLY"})
    ok = {(r.expectation_config.type, r.expectation_config.kwargs.get("column")): r.success for r in res.results}
    failed_specs = [s for s in specs if not ok[(s.type, s.column)]]
    unexpected: dict[tuple[str, str], list] = {}
    if failed_specs:  # which rows: only the failed expectations, on only their columns
        cols = sorted({s.column for s in failed_specs} | {key})
        detail = _run(suite_table, df[cols], _suite(suite_table, failed_specs),
                      {"result_format": "COMPLETE", "unexpected_index_column_names": [key]})
        for r in detail.results:
            cfg = r.expectation_config
            unexpected[(cfg.type, cfg.kwargs.get("column"))] = r.result.get("unexpected_index_list") or []
    failing: dict[str, str] = {}
    failed = []
    for s in specs:  # declared order: a row's reason is its first failed expectation
        rows = unexpected.get((s.type, s.column))
        if rows is None:
            continue
        failed.append({"expectation": s.type, "column": s.column, "unexpected_count": len(rows)})
        for row in rows:
            failing.setdefault(str(row[key]), s.reason)
    summary = {"suite": suite_table, "rows": table.num_rows, "expectations": len(specs),
               "success": bool(res.success), "failed": failed,
               "statistics": {k: (float(v) if v is not None else None) for k, v in res.statistics.items()}}
    return QualityResult(suite_table, bool(res.success), failing, summary)
