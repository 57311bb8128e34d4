"""One message through the landing door: decode, validate, stamp, dedupe,
quarantine. The per-source steps are the ingest path's own
(:func:`pipeline.landing.ingest.check_source` for trajectories,
:func:`pipeline.lake.validate.validate_table` for events), so a batch that
``pipeline ingest`` would refuse is refused here with the same reasons.

A message-level problem (not an Arrow IPC stream, an unknown ``Lake-Wire``
version, a ``Lake-Table`` header naming another table) is one quarantine entry
for the whole message (``source_row`` -1, reason code ``bad_payload``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.landing import wire


@dataclass
class RowStats:
    rows_read: int = 0
    duplicates: int = 0


def message_problem(table: str, headers: dict[str, str], decoded: wire.Decoded) -> str | None:
    wv = headers.get(wire.HEADER_WIRE, str(wire.WIRE_VERSION))
    if wv != str(wire.WIRE_VERSION):
        return f"wire version {wv!r} is not one this committer reads ({wire.WIRE_VERSION}); upgrade pipeline serve"
    named = headers.get(wire.HEADER_TABLE, table)
    if named != table:
        return f"the message names table {named!r} but was published to the subject of {table!r}"
    return decoded.problem


def check_rows(seen: Any, table: str, payload: bytes, headers: dict[str, str], *, msg_id: str, source: str
               ) -> tuple[pa.Table | None, pa.Table | None, RowStats]:
    """(rows to land (stamped) or None, quarantine rows or None, counts) of one message."""
    from pipeline.landing.ingest import IngestReport, check_source
    from pipeline.lake.quarantine import FILE_ROW, quarantine_rows
    from pipeline.lake.validate import safe_raw

    ingest_id = f"serve:{msg_id}"
    decoded = wire.decode(payload)
    problem = message_problem(table, headers, decoded)
    stats = RowStats()
    if problem is not None:
        raw = decoded.table if decoded.table is not None else pa.table({})
        stats.rows_read = raw.num_rows
        q = quarantine_rows([(FILE_ROW, "bad_payload", f"message {msg_id}: {problem}", None)], raw=raw,
                            raw_lines=None, source=source, fingerprint=msg_id, ingest_id=ingest_id, target=table)
        return None, q, stats
    raw = decoded.table
    assert raw is not None
    if table == "events":
        return _check_events(seen, raw, msg_id=msg_id, source=source, ingest_id=ingest_id)
    from pipeline.landing.ingest import as_arrow

    raw = as_arrow(raw)                  # view / dictionary types decoded as ingest_table does
    report = IngestReport(ingest_id=ingest_id)
    to_land, rej = check_source(seen, raw, None, [], report, source=source)
    stats.rows_read, stats.duplicates = report.rows_read, report.duplicates
    q = quarantine_rows(sorted(rej), raw=safe_raw(raw), raw_lines=None, source=source, fingerprint=msg_id,
                        ingest_id=ingest_id) if rej else None
    return to_land, q, stats


def _check_events(seen: Any, raw: pa.Table, *, msg_id: str, source: str, ingest_id: str
                  ) -> tuple[pa.Table | None, pa.Table | None, RowStats]:
    """Events: validated against schemas/events.yaml; a row whose key landed
    before (or earlier in this flush) is a duplicate (the spool's rule)."""
    from pipeline.lake.delta import row_keys
    from pipeline.lake.quarantine import quarantine_rows
    from pipeline.lake.validate import safe_raw
    from pipeline.landing.ingest import validate_stamp
    from pipeline.schema import ROW_KEY, table_spec

    stats = RowStats(rows_read=raw.num_rows)
    v, _ = validate_stamp(raw, ingest_id, table="events", stamped=False)
    q = None
    if v.rejects:
        shown = safe_raw(raw)
        ids = shown.column("episode_id").to_pylist() if "episode_id" in shown.column_names else [None] * shown.num_rows
        q = quarantine_rows([(r.row, r.code, r.message, ids[r.row] if r.row >= 0 else None) for r in v.rejects],
                            raw=shown, raw_lines=None, source=source, fingerprint=msg_id, ingest_id=ingest_id,
                            target="events")
    valid = v.valid
    if not valid.num_rows:
        return None, q, stats
    if ROW_KEY in valid.column_names:
        valid = valid.drop_columns([ROW_KEY])
    keys = row_keys(table_spec("events"), valid).to_numpy()
    taken = getattr(seen, "event_keys", None)
    if taken is None:
        taken = seen.event_keys = set()
    _, first = np.unique(keys, return_index=True)
    keep = np.zeros(len(keys), bool)
    keep[first] = True
    keep &= ~seen.table_keys.contains(keys)
    keep &= ~np.isin(keys, np.fromiter(taken, np.int64, len(taken)))
    stats.duplicates = int((~keep).sum())
    taken.update(keys[keep].tolist())
    if not keep.any():
        return None, q, stats
    out = valid if keep.all() else valid.filter(pa.array(keep))
    return out.append_column(ROW_KEY, pa.array(keys[keep], pa.int64())), q, stats


@dataclass
class Incoming:
    """One message of a flush: its id, where it came from, its payload and headers."""

    msg_id: str
    source: str
    payload: bytes
    headers: dict[str, str]


def check_flush(seen: Any, table: str, msgs: list[Incoming]) -> tuple[list[pa.Table], list[pa.Table], RowStats]:
    """(tables to land, quarantine tables, counts) of a flush's messages, in order.

    Trajectories of messages that decode to the same schema are validated,
    stamped and deduplicated as ONE table (the ingest path's fixed costs once a
    flush, not once a message), then attributed back to their messages: each
    landed row's ``ingest_id`` is ``serve:<its message id>`` and each
    quarantine entry names its message (fingerprint) and its row in it. A
    group with a problem of every row (a missing column...) is checked message
    by message instead, so each message gets its own entry."""
    stats = RowStats()
    lands: list[pa.Table] = []
    quarantined: list[pa.Table] = []

    def single(m: Incoming) -> None:
        to_land, q, st = check_rows(seen, table, m.payload, m.headers, msg_id=m.msg_id, source=m.source)
        stats.rows_read += st.rows_read
        stats.duplicates += st.duplicates
        if to_land is not None:
            lands.append(to_land)
        if q is not None:
            quarantined.append(q)

    if table != "trajectories":
        for m in msgs:
            single(m)
        return lands, quarantined, stats
    groups: dict[pa.Schema, list[tuple[Incoming, pa.Table]]] = {}
    for m in msgs:
        decoded = wire.decode(m.payload)
        if message_problem(table, m.headers, decoded) is not None or decoded.table is None:
            single(m)
            continue
        groups.setdefault(decoded.table.schema, []).append((m, decoded.table))
    for members in groups.values():
        if len(members) == 1:
            single(members[0][0])
            continue
        got = _check_group(seen, members)
        if got is None:
            for m, _ in members:
                single(m)
            continue
        to_land, qs, st = got
        stats.rows_read += st.rows_read
        stats.duplicates += st.duplicates
        if to_land is not None:
            lands.append(to_land)
        quarantined.extend(qs)
    return lands, quarantined, stats


def _check_group(seen: Any, members: list[tuple[Incoming, pa.Table]]
                 ) -> tuple[pa.Table | None, list[pa.Table], RowStats] | None:
    """Messages of one schema checked as one table; None when the group has a
    problem of every row (the caller checks them one by one)."""
    import pyarrow.compute as pc

    from pipeline.landing.ingest import IngestReport, as_arrow, check_source
    from pipeline.lake.quarantine import quarantine_rows
    from pipeline.lake.validate import safe_raw

    parts = [as_arrow(t) for _, t in members]
    raw = pa.concat_tables(parts)
    offsets = np.cumsum([0] + [p.num_rows for p in parts])
    report = IngestReport(ingest_id="serve:flush")
    to_land, rej = check_source(seen, raw, None, [], report, source="flush")
    if report.file_problems:
        return None
    stats = RowStats(rows_read=report.rows_read, duplicates=report.duplicates)
    if to_land is not None:
        # each landed row's message: the first raw row with its id (dedupe keeps first occurrences)
        owner = np.searchsorted(offsets, np.arange(raw.num_rows), side="right") - 1
        at = pc.index_in(to_land.column("trajectory_id"), value_set=raw.column("trajectory_id"))
        ids = pa.array([f"serve:{m.msg_id}" for m, _ in members], pa.string())
        per_row = ids.take(pa.array(owner[np.asarray(at.to_numpy(zero_copy_only=False), np.int64)]))
        to_land = to_land.set_column(to_land.schema.get_field_index("ingest_id"), "ingest_id", per_row)
    qs = []
    by_msg: dict[int, list[tuple[int, str, str, str | None]]] = {}
    for row, code, msg, tid in rej:
        k = int(np.searchsorted(offsets, row, side="right") - 1)
        by_msg.setdefault(k, []).append((row - int(offsets[k]), code, msg, tid))
    for k, entries in sorted(by_msg.items()):
        m, _ = members[k]
        qs.append(quarantine_rows(sorted(entries), raw=safe_raw(parts[k]), raw_lines=None, source=m.source,
                                  fingerprint=m.msg_id, ingest_id=f"serve:{m.msg_id}"))
    return to_land, qs, stats
