"""Each health query in sql/ through the lake's views vs DuckDB over the Parquet files directly.

    .venv/bin/python benchmarks/run.py --only queries            # 1M trajectories
    .venv/bin/python benchmarks/run.py --only queries --quick    # 100k, < 1 minute

Measured: ``pipeline.query.duck.query(lake, sql)`` end to end (open the Delta
tables at their latest version, register the views, run). Baseline: a fresh
DuckDB connection whose views are ``read_parquet`` over exactly the data files
of the same Delta versions (``DeltaTable.file_uris()``, listed before timing;
partition columns from the hive-style paths), running the same SQL; both
create views only for the tables the query names. The ratio is the views'
overhead (reading the Delta log, mapping partition values); target <= 1.5x.

The lake: pipeline.testing.health_lake with SHORT token arrays (4-8 response tokens,
2 prompt tokens): the queries never read token values, only list lengths
(efficiency, quality), so long arrays would only measure Parquet decoding of
payload the queries do not touch. Trajectories land in 200k-row appends;
receipts, snapshot_members, checkpoints and events come with them (events for
100k episodes, ~1M rows). The lake is cached under $TMPDIR between runs.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

from run import Result, best_of

QUERIES = {  # name -> parameters
    "comparability": {}, "comparability_groups": {}, "efficiency": {}, "efficiency_latency": {},
    "efficiency_failures": {}, "quality": {}, "quality_over_time": {}, "quality_components": {},
    "quality_pass_at_k": {"k": 4}, "freshness": {}, "freshness_lag": {}, "freshness_rejections": {},
    "lineage": {}, "lineage_summary": {}, "lineage_trajectory": None, "receipts_latest": {},
}
HIVE_TYPES = {"run_id": "VARCHAR", "created_day": "DATE"}


def _lake(n: int, events: int):
    from pipeline.lake.delta import Lake
    from pipeline.testing.health_lake import HealthLakeSpec, build_health_lake

    root = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / f"bench_queries_{n}_{events}"
    lake = Lake(root / "lake")
    done = root / "DONE"
    if not done.exists():
        import shutil

        shutil.rmtree(root / "lake", ignore_errors=True)
        lake = Lake(root / "lake")
        t0 = time.perf_counter()
        counts = build_health_lake(lake, HealthLakeSpec(trajectories_per_version=n // 5, versions=5, short_tokens=True,
                                                        event_episodes=events, chunk=200_000))
        print(f"   built {counts} in {time.perf_counter() - t0:.0f}s", flush=True)
        done.write_text("ok")
    return lake


def _direct(lake, sql: str, params: dict):
    """DuckDB over the Parquet files of each table's current Delta version."""
    import duckdb

    from pipeline.schema import TABLES, table_spec

    con = duckdb.connect()
    for name in TABLES:
        if not re.search(rf"\b{name}\b", sql):
            continue  # like the views: only the tables the query names
        files = _files(lake, name)
        if files:
            spec = table_spec(name)
            hive = {c: HIVE_TYPES[c] for c in spec.partition_by}
            src = f"read_parquet({files!r}, hive_partitioning = {bool(hive)}" + (
                f", hive_types = {hive!r})" if hive else ")")
        else:
            con.register(f"__e_{name}", table_spec(name).arrow_schema().empty_table())
            src = f'"__e_{name}"'
        con.execute(f'CREATE VIEW "{name}" AS SELECT * FROM {src}')
    try:
        return con.sql(sql, params=params).to_arrow_table() if params else con.sql(sql).to_arrow_table()
    finally:
        con.close()


_FILES: dict[str, list[str]] = {}


def _files(lake, name: str) -> list[str]:
    if name not in _FILES:
        _FILES[name] = lake.table(name).file_uris() if lake.exists(name) else []
    return _FILES[name]


def run(quick: bool) -> list[Result]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pipeline.query.duck import declared_params, query
    from pipeline.resources import sql_path

    n = 100_000 if quick else 1_000_000
    events = 10_000 if quick else 100_000
    lake = _lake(n, events)
    _FILES.clear()
    tid = lake.read("snapshot_members", columns=["trajectory_id"]).column(0)[0].as_py()
    repeat = 3 if quick else 5
    results = []
    for name, params in QUERIES.items():
        sql = sql_path(name).read_text()
        params = {"trajectory_id": tid} if params is None else params
        full = {**declared_params(sql), **params}
        used = {k: v for k, v in full.items() if f"${k}" in sql}
        a = query(lake, sql, params=params)
        b = _direct(lake, sql, used)
        assert a.num_rows == b.num_rows, f"{name}: {a.num_rows} rows via views, {b.num_rows} direct"
        t_view = best_of(lambda: query(lake, sql, params=params), repeat)
        t_direct = best_of(lambda: _direct(lake, sql, used), repeat)
        results.append(Result(
            name=f"query {name} {n // 1000}k: views / parquet",
            ratio=t_view / t_direct, target=1.5,
            measured=f"{t_view * 1e3:.0f} ms ({a.num_rows} rows)", baseline=f"{t_direct * 1e3:.0f} ms"))
        print(f"   {name}: {t_view * 1e3:.0f} ms vs {t_direct * 1e3:.0f} ms", flush=True)
    return results
