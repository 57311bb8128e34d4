"""The one adapter over great_expectations (imported lazily: ~4.5 s).

``validate(table, suite_name, key)`` runs the suite built from schemas/ on an
Arrow table through GX's pandas path (docs/dependency-notes.md: the SQLAlchemy + duckdb path
fails silently) and returns the failing rows (key -> first failed expectation)
and a JSON-able summary.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.errors import MissingExtraError
from pipeline.quality.suites import suite_for


@dataclass
class QualityResult:
    suite: str
    success: bool
    failing: dict[str, str] = field(default_factory=dict)   # key value -> reason
    summary: dict[str, Any] = field(default_factory=dict)


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


@functools.cache
def _context():
    gx = _gx()
    ctx = gx.get_context(mode="ephemeral")
    try:
        ctx.variables.progress_bars = {"globally": False, "metric_calculations": False}
    except Exception:  # older/newer GX: progress bars are cosmetic
        pass
    return ctx


_counter = [0]


def validate(table: pa.Table, suite_table: str, *, key: str) -> QualityResult:
    """Validate ``table`` with the suite generated from schemas/``suite_table``.yaml."""
    specs = suite_for(suite_table, [c for c in table.column_names])
    if table.num_rows == 0 or not specs:
        return QualityResult(suite_table, True, {}, {"suite": suite_table, "rows": table.num_rows,
                                                     "expectations": len(specs), "failed": []})
    gx = _gx()
    ctx = _context()
    _counter[0] += 1
    name = f"{suite_table}-{os.getpid()}-{_counter[0]}"
    batch_def = ctx.data_sources.add_pandas(name).add_dataframe_asset(name) \
        .add_batch_definition_whole_dataframe(name)
    suite = ctx.suites.add(gx.ExpectationSuite(name=name))
    for s in specs:
        suite.add_expectation(getattr(gx.expectations, _camel(s.type))(column=s.column, **dict(s.kwargs)))
    vd = ctx.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch_def, suite=suite))
    cols = sorted({s.column for s in specs} | {key})
    df = table.select(cols).to_pandas()
    res = vd.run(batch_parameters={"dataframe": df},
                 result_format={"result_format": "COMPLETE", "unexpected_index_column_names": [key]})
    failing: dict[str, str] = {}
    failed = []
    unexpected: dict[tuple[str, str], list] = {}
    for r in res.results:
        cfg = r.expectation_config
        if not r.success:
            unexpected[(cfg.type, cfg.kwargs.get("column"))] = r.result.get("unexpected_index_list") or []
    for s in specs:  # declared order: a row's reason is its first failed expectation
        rows = unexpected.get((s.type, s.column))
        if rows is None:
            continue
        failed.append({"expectation": s.type, "column": s.column, "unexpected_count": len(rows)})
        for row in rows:
            failing.setdefault(str(row[key]), s.reason)
    for ds_name in (name,):  # keep the ephemeral context small across many runs
        try:
            ctx.validation_definitions.delete(name)
            ctx.suites.delete(name)
            ctx.data_sources.delete(ds_name)
        except Exception:
            pass
    summary = {"suite": suite_table, "rows": table.num_rows, "expectations": len(specs),
               "success": bool(res.success), "failed": failed,
               "statistics": {k: (float(v) if v is not None else None) for k, v in res.statistics.items()}}
    return QualityResult(suite_table, bool(res.success), failing, summary)
