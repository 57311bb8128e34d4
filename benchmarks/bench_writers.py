"""Many small writers: group commit vs one append of the same rows.

P writer processes (8 and 32) each land B batches of 100 trajectories one after
the other, all at once, on one lake (local, and S3 on a moto server). The
figure is their rows/s against one process landing the same rows in one
append: target >= 0.5x (moonshot 0.8x). The same P writers with group commit
off (``PIPELINE_GROUP_COMMIT=0``: every append commits alone, serialised by
``pipeline.keys``) are measured in the same run, arms alternated (local: best
of 2; S3: one run each, and the alone arm only up to 8 writers: on moto, one
Python process serving every request, it takes minutes at 8 and would take
over an hour at 32).

Writers are resident, like rollout workers: each lands one warm-up batch before
the start signal (imports, first table load and key read are not timed), and
each reports the wall-clock times of its first and last append; a run's time is
last end minus the start signal (process start and exit are not counted). The
one-append baseline is warm too (one warm-up append first). Every run checks
every row landed exactly once.

    .venv/bin/python benchmarks/run.py --only writers
    .venv/bin/python benchmarks/bench_writers.py --procs 8 --stores local
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import Result

ROOT = Path(__file__).resolve().parents[1]
ROWS = 100
# Appends committing alone on the moto server (one Python process serving every request) slow down
# with the square of the writers: measured up to this many.
S3_ALONE_MAX_PROCS = 8

WRITER = f"""
import json, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from pipeline.lake.delta import Lake
from pipeline.landing.ingest import stamp_derived
from pipeline.testing.trajectories import make_trajectories
lake = Lake(sys.argv[1]); w = int(sys.argv[2]); start = sys.argv[3]; batches = int(sys.argv[4]); tag = sys.argv[5]
def batch(k):
    return stamp_derived(make_trajectories({ROWS}, seed=w * 1000 + k, median_len=32, id_prefix=f"{{tag}}-w{{w}}-{{k}}-"), "w")
tables = [batch(k) for k in range(batches + 1)]
lake.append("trajectories", tables[0], command="bench writer", app_id=f"{{tag}}-w{{w}}", txn_version=0)  # warm-up
open(start + f".ready-{{w}}", "w").close()
while not os.path.exists(start): time.sleep(0.0005)
t0 = time.time(); c0 = time.process_time()
for k in range(1, batches + 1):
    r = lake.append("trajectories", tables[k], command="bench writer", app_id=f"{{tag}}-w{{w}}", txn_version=k)
    assert r.landed and r.rows == {ROWS}, r
