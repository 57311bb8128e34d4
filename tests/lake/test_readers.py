"""Readers that are not the project's own code see the same rows as `pipeline sql`;
time travel by version; commit metadata on every write."""

from __future__ import annotations

import json

import polars as pl
import pyarrow.parquet as pq
from deltalake import DeltaTable

from pipeline.cli import main
from pipeline.ingest import ingest_files


def _sql(capsys, lake, q, *extra):
    assert main(["sql", q, "--lake", lake.uri, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_polars_and_deltalake_see_what_pipeline_sql_sees(lake, tmp_path, make_traj, capsys):
    for k in range(3):
        pq.write_table(make_traj(30, seed=k), tmp_path / f"{k}.parquet")
        ingest_files(lake, [tmp_path / f"{k}.parquet"])
    ours = _sql(capsys, lake, "SELECT trajectory_id, content_hash, reward FROM trajectories ORDER BY trajectory_id")
    theirs = (pl.read_delta(lake.table_uri("trajectories"))
              .select("trajectory_id", "content_hash", "reward").sort("trajectory_id").to_dicts())
    assert ours["rows"] == theirs
    plain = DeltaTable(lake.table_uri("trajectories")).to_pyarrow_table(columns=["trajectory_id"])
    assert sorted(plain.column(0).to_pylist()) == [r["trajectory_id"] for r in ours["rows"]]


def test_as_of_version_and_metadata(lake, tmp_path, make_traj, capsys):
    pq.write_table(make_traj(10, seed=1), tmp_path / "a.parquet")
    pq.write_table(make_traj(5, seed=2), tmp_path / "b.parquet")
    ingest_files(lake, [tmp_path / "a.parquet"])
    v1 = lake.version("trajectories")
    ingest_files(lake, [tmp_path / "b.parquet"])
    assert _sql(capsys, lake, "SELECT count(*) AS n FROM trajectories")["rows"] == [{"n": 15}]
    assert _sql(capsys, lake, "SELECT count(*) AS n FROM trajectories", "--as-of", str(v1))["rows"] == [{"n": 10}]
    assert _sql(capsys, lake, "SELECT count(*) AS n FROM trajectories", "--as-of",
                f"trajectories={v1}")["rows"] == [{"n": 10}]
    for commit in lake.history("trajectories"):
        if commit.get("operation") == "WRITE":
            assert commit["pipeline.command"] and commit["pipeline.user"] and commit["pipeline.app_id"]


def test_sql_output_formats_and_params(lake, tmp_path, make_traj, capsys):
    pq.write_table(make_traj(8, seed=3, group_size=4), tmp_path / "a.parquet")
    ingest_files(lake, [tmp_path / "a.parquet"])
    q = "SELECT group_id, count(*) AS n FROM trajectories WHERE group_size = $g GROUP BY 1 ORDER BY 1"
    assert main(["sql", q, "--lake", lake.uri, "--param", "g=4", "--csv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "group_id,n" and len(out) == 3
    assert main(["sql", q, "--lake", lake.uri, "--param", "g=4"]) == 0
    assert "(2 rows)" in capsys.readouterr().out
    assert main(["sql", q, "--lake", lake.uri]) == 2  # missing parameter: a clear error
    assert "--param g=VALUE" in capsys.readouterr().err


def test_sql_on_a_new_lake_has_empty_views(lake, capsys):
    assert _sql(capsys, lake, "SELECT count(*) AS n FROM receipts")["rows"] == [{"n": 0}]


def test_filtered_reads_find_rows_despite_long_strings_nulls_and_non_finite_floats(lake, make_traj):
    """Delta file stats drive file pruning: every scalar column must carry bounds
    that contain its values (a file without them is pruned from every filter)."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    from pipeline.lake.ingest import stamp_derived

    t = make_traj(6, seed=5)
    long_ids = [f"{'x' * 200}-{i}" for i in range(6)]
    t = t.set_column(0, "trajectory_id", pa.array(long_ids))
    t = t.set_column(t.schema.get_field_index("difficulty"), "difficulty", pa.nulls(6, pa.string()))
    lake.append("trajectories", stamp_derived(t, "x"), command="t")
    assert lake.read("trajectories", columns=["trajectory_id"],
                     filter=ds.field("trajectory_id") == long_ids[5]).num_rows == 1
    assert lake.read("trajectories", columns=["trajectory_id"], filter=ds.field("difficulty").is_null()).num_rows == 6
    import math
    from datetime import datetime, timezone

    from pipeline.schema import arrow_schema

    row = {"step": 0, "loss": math.inf}  # a diverged training step is still findable
    schema = arrow_schema("metrics")
    full = {f.name: None for f in schema}
    full.update({k: v for k, v in row.items() if k in full})
    for f in schema:
        if not f.nullable and full[f.name] is None:
            full[f.name] = (datetime.now(timezone.utc) if pa.types.is_timestamp(f.type) else
                            "x" if pa.types.is_string(f.type) else 0)
    lake.append("metrics", pa.Table.from_pylist([full], schema=schema), command="t")
    if "loss" in schema.names:
        assert lake.read("metrics", columns=["loss"], filter=ds.field("loss") > 1.0).num_rows == 1


def test_oldest_version_is_the_smallest_sampled_version_computed_at_landing(make_traj):
    """oldest_version (admission's freshness input) = min over response tokens' versions >= 0
    (observation tokens carry -1), policy_version when there is none; by hand."""
    import pyarrow as pa

    from pipeline.lake.ingest import list_min_nonneg, stamp_derived

    tpv = pa.array([[3, -1, 2], [-1, -1], [], None, [0, 5], [7]], pa.list_(pa.int32()))
    assert list_min_nonneg(tpv).tolist() == [2, -1, -1, -1, 0, 7]
    t = make_traj(2, seed=5, median_len=4, sigma=0.1, policy_version=9)
    t = t.set_column(t.schema.get_field_index("token_policy_versions"), "token_policy_versions",
                     pa.array([None, [-1] * len(t.column("response_ids")[1].as_py())], pa.list_(pa.int32())))
    d = stamp_derived(t, "x")
    assert d.column("oldest_version").to_pylist() == [9, 9]
    assert d.column("response_len").to_pylist() == [len(r) for r in t.column("response_ids").to_pylist()]
