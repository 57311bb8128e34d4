"""The one adapter over ``duckdb``.

Each lake table becomes a view of the same name over its Delta version: on a
local lake DuckDB's ``read_parquet`` over exactly that version's data files
(fastest); otherwise (object stores, tables outside schemas/) deltalake's
pyarrow dataset, with projection and filter pushdown. Named queries in sql/
may use ``$name`` parameters.

Facts that live outside the lake come in as Arrow tables the caller passes
(``views``), registered as views of those names: the query layer reads no
stage. The environments' reward component tags are one
(``views={"component_tags": pipeline.rollout.envs.base.component_tags_table()}``,
which ``pipeline sql`` and the report pass).
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping

import duckdb
import pyarrow as pa

from pipeline.errors import PipelineError
from pipeline.lake.ref import as_lake
from pipeline.schema import ALL_TABLES, table_spec

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake



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


def scratch(threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with no lake views: the caller registers its own Arrow tables."""
    return duckdb.connect(config={"threads": threads} if threads else {})


def connect(lake: Lake | str | os.PathLike[str], *, as_of: dict[str, int | datetime] | int | datetime | None = None,
            threads: int | None = None, tables: set[str] | None = None,
            views: Mapping[str, pa.Table] | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with one view per existing lake table (only ``tables`` when given),
    plus one view per Arrow table of ``views`` (named by its key)."""
    lake = as_lake(lake)
    from pipeline.errors import NotFoundError

    con = scratch(threads)
    versions: dict[str, Any] = {}
    if isinstance(as_of, dict):
        versions = as_of
    for name in ALL_TABLES:
        if tables is not None and name not in tables:
            continue
        version = as_of if isinstance(as_of, (int, datetime)) and not isinstance(as_of, bool) else versions.get(name)
        try:
            dt = lake.table(name, version)
        except NotFoundError:
            if lake.exists(name):  # the table is there, the version is not
                raise
            if name in versions:   # --as-of TABLE=... for a table that has never existed: say so, not 0 rows
                raise NotFoundError(f"--as-of {_as_of_text(version)}: table {name} does not exist in this lake",
                                    hint="drop --as-of for it, or query a table that exists "
                                         "(pipeline lake info lists them)") from None
            if _has_spec(name):
                # an empty view with the declared schema, so named queries run on a new lake
                con.register(f"__ds_{name}", table_spec(name).arrow_schema().empty_table())
                con.execute(f'CREATE OR REPLACE VIEW "{name}" AS SELECT * FROM "__ds_{name}"')
            continue
        if isinstance(version, datetime):
            _check_existed_at(name, dt, version)
        if not (lake.is_local and _parquet_view(con, name, dt, same_schema=_never_evolved(lake, name, dt))):
            con.register(f"__ds_{name}", lake.arrow_dataset(name, dt))
            con.execute(f'CREATE OR REPLACE VIEW "{name}" AS SELECT * FROM "__ds_{name}"')
    for name, t in (views or {}).items():
        con.register(f"__view_{name}", t)
        con.execute(f'CREATE OR REPLACE VIEW "{name}" AS SELECT * FROM "__view_{name}"')
    return con


def _as_of_text(version: Any) -> str:
    return version.isoformat() if isinstance(version, datetime) else str(version)


def _check_existed_at(name: str, dt: Any, at: datetime) -> None:
    """deltalake loads version 0 for a time before the table's first commit; a query as of a time the
    table did not exist yet is refused instead of answering from a version that was not there."""
    from pipeline.errors import NotFoundError

    first = min((h.get("timestamp") for h in dt.history() if h.get("timestamp") is not None), default=None)
    if first is None:
        return
    created = datetime.fromtimestamp(first / 1000, tz=at.tzinfo) if at.tzinfo else datetime.fromtimestamp(first / 1000)
    if at < created:
        raise NotFoundError(f"--as-of {at.isoformat()}: table {name} did not exist yet (first commit "
                            f"{created.isoformat()})",
                            hint=f"use a time after {created.isoformat()}, or {name}=VERSION for a table version")


# Views the named queries read that are not lake tables: the caller passes them (``views``).
EXTERNAL_VIEWS = {
    "component_tags": "each environment's reward components tagged fact or heuristic: pass "
                      "views={'component_tags': pipeline.rollout.envs.base.component_tags_table()}",
}


_DUCK_TYPES = {"string": "VARCHAR", "date32": "DATE", "int32": "INTEGER", "int64": "BIGINT"}
# Up to this many partition-value tuples the view is a UNION ALL of one
# read_parquet per tuple (filters on partition columns prune whole branches);
# above it, one read_parquet joined to the file -> partition-values map.
MAX_UNION_BRANCHES = 64


def _parquet_view(con: duckdb.DuckDBPyConnection, name: str, dt, *, same_schema: bool = False) -> bool:
    """View ``name`` as DuckDB's own ``read_parquet`` over exactly the data files of
    this Delta version; False when the table needs the general path.

    Exact for our tables: append-only (compaction swaps files in the log, so
    the add actions are the version's file set), no deletion vectors, no
    column mapping. Partition values come from the log's add actions, never
    from directory names (the writer may hash unsafe values into paths).
    ``union_by_name`` reads files written before a column was appended; it
    reads every file's footer first, which costs up to ~1.6x on a lake of
    hundreds of small files, so it is used only when the table's schema ever
    changed (``same_schema=False``). Over
    deltalake's pyarrow dataset the same queries ran up to 3x slower
    (benchmarks/bench_queries.py).
    """
    if not _has_spec(name):
        return False
    proto = dt.protocol()
    meta = dt.metadata()
    if set(proto.reader_features or ()) & {"deletionVectors", "columnMapping"} \
            or meta.configuration.get("delta.columnMapping.mode", "none") != "none":
        return False  # the file list alone would not be the table: let delta-rs read it
    uris = dt.file_uris()
    if not uris:
        return False
    spec = table_spec(name)
    parts = list(meta.partition_columns)
    try:
        types = {c: _DUCK_TYPES[spec.column(c).type_text] for c in parts}
    except KeyError:
        return False
    columns = [f.name for f in dt.schema().fields]
    groups: dict[tuple, list[str]] = {(): list(uris)}
    if parts:
        from pipeline.lake.delta import Lake

        listed = Lake.live_file_uris(dt)          # partition values as log strings, cast below
        if any(set(pv) != set(parts) for _, pv in listed):
            return False
        groups = {}
        for uri, pv in listed:
            groups.setdefault(tuple(pv[c] for c in parts), []).append(uri)

    def scan(files: list[str], extra: str = "") -> str:
        listed = "[" + ", ".join(_quote(f) for f in files) + "]"
        by_name = "false" if same_schema else "true"
        return f"read_parquet({listed}, union_by_name = {by_name}, hive_partitioning = false{extra})"

    if len(groups) <= MAX_UNION_BRANCHES:
        branches = []
        for key, files in groups.items():
            const = {c: f"{_literal(v, types[c])} AS \"{c}\"" for c, v in zip(parts, key)}
            select = ", ".join(const.get(c, f'"{c}"') for c in columns)
            branches.append(f"SELECT {select} FROM {scan(files)}")
        body = "\nUNION ALL\n".join(branches)
    else:
        rows = [{"__file": f, **dict(zip(parts, key))} for key, files in groups.items() for f in files]
        con.register(f"__parts_{name}", pa.Table.from_pylist(rows))
        select = ", ".join(f'CAST(m."{c}" AS {types[c]}) AS "{c}"' if c in types else f'd."{c}"' for c in columns)
        source = scan(uris, ", filename = '__file'")
        body = (f"SELECT {select} FROM {source} AS d "
                f'JOIN "__parts_{name}" AS m ON d.__file = m.__file')
    try:
        con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {body}')
    except duckdb.Error:
        return False
    return True


def _never_evolved(lake: Lake, name: str, dt) -> bool:
    """True when the table has the columns it was created with: every data file
    then has the same columns (all writes go through the lake's writer, and
    columns are only ever added, at the end), so DuckDB need not reconcile
    footers. Unknown (the first commit's log file is gone) counts as evolved."""
    import json

    for entry in lake.log_entries(name, 0) or []:
        if "metaData" in entry:
            created = [f["name"] for f in json.loads(entry["metaData"]["schemaString"])["fields"]]
            return created == [f.name for f in dt.schema().fields]
    return False


def _has_spec(name: str) -> bool:
    try:
        table_spec(name)
    except Exception:  # no schemas/<name>.yaml (yet)
        return False
    return True


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _literal(value: Any, duck_type: str) -> str:
    if value is None:
        return f"NULL::{duck_type}"
    return f"{_quote(str(value))}::{duck_type}"


def query(lake: Lake | str | os.PathLike[str], sql: str, *, params: dict[str, Any] | None = None,
          as_of: dict[str, int | datetime] | int | datetime | None = None,
          views: Mapping[str, pa.Table] | None = None) -> pa.Table:
    """Run ``sql`` over the lake's views (and the Arrow tables of ``views``); returns an Arrow table."""
    lake = as_lake(lake)
    stripped = strip_comments(sql)
    views = views or {}
    missing_views = sorted(v for v in EXTERNAL_VIEWS if v not in views and _names(stripped, v))
    if missing_views:
        raise SQLError(f"the query reads {', '.join(missing_views)}, which is not a lake table",
                       hint="; ".join(f"{v}: {EXTERNAL_VIEWS[v]}" for v in missing_views))
    # open only the tables the query names: each costs a Delta log load
    named = {t for t in ALL_TABLES if _names(stripped, t)}
    con = connect(lake, as_of=as_of, tables=named, views={k: v for k, v in views.items() if _names(stripped, k)})
    try:
        used = set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", stripped))
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
        msg = str(exc)
        if as_of is not None and ("not found" in msg or "No such file" in msg) and (
                "Parquet" in msg or ".parquet" in msg):  # DuckDB's reader, or Arrow's through a registered stream
            raise SQLError("--as-of: a data file of that table version no longer exists (removed by vacuum)",
                           hint="pipeline lake maintain keeps only the versions snapshots were admitted from; "
                                "query a newer version (pipeline lake info shows the current ones)") from None
        missing_table = re.search(r"Table with name (\S+) does not exist", msg)
        if missing_table:
            raise _unknown_table(missing_table.group(1).strip('"'), con) from None
        raise SQLError(f"SQL failed: {msg}") from None
    finally:
        con.close()


def _unknown_table(name: str, con: duckdb.DuckDBPyConnection) -> SQLError:
    """DuckDB suggests its catalog's own tables ("Did you mean pg_attribute?"); suggest the lake's."""
    import difflib

    known = sorted(set(ALL_TABLES) | {"component_tags"})
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = ("did you mean " + " or ".join(close) + "? " if close else "") + f"the lake's tables: {', '.join(known)}"
    return SQLError(f"no table named {name} in the lake", hint=hint)


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


def _names(sql: str, name: str) -> bool:
    return re.search(rf"\b{name}\b", sql, re.I) is not None


def strip_comments(sql: str) -> str:
    """``sql`` without its ``--`` comments and with every string literal emptied (what is left is code)."""
    sql = re.sub(r"--[^\n]*", "", sql)
    sql = re.sub(r"'(?:[^']|'')*'", "''", sql)
    return sql