print(json.dumps({{"first": t0, "last": time.time(), "cpu_s": time.process_time() - c0}}), flush=True)
os._exit(0)
"""


def _env(store: dict | None, group: bool) -> dict:
    env = dict(os.environ, PIPELINE_GROUP_COMMIT="1" if group else "0", OMP_NUM_THREADS="1")
    env.update(store or {})
    return env


def _many(uri: str, store: dict | None, procs: int, batches: int, group: bool, tag: str, work: Path) -> dict:
    start = work / f"go-{tag}"
    ps = [subprocess.Popen([sys.executable, "-c", WRITER, uri, str(w), str(start), str(batches), tag],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(store, group))
          for w in range(procs)]
    deadline = time.time() + 600
    while len(list(work.glob(f"go-{tag}.ready-*"))) < procs:
        if any(p.poll() is not None for p in ps):
            raise RuntimeError("a writer died: " + "".join(p.communicate()[1][-2000:] for p in ps if p.poll()))
        if time.time() > deadline:
            raise RuntimeError("the writers did not get ready")
        time.sleep(0.01)
    time.sleep(0.5)     # let the ready processes settle on their polling loop
    t_go = time.time()
    start.write_text("go")
    ends, cpu = [], 0.0
    for p in ps:
        out, err = p.communicate(timeout=1200)
        if p.returncode != 0:
            raise RuntimeError(f"a writer failed: {err[-3000:]}")
        done = json.loads(out.strip().splitlines()[-1])
        ends.append(done["last"])
        cpu += done["cpu_s"]
    # the writers' CPU seconds per append (process_time counts delta-rs's and Arrow's threads too)
    return {"wall_s": max(ends) - t_go, "cpu_per_append_s": cpu / (procs * batches)}


def _one(lake_factory, store: dict | None, procs: int, batches: int, tag: str) -> float:
    """One warm process landing every row of the P x B batches in one append."""
    import pyarrow as pa

    from pipeline.landing.ingest import stamp_derived
    from pipeline.testing.trajectories import make_trajectories

    lake = lake_factory(f"one-{tag}")
    lake.ensure("trajectories")
    warm = stamp_derived(make_trajectories(ROWS, seed=999_999, median_len=32, id_prefix=f"{tag}-warm-"), "w")
    lake.append("trajectories", warm, command="bench one", app_id=f"{tag}-warm")
    t = pa.concat_tables([stamp_derived(make_trajectories(ROWS, seed=w * 1000 + k, median_len=32,
                                                          id_prefix=f"{tag}-w{w}-{k}-"), "w")
                          for w in range(procs) for k in range(1, batches + 1)])
    t0 = time.perf_counter()
    r = lake.append("trajectories", t, command="bench one", app_id=f"{tag}-one")
    took = time.perf_counter() - t0
    assert r.rows == t.num_rows
    return took


def _check_once(lake, expected: int) -> int:
    import pyarrow.compute as pc

    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0)
    assert len(ids) == expected and pc.count_distinct(ids).as_py() == expected, (len(ids), expected)
    return lake.version("trajectories")


def _moto() -> tuple[subprocess.Popen, dict]:
    from pipeline.testing import moto_server

    proc, endpoint = moto_server.start()
    return proc, moto_server.storage_options(endpoint)


def run(quick: bool = False, procs_list: tuple[int, ...] = (8, 32), stores: tuple[str, ...] = ("local", "s3"),
        batches: int | None = None) -> list[Result]:
    from pipeline.lake.delta import Lake

    batches = batches or (2 if quick else 5)
    work = Path(tempfile.mkdtemp(prefix="bench-writers-"))
    results, raw = [], {}
    moto = None
    try:
        for store in stores:
            opts = None
            if store == "s3":
                import boto3

                moto, opts = _moto()
                boto3.client("s3", endpoint_url=opts["AWS_ENDPOINT_URL"], region_name="us-east-1",
                             aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="bench")

            def factory(sub: str) -> Lake:
                if store == "local":
                    return Lake(work / sub)
                return Lake(f"s3://bench/{sub}", storage_options=opts)

            for procs in procs_list:
                runs: dict[str, list[float]] = {"group": [], "alone": []}
                cpu: dict[str, list[float]] = {"group": [], "alone": []}
                commits: dict[str, list[int]] = {"group": [], "alone": []}
                one = []
                reps = 1 if quick or store == "s3" else 2
                for rep, order in enumerate([("group", "alone"), ("alone", "group")][:reps]):
                    for arm in order:
                        if arm == "alone" and store == "s3" and procs > S3_ALONE_MAX_PROCS:
                            continue
                        tag = f"{store}-{procs}-{arm}-{rep}"
                        lake = factory(tag)
                        lake.ensure("trajectories")
                        out = _many(lake.uri, opts, procs, batches, arm == "group", tag, work)
                        version = _check_once(lake, procs * (batches + 1) * ROWS)
                        runs[arm].append(out["wall_s"])
                        cpu[arm].append(out["cpu_per_append_s"])
                        commits[arm].append(version)
                        print(f"   {store} {procs} writers, {arm}: {out['wall_s']:.2f} s, table version {version}, "
                              f"{out['cpu_per_append_s'] * 1000:.0f} ms CPU per append", flush=True)
                    one.append(_one(factory, opts, procs, batches, f"{store}-{procs}-{rep}"))
                g, o = min(runs["group"]), min(one)
                a = min(runs["alone"]) if runs["alone"] else None
                rows = procs * batches * ROWS
                alone = (f"each commit alone: {o / a:.3f}x ({rows / a:,.0f} rows/s)" if a
                         else f"each commit alone: not measured on moto past {S3_ALONE_MAX_PROCS} writers "
                              "(its 8-writer run took minutes; this one would take over an hour)")
                raw[f"{store}-{procs}"] = {"group_s": runs["group"], "alone_s": runs["alone"], "one_s": one,
                                           "table_versions": commits, "cpu_per_append_s": cpu, "rows": rows,
                                           "batches": batches}
                results.append(Result(
                    f"{procs} writers x {batches} x {ROWS}-row appends / 1 append, {store} (rows/s)", o / g, 0.5,
                    f"{rows / g:,.0f} rows/s", f"{rows / o:,.0f} rows/s", higher_is_better=True,
                    note=f"group commit (moonshot 0.8); {alone}"))
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    if results:
        results[0].raw = raw
    return results


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--procs", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--stores", nargs="+", default=["local", "s3"])
    ap.add_argument("--batches", type=int, default=None)
    a = ap.parse_args()
    for r in run(a.quick, tuple(a.procs), tuple(a.stores), a.batches):
        print(f"{r.name}: {r.ratio:.3f} (target {r.target}) {r.measured} | {r.baseline} {r.note}")
