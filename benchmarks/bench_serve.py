"""The front door under load: P producers publishing 100-row batches to the
lake's log, one ``pipeline serve`` committing, vs one ``ingest_table`` call of
the same rows.

Producers are **asyncio tasks** in one process (each with its own NATS
connection and producer id): 8, 32 and 128 of them, beyond the box's process
budget. Each publishes B batches of 100 trajectories one after the other and
waits for each publish ack. The committer is ``pipeline serve`` in its own
process (interval 1 s, the default), as deployed; it and the producers share
the box's cores, as the baseline does. Rows are generated before the start
(not timed).

Figures, per producer count and store (local; moto S3):
- rows/s committed (start -> the lake's transaction covers the last
  acknowledged sequence) vs rows/s of one warm ``ingest_table`` call of the
  same rows on a fresh lake in the same run (validate, stamp, dedupe,
  append: the committer's work): target >= 0.5x at 32 (moonshot 0.8x);
- publish-ack latency p50/p99 (target p99 <= 250 ms at 32);
- ack-to-visible p95: from a batch's ack to the first poll (every 50 ms) at
  which the table's committed transaction covers its sequence (what
  ``pipeline sql`` then sees): target <= 2 s;
- Delta commits per second on the table while serving (<= 1);
- CPU per row: the producer process and the committer process (utime + stime);
- every row exactly once (checked).

    .venv/bin/python benchmarks/run.py --only serve
    BENCH_SERVE_PRODUCERS=8,32 BENCH_SERVE_STORES=local .venv/bin/python benchmarks/run.py --only serve
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from run import Result

ROOT = Path(__file__).resolve().parents[1]
ROWS = 100
TOTAL_BATCHES = 600          # per configuration: B = TOTAL_BATCHES // P batches per producer (at least 2)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _batches(procs: int, per: int, tag: str) -> list[list]:
    from pipeline.testing.trajectories import make_trajectories

    return [[make_trajectories(ROWS, seed=w * 1000 + k, median_len=32, id_prefix=f"{tag}-p{w}-{k}-")
             for k in range(per)] for w in range(procs)]


async def _produce(url: str, stream: str, batches: list[list], go: float) -> tuple[list[float], list[tuple[int, float]]]:
    from pipeline.landing.producer import AsyncProducer

    doors = [await AsyncProducer.connect(url, stream=stream, producer_id=f"bench-{w}") for w in range(len(batches))]
    lat: list[float] = []
    acks: list[tuple[int, float]] = []

    async def one(door, mine) -> None:
        for t in mine:
            t0 = time.perf_counter()
            rep = await door.ingest_table(t)
            t1 = time.perf_counter()
            lat.append(t1 - t0)
            acks.append((rep.last_seq, time.time()))
    await asyncio.sleep(max(0.0, go - time.time()))
    await asyncio.gather(*(one(d, m) for d, m in zip(doors, batches)))
    for d in doors:
        await d.close()
    return lat, acks


def _poll(lake, app: str, stop: threading.Event, out: list[tuple[float, int]]) -> None:
    while not stop.is_set():
        v = lake.transaction_version("trajectories", app) if lake.exists("trajectories") else None
        out.append((time.time(), v or 0))
        time.sleep(0.05)


def _serve_arm(url: str, uri: str, opts: dict | None, procs: int, per: int, tag: str) -> dict:
    from pipeline.lake.delta import Lake
    from pipeline.landing import wire

    stream = f"b{uuid.uuid4().hex[:8]}"
    lake = Lake(uri, storage_options=opts)
    lake.ensure("trajectories")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(opts or {}))
    serve = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "--lake", uri, "--nats", url, "--stream",
                              stream, "--tables", "trajectories"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=env, text=True)
    try:
        batches = _batches(procs, per, tag)
        app = wire.app_id(stream, "trajectories")
        deadline = time.time() + 120
        while not _stream_ready(url, stream):
            if serve.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"pipeline serve did not start: {serve.stderr.read() if serve.stderr else ''}")
            time.sleep(0.1)
        v0 = lake.version("trajectories")
        cpu0, pcpu0 = _cpu_s(serve.pid), time.process_time()
        polls: list[tuple[float, int]] = []
        stop = threading.Event()
        poller = threading.Thread(target=_poll, args=(lake, app, stop, polls), daemon=True)
        go = time.time() + 0.5
        poller.start()
        lat, acks = asyncio.run(_produce(url, stream, batches, go))
        pcpu = time.process_time() - pcpu0
        last = max(s for s, _ in acks)
        while (polls[-1][1] if polls else 0) < last:
            if serve.poll() is not None:
                raise RuntimeError(f"pipeline serve died: {serve.stderr.read() if serve.stderr else ''}")
            time.sleep(0.05)
        stop.set()
        poller.join()
        end = next(t for t, s in polls if s >= last)
        ccpu = _cpu_s(serve.pid) - cpu0
        visible = []
        for seq, at in acks:
            seen = next((t for t, s in polls if s >= seq and t >= at), end)
            visible.append(max(0.0, seen - at))
        commits = lake.version("trajectories") - v0
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    rows = procs * per * ROWS
    import pyarrow.compute as pc

    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0)
    assert len(ids) == rows and pc.count_distinct(ids).as_py() == rows, (len(ids), rows)
    wall = end - go
    return {"wall_s": wall, "rows": rows, "ack_p50_ms": _pct(lat, 0.5) * 1000, "ack_p99_ms": _pct(lat, 0.99) * 1000,
            "visible_p95_s": _pct(visible, 0.95), "commits": commits, "commits_per_s": commits / wall,
            "producer_cpu_us_per_row": pcpu / rows * 1e6, "committer_cpu_us_per_row": ccpu / rows * 1e6}


def _stream_ready(url: str, stream: str) -> bool:
    async def go() -> bool:
        import nats

        nc = await nats.connect(url)
        try:
            await nc.jetstream().stream_info(stream)
            return True
        except Exception:  # noqa: BLE001 - not created yet
            return False
        finally:
            await nc.close()
    return asyncio.run(go())


def _one(uri: str, opts: dict | None, procs: int, per: int, tag: str) -> float:
    """One warm ingest_table call landing every row on a fresh lake."""
    import pyarrow as pa

    from pipeline.ingest import ingest_table
    from pipeline.lake.delta import Lake
    from pipeline.testing.trajectories import make_trajectories

    lake = Lake(uri, storage_options=opts)
    ingest_table(lake, make_trajectories(ROWS, seed=999_999, median_len=32, id_prefix=f"{tag}-warm-"))
    t = pa.concat_tables([b for bs in _batches(procs, per, tag) for b in bs])
    t0 = time.perf_counter()
    rep = ingest_table(lake, t)
    took = time.perf_counter() - t0
    assert rep.landed == t.num_rows, rep
    return took


def run(quick: bool = False) -> dict:
    """The raw measurements of every configuration (``derive`` turns them into the figures)."""
    from pipeline.testing.nats_server import NatsServer

    producers = tuple(int(x) for x in os.environ.get("BENCH_SERVE_PRODUCERS", "8,32,128").split(","))
    stores = tuple(os.environ.get("BENCH_SERVE_STORES", "local,s3").split(","))
    total = 48 if quick else TOTAL_BATCHES
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    srv = NatsServer(work / "js").start()
    raw: dict = {"rows_per_batch": ROWS, "configs": {}}
    moto = None
    try:
        for store in stores:
            opts = None
            if store == "s3":
                import boto3

                from pipeline.testing import moto_server

                moto, endpoint = moto_server.start()
                opts = moto_server.storage_options(endpoint)
                boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                             aws_secret_access_key="testing").create_bucket(Bucket="bench")

            def uri(sub: str) -> str:
                return str(work / sub) if store == "local" else f"s3://bench/{sub}"

            for procs in producers:
                per = max(2, total // procs)
                tag = f"{store}-{procs}"
                out = _serve_arm(srv.url, uri(f"serve-{tag}"), opts, procs, per, tag)
                one = _one(uri(f"one-{tag}"), opts, procs, per, tag)
                raw["configs"][tag] = out | {"store": store, "producers": procs, "one_s": one,
                                             "batches_per_producer": per}
                rows = out["rows"]
                print(f"   {store} {procs} producers: {rows / out['wall_s']:,.0f} rows/s committed vs "
                      f"{rows / one:,.0f} one ingest_table; ack p50 {out['ack_p50_ms']:.1f} ms "
                      f"p99 {out['ack_p99_ms']:.1f} ms; visible p95 {out['visible_p95_s']:.2f} s; "
                      f"{out['commits_per_s']:.2f} commits/s; CPU/row producer "
                      f"{out['producer_cpu_us_per_row']:.0f} us, committer {out['committer_cpu_us_per_row']:.0f} us",
                      flush=True)
    finally:
        srv.stop()
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return raw


ACK_P99_BUDGET_MS = 250.0     # the target at 32 producers (Zerobus: ~150 ms)
VISIBLE_P95_BUDGET_S = 2.0    # ack -> visible in `pipeline sql` (Zerobus: ~5 s)


def derive(raw: dict) -> list[Result]:
    """Four figures per configuration: rows/s against one ingest_table of the same rows (>= 0.5x), the publish
    ack's p99 and the ack-to-visible p95 against their budgets (<= 1), and Delta commits per second (<= 1)."""
    out: list[Result] = []
    for c in raw["configs"].values():
        rows, per, store, procs = c["rows"], c["batches_per_producer"], c["store"], c["producers"]
        where = f"{procs} producers x {per} x {raw['rows_per_batch']}-row batches, {store}"
        served, one = rows / c["wall_s"], rows / c["one_s"]
        cpu = (f"CPU per row: producer {c['producer_cpu_us_per_row']:.0f} us, committer "
               f"{c['committer_cpu_us_per_row']:.0f} us; every row exactly once (checked)")
        out += [
            Result(f"front door {where}: rows/s committed / one ingest_table of the same rows", served / one, 0.5,
                   f"{served:,.0f} rows/s", f"{one:,.0f} rows/s", higher_is_better=True,
                   note=f"moonshot 0.8; {cpu}", possible=(0.0, None)),
            Result(f"front door {where}: publish-ack p99 / {ACK_P99_BUDGET_MS:.0f} ms",
                   c["ack_p99_ms"] / ACK_P99_BUDGET_MS, 1.0, f"p99 {c['ack_p99_ms']:.1f} ms (p50 {c['ack_p50_ms']:.1f})",
                   f"{ACK_P99_BUDGET_MS:.0f} ms", possible=(0.0, None)),
            Result(f"front door {where}: ack-to-visible p95 / {VISIBLE_P95_BUDGET_S:.0f} s",
                   c["visible_p95_s"] / VISIBLE_P95_BUDGET_S, 1.0, f"p95 {c['visible_p95_s']:.2f} s",
                   f"{VISIBLE_P95_BUDGET_S:.0f} s", note="a burst: every batch is published within a few seconds, "
                   "so this is the backlog draining, not a steady fleet's latency", possible=(0.0, None)),
            Result(f"front door {where}: Delta commits per second on the table", c["commits_per_s"], 1.0,
                   f"{c['commits_per_s']:.2f} commits/s", "1 commit/s", possible=(0.0, None)),
        ]
    return out


if __name__ == "__main__":
    for r in derive(run("--quick" in sys.argv)):
        print(f"{r.name}: {r.ratio:.3f} (target {r.target}) {r.measured} | {r.baseline} {r.note}")
