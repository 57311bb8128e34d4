"""The worker's local write-ahead spool and the shipper that lands it in Delta.

A Delta commit costs ~70 ms and commits do not scale with writers
(docs/write-protocol.md), so a worker never commits per event. Every
event (and every finished trajectory row) is first appended as one JSON line
to ``<spool_dir>/<worker>.spool.jsonl`` and made durable with flush + fsync
before the harness acts on it: "the action is committed before the tool runs"
means its line is on disk before the tool is called. The harness group-commits
(one fsync per phase of a wave, covering every episode in it); the ordering
per event is what matters and is kept.

Shipping cuts the unshipped tail into a batch: ``(seq, start_line, end_line)``
is appended (fsynced) to ``<worker>.batches.jsonl`` *before* anything is
written to Delta, so a retried or restarted shipper lands exactly the same
rows again under the same application transaction ``(app_id = worker id,
txn_version = seq)``, which ``Lake.append`` turns into a no-op when it had
already landed. A batch goes through the landing door
(:func:`pipeline.landing.rows.land_rows`: validate, stamp, quarantine, append,
in the order quarantine -> trajectories -> events); rejects go to ``quarantine``.

The transaction alone is not enough when the spool is gone (a lost disk, a
rerun with another ``--workers``: another app id): trajectories and events
land by ``Lake.append``'s keyed append, which drops every row whose key is
already in the table —
``trajectory_id``, and ``(episode_id, step_id, action_id, event_type)`` for
events — whoever ships them (the lake's keyed append,
docs/write-protocol.md), so a batch shipped again from a new spool, under
another worker id or by a second process lands nothing twice. A trajectory
re-sampled after its first landing comes back as a conflict: the first
landing stands, the re-run is dropped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pipeline.resources import machine_cache

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake
    from pipeline.rollout.config import RolloutConfig


def run_spool_dir(lake: Lake, cfg: RolloutConfig) -> Path:
    """The run's spool folder: ``spool_dir`` when set, else ``<lake>/_spool/<run_id>`` (a remote lake's under
    ``$PIPELINE_CACHE``, default ``~/.cache/pipeline``)."""
    if cfg.spool_dir:
        return Path(cfg.spool_dir)
    base = Path(lake.uri) if lake.is_local else machine_cache()
    return base / "_spool" / cfg.run_id


def _safe(worker_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in worker_id)


class Spool:
    """Append-only JSON-lines file, one record per line: ``{"kind": "event"|"trajectory", ...}``."""

    def __init__(self, spool_dir: str | os.PathLike[str], worker_id: str, *, fsync: bool = True) -> None:
        self.dir = Path(spool_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.worker_id = worker_id
        self.path = self.dir / f"{_safe(worker_id)}.spool.jsonl"
        self.batches_path = self.dir / f"{_safe(worker_id)}.batches.jsonl"
        self.fsync = fsync
        for f in (self.path, self.batches_path):
            _drop_torn_tail(f)  # else the next append would extend the fragment into a corrupt line
        self._lines = self._read_lines(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._dirty = False

    @staticmethod
    def _read_lines(path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        out = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # a torn last line (killed mid-write): never acted on, since never synced
                out.append(json.loads(line))
        return out

    def records(self) -> list[dict[str, Any]]:
        return list(self._lines)

    def __len__(self) -> int:
        return len(self._lines)

    def append(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        self._lines.append(record)
        self._dirty = True

    def sync(self) -> None:
        """Make every appended record durable (flush + fsync)."""
        if not self._dirty:
            return
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())
        self._dirty = False

    def close(self) -> None:
        self.sync()
        self._f.close()

    # -- batches -------------------------------------------------------------------------
    def batches(self) -> list[tuple[int, int, int]]:
        return [(b["seq"], b["start"], b["end"]) for b in self._read_lines(self.batches_path)]

    def cut_batch(self, min_seq: int = 0) -> tuple[int, int, int] | None:
        """Declare the unshipped tail a batch (durably); None when nothing is pending.
        ``min_seq``: the first sequence number the lake has not seen from this worker
        (a spool that was lost and started anew must not reuse landed numbers, or its
        batches would be skipped as already shipped)."""
        self.sync()
        done = self.batches()
        start = done[-1][2] if done else 0
        if start >= len(self._lines):
            return None
        seq = max(done[-1][0] + 1 if done else 0, min_seq)
        with open(self.batches_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"seq": seq, "start": start, "end": len(self._lines)}) + "\n")
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        return seq, start, len(self._lines)

    def unshipped(self) -> int:
        done = self.batches()
        return len(self._lines) - (done[-1][2] if done else 0)


@dataclass
class ShipReport:
    batches: int = 0
    trajectories: int = 0
    events: int = 0
    quarantined: int = 0
    skipped: int = 0                     # batches that had already landed (exactly-once no-ops)
    reasons: dict[str, int] = field(default_factory=dict)


def _events_table(records: list[dict[str, Any]]) -> pa.Table:
    from pipeline.schema import table_spec

    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k != "kind"}
        row["created_at"] = datetime.fromisoformat(row["created_at"])
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=table_spec("events").ingest_schema())  # row_key: the lake's


def _trajectory_table(records: list[dict[str, Any]], shipped_at: datetime) -> pa.Table:
    from pipeline.schema import table_spec

    spec = table_spec("trajectories")
    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k != "kind"}
        row["created_at"] = datetime.fromisoformat(row["created_at"])
        row["finished_at"] = datetime.fromisoformat(row["finished_at"])
        # queue wait as seen by the writer: finish -> landing in the lake
        row["queue_wait_ms"] = max(0, int((shipped_at - row["finished_at"]).total_seconds() * 1000))
        if row.get("reward_components") is not None:
            row["reward_components"] = list(row["reward_components"].items())
        rows.append(row)
    schema = pa.schema([c.arrow_field().with_nullable(True) for c in spec.ingest_columns
                        if c.name != "content_hash"])
    return pa.Table.from_pylist(rows, schema=schema)


def _drop_torn_tail(path: Path) -> None:
    """Truncate a file to its last complete line (a process killed mid-write
    leaves a fragment that was never synced, so never acted on)."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def ship_all(lake: Lake, spool_dir: str | os.PathLike[str], *, fsync: bool = True,
             command: str = "pipeline rollout") -> ShipReport:
    """Ship every worker spool found in ``spool_dir`` (one run's), whichever worker
    wrote it: a rerun calls this before its workers start, so the lake holds every
    recorded event of the run, whatever ``--workers`` the crashed run had."""
    total = ShipReport()
    for path in sorted(Path(spool_dir).glob("*.spool.jsonl")) if Path(spool_dir).is_dir() else []:
        worker_id = spool_worker_id(path)
        if worker_id is None:
            continue                      # nothing complete was ever written to it
        spool = Spool(spool_dir, worker_id, fsync=fsync)
        try:
            rep = ship(lake, spool, command=command)
        finally:
            spool.close()
        for f in ("batches", "trajectories", "events", "quarantined", "skipped"):
            setattr(total, f, getattr(total, f) + getattr(rep, f))
        for k, v in rep.reasons.items():
            total.reasons[k] = total.reasons.get(k, 0) + v
    return total


