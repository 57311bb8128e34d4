"""Quarantine entries: the rows (or whole files) ingest and the writers refuse,
with the raw row, where it came from and a reason a user can act on
(schemas/quarantine.yaml)."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone

import pyarrow as pa

from pipeline.schema import table_spec

FILE_ROW = -1   # source_row of a quarantine entry for a problem of the whole file


def quarantine_rows(rejects: list[tuple[int, str, str, str | None]], *, raw: pa.Table, raw_lines: list[str] | None,
                    source: str, fingerprint: str, ingest_id: str, target: str = "trajectories",
                    hashes: dict[int, str] | None = None) -> pa.Table:
    """Quarantine rows for (row, code, message, trajectory_id) rejects of one source."""
    now = datetime.now(timezone.utc)
    rows = []
    at = [r[0] for r in rejects if r[0] != FILE_ROW]
    py = dict(zip(at, raw.take(pa.array(at, pa.int64())).to_pylist())) if at and raw_lines is None else {}
    for row, code, message, tid in rejects:
        if row == FILE_ROW:      # the whole file: its shape, so the entry says what the file held
            raw_text = json.dumps({"rows": raw.num_rows, "columns": {f.name: str(f.type) for f in raw.schema}})
        else:
            raw_text = raw_lines[row] if raw_lines is not None else json.dumps(py[row], default=str)
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


def row_trajectory_id(raw: pa.Table, raw_lines: list[str] | None, row: int) -> str | None:
    if "trajectory_id" in raw.column_names:
        v = raw.column("trajectory_id")[row].as_py()
        return v if isinstance(v, str) else (None if v is None else str(v))
    return None
