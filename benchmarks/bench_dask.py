"""Dask admission on a 2-worker cluster vs DuckDB on one machine, at growing sizes.

    .venv/bin/python benchmarks/run.py --only dask            # 20k, 50k, 100k trajectories (env BENCH_DASK_SIZES)
    .venv/bin/python benchmarks/run.py --only dask --quick    # 6k (smoke)

Both engines make the same decisions (``admit(dry_run=True)`` up to the
receipts; tests/admission/test_engines.py checks they are equal) over the
lake bench_admission builds (short responses here: the decision columns are
scalars and per-token policy versions). The cluster is a real one, started
once and kept running as a deployment would keep it (a ``dask scheduler`` and
two ``dask worker`` processes, 1 thread each); its start-up is not timed.
Engines alternate, best of ``reps``; the figure is dask / duckdb wall time, so
below 1.0 means the cluster wins. On one machine the workers share the same
cores and disk as DuckDB's threads would, plus serialization and a shuffle:
expect it to lose here; the cluster pays off only when workers bring cores
and I/O bandwidth the driver machine does not have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import Result

HERE = Path(__file__).resolve().parent


def _start_cluster(tmp: Path, n_workers: int = 2) -> tuple[str, list[subprocess.Popen]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    f = tmp / "scheduler.json"
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--scheduler-file", str(f),
                               "--host", "127.0.0.1", "--port", "0", "--no-dashboard"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    while not f.exists() or not f.read_text().strip():
        time.sleep(0.1)
    addr = json.loads(f.read_text())["address"]
    for i in range(n_workers):
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", addr, "--nthreads", "1",
                                       "--no-dashboard", "--name", f"bench-{i}"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    from distributed import Client

    with Client(addr, timeout=60) as c:
        c.wait_for_workers(n_workers, timeout=120)
    return addr, procs


def run(quick: bool = False) -> list[Result]:
    sys.path.insert(0, str(HERE))
    from bench_admission import build

    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.lake.delta import Lake

    sizes = [6_000] if quick else [int(s) for s in os.environ.get("BENCH_DASK_SIZES", "20000,50000,100000").split(",")]
    reps = 1 if quick else 2
    cfg = AdmissionConfig(quality=False, batch_rows=16384)
    tmp = Path(tempfile.mkdtemp(prefix="bench-dask-"))
    addr, procs = _start_cluster(tmp)
    results = []
    try:
        for n in sizes:
            t0 = time.perf_counter()
            lake = Lake(build(n, 100))
            print(f"   lake of {n:,} ready in {time.perf_counter() - t0:.0f}s", flush=True)
            best: dict[str, float] = {}
            counts: dict[str, dict] = {}
            for rep in range(reps):
                order = ("duckdb", "dask") if rep % 2 == 0 else ("dask", "duckdb")
                for engine in order:
                    t1 = time.perf_counter()
                    r = admit(lake, cfg, current_policy_version=2, dry_run=True, engine=engine,
                              dask_scheduler=addr if engine == "dask" else None)
                    s = time.perf_counter() - t1
                    best[engine] = min(best.get(engine, s), s)
                    counts[engine] = r.counts
                    print(f"   {n:,} {engine}: {s:.1f}s", flush=True)
            if counts["dask"] != counts["duckdb"]:
                raise AssertionError(f"engines disagree at {n}: {counts}")
            ratio = best["dask"] / best["duckdb"]
            results.append(Result(
                f"admission {n // 1000}k: dask on 2 workers / duckdb", ratio, None,
                f"{best['dask']:.1f} s", f"{best['duckdb']:.1f} s",
                note="cluster wins" if ratio < 1 else "duckdb wins on one machine",
                raw={"trajectories": n, "best_s": best, "counts": counts["duckdb"], "reps": reps}))
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return results
