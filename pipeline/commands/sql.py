"""CLI: `pipeline sql "SELECT …"` / `pipeline sql --file sql/NAME.sql`."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import Callable


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import common

    p = common(sub.add_parser(
        "sql", help="SQL over the lake's tables (DuckDB views named after the tables)",
        description="Tables are views named after the lake's tables, at their latest version or --as-of.\n"
                    "Output: an aligned table (default), --csv (RFC 4180 with LF line ends) or --json.",
        epilog='examples:\n  pipeline sql "SELECT status, count(*) FROM trajectories GROUP BY ALL"\n'
               "  pipeline sql --file freshness --param run_id=exp-7\n"
               "  pipeline sql --as-of receipts=3 \"SELECT count(*) FROM receipts\"",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("query", nargs="?", help="the SQL text")
    p.add_argument("--file", "-f", default=None,
                   help="a .sql file, or the name of a named query in sql/ (pipeline sql --list)")
    p.add_argument("--param", action="append", default=[], metavar="NAME[:TYPE]=VALUE",
                   help="bind $NAME in the query (repeatable). VALUE is a string unless TYPE is given: "
                        "int, float, bool or str (DuckDB casts a string where the query compares it with a number)")
    p.add_argument("--as-of", action="append", default=None, metavar="[TABLE=]VERSION|TIME",
                   help="time travel: VERSION (trajectories), TABLE=VERSION, or an ISO time for every table")
    p.add_argument("--csv", action="store_true", help="print CSV (LF line ends)")
    p.add_argument("--wide", action="store_true",
                   help="never cut long values in the aligned table (by default columns but the last are cut "
                        "at 60 characters, and the output says so)")
    p.add_argument("--list", action="store_true", help="list the named queries in sql/")
    p.set_defaults(handler=_sql)


# Named queries that are stages of admission (they read the view `members`, which
# only the admission job defines): not listed, and refused with a pointer.
INTERNAL_QUERIES = {"admission_groups": "it reads the view `members` that admission_members.sql produces; "
                                         "it runs inside `pipeline admit` (see pipeline admit --dry-run)"}
def _parse_bool(raw: str) -> bool:
    if raw.lower() not in ("true", "false", "1", "0"):
        raise ValueError(raw)
    return raw.lower() in ("true", "1")


PARAM_TYPES: dict[str, Callable[[str], object]] = {"int": int, "float": float, "str": str, "bool": _parse_bool}


def read_query(arg: str) -> str:
    from pipeline.errors import InputFileError, NotFoundError
    from pipeline.resources import resource_dir, sql_path

    path = Path(arg)
    try:
        if path.is_file():
            return path.read_text()
        stem = path.name[:-4] if path.name.endswith(".sql") else path.name
        if stem in INTERNAL_QUERIES and path.parent == Path("."):
            raise NotFoundError(f"{stem} is not runnable on its own: {INTERNAL_QUERIES[stem]}")
        if path.parent != Path(".") or path.exists():
            raise FileNotFoundError(arg)
        return sql_path(stem).read_text()
    except FileNotFoundError:
        known = sorted(p.stem for p in resource_dir("sql").glob("*.sql") if p.stem not in INTERNAL_QUERIES)
        raise NotFoundError(f"--file {arg}: no such file and no named query {path.stem!r}",
                            hint=f"named queries: {', '.join(known)}") from None
    except UnicodeDecodeError:
        raise InputFileError(f"--file {arg}: not UTF-8 text") from None
    except OSError as exc:
        raise InputFileError(f"--file {arg}: cannot read ({exc.strerror or exc})") from None


def parse_params(items: list[str]) -> dict[str, object]:
    """``NAME=VALUE`` binds a string; ``NAME:int=7`` / ``:float`` / ``:bool`` / ``:str`` a typed value."""
    import re

    from pipeline.errors import ConfigError

    params: dict[str, object] = {}
    for item in items:
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?::([a-z]+))?=(.*)", item, re.S)
        if not m:
            raise ConfigError(f"--param {item!r}: expected NAME=VALUE or NAME:TYPE=VALUE",
                              hint="e.g. --param run_id=exp-7 --param min_version:int=3")
        name, typ, raw = m.groups()
        if typ is None:
            params[name] = raw
            continue
        if typ not in PARAM_TYPES:
            raise ConfigError(f"--param {item!r}: unknown type {typ!r}", hint=f"types: {', '.join(PARAM_TYPES)}")
        try:
            params[name] = PARAM_TYPES[typ](raw)
        except ValueError:
            raise ConfigError(f"--param {item!r}: {raw!r} is not a valid {typ}") from None
    return params


def _sql(args: argparse.Namespace) -> None:
    import re

    from pipeline.clikit import emit, open_lake, out, result_stream
    from pipeline.errors import ConfigError, PipelineError
    from pipeline.query.duck import strip_comments, declared_params, parse_as_of, query
    from pipeline.resources import resource_dir
    from pipeline.schema import ALL_TABLES

    if args.list:
        named = {}
        for f in sorted(resource_dir("sql").glob("*.sql")):
            if f.stem in INTERNAL_QUERIES:
                continue
            named[f.stem] = next((ln[2:].strip() for ln in f.read_text().splitlines() if ln.startswith("--")), "")
        if args.json:
            emit({"queries": named}, args)
        else:
            for name, first in named.items():
                out(f"{name:32s} {first}")
        return
    if bool(args.query) == bool(args.file):
        raise PipelineError("give either a query or --file", hint='pipeline sql "SELECT count(*) FROM trajectories"')
    sql = args.query or read_query(args.file)
    params = parse_params(args.param)
    # an untyped value for a parameter the named query declares with a numeric default
    # takes that type (`$group_timeout_s * 1e6` needs a number); every other one stays a string
    typed = {item.split("=", 1)[0].split(":", 1)[0] for item in args.param if ":" in item.split("=", 1)[0]}
    for name, default in declared_params(sql).items():
        value = params.get(name)   # a str unless typed (parse_params)
        if isinstance(value, str) and name not in typed and isinstance(default, (int, float)) \
                and not isinstance(default, bool):
            kind = type(default)
            try:
                params[name] = kind(value)
            except ValueError:
                raise ConfigError(f"--param {name}={value!r}: the query expects "
                                  f"{'an integer' if kind is int else 'a number'}") from None
    used = set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", strip_comments(sql)))
    unknown = sorted(set(params) - used)
    if unknown:
        raise ConfigError(f"--param {', '.join(unknown)}: the query has no such parameter",
                          hint=f"its parameters: {', '.join(sorted(used))}" if used else "the query takes no parameters")
    as_of = parse_as_of(args.as_of)
    if isinstance(as_of, dict):
        bad = sorted(set(as_of) - set(ALL_TABLES))
        if bad:
            raise ConfigError(f"--as-of {', '.join(bad)}: no such table",
                              hint=f"tables: {', '.join(ALL_TABLES)}")
    from pipeline.rollout.envs.base import component_tags_table

    table = query(open_lake(args), sql, params=params, as_of=as_of,
                  views={"component_tags": component_tags_table()})
    print_table(table, as_json=args.json, as_csv=args.csv, out=result_stream(), max_width=0 if args.wide else 60)


def print_table(table, *, as_json: bool = False, as_csv: bool = False, out=None, max_width: int = 60) -> None:
    """Print ``table``: JSON, CSV, or an aligned text table whose cells, except the last column's (nothing is
    aligned after it), are cut at ``max_width`` characters (0: never), with a note when any was."""
    out = out or sys.stdout
    rows = table.to_pylist()
    if as_json:
        print(json.dumps({"columns": table.column_names, "rows": rows, "row_count": len(rows)}, default=str), file=out)
        return
    if as_csv:
        w = csv.writer(out, lineterminator="\n")
        w.writerow(table.column_names)
        for r in rows:
            w.writerow([r[c] for c in table.column_names])
        return
    last = len(table.column_names) - 1
    full = [[_fmt(r[c], 0) for c in table.column_names] for r in rows]
    cells = [[_fmt(r[c], max_width if i < last else 0) for i, c in enumerate(table.column_names)] for r in rows]
    cut = any(a != b for fr, cr in zip(full, cells) for a, b in zip(fr, cr))
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(table.column_names)]
    buf = io.StringIO()
    buf.write("  ".join(c.ljust(w) for c, w in zip(table.column_names, widths)).rstrip() + "\n")
    buf.write("  ".join("-" * w for w in widths) + "\n")
    for row in cells:
        buf.write("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n")
    buf.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")
    if cut:
        buf.write(f"(values over {max_width} characters are cut with …; --wide, --csv or --json print them whole)\n")
    out.write(buf.getvalue())


def _fmt(v, max_width: int) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        s = f"{v:.6g}"
    else:
        s = str(v)
    return s if max_width <= 0 or len(s) <= max_width else s[: max_width - 1] + "…"
