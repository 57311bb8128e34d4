"""Cost that grows with new data, not with history.

(a) `pipeline ingest` and `pipeline admit` (default config: quality suites on)
    of the same-shaped 5k new trajectories on an empty lake (its tables created,
    no rows, so table creation is not counted) vs on a lake already
    holding N admitted trajectories (N = 1M; compacted as `lake maintain`
    leaves it). Target: <= 1.2x each. The two lakes are measured alternately,
    each repetition with fresh ids; the best of the repetitions is reported.
(c) the same for the Dask engine: another 5k new trajectories admitted with
    ``engine="dask"`` on a 2-worker cluster (started once, not timed), on both
    lakes. Incremental reads make it follow the new rows, not the history:
    target <= 1.2x.
(Many writers landing small batches at once: benchmarks/bench_writers.py.)

    .venv/bin/python benchmarks/run.py --only history            # N = 1M (env BENCH_HISTORY_N; reps BENCH_HISTORY_REPS)
    .venv/bin/python benchmarks/bench_history.py --existing 200000
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq

from run import Result

NEW = 5_000
CHUNK = 100_000


def _batch(n: int, seed: int, prefix: str, start: datetime):
    from pipeline.testing.trajectories import make_trajectories

    return make_trajectories(n, seed=seed, median_len=32, sigma=0.5, max_len=512, prompt_len=32,
                             id_prefix=prefix, group_size=8, start=start, run_id=f"run-{seed % 4}")


def _build_history(lake, n: int) -> None:
    """N trajectories landed in 100k appends, admitted, then compacted."""
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.landing.ingest import stamp_derived
    from pipeline.maintain import maintain

    start = datetime(2026, 10, 1, tzinfo=timezone.utc)
    for k in range(0, n, CHUNK):
        t = _batch(min(CHUNK, n - k), 1000 + k // CHUNK, f"h{k // CHUNK}-", start + timedelta(hours=k // CHUNK))
        lake.append("trajectories", stamp_derived(t, f"history-{k}"), command="bench", app_id="history",
                    txn_version=k // CHUNK)
    admit(lake, AdmissionConfig(quality=False), current_policy_version=0)
    maintain(lake)


def _dask_admit(lake, root: Path, rep: int, tag: str, address: str) -> float:
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.ingest import ingest_files

    path = root / f"dask-{tag}-{rep}.parquet"
    pq.write_table(_batch(NEW, 70 + rep, f"d{tag}{rep}-", datetime.now(timezone.utc) - timedelta(hours=2)), path)
    assert ingest_files(lake, [path]).landed == NEW
    t0 = time.perf_counter()
    a = admit(lake, AdmissionConfig(), current_policy_version=0, engine="dask", dask_scheduler=address)
    dt = time.perf_counter() - t0
    assert a.quality["candidate_rows"] == NEW, a.quality   # incremental: only the new rows were read
    return dt


def _ingest_and_admit(lake, root: Path, rep: int, tag: str) -> tuple[float, float]:
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.ingest import ingest_files

    path = root / f"new-{tag}-{rep}.parquet"
    pq.write_table(_batch(NEW, 7 + rep, f"n{tag}{rep}-", datetime.now(timezone.utc) - timedelta(hours=2)), path)
    t0 = time.perf_counter()
    r = ingest_files(lake, [path])
    t1 = time.perf_counter()
    a = admit(lake, AdmissionConfig(), current_policy_version=0)
    t2 = time.perf_counter()
    assert r.landed == NEW, r
    assert a.admitted_members + sum(v for k, v in a.counts.items() if k != "admit") > 0, a.counts
    return t1 - t0, t2 - t1


def run(quick: bool = False, existing: int | None = None) -> list[Result]:
    from pipeline.lake.delta import Lake

    n = existing or (100_000 if quick else int(os.environ.get("BENCH_HISTORY_N", 1_000_000)))
    reps = 2 if quick else int(os.environ.get("BENCH_HISTORY_REPS", 5))
    root = Path(tempfile.mkdtemp(prefix="bench-history-"))
    try:
        big = Lake(root / "big")
        t0 = time.perf_counter()
        _build_history(big, n)
        print(f"   history of {n:,} admitted trajectories built in {time.perf_counter() - t0:.0f}s "
              f"({big.file_count('trajectories')} files)", flush=True)
        times: dict[str, list[tuple[float, float]]] = {"empty": [], "big": []}
        dask_times: dict[str, list[float]] = {"empty": [], "big": []}
        from bench_dask import _start_cluster

        address, cluster = _start_cluster(root)
        for rep in range(reps):
            order = ["empty", "big"] if rep % 2 == 0 else ["big", "empty"]
            for which in order:
                if which == "empty":  # tables created, no rows: the ratio measures history, not creation
                    lake = Lake(root / f"empty-{rep}")
                    for t in ("trajectories", "quarantine", "receipts", "snapshots", "snapshot_members"):
                        lake.ensure(t)
                else:
                    lake = big
                times[which].append(_ingest_and_admit(lake, root, rep, which))
                if which == "empty":   # a fresh empty lake for the Dask figure too
                    lake = Lake(root / f"empty-dask-{rep}")
                    for t in ("trajectories", "quarantine", "receipts", "snapshots", "snapshot_members"):
                        lake.ensure(t)
                dask_times[which].append(_dask_admit(lake, root, rep, which, address))
        for proc in cluster:
            proc.terminate()
            proc.wait(timeout=60)
        ing = {k: min(t[0] for t in v) for k, v in times.items()}
        dsk = {k: min(v) for k, v in dask_times.items()}
        adm = {k: min(t[1] for t in v) for k, v in times.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    raw = {"history_rows": n, "new_rows": NEW, "reps": reps,
           "ingest_s": {k: [t[0] for t in v] for k, v in times.items()},
           "admit_s": {k: [t[1] for t in v] for k, v in times.items()},
           "dask_admit_s": dask_times}
    return [
        Result(f"ingest 5k new on {n:,}-row lake / on empty lake", ing["big"] / ing["empty"], 1.2,
               f"{ing['big']:.2f} s", f"{ing['empty']:.2f} s", raw=raw),
        Result(f"admit 5k new on {n:,}-row lake / on empty lake", adm["big"] / adm["empty"], 1.2,
               f"{adm['big']:.2f} s", f"{adm['empty']:.2f} s", note="quality suites on (the default)"),
        Result(f"dask admit 5k new on {n:,}-row lake / on empty lake", dsk["big"] / dsk["empty"], 1.2,
               f"{dsk['big']:.2f} s", f"{dsk['empty']:.2f} s",
               note="incremental: reads only the files added since the last admission; 2 workers"),
    ]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--existing", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    for r in run(a.quick, a.existing):
        print(f"{r.name}: {r.ratio:.2f} (target {r.target}) {r.measured} | {r.baseline} {r.note}")
