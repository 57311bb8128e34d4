"""The lake's DuckDB views (read_parquet over a Delta version's exact file list
on local lakes) read exactly what deltalake reads: same rows, same columns in
the same order, same types; partition values decoded; time travel and
compaction respected."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.query.duck import connect, query


def _land(lake, make_traj, run_id: str, seed: int, n: int = 12):
    from pipeline.lake.ingest import stamp_derived

    t = make_traj(n, seed=seed, run_id=run_id, id_prefix=f"s{seed}-")
    return lake.append("trajectories", stamp_derived(t, f"ing-{seed}"), command="test", app_id="w", txn_version=seed)


def _shape(t: pa.DataType) -> pa.DataType:
    """The type without child-field names, nullability or zone name (DuckDB names list children 'l')."""
    if pa.types.is_list(t):
        return pa.list_(_shape(t.value_type))
    if pa.types.is_map(t):
        return pa.map_(_shape(t.key_type), _shape(t.item_type))
    if pa.types.is_timestamp(t):  # DuckDB labels instants with its session zone (UTC here)
        return pa.timestamp(t.unit, tz="UTC" if t.tz else None)
    return t


def _sorted(t: pa.Table) -> pa.Table:
    return t.sort_by("trajectory_id")


@pytest.mark.parametrize("max_branches", [64, 1], ids=["union", "join"])
def test_views_read_what_deltalake_reads(lake, make_traj, monkeypatch, max_branches):
    import pipeline.query.duck as duck

    monkeypatch.setattr(duck, "MAX_UNION_BRANCHES", max_branches)
    # partition values that need URL-encoding in the hive paths
    for i, run in enumerate(["plain", "a b/c%d", "it's", "é=ü?", "123"]):
        _land(lake, make_traj, run, seed=i)
    got = _sorted(query(lake, "SELECT * FROM trajectories"))
    want = _sorted(lake.read("trajectories"))
    assert got.schema.names == want.schema.names
    assert [_shape(f.type) for f in got.schema] == [_shape(f.type) for f in want.schema]
    assert got.cast(want.schema).equals(want)
    runs = query(lake, "SELECT DISTINCT run_id FROM trajectories ORDER BY run_id").column(0).to_pylist()
    assert runs == sorted(["plain", "a b/c%d", "it's", "é=ü?", "123"])
    # a filter on a partition column still sees exactly its rows
    n = query(lake, "SELECT count(*) FROM trajectories WHERE run_id = $r", params={"r": "a b/c%d"})
    assert n.column(0)[0].as_py() == 12


def test_views_use_read_parquet_on_local_lakes(lake, make_traj):
    _land(lake, make_traj, "r", seed=1)
    con = connect(lake)
    try:
        sql = con.sql("SELECT sql FROM duckdb_views() WHERE view_name = 'trajectories'").fetchall()[0][0]
    finally:
        con.close()
    assert "read_parquet" in sql


def test_time_travel_and_compaction(lake, make_traj):
    for i in range(3):
        _land(lake, make_traj, "r", seed=i)
    assert query(lake, "SELECT count(*) AS n FROM trajectories", as_of={"trajectories": 1}).column(0)[0].as_py() == 12
    before = _sorted(query(lake, "SELECT * FROM trajectories"))
    lake.compact("trajectories")
    after = _sorted(query(lake, "SELECT * FROM trajectories"))
    assert after.num_rows == 36 and after.equals(before)
    # the pre-compaction version still reads its own (now removed-from-log) files
    v2 = query(lake, "SELECT count(*) FROM trajectories", as_of={"trajectories": 3}).column(0)[0].as_py()
    assert v2 == 36


@pytest.mark.parametrize("table", ["receipts", "checkpoints", "events", "snapshot_members"])
def test_unpartitioned_tables_match(tmp_path, table):
    from pipeline.lake.delta import Lake
    from pipeline.testing.health_lake import HealthLakeSpec, build_health_lake

    lake = Lake(tmp_path / "lake")
    build_health_lake(lake, HealthLakeSpec(trajectories_per_version=40, versions=2, event_episodes=10))
    got = query(lake, f"SELECT * FROM {table}")
    want = lake.read(table)
    assert got.schema.names == want.schema.names
    assert [_shape(f.type) for f in got.schema] == [_shape(f.type) for f in want.schema]
    assert got.num_rows == want.num_rows > 0
    from pipeline.schema import table_spec

    key = table_spec(table).key  # rows are unique on the table's key
    order = lambda r: tuple(r[k] for k in key)  # noqa: E731
    assert sorted(got.to_pylist(), key=order) == sorted(want.to_pylist(), key=order)


def test_unknown_table_suggests_the_lakes_tables_not_duckdbs_catalog(lake, make_traj):
    from pipeline.query.duck import SQLError

    _land(lake, make_traj, "r", seed=1)
    with pytest.raises(SQLError) as exc:
        query(lake, "SELECT count(*) FROM trajectorie")
    assert exc.value.message == "no table named trajectorie in the lake"
    assert "did you mean trajectories?" in exc.value.hint and "pg_" not in exc.value.hint


def test_as_of_a_time_before_the_table_existed_is_refused_not_empty(lake, make_traj):
    from datetime import datetime, timedelta, timezone

    from pipeline.errors import NotFoundError

    before = datetime.now(timezone.utc) - timedelta(days=1)
    _land(lake, make_traj, "r", seed=1)
    with pytest.raises(NotFoundError, match="table trajectories did not exist yet"):
        query(lake, "SELECT count(*) FROM trajectories", as_of=before)
    later = datetime.now(timezone.utc) + timedelta(seconds=1)
    assert query(lake, "SELECT count(*) FROM trajectories", as_of=later).column(0)[0].as_py() == 12
    with pytest.raises(NotFoundError, match="table receipts does not exist in this lake"):
        query(lake, "SELECT count(*) FROM receipts", as_of={"receipts": 0})


def test_sql_output_keeps_the_last_column_whole_and_says_when_it_cut(capsys):
    from pipeline.commands.sql import print_table

    reason = "missing_column: required column reward is absent; add it (null where there is no evaluation)"
    t = pa.table({"trajectory_id": ["x" * 80], "reason": [reason]})
    print_table(t)
    text = capsys.readouterr().out
    assert reason in text, "the last column (here a quarantine reason) is never cut"
    assert "x" * 80 not in text and "--wide" in text, "a cut value is marked and the output says how to see it"
    print_table(t, max_width=0)
    text = capsys.readouterr().out
    assert "x" * 80 in text and "--wide" not in text


def test_a_view_outside_the_lake_is_passed_in_or_named_as_missing(tmp_path):
    """component_tags comes from the environments, not the lake: the query layer
    reads no stage, so the caller passes it (views=) and a query without it is
    told how to get it instead of DuckDB's 'table does not exist'."""
    from pipeline.lake.delta import Lake
    from pipeline.query.duck import SQLError
    from pipeline.rollout.envs.base import component_tags_table, declared_component_tags

    lake = Lake(tmp_path / "lake")
    with pytest.raises(SQLError, match="component_tags_table"):
        query(lake, "SELECT * FROM component_tags")
    got = query(lake, "SELECT env_version, component, tag FROM component_tags ORDER BY env_version, component",
                views={"component_tags": component_tags_table()}).to_pylist()
    assert got == declared_component_tags() and got   # the built-in environments declare some