def spool_worker_id(path: Path) -> str | None:
    """The worker id (the app id of its batches) that wrote the spool at ``path``:
    its event records carry it, and the file name is derived from it."""
    stem = path.name[:-len(".spool.jsonl")]
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                return None
            wid = json.loads(line).get("worker_id")
            if wid and _safe(wid) == stem:
                return wid
    return None


def ship(lake: Lake, spool: Spool, *, command: str = "pipeline rollout") -> ShipReport:
    """Cut the pending tail into a batch and land every batch not yet in the lake
    (also the ones a crashed run declared but never landed)."""
    from pipeline.landing.rows import land_rows

    report = ShipReport()
    app_id = spool.worker_id
    landed = {name: lake.transaction_version(name, app_id) for name in ("trajectories", "events", "quarantine")}
    spool.cut_batch(min_seq=max((v for v in landed.values() if v is not None), default=-1) + 1)
    lines = spool.records()
    for seq, start, end in spool.batches():
        recs = lines[start:end]
        events = [r for r in recs if r["kind"] == "event"]
        trajs = [r for r in recs if r["kind"] == "trajectory"]
        # written in the order quarantine -> trajectories -> events (land_rows): the last table present
        # tells whether the whole batch landed
        last = "events" if events else "trajectories"
        landed_seq = landed[last]
        if landed_seq is not None and landed_seq >= seq:
            report.skipped += 1
            continue
        rows = {}
        if trajs:
            rows["trajectories"] = _trajectory_table(trajs, datetime.now(timezone.utc))
        if events:
            rows["events"] = _events_table(events)
        res = land_rows(lake, rows, command=command, ingest_id=f"rollout:{app_id}:{seq}", source=str(spool.path),
                        fingerprint=f"{app_id}:{seq}", app_id=app_id, txn_version=seq)
        report.quarantined += res.quarantined
        for code, n in res.reasons.items():
            report.reasons[code] = report.reasons.get(code, 0) + n
        report.trajectories += res.landed.get("trajectories", 0)
        report.events += res.landed.get("events", 0)
        report.batches += 1
    return report


