"""The one adapter over ``duckdb``.

Each lake table becomes a view of the same name over its Delta version (read
through deltalake's pyarrow dataset, so the same code path serves local paths
and object stores, with projection and filter pushdown). Named queries in sql/
may use ``$name`` parameters.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import duckdb
import pyarrow as pa

from pipeline.errors import PipelineError
from pipeline.schema import TABLES, table_spec

EXTRA_TABLES = ("metrics",)


class SQLError(PipelineError):
    """The query failed in DuckDB."""


def parse_as_of(values: list[str] | None) -> dict[str, int | datetime] | int | datetime | None:
    """``["5"]`` -> trajectories@5; ``["receipts=3"]`` -> per table; an ISO time -> every table."""
    if not values:
        return None
    out: dict[str, int | datetime] = {}
    for v in values:
        if "=" in v:
            t, ver = v.split("=", 1)
            out[t] = _version(ver)
        else:
            parsed = _version(v)
            if isinstance(parsed, datetime):
                return parsed
            out["trajectories"] = parsed
    return out


def _version(v: str) -> int | datetime:
    if re.fullmatch(r"\d+", v.strip()):
        return int(v)
    try:
        return datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise PipelineError(f"--as-of {v!r}: expected a version number or an ISO-8601 time") from None


def connect(lake, *, as_of: dict[str, int | datetime] | int | datetime | None = None,
            threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with one view per existing lake table."""
    con = duckdb.connect(config={"threads": threads} if threads else {})
    versions: dict[str, Any] = {}
    if isinstance(as_of, dict):
        versions = as_of
    for name in TABLES + EXTRA_TABLES:
        version = as_of if isinstance(as_of, (int, datetime)) and not isinstance(as_of, bool) else versions.get(name)
        if lake.exists(name):
            dataset = lake.dataset(name, version)
            con.register(f"__ds_{name}", dataset)
            con.execute(f'CREATE OR REPLACE VIEW "{name}" AS SELECT * FROM "__ds_{name}"')
        elif name in TABLES:
            # an empty view with the declared schema, so named queries run on a new lake
            con.register(f"__ds_{name}", table_spec(name).arrow_schema().empty_table())
            con.execute(f'CREATE OR REPLACE VIEW "{name}" AS SELECT * FROM "__ds_{name}"')
    return con


def query(lake, sql: str, *, params: dict[str, Any] | None = None,
          as_of: dict[str, int | datetime] | int | datetime | None = None) -> pa.Table:
    """Run ``sql`` over the lake's views; returns an Arrow table."""
    con = connect(lake, as_of=as_of)
    try:
        used = set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", _strip_comments(sql)))
        params = {**declared_params(sql), **(params or {})}
        missing = sorted(used - set(params))
        if missing:
            raise SQLError(f"the query needs parameter(s) {missing}",
                           hint=" ".join(f"--param {m}=VALUE" for m in missing))
        p = {k: v for k, v in params.items() if k in used}
        rel = con.sql(sql, params=p) if p else con.sql(sql)
        if rel is None:  # a statement without a result (e.g. SET)
            return pa.table({})
        return rel.to_arrow_table()
    except duckdb.Error as exc:
        raise SQLError(f"SQL failed: {exc}") from None
    finally:
        con.close()


_PARAM_LINE = re.compile(r"^\s*--\s*@param\s+([A-Za-z_][A-Za-z0-9_]*)\s*(?:=\s*('(?:[^']|'')*'|\S+))?", re.M)


def declared_params(sql: str) -> dict[str, Any]:
    """Defaults a named query declares in its header: ``-- @param NAME = DEFAULT``.

    DEFAULT is NULL, a number, or a 'quoted string'; a parameter declared
    without ``= DEFAULT`` is required (absent from the result).
    """
    out: dict[str, Any] = {}
    for name, raw in _PARAM_LINE.findall(sql):
        if not raw:
            continue
        if raw.upper() == "NULL":
            out[name] = None
        elif raw.startswith("'"):
            out[name] = raw[1:-1].replace("''", "'")
        else:
            for cast in (int, float, str):
                try:
                    out[name] = cast(raw)
                    break
                except ValueError:
                    pass
    return out


def _strip_comments(sql: str) -> str:
    sql = re.sub(r"--[^\n]*", "", sql)
    sql = re.sub(r"'(?:[^']|'')*'", "''", sql)
    return sql
