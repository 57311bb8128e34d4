"""`pipeline lake migrate` upgrades the committed old-layout fixture
(tests/lake/fixtures/old-layout-lake: derived columns missing, written by
delta-rs as earlier versions did) in place: same rows, derived columns equal to
what ingest computes, files rewritten with dataChange=false; then both engines
admit it and appends dedupe against its rows. Every other command refuses the
old lake with the instruction to migrate. Killed inside a rewrite (before or
after its commit) it resumes; run on a current lake it is a no-op."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.lake import migrate as mig
from pipeline.lake.delta import PAUSE_AT_ENV, Lake
from pipeline.lake.ingest import stamp_derived

FIXTURE = Path(__file__).parent / "fixtures" / "old-layout-lake"
DERIVED = ["row_key", "oldest_version", "response_len", "prompt_hash"]


@pytest.fixture
def old_lake(tmp_path) -> Lake:
    shutil.copytree(FIXTURE, tmp_path / "old")
    return Lake(tmp_path / "old")


def _rows(lake: Lake, cols: list[str] | None = None) -> list[dict]:
    t = lake.read("trajectories", columns=cols)
    return t.sort_by("trajectory_id").to_pylist()


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_tables_migrate_checks_are_those_with_derived_columns():
    assert mig.tables() == mig.tables_from_specs()


def test_the_fixture_is_the_previous_layout(old_lake):
    names = {f.name for f in old_lake.table("trajectories").schema().fields}
    assert not set(DERIVED) & names and "ingest_id" in names
    assert "row_key" not in {f.name for f in old_lake.table("events").schema().fields}
    assert sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file()) < 200_000
    assert mig.status(old_lake) == {"trajectories": DERIVED, "events": ["row_key"]}


def test_commands_on_an_old_lake_say_to_migrate(old_lake, capsys):
    for argv in (["admit"], ["snapshots", "list"], ["lake", "maintain"], ["sql", "--file", "freshness"]):
        rc, out, err = _cli(capsys, *argv, "--lake", old_lake.uri)
        assert rc == 2, (argv, out, err)
        assert "written by an earlier version" in err and f"pipeline lake migrate --lake {old_lake.uri}" in err, argv
    rc, out, _ = _cli(capsys, "lake", "info", "--lake", old_lake.uri, "--json")   # inspection still works
    assert rc == 0 and json.loads(out)["tables"]["trajectories"]["rows"] == 16


def test_migrate_backfills_in_place_then_both_engines_admit(old_lake, capsys, make_traj):
    before_t = old_lake.read("trajectories").sort_by("trajectory_id")
    before = before_t.to_pylist()
    v0 = old_lake.version("trajectories")
    rc, out, _ = _cli(capsys, "lake", "migrate", "--lake", old_lake.uri, "--dry-run", "--json")
    dry = json.loads(out)
    assert rc == 0 and dry["tables"]["trajectories"]["outdated_files"] == 2 and not dry["current"]
    assert old_lake.version("trajectories") == v0
    rc, out, _ = _cli(capsys, "lake", "migrate", "--lake", old_lake.uri, "--json")
    r = json.loads(out)
    assert rc == 0 and r["current"] and r["tables"]["trajectories"]["rewritten"] == 2
    assert r["tables"]["events"]["rewritten"] == 2
    after = _rows(old_lake)
    # the same rows; derived columns as ingest computes them from the same rows
    keep = [c for c in before[0] if c not in DERIVED and c != "tool_schema_version"]
    assert [{c: x[c] for c in keep} for x in after] == [{c: x[c] for c in keep} for x in before]
    base = before_t.select([c for c in keep if c not in ("created_day", "ingest_id")])
    expect = stamp_derived(base, "x").sort_by("trajectory_id").select(DERIVED).to_pylist()
    assert [{c: x[c] for c in DERIVED} for x in after] == expect
    assert old_lake.read("events", columns=["row_key"]).column(0).null_count == 0
    # rewritten with dataChange=false: rows unchanged for every reader, at every version
    actions = [(k, e[k]) for v in range(v0 + 1, old_lake.version("trajectories") + 1)
               for e in old_lake.log_entries("trajectories", v) or [] for k in ("add", "remove") if k in e]
    assert sorted(k for k, _ in actions) == ["add", "remove", "remove"]    # one partition: one new file
    assert all(a["dataChange"] is False for _, a in actions)
    assert old_lake.read("trajectories", version=v0, columns=["trajectory_id"]).num_rows == 16
    # a no-op when current
    v1 = old_lake.version("trajectories")
    rc, out, _ = _cli(capsys, "lake", "migrate", "--lake", old_lake.uri, "--json")
    assert rc == 0 and json.loads(out) == {"lake": old_lake.uri, "dry_run": False, "tables": {}, "current": True}
    assert old_lake.version("trajectories") == v1
    # every command works again; appends dedupe against the migrated rows
    rc, out, err = _cli(capsys, "admit", "--lake", old_lake.uri, "--json", "--set", "quality=false",
                        "--current-policy-version", "0", "--dry-run")
    assert rc == 0, err
    duck = json.loads(out)
    assert duck["decided_groups"] == 4 and duck["counts"] == {"admit": 2, "zero_variance": 2}
    again = old_lake.append("trajectories", old_lake.read("trajectories").drop_columns(["row_key"]), command="test")
    assert not again.landed and again.duplicates == 16


@pytest.mark.slow
def test_the_dask_engine_admits_a_migrated_lake_as_duckdb_does(old_lake):
    from distributed import LocalCluster

    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit

    mig.migrate(old_lake)
    cfg = AdmissionConfig(quality=False)
    duck = admit(old_lake, cfg, current_policy_version=0, dry_run=True)
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None)
    try:
        dask = admit(old_lake, cfg, current_policy_version=0, dry_run=True, engine="dask",
                     dask_scheduler=cluster.scheduler_address)
    finally:
        cluster.close()
    assert dask.counts == duck.counts == {"admit": 2, "zero_variance": 2}
    assert dask.snapshot_id == duck.snapshot_id


MIGRATOR = r"""
import sys
from pipeline.lake.delta import Lake
from pipeline.lake.migrate import migrate
print(migrate(Lake(sys.argv[1]), batch_bytes=1))
"""


@pytest.mark.parametrize("point", ["written", "committed"])
def test_a_migration_killed_inside_a_rewrite_resumes(old_lake, tmp_path, point):
    """Killed (SIGKILL) with the first file's rewrite written but not committed, or
    just committed: the lake is still not current; a rerun finishes it; every row
    once; what the killed one staged is orphan cleanup's."""
    marker = tmp_path / "marker"
    env = dict(os.environ, **{PAUSE_AT_ENV: f"rewrite:trajectories:{point}={marker}"})
    p = subprocess.Popen([sys.executable, "-c", MIGRATOR, old_lake.uri], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not marker.exists():
            assert time.time() < deadline and p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.02)
    finally:
        p.kill()
        p.wait()
    fresh = Lake(old_lake.uri)
    assert "trajectories" in mig.status(fresh)
    assert len(mig.outdated_files(fresh, "trajectories")) == (1 if point == "committed" else 2)
    r = mig.migrate(fresh)
    assert r["current"] and r["tables"]["trajectories"]["rewritten"] == (1 if point == "committed" else 2)
    ids = fresh.read("trajectories", columns=["trajectory_id", "row_key"])
    assert ids.num_rows == 16 == len(set(ids.column("trajectory_id").to_pylist()))
    assert ids.column("row_key").null_count == 0
    removed = fresh.remove_orphans("trajectories", min_age_s=0)
    assert len(removed) == (1 if point == "written" else 0)
    assert fresh.read("trajectories", columns=["trajectory_id"]).num_rows == 16
