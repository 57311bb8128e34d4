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

Two arms. **Burst** (every producer publishes all its batches as fast as acks
come back: the committer's capacity; its ack-to-visible figure is mostly the
backlog draining) and **steady** (32 producers, each publishing one batch
every T seconds from a jittered start for about 24 s, T chosen so the offered
load is half the rows/s the committer sustained in the 32-producer burst just
before on the same store: the latency a fleet sees; the issue's fleet is 500
workers shipping every 10 s, 50 batches/s: a second steady arm offers
exactly that, 5,000 rows/s, from the same 32 producers).

Burst figures, per producer count and store (local; moto S3):
- rows/s committed (start -> the lake's transaction covers the last
  acknowledged sequence) vs rows/s of one warm ``ingest_table`` call of the
  same rows on a fresh lake in the same run (validate, stamp, dedupe,
  append: the committer's work): target >= 0.5x at 32 (moonshot 0.8x);
- publish-ack latency p50/p99 (target p99 <= 250 ms at 32);
- ack-to-visible p95: from a batch's ack to the first poll (every 50 ms) at
  which the table's committed transaction covers its sequence (what
  ``pipeline sql`` then sees): target <= 2 s;
- Delta commits per second on the table while serving (<= 1): (N - 1) / the
  time between the first and the last of its N commits (log timestamps);
- CPU per row: the producer process and the committer process (utime + stime);
- every row exactly once (checked).

Steady figures, per store: publish-ack p50/p99, ack-to-visible p50/p95 (the
same poller), Delta commits per second, every row exactly once (checked).

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
STEADY_PRODUCERS = 32       # the steady arm: this many producers, each one batch per period ...
STEADY_SHARE = 0.5           # ... offering this share of the committer's burst capacity measured in the same run
STEADY_S = 24.0              # ... for about this long
FLEET_ROWS_S = 5000.0        # ... and a second time offering the fleet: 500 workers x 100 rows every 10 s
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


async def _produce(url: str, stream: str, batches: list[list], go: float,
                   period: float | None = None) -> tuple[list[float], list[tuple[int, float]]]:
    """Burst (``period`` None): each producer publishes its batches back to back. Steady: producer w publishes
    its k-th batch at ``go + jitter_w + k * period`` (jitter uniform in [0, period), seeded), or at once if late."""
    import random

    from pipeline.landing.producer import AsyncProducer

    doors = [await AsyncProducer.connect(url, stream=stream, producer_id=f"bench-{w}") for w in range(len(batches))]
    lat: list[float] = []
    acks: list[tuple[int, float]] = []
    rng = random.Random(37)
    starts = [go + (rng.uniform(0.0, period) if period else 0.0) for _ in batches]

    async def one(door, mine, start: float) -> None:
        for k, t in enumerate(mine):
            if period:
                await asyncio.sleep(max(0.0, start + k * period - time.time()))
            t0 = time.perf_counter()
            rep = await door.ingest_table(t)
            t1 = time.perf_counter()
            lat.append(t1 - t0)
            acks.append((rep.last_seq, time.time()))
    await asyncio.sleep(max(0.0, go - time.time()))
    await asyncio.gather(*(one(d, m, s0) for d, m, s0 in zip(doors, batches, starts)))
    for d in doors:
        await d.close()
    return lat, acks


def _poll(lake, app: str, stop: threading.Event, out: list[tuple[float, int]]) -> None:
    while not stop.is_set():
        v = lake.transaction_version("trajectories", app) if lake.exists("trajectories") else None
        out.append((time.time(), v or 0))
        time.sleep(0.05)


