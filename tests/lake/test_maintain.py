"""`pipeline lake maintain`: compaction, checkpoints, and a vacuum that keeps the
table versions snapshots were admitted from."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from pipeline.cli import main
from pipeline.lake.ingest import stamp_derived
from pipeline.schema import arrow_schema


def _append_batches(lake, make_traj, n):
    _append_batches_from(lake, make_traj, 0, n)


def _append_batches_from(lake, make_traj, start, stop):
    for k in range(start, stop):
        t = stamp_derived(make_traj(5, seed=k, median_len=8), "test")
        lake.append("trajectories", t, command="test", app_id="m", txn_version=k)


def _register_snapshot(lake, source_version):
    row = {"snapshot_id": "s" * 64, "admission_run_id": "a", "config_hash": "c", "config_json": "{}",
           "advantage_estimator": "grpo", "current_policy_version": 0, "num_groups": 0, "num_members": 0,
           "num_tokens": 0, "path": "_snapshots/x", "manifest_sha256": "m",
           "source_versions": [("trajectories", source_version), ("receipts", -1)], "quality_json": None,
           "created_at": datetime.now(timezone.utc)}
    lake.append("snapshots", pa.Table.from_pylist([row], schema=arrow_schema("snapshots")), command="test")


def test_maintain_compacts_checkpoints_and_keeps_snapshot_versions(lake, make_traj, capsys):
    _append_batches(lake, make_traj, 4)
    kept = lake.version("trajectories")  # a snapshot was admitted from this version
    _register_snapshot(lake, kept)
    rows_kept = lake.read("trajectories", columns=["trajectory_id"]).num_rows
    _append_batches_from(lake, make_traj, 4, 12)
    rows_before = sorted(lake.read("trajectories", columns=["trajectory_id"]).column(0).to_pylist())
    files_before = lake.file_count("trajectories")
    assert files_before >= 12
    assert main(["lake", "maintain", "--lake", lake.uri, "--retention-hours", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["tables"]["trajectories"]
    assert report["files_after"] < files_before and report["files_after"] >= 1
    assert report["kept_versions"] == [kept]
    assert sorted(lake.read("trajectories", columns=["trajectory_id"]).column(0).to_pylist()) == rows_before
    log = Path(lake.table_uri("trajectories")) / "_delta_log"
    assert list(log.glob("*.checkpoint.parquet")), "maintain writes a Delta checkpoint"
    # the version a snapshot was admitted from still loads after vacuum ...
    at_kept = DeltaTable(lake.table_uri("trajectories"), version=kept).to_pyarrow_table(columns=["trajectory_id"])
    assert at_kept.num_rows == rows_kept
    # ... while files only unreferenced versions needed were vacuumed
    assert report["vacuumed"] > 0


def test_maintain_dry_run_deletes_nothing(lake, make_traj, capsys):
    _append_batches(lake, make_traj, 3)
    files = sorted(p.name for p in Path(lake.table_uri("trajectories")).rglob("*.parquet"))
    assert main(["lake", "maintain", "--lake", lake.uri, "--dry-run", "--retention-hours", "0"]) == 0
    assert sorted(p.name for p in Path(lake.table_uri("trajectories")).rglob("*.parquet")) == files


def test_appends_dedupe_against_the_key_index_and_what_landed_after_it(lake, make_traj):
    """After `lake maintain` writes the sorted key index, a fresh process finds
    every landed key through the index plus the files committed after it."""
    import numpy as np

    import pipeline.lake.delta as delta
    from pipeline.ingest import ingest_table
    from pipeline.maintain import maintain

    a = make_traj(30, seed=1, id_prefix="a-")
    b = make_traj(30, seed=2, id_prefix="b-")
    assert ingest_table(lake, a).landed == 30
    out = maintain(lake, tables=["trajectories"], orphan_min_age_s=0)
    iv = out["tables"]["trajectories"]["key_index_version"]
    assert iv == lake.version("trajectories")
    assert ingest_table(lake, b).landed == 30           # committed after the index
    delta.KEY_CACHE.clear()                            # as a new process
    ks = lake.keys("trajectories", lake.table("trajectories"))
    assert len(ks.index) == 30 and len(ks.loose) == 30  # index + only the file added since
    c = make_traj(3, seed=3, id_prefix="c-")
    from pipeline.lake.delta import row_keys
    from pipeline.schema import table_spec

    spec = table_spec("trajectories")
    landed_keys = np.concatenate([row_keys(spec, a).to_numpy(), row_keys(spec, b).to_numpy()])
    new_keys = row_keys(spec, c).to_numpy()
    assert ks.contains(landed_keys).all()
    assert not ks.contains(new_keys).any()
    r = ingest_table(lake, pa.concat_tables([a.slice(0, 5), b.slice(0, 5), c]))
    assert (r.landed, r.duplicates) == (3, 10)
    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0)
    assert len(ids) == len(set(ids.to_pylist())) == 63
