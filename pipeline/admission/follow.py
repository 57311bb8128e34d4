"""Resident admission: ``pipeline admit --follow --interval S`` in one process.

    pipeline admit --follow --interval 10 --json       # one JSON line per pass that decided groups
    pipeline admit --follow --interval 5 --max-idle-seconds 30 --max-seconds 1500   # the admission job

Each pass is one ordinary :func:`pipeline.admission.run.admit` (the same
receipts guard, the same snapshot-per-id publication, so two admitters, resident
or not, still decide every group exactly once: docs/write-protocol.md). What the
resident process saves is what a fresh ``pipeline admit`` pays before it
decides anything: the imports (DuckDB, great-expectations, OpenLineage) and the
great-expectations suites, built once here (:func:`pipeline.quality.gx.prepare`)
so each pass costs only their validation.

A pass runs when the trajectories or receipts table moved since the previous
one, or when the previous pass left groups pending (they may time out without
new data). Groups are admitted as they complete: a group's last member landing
makes it ready for the next pass. Each pass reports, for the groups it decided
whose last member landed since the previous pass, the latency from that
member's commit (its trajectories commit timestamp) to the end of the pass (the
snapshot and the receipts committed).

The admission job (jobs/admission.yaml) runs it with ``--max-seconds`` under
its timeout and ``--max-idle-seconds``: the next scheduled start, held off by
the job's lease while one runs, takes over when it ends.

SIGTERM or SIGINT ends the loop after the current pass (never inside one: a
pass is either committed whole or, killed harder, left to the next run as every
admission is).
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.admission.config import AdmissionConfig

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

    from pipeline.admission.run import AdmissionResult


FIRST_PASS_LOOKBACK = 100   # trajectories commits a first pass looks back for landing times, at most


@dataclass
class PassReport:
    """One pass of the resident loop."""

    n: int                                   # pass number, from 1
    result: AdmissionResult
    wall_s: float
    pending_rows: int                        # candidate rows of groups left undecided
    latency_s: dict[str, float | int] = field(default_factory=dict)   # last member landed -> snapshot

    def as_dict(self) -> dict[str, Any]:
        d = self.result.as_dict()
        d.update({"pass": self.n, "pass_wall_s": round(self.wall_s, 4), "pending_rows": self.pending_rows,
                  "latency_s": self.latency_s})
        return d


class StopFlag:
    """Set by SIGTERM / SIGINT (or by a caller); the loop checks it between passes."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: str | None = None

    def install(self) -> None:
        def handler(signum, frame):  # noqa: ARG001 - the signal module's signature
            self.signal = signal.Signals(signum).name
            self.event.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def __bool__(self) -> bool:
        return self.event.is_set()


def landing_times(lake: Lake, since: int | None, version: int) -> dict[int, float]:
    """{trajectories version: commit time (epoch seconds)} of the commits in
    (``since``, ``version``] that added rows (compactions and migrations,
    ``dataChange=false``, land nothing)."""
    out: dict[int, float] = {}
    for v in range((since if since is not None else -1) + 1, version + 1):
        entries = lake.log_entries("trajectories", v) or []
        if not any("add" in e and e["add"].get("dataChange", True) for e in entries):
            continue
        info: dict[str, Any] = next((e["commitInfo"] for e in entries if "commitInfo" in e), {})
        if "timestamp" in info:
            out[v] = float(info["timestamp"]) / 1000.0
    return out


def last_landing(lake: Lake, since: int | None, version: int, group_ids: pa.Array) -> dict[str, float]:
    """{group_id: commit time of its newest member} for the groups in ``group_ids``
    with a member landed by a commit in (``since``, ``version``]: the group_id
    column of just those commits' files."""
    from urllib.parse import unquote

    times = landing_times(lake, since, version)
    if not times or len(group_ids) == 0:
        return {}
    dt = lake.table("trajectories", version)
    live = {unquote(p): pv for p, pv in lake.live_files(dt)}
    out: dict[str, float] = {}
    for v, ts in times.items():
        files = [(p, live[p]) for p in (unquote(e["add"]["path"]) for e in lake.log_entries("trajectories", v) or []
                                        if "add" in e) if p in live]
        if not files:
            continue  # compacted since: those rows now sit in a file a later commit added
        t = lake.files_dataset("trajectories", files).to_table(columns=["group_id"])
        for g in pc.unique(t.filter(pc.is_in(t.column("group_id"), value_set=group_ids)).column("group_id")).to_pylist():
            out[g] = max(out.get(g, 0.0), ts)
    return out


