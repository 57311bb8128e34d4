"""CLI: `pipeline sql "SELECT …"` / `pipeline sql --file sql/NAME.sql`."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.cli import common

    p = common(sub.add_parser(
        "sql", help="SQL over the lake's tables (DuckDB views named after the tables)",
        description="Tables are views named after the lake's tables, at their latest version or --as-of."))
    p.add_argument("query", nargs="?", help="the SQL text")
    p.add_argument("--file", "-f", default=None,
                   help="a .sql file, or the name of a named query in sql/ (e.g. admission_rates)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="bind $NAME in the query (repeatable)")
    p.add_argument("--as-of", action="append", default=None, metavar="[TABLE=]VERSION|TIME",
                   help="time travel: VERSION (trajectories), TABLE=VERSION, or an ISO time for every table")
    p.add_argument("--csv", action="store_true", help="print CSV")
    p.add_argument("--list", action="store_true", help="list the named queries in sql/")
    p.set_defaults(handler=_sql)


def read_query(arg: str) -> str:
    from pipeline.resources import sql_path

    path = Path(arg)
    if path.is_file():
        return path.read_text()
    return sql_path(Path(arg).name).read_text()


def _sql(args: argparse.Namespace) -> None:
    from pipeline.errors import PipelineError
    from pipeline.lake.delta import Lake
    from pipeline.query.duck import parse_as_of, query
    from pipeline.resources import resource_dir

    if args.list:
        for f in sorted(resource_dir("sql").glob("*.sql")):
            first = next((ln[2:].strip() for ln in f.read_text().splitlines() if ln.startswith("--")), "")
            print(f"{f.stem:32s} {first}")
        return
    if bool(args.query) == bool(args.file):
        raise PipelineError("give either a query or --file", hint='pipeline sql "SELECT count(*) FROM trajectories"')
    sql = args.query or read_query(args.file)
    params = {}
    for item in args.param:
        if "=" not in item:
            raise PipelineError(f"--param {item!r}: expected NAME=VALUE")
        k, v = item.split("=", 1)
        params[k] = _scalar(v)
    table = query(Lake(args.lake), sql, params=params, as_of=parse_as_of(args.as_of))
    print_table(table, as_json=args.json, as_csv=args.csv)


def _scalar(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def print_table(table, *, as_json: bool = False, as_csv: bool = False, out=None, max_width: int = 60) -> None:
    out = out or sys.stdout
    rows = table.to_pylist()
    if as_json:
        print(json.dumps({"columns": table.column_names, "rows": rows, "row_count": len(rows)}, default=str), file=out)
        return
    if as_csv:
        w = csv.writer(out)
        w.writerow(table.column_names)
        for r in rows:
            w.writerow([r[c] for c in table.column_names])
        return
    cells = [[_fmt(r[c], max_width) for c in table.column_names] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(table.column_names)]
    buf = io.StringIO()
    buf.write("  ".join(c.ljust(w) for c, w in zip(table.column_names, widths)).rstrip() + "\n")
    buf.write("  ".join("-" * w for w in widths) + "\n")
    for row in cells:
        buf.write("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n")
    buf.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")
    out.write(buf.getvalue())


def _fmt(v, max_width: int) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        s = f"{v:.6g}"
    else:
        s = str(v)
    return s if len(s) <= max_width else s[: max_width - 1] + "…"
