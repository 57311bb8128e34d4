"""In-memory rows through the landing door as one batch of an application
transaction: validate, stamp, quarantine, append (docs/write-protocol.md).

:func:`land_rows` is what rollout spool shipping (``pipeline.rollout.spool.ship``)
and the simulator's lake mode (``pipeline.sim.lake_mode``) call once per batch;
its validate-and-stamp step is :func:`pipeline.landing.ingest.validate_stamp`,
the one ``pipeline ingest`` (files, ``ingest_table``) and the committer
(``pipeline serve``) run per source. Unlike those, it does not read the table's
keys first: every data append is keyed (``Lake.append`` drops a row whose key
landed, serialised with every other keyed append), which is what a batch
shipped again from a new spool or by a second process needs.

The order of the commits is the exactly-once contract of a batch: quarantine
(both tables' rejects, one commit), then trajectories, then events, each with
the same ``app_id`` / ``txn_version``. A batch is whole once the last table it
writes holds the version, so a caller that died midway ships the batch again
and each table's transaction makes the part already written a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import pyarrow as pa

from pipeline.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake

ORDER = ("trajectories", "events")     # data tables in commit order, after the quarantine
ID_COLUMN = {"trajectories": "trajectory_id", "events": "episode_id"}   # what a quarantine entry names


@dataclass
class LandResult:
    landed: dict[str, int] = field(default_factory=dict)    # rows committed per data table (0: a no-op rerun)
    quarantined: int = 0             # quarantine rows committed
    offered_quarantine: int = 0      # quarantine rows of the batch (also when its commit was a no-op)
    reasons: dict[str, int] = field(default_factory=dict)   # committed quarantine rows per reason_code
    versions: dict[str, int | None] = field(default_factory=dict)  # the version each append left its table at


def land_rows(lake: Lake, rows: Mapping[str, pa.Table], *, command: str, ingest_id: str, source: str,
              fingerprint: str, app_id: str | None = None, txn_version: int = 0,
              config_hash: str | None = None, strict: Sequence[str] = ()) -> LandResult:
    """Land ``rows`` ({"trajectories": raw, "events": raw}, either may be absent):
    each validated against schemas/<table>.yaml; valid trajectories stamped
    (``ingest_id``, derived columns); rejects of both tables quarantined in one
    commit (``source``; fingerprint ``fingerprint`` for trajectories,
    ``<fingerprint>:events`` for events); then the valid rows appended, each
    commit carrying ``app_id`` / ``txn_version`` (and ``config_hash`` on the
    data tables). A table named in ``strict`` holds the caller's own rows: a
    reject there is a bug, raised before anything is written."""
    from pipeline.lake.quarantine import quarantine_rows
    from pipeline.landing.ingest import validate_stamp

    unknown = sorted(set(rows) - set(ORDER))
    if unknown:
        raise PipelineError(f"land_rows lands {', '.join(ORDER)}, not {', '.join(unknown)}")
    q_tables: list[pa.Table] = []
    to_land: dict[str, pa.Table] = {}
    for table in ORDER:
        raw = rows.get(table)
        if raw is None:
            continue
        checked, stamped = validate_stamp(raw, ingest_id, table=table)
        if checked.rejects and table in strict:
            raise PipelineError(f"{source}: rows of {table} violate schemas/{table}.yaml: {checked.rejects[:3]}",
                                hint=f"a bug in what {source} writes; please report it")
        if stamped is not None:
            to_land[table] = stamped
        if checked.rejects:
            ids = raw.column(ID_COLUMN[table])
            q_tables.append(quarantine_rows(
                [(r.row, r.code, r.message, ids[r.row].as_py()) for r in checked.rejects], raw=raw, raw_lines=None,
                source=source, fingerprint=fingerprint if table == "trajectories" else f"{fingerprint}:{table}",
                ingest_id=ingest_id, target=table))
    result = LandResult()
    if q_tables:
        q = pa.concat_tables(q_tables)
        res = lake.append("quarantine", q, command=command, app_id=app_id, txn_version=txn_version)
        result.offered_quarantine = q.num_rows
        result.versions["quarantine"] = res.version
        if res.landed:
            result.quarantined = q.num_rows
            for code in q.column("reason_code").to_pylist():
                result.reasons[code] = result.reasons.get(code, 0) + 1
    for table, data in to_land.items():
        res = lake.append(table, data, command=command, config_hash=config_hash, app_id=app_id,
                          txn_version=txn_version)
        result.landed[table] = res.rows if res.landed else 0
        result.versions[table] = res.version
    return result