def _latency(lake: Lake, since: int | None, result: AdmissionResult, done_at: float) -> dict[str, float | int]:
    if result.dry_run or not result.receipts.num_rows:
        return {}
    tv = result.source_versions.get("trajectories")
    if tv is None:
        return {}
    if since is None:  # the first pass: commits after the previous admission's recorded read
        from pipeline.admission.run import previous_state

        prev = previous_state(lake, int(result.source_versions.get("receipts", -1)))
        since = prev[0] if prev is not None else max(-1, tv - FIRST_PASS_LOOKBACK)
    landed = last_landing(lake, since, tv, result.receipts.column("group_id").combine_chunks())
    if not landed:
        return {"groups": 0}
    lat = sorted(done_at - t for t in landed.values())
    return {"groups": len(lat), "p50": round(lat[len(lat) // 2], 4), "max": round(lat[-1], 4),
            "min": round(lat[0], 4)}


def follow(lake: Lake, cfg: AdmissionConfig | None = None, *, interval_s: float, stop: StopFlag | None = None,
           max_passes: int | None = None, max_seconds: float | None = None, max_idle_s: float | None = None,
           on_pass: Callable[[PassReport], None] | None = None, **admit_kwargs: Any) -> list[PassReport]:
    """Admit in a loop every ``interval_s`` seconds until ``stop`` is set (SIGTERM), ``max_passes``
    passes ran, ``max_seconds`` elapsed or no pass decided anything for ``max_idle_s``;
    ``admit_kwargs`` go to every ``admit`` call. Returns the reports of the passes that ran
    (``on_pass`` sees each as it ends)."""
    from pipeline.admission.run import admit

    cfg = cfg or AdmissionConfig()
    stop = stop if stop is not None else StopFlag()
    if cfg.quality:  # built once: every pass pays only the validation
        from pipeline.admission.run import quality_suites
        from pipeline.quality.gx import prepare

        prepare(quality_suites())
    started = busy = time.monotonic()
    reports: list[PassReport] = []
    seen: tuple[int | None, int | None] | None = None
    pending = 0
    since: int | None = None                 # trajectories version the previous pass read
    n = 0
    while not stop:
        tick = time.monotonic()
        state = (lake.version("trajectories"), lake.version("receipts"))
        if state != seen or pending:
            n += 1
            t0 = time.perf_counter()
            res = admit(lake, cfg, **admit_kwargs)
            wall = time.perf_counter() - t0
            done_at = time.time()
            decided_rows = int(pc.sum(res.receipts.column("arrived_members")).as_py() or 0) \
                if res.receipts.num_rows else 0
            pending = max(0, int(res.quality.get("candidate_rows", 0)) - decided_rows)
            # what this pass has seen: the trajectories version it read (a landing during the pass, or
            # before the report below is read, moves the table past it) and the receipts after its commit
            seen = (res.source_versions.get("trajectories", state[0]), lake.version("receipts"))
            rep = PassReport(n, res, wall, pending, _latency(lake, since, res, done_at))
            if res.receipts.num_rows:
                busy = time.monotonic()
            reports.append(rep)
            if on_pass is not None:
                on_pass(rep)
            since = res.source_versions.get("trajectories", since)
            if max_passes is not None and n >= max_passes:
                break
        if max_seconds is not None and time.monotonic() - started >= max_seconds:
            break
        if max_idle_s is not None and time.monotonic() - busy >= max_idle_s:
            break
        stop.event.wait(max(0.0, interval_s - (time.monotonic() - tick)))
    return reports
