"""Land trajectories: read files, validate (pure core in validate.py), dedupe
against the table, write valid rows and quarantine the rest.

Idempotence, at two levels:
- file: each file's sha256 is an application transaction (``ingest:<sha>``) on
  both tables, so re-ingesting a file is a no-op, and a run that died between
  the two commits converges when rerun;
- row: a trajectory_id that already landed with the same content_hash is a
  duplicate (no-op); with a different one it is a ``conflict`` (quarantined).

Every file is read and validated before anything is written: a corrupt file
fails the command with no new table version.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import InputFileError
from pipeline.lake.validate import Reject, Validated, validate_table
from pipeline.schema import table_spec

FORMATS = ("parquet", "ipc", "jsonl")


@dataclass
class IngestReport:
    ingest_id: str
    files: int = 0
    rows_read: int = 0
    landed: int = 0
    duplicates: int = 0
    quarantined: int = 0
    skipped_files: list[str] = field(default_factory=list)  # already ingested (same bytes)
    trajectories_version: int | None = None
    quarantine_version: int | None = None
    reasons: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Source:
    path: str
    fingerprint: str
    raw: pa.Table
    raw_lines: list[str] | None  # JSONL: the raw lines (for quarantine)
    validated: Validated


# -- reading ----------------------------------------------------------------------------
def detect_format(path: Path, head: bytes) -> str:
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".arrow", ".ipc", ".feather", ".arrows"):
        return "ipc"
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1") or head[:4] == b"\xff\xff\xff\xff":
        return "ipc"
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    raise InputFileError(f"{path}: cannot tell the format",
                         hint="name it *.parquet, *.arrow (Arrow IPC) or *.jsonl")


def read_bytes(path: str | os.PathLike[str]) -> tuple[bytes, str]:
    """(the file's bytes, their sha256)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise InputFileError(f"{p}: no such file") from None
    except OSError as exc:
        raise InputFileError(f"{p}: cannot read: {exc}") from None
    if not data:
        raise InputFileError(f"{p}: the file is empty (0 bytes)",
                             hint="write at least one row, or leave the file out")
    return data, hashlib.sha256(data).hexdigest()


def count_rows(path: str | os.PathLike[str], data: bytes) -> int:
    """Row count without parsing rows (for files skipped as already ingested)."""
    fmt = detect_format(Path(path), data[:8])
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows
    if fmt == "ipc":
        return read_file(path, data)[0].num_rows
    return sum(1 for ln in data.split(b"\n") if ln.strip())


def read_file(path: str | os.PathLike[str], data: bytes | None = None
              ) -> tuple[pa.Table, list[str] | None, list[Reject], str]:
    """(raw table, raw JSON lines or None, parse rejects, sha256 of the bytes)."""
    p = Path(path)
    if data is None:
        data, fp = read_bytes(p)
    else:
        fp = hashlib.sha256(data).hexdigest()
    fmt = detect_format(p, data[:8])
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(pa.BufferReader(data)), None, [], fp
        if fmt == "ipc":
            try:
                return pa.ipc.open_file(pa.BufferReader(data)).read_all(), None, [], fp
            except pa.ArrowInvalid:
                return pa.ipc.open_stream(pa.BufferReader(data)).read_all(), None, [], fp
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise InputFileError(f"{p}: not a readable {fmt} file ({exc})",
                             hint="the file is corrupt or truncated; re-export it") from None
    from pipeline.lake.jsonl import parse_jsonl

    table, lines, rejects = parse_jsonl(data, p)
    return table, lines, rejects, fp


# -- the pure part ------------------------------------------------------------------------
def dedupe(valid: pa.Table, existing: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``valid`` rows into (new, duplicate, conflict) boolean masks.

    ``existing`` has trajectory_id and content_hash of landed rows. Within
    ``valid`` itself, repeated ids with equal content keep the first occurrence;
    repeated ids with different content are all conflicts.
    """
    n = valid.num_rows
    ids = valid.column("trajectory_id").to_numpy(zero_copy_only=False).astype(object)
    hashes = valid.column("content_hash").to_numpy(zero_copy_only=False).astype(object)
    new = np.ones(n, bool)
    dup = np.zeros(n, bool)
    conflict = np.zeros(n, bool)
    # within the batch
    seen: dict[str, tuple[int, str]] = {}
    in_batch_conflict: set[str] = set()
    for i in range(n):
        prev = seen.get(ids[i])
        if prev is None:
            seen[ids[i]] = (i, hashes[i])
        elif prev[1] == hashes[i]:
            new[i], dup[i] = False, True
        else:
            in_batch_conflict.add(ids[i])
    if in_batch_conflict:
        m = np.isin(ids, list(in_batch_conflict))
        conflict |= m
        new &= ~m
        dup &= ~m
    # against the table
    if existing.num_rows:
        idx = pc.index_in(valid.column("trajectory_id"), value_set=existing.column("trajectory_id"))
        hit = np.asarray(idx.is_valid().to_numpy(zero_copy_only=False), bool)
        if hit.any():
            ex_hash = existing.column("content_hash").combine_chunks().take(idx.fill_null(0))
            same = np.asarray(pc.equal(ex_hash, valid.column("content_hash")).to_numpy(zero_copy_only=False), bool)
            dup |= hit & same & new
            conflict |= hit & ~same & new
            new &= ~hit
    return new, dup, conflict


def stamp_derived(valid: pa.Table, ingest_id: str) -> pa.Table:
    """Add the lake-derived columns (created_day, ingest_id)."""
    day = pc.cast(pc.cast(valid.column("created_at"), pa.timestamp("us", tz="UTC")), pa.date32())
    t = valid.append_column("created_day", day)
    return t.append_column("ingest_id", pa.array([ingest_id] * valid.num_rows, pa.string()))


def quarantine_rows(rejects: list[tuple[int, str, str, str | None]], *, raw: pa.Table, raw_lines: list[str] | None,
                    source: str, fingerprint: str, ingest_id: str, target: str = "trajectories",
                    hashes: dict[int, str] | None = None) -> pa.Table:
    """Quarantine rows for (row, code, message, trajectory_id) rejects of one source."""
    now = datetime.now(timezone.utc)
    rows = []
    if rejects and raw_lines is None:
        py = raw.take(pa.array([r[0] for r in rejects], pa.int64())).to_pylist()
    for k, (row, code, message, tid) in enumerate(rejects):
        raw_text = raw_lines[row] if raw_lines is not None else json.dumps(py[k], default=str)
        rows.append({
            "quarantine_id": hashlib.sha256(f"{fingerprint}:{row}:{code}".encode()).hexdigest(),
            "target_table": target,
            "source_file": source,
            "source_fingerprint": fingerprint,
            "source_row": row,
            "trajectory_id": tid,
            "reason_code": code,
            "reason": message,
            "raw_row": raw_text,
            "content_hash": (hashes or {}).get(row),
            "ingest_id": ingest_id,
            "quarantined_at": now,
        })
    return pa.Table.from_pylist(rows, schema=table_spec("quarantine").arrow_schema())


def _tid(raw: pa.Table, raw_lines: list[str] | None, row: int) -> str | None:
    if "trajectory_id" in raw.column_names:
        v = raw.column("trajectory_id")[row].as_py()
        return v if isinstance(v, str) else (None if v is None else str(v))
    return None


# -- the wrapper --------------------------------------------------------------------------
def precheck(path: str, data: bytes) -> None:
    """Cheap structural check (Parquet footer, Arrow IPC schema) so a corrupt or
    truncated file fails the command before anything is written."""
    fmt = detect_format(Path(path), data[:8])
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.ParquetFile(pa.BufferReader(data)).metadata
        elif fmt == "ipc":
            try:
                pa.ipc.open_file(pa.BufferReader(data)).schema
            except pa.ArrowInvalid:
                pa.ipc.open_stream(pa.BufferReader(data)).schema
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise InputFileError(f"{path}: not a readable {fmt} file ({exc})",
                             hint="the file is corrupt or truncated; re-export it") from None


def ingest_files(lake, paths: Iterable[str | os.PathLike[str]], *, command: str = "ingest",
                 progress: bool = False) -> IngestReport:
    """Land valid rows (one commit) and quarantine the rest (one commit).

    Every file is fingerprinted and structurally checked first: an unreadable
    file raises InputFileError before anything is written. Then, file by file in
    input order, rows are parsed, validated and deduplicated (against the table
    and the files before it: the first occurrence of an id wins), and their data
    files are staged on a writer thread while the next file is validated. The
    staged files become visible in one trajectories commit at the end; if
    anything fails first, they are removed and no table version is written.
    """
    from concurrent.futures import ThreadPoolExecutor

    ingest_id = f"ingest-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    report = IngestReport(ingest_id=ingest_id)
    heads: list[tuple[str, str, bytes]] = []
    seen_fp: set[str] = set()
    for path in [str(p) for p in paths]:
        data, fp = read_bytes(path)
        report.files += 1
        # A file whose rows landed before (its transaction is in the trajectories
        # log; quarantine commits first) is a no-op: skip parsing it at all.
        if fp in seen_fp or lake.transaction_version("trajectories", f"ingest:{fp}") is not None:
            n = count_rows(path, data)
            report.rows_read += n
            report.skipped_files.append(path)
            report.duplicates += n
            continue
        precheck(path, data)
        seen_fp.add(fp)
        heads.append((path, fp, data))
    if not heads:
        return report
    lake.ensure("trajectories")
    lake.ensure("quarantine")
    quarantined_txn = {fp for _, fp, _ in heads
                       if lake.transaction_version("quarantine", f"ingest:{fp}") is not None}
    existing = pa.table({"trajectory_id": pa.array([], pa.string()), "content_hash": pa.array([], pa.string())})
    if lake.version("trajectories"):
        existing = lake.read("trajectories", columns=["trajectory_id", "content_hash"])
    staged: list = []
    futures = []
    landed = 0
    q_tables = []
    try:
        with ThreadPoolExecutor(max_workers=1) as writer:
            for k in range(len(heads)):
                path, fp, data = heads[k]
                heads[k] = (path, fp, b"")  # release the bytes as we go
                raw, lines, pre, _ = read_file(path, data)
                del data
                report.rows_read += raw.num_rows
                validated = validate_table(raw, pre_rejected=pre)
                valid = validated.valid
                rej = [(r.row, r.code, r.message, _tid(raw, lines, r.row)) for r in validated.rejects]
                if valid.num_rows:
                    new, dup, conflict = dedupe(valid, existing)
                    report.duplicates += int(dup.sum())
                    for i in np.flatnonzero(conflict):
                        tid = valid.column("trajectory_id")[int(i)].as_py()
                        rej.append((int(validated.valid_rows[i]), "conflict",
                                    f"trajectory_id {tid!r} already exists (or repeats in this input) with different "
                                    f"content (content_hash {valid.column('content_hash')[int(i)].as_py()[:12]}…); "
                                    f"ids are idempotency keys: use a new id for new content", tid))
                    if new.any():  # filter copies every token list: skip it when nothing is dropped
                        to_land = stamp_derived(valid if new.all() else valid.filter(pa.array(new)), ingest_id)
                        existing = pa.concat_tables([existing, to_land.select(["trajectory_id", "content_hash"])],
                                                    promote_options="permissive")
                        landed += to_land.num_rows
                        futures.append(writer.submit(lake.stage, "trajectories", to_land))
                if rej and fp not in quarantined_txn:
                    q_tables.append(quarantine_rows(sorted(rej), raw=raw, raw_lines=lines, source=path,
                                                    fingerprint=fp, ingest_id=ingest_id))
                del raw, lines, validated, valid
            for f in futures:
                staged.extend(f.result())
    except BaseException:
        for f in futures:
            if f.done() and not f.exception():
                staged.extend(f.result())
        lake.discard("trajectories", staged)
        raise
    txns = [f"ingest:{fp}" for _, fp, _ in heads]
    quarantine = pa.concat_tables(q_tables) if q_tables else None
    try:
        if quarantine is not None and quarantine.num_rows:
            res = lake.append("quarantine", quarantine, command=command, app_id=_batch_app_id(txns), txn_version=0,
                              extra_transactions=txns)
            report.quarantined = quarantine.num_rows
            report.quarantine_version = res.version
            for code in quarantine.column("reason_code").to_pylist():
                report.reasons[code] = report.reasons.get(code, 0) + 1
        if staged:
            res = lake.append("trajectories", None, command=command, app_id=_batch_app_id(txns), txn_version=0,
                              extra_transactions=txns, staged=staged, rows=landed)
            report.landed = landed if res.landed else 0
            report.trajectories_version = res.version
            if not res.landed:  # the same batch landed concurrently: our copies are garbage
                lake.discard("trajectories", staged)
    except BaseException:
        if staged and lake.transaction_version("trajectories", _batch_app_id(txns)) is None:
            lake.discard("trajectories", staged)
        raise
    return report


def _batch_app_id(txns: list[str]) -> str:
    return "ingest-batch:" + hashlib.sha256("\n".join(sorted(txns)).encode()).hexdigest()[:32]
