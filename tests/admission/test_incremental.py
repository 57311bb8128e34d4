"""Incremental admission reads only what changed since the previous run (new
files plus the rows of groups still pending), and decides exactly what a full
scan decides: same receipts, same snapshots, run after run -- with groups that
complete across ingests, late members of decided groups, timeouts, and a
compaction in between."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline.admission import run as admission_run
from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit
from pipeline.lake.delta import Lake
from pipeline.ingest import ingest_table
from pipeline.maintain import maintain

T0 = datetime(2026, 11, 20, 12, 0, tzinfo=timezone.utc)


def _steps(make_traj):
    """Batches landing at successive times; each group has 4 members."""
    a = make_traj(48, seed=1, id_prefix="a-", start=T0)                      # 12 groups
    b = make_traj(48, seed=2, id_prefix="b-", start=T0 + timedelta(minutes=5))
    gid = a.column("group_id")
    # groups a-g0..a-g3 arrive with 2 of 4 members first; the rest comes in step 2, and
    # one member of a-g4 arrives only after its group was decided (a late member)
    first_half = pc.invert(pc.and_(pc.is_in(gid, pa.array([g for g in set(gid.to_pylist())][:4])),
                                   pc.is_in(pc.utf8_slice_codeunits(a.column("trajectory_id"), -1),
                                            pa.array(["2", "3"]))))
    ids = a.column("trajectory_id").to_pylist()
    late_id = ids[4 * 4 + 3]
    step1 = a.filter(pc.and_(first_half, pc.not_equal(a.column("trajectory_id"), late_id)))
    step2 = pa.concat_tables([a.filter(pc.invert(first_half)), b.slice(0, 24)])
    step3 = pa.concat_tables([a.filter(pc.equal(a.column("trajectory_id"), late_id)), b.slice(24)])
    return [step1, step2, step3]


def _run(lake, steps, nows, *, compact_after: int | None = None) -> list[tuple]:
    out = []
    for i, (batch, now) in enumerate(zip(steps, nows)):
        ingest_table(lake, batch, source=f"step{i}")
        r = admit(lake, AdmissionConfig(quality=False, group_timeout_s=600), current_policy_version=0, now=now)
        rec = sorted((x["group_id"], x["decision"], tuple(sorted(x["valid_members"] or [])))
                     for x in r.receipts.to_pylist())
        out.append((r.snapshot_id, rec))
        if compact_after == i:
            maintain(lake, orphan_min_age_s=0)
    return out


def test_incremental_admission_decides_what_a_full_scan_decides(tmp_path, make_traj, monkeypatch):
    steps = _steps(make_traj)
    # step 1 at T0+2min: half-arrived groups pending; step 2 at T0+8min: they complete;
    # step 3 much later: the remaining groups time out; the late member is ignored
    nows = [T0 + timedelta(minutes=2), T0 + timedelta(minutes=8), T0 + timedelta(hours=2)]
    seen_sources = []
    real = admission_run._trajectory_sources

    def spy(lake, tv, previous):
        srcs = real(lake, tv, previous)
        seen_sources.append((previous is not None, sum(len(d.files) for d, _ in srcs)))
        return srcs

    monkeypatch.setattr(admission_run, "_trajectory_sources", spy)
    incremental = _run(Lake(tmp_path / "inc"), steps, nows, compact_after=0)
    assert [s[0] for s in seen_sources] == [False, True, True]  # runs 2 and 3 used the recorded state
    monkeypatch.setattr(admission_run, "previous_state", lambda lake, rv: None)
    full = _run(Lake(tmp_path / "full"), steps, nows)
    assert incremental == full
    decisions = {d for _, rec in full for _, d, _ in rec}
    assert "admit" in decisions
    # every group decided exactly once across the three runs
    groups = [g for _, rec in incremental for g, _, _ in rec]
    assert len(groups) == len(set(groups))


def test_incremental_admission_skips_old_files_of_decided_groups(tmp_path, make_traj):
    lake = Lake(tmp_path / "lk")
    now = datetime.now(timezone.utc)
    for k in range(5):
        ingest_table(lake, make_traj(40, seed=10 + k, id_prefix=f"o{k}-", start=now - timedelta(days=2)))
    admit(lake, AdmissionConfig(quality=False), current_policy_version=0)
    ingest_table(lake, make_traj(40, seed=99, id_prefix="new-", start=now - timedelta(hours=1)))
    rv = lake.version("receipts")
    srcs = admission_run._trajectory_sources(lake, lake.version("trajectories"), admission_run.previous_state(lake, rv))
    # one new file read whole; the five old files only through a finished_at filter that excludes them
    rows = [d.to_table(columns=["trajectory_id"], filter=f).num_rows for d, f in srcs]
    assert rows == [40, 0]
    r = admit(lake, AdmissionConfig(quality=False), current_policy_version=0)
    assert r.quality["candidate_rows"] == 40


@pytest.mark.slow
def test_dask_engine_reads_the_same_candidates_as_duckdb_run_after_run(tmp_path, make_traj):
    """Incremental on both engines: over three runs with groups completing across
    ingests, a late member, timeouts and a compaction in between, the Dask engine
    reads the same candidate rows (the same count: only the files added since the
    previous admission, plus the pending rows of older ones) and writes the same
    receipts and snapshots as DuckDB."""
    from distributed import LocalCluster

    steps = _steps(make_traj)
    nows = [T0 + timedelta(minutes=2), T0 + timedelta(minutes=8), T0 + timedelta(hours=2)]
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None)
    try:
        out = {}
        for engine in ("duckdb", "dask"):
            lake = Lake(tmp_path / engine)
            runs = []
            for i, (batch, now) in enumerate(zip(steps, nows)):
                ingest_table(lake, batch, source=f"step{i}")
                r = admit(lake, AdmissionConfig(quality=False, group_timeout_s=600), current_policy_version=0,
                          now=now, engine=engine, dask_scheduler=cluster.scheduler_address)
                runs.append((r.quality["candidate_rows"], r.snapshot_id,
                             sorted((x["group_id"], x["decision"], tuple(sorted(x["valid_members"] or [])))
                                    for x in r.receipts.to_pylist())))
                if i == 0:
                    maintain(lake, orphan_min_age_s=0)
            out[engine] = runs
    finally:
        cluster.close()
    assert out["dask"] == out["duckdb"]
    reads = [n for n, _, _ in out["dask"]]
    assert reads[1] < sum(s.num_rows for s in _steps(make_traj)[:2])   # run 2 skipped decided groups' rows


def test_dask_reads_only_row_groups_that_reach_the_pending_bound(tmp_path, make_traj):
    from pipeline.admission import engine_dask

    lake = Lake(tmp_path / "lk")
    now = datetime.now(timezone.utc)
    ingest_table(lake, make_traj(40, seed=10, id_prefix="old-", start=now - timedelta(days=2)))
    ingest_table(lake, make_traj(40, seed=11, id_prefix="new-", start=now - timedelta(minutes=5)))
    cfg = AdmissionConfig(quality=False)
    (old, _), (new, _) = sorted(lake.live_files(lake.table("trajectories")),
                                key=lambda f: lake.files_dataset("trajectories", [f]).to_table(
                                    columns=["finished_at"]).column(0)[0].as_py())
    base = lake.table_uri("trajectories")
    bound = (now - timedelta(hours=1)).isoformat()
    empty = pa.array([], pa.string())
    assert len(engine_dask._read_file((f"{base}/{old}", {}, bound), cfg, empty, None)) == 0
    assert len(engine_dask._read_file((f"{base}/{new}", {}, bound), cfg, empty, None)) == 40
    import pyarrow.parquet as pq

    b = pa.scalar(now - timedelta(hours=1), pa.timestamp("us", tz="UTC"))
    assert engine_dask._row_groups_reaching(pq.ParquetFile(f"{base}/{old}"), "finished_at", b) == []
    # pruned by finished_at's own statistics (list and map columns come before it in the file):
    # rows created long before the bound but finished after it are kept
    late = make_traj(8, seed=12, id_prefix="late-", start=now - timedelta(days=3), with_hash=False)
    late = late.set_column(late.schema.get_field_index("finished_at"), "finished_at",
                           pa.array([now - timedelta(minutes=1)] * 8, late.schema.field("finished_at").type))
    lk2 = Lake(tmp_path / "lk2")
    ingest_table(lk2, late)
    (path, _), = lk2.live_files(lk2.table("trajectories"))
    pf = pq.ParquetFile(f"{lk2.table_uri('trajectories')}/{path}")
    assert engine_dask._row_groups_reaching(pf, "finished_at", b) == [0]
    assert len(engine_dask._read_file((f"{lk2.table_uri('trajectories')}/{path}", {}, bound), cfg, empty,
                                      None)) == 8