def _serve_arm(url: str, uri: str, opts: dict | None, procs: int, per: int, tag: str,
               period: float | None = None) -> dict:
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
        lat, acks = asyncio.run(_produce(url, stream, batches, go, period))
        sent = time.time() - go
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
        stamps = sorted(h["timestamp"] / 1000 for h in lake.history("trajectories", limit=commits + 1)
                        if h.get("version", -1) > v0)
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    rows = procs * per * ROWS
    import pyarrow.compute as pc

    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0)
    assert len(ids) == rows and pc.count_distinct(ids).as_py() == rows, (len(ids), rows)
    wall = end - go
    return {"wall_s": wall, "rows": rows, "ack_p50_ms": _pct(lat, 0.5) * 1000, "ack_p99_ms": _pct(lat, 0.99) * 1000,
            "visible_p50_s": _pct(visible, 0.5), "visible_p95_s": _pct(visible, 0.95), "publish_s": sent,
            "commits": commits,
            # the rate between the first and the last commit (their log timestamps): commits / wall would count
            # the edges (a run of N commits one second apart spans N - 1 seconds)
            "commit_span_s": stamps[-1] - stamps[0] if stamps else 0.0,
            "commits_per_s": (commits - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0]
            else commits / wall,
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


def _steady(url: str, uri: str, opts: dict | None, store: str, burst: dict, offered: float | None, *,
            duration: float) -> dict:
    """A steady arm: STEADY_PRODUCERS producers, each publishing one batch every ``period`` seconds for
    ``duration`` seconds, offering ``offered`` rows/s (None: STEADY_SHARE of the committer's burst capacity
    measured just before on the same store, the rows/s committed in the burst)."""
    capacity = burst["rows"] / burst["wall_s"]
    period = STEADY_PRODUCERS * ROWS / (offered or STEADY_SHARE * capacity)
    per = max(2, int(duration / period))
    out = _serve_arm(url, uri, opts, STEADY_PRODUCERS, per, uri.rsplit('/', 1)[-1], period=period)
    print(f"   {store} steady, {STEADY_PRODUCERS} producers x 1 batch / {period:.2f} s for {per * period:.0f} s "
          f"({STEADY_PRODUCERS * ROWS / period:,.0f} rows/s offered, {STEADY_PRODUCERS * ROWS / period / capacity:.0%} of the burst's "
          f"{capacity:,.0f}): ack p50 {out['ack_p50_ms']:.1f} ms p99 {out['ack_p99_ms']:.1f} ms; visible p50 "
          f"{out['visible_p50_s']:.2f} s p95 {out['visible_p95_s']:.2f} s; {out['commits_per_s']:.2f} commits/s",
          flush=True)
    return out | {"store": store, "producers": STEADY_PRODUCERS, "period_s": period, "batches_per_producer": per,
                  "burst_rows_per_s": capacity, "offered_rows_per_s": STEADY_PRODUCERS * ROWS / period,
                  "fleet": offered is not None}


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
            burst = raw["configs"][f"{store}-{STEADY_PRODUCERS if STEADY_PRODUCERS in producers else procs}"]
            for label, offered in (("half", None), ("fleet", FLEET_ROWS_S)):
                raw.setdefault("steady", {})[f"{store}-{label}"] = _steady(
                    srv.url, uri(f"steady-{label}-{store}"), opts, store, burst, offered,
                    duration=8.0 if quick else STEADY_S)
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
    """Burst, per configuration: rows/s against one ingest_table of the same rows (>= 0.5x), the publish ack's p99
    and the ack-to-visible p95 against their budgets (<= 1; in a burst the latter is the backlog draining), and
    Delta commits per second (<= 1). Steady, per store: the publish ack's p99 and the ack-to-visible p95 against
    their budgets (a fleet's latency) and Delta commits per second."""
    out: list[Result] = []
    for c in raw["configs"].values():
        rows, per, store, procs = c["rows"], c["batches_per_producer"], c["store"], c["producers"]
        where = f"burst, {procs} producers x {per} x {raw['rows_per_batch']}-row batches back to back, {store}"
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
            Result(f"front door {where}: ack-to-visible p95 / {VISIBLE_P95_BUDGET_S:.0f} s (backlog draining)",
                   c["visible_p95_s"] / VISIBLE_P95_BUDGET_S, 1.0, f"p95 {c['visible_p95_s']:.2f} s",
                   f"{VISIBLE_P95_BUDGET_S:.0f} s", note="a burst: every batch is published within a few seconds, "
                   "so this is the backlog draining, not a steady fleet's latency (see the steady rows)",
                   possible=(0.0, None)),
            Result(f"front door {where}: Delta commits per second on the table", c["commits_per_s"], 1.0,
                   f"{c['commits_per_s']:.2f} commits/s ({c['commits']} commits in {c.get('commit_span_s', 0):.1f} s)",
                   "1 commit/s", possible=(0.0, None)),
        ]
    for c in raw.get("steady", {}).values():
        where = (f"steady, {c['producers']} producers x 1 {raw['rows_per_batch']}-row batch every "
                 f"{c['period_s']:.2f} s for {c['publish_s']:.0f} s, {c['store']}")
        load = (f"offered {c['offered_rows_per_s']:,.0f} rows/s = {c['offered_rows_per_s'] / c['burst_rows_per_s']:.0%}"
                f" of the burst's {c['burst_rows_per_s']:,.0f} rows/s committed in the same run"
                f"{' (the issue fleet: 500 workers x 100 rows every 10 s)' if c.get('fleet') else ''}; a fleet's "
                f"latency; every row exactly once (checked)")
        out += [
            Result(f"front door {where}: publish-ack p99 / {ACK_P99_BUDGET_MS:.0f} ms",
                   c["ack_p99_ms"] / ACK_P99_BUDGET_MS, 1.0, f"p99 {c['ack_p99_ms']:.1f} ms (p50 {c['ack_p50_ms']:.1f})",
                   f"{ACK_P99_BUDGET_MS:.0f} ms", note=load, possible=(0.0, None)),
            Result(f"front door {where}: ack-to-visible p95 / {VISIBLE_P95_BUDGET_S:.0f} s (a fleet's latency)",
                   c["visible_p95_s"] / VISIBLE_P95_BUDGET_S, 1.0,
                   f"p95 {c['visible_p95_s']:.2f} s (p50 {c['visible_p50_s']:.2f})", f"{VISIBLE_P95_BUDGET_S:.0f} s",
                   note=f"{load}; Zerobus quotes ~5 s to the table", possible=(0.0, None)),
            Result(f"front door {where}: Delta commits per second on the table", c["commits_per_s"], 1.0,
                   f"{c['commits_per_s']:.2f} commits/s ({c['commits']} commits in {c['commit_span_s']:.1f} s)",
                   "1 commit/s", note=load, possible=(0.0, None)),
        ]
    return out


if __name__ == "__main__":
    for r in derive(run("--quick" in sys.argv)):
        print(f"{r.name}: {r.ratio:.3f} (target {r.target}) {r.measured} | {r.baseline} {r.note}")