# -- shipping through the lake's log (pipeline rollout --ingest-url) -------------------------------------
def _published_path(spool: Spool) -> Path:
    return spool.dir / f"{_safe(spool.worker_id)}.published.jsonl"


def _published(spool: Spool) -> tuple[str, dict[int, dict[str, int]]]:
    """(this spool's epoch, {batch seq: {table: last stream sequence}}) from ``<worker>.published.jsonl``.
    The epoch (created with the file) is part of the producer id: a spool lost and started anew
    publishes under new message ids, never ones the log may still hold as duplicates."""
    import uuid

    path = _published_path(spool)
    _drop_torn_tail(path)
    lines = Spool._read_lines(path)
    if not lines:
        epoch = uuid.uuid4().hex[:12]
        _append_durably(path, {"epoch": epoch}, fsync=spool.fsync)
        return epoch, {}
    return lines[0]["epoch"], {r["seq"]: r["stream_seqs"] for r in lines[1:]}


def _append_durably(path: Path, record: dict[str, Any], *, fsync: bool) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def ship_log(door: Any, spool: Spool) -> ShipReport:
    """Publish every batch of ``spool`` not yet acknowledged by the lake's log
    (``door``: a :func:`pipeline.landing.connect` producer); ``pipeline serve``
    commits them. Batch ``seq`` goes out as ``<worker>.<epoch>.t:<seq>`` (its
    trajectories) and ``<worker>.<epoch>.e:<seq>`` (its events), so a batch
    published again after a crash is stored once (inside the stream's duplicate
    window; after it, the rows' keys catch it at commit). Counts in the report
    are rows published (acknowledged), not yet landed."""
    report = ShipReport()
    epoch, done = _published(spool)
    spool.cut_batch(min_seq=max(done, default=-1) + 1)
    lines = spool.records()
    base = f"{_safe(spool.worker_id)}.{epoch}"
    for seq, start, end in spool.batches():
        if seq in done:
            report.skipped += 1
            continue
        recs = lines[start:end]
        events = [r for r in recs if r["kind"] == "event"]
        trajs = [r for r in recs if r["kind"] == "trajectory"]
        marks: dict[str, int] = {}
        if trajs:
            rep = _publish(door, f"{base}.t", "trajectories", _trajectory_table(trajs, datetime.now(timezone.utc)),
                           seq)
            marks["trajectories"] = rep.last_seq
            report.trajectories += len(trajs)
        if events:
            rep = _publish(door, f"{base}.e", "events", _events_table(events), seq)
            marks["events"] = rep.last_seq
            report.events += len(events)
        _append_durably(_published_path(spool), {"seq": seq, "stream_seqs": marks}, fsync=spool.fsync)
        report.batches += 1
    return report


def _publish(door: Any, producer_id: str, table: str, rows: pa.Table, seq: int) -> Any:
    return door.append(table, rows, seq=seq, producer_id=producer_id)


def published_marks(spool_dir: str | os.PathLike[str]) -> dict[str, int]:
    """{table: the highest stream sequence any worker spool in ``spool_dir`` had acknowledged}."""
    out: dict[str, int] = {}
    for path in sorted(Path(spool_dir).glob("*.published.jsonl")) if Path(spool_dir).is_dir() else []:
        for r in Spool._read_lines(path)[1:]:
            for table, s in r["stream_seqs"].items():
                out[table] = max(out.get(table, 0), s)
    return out
