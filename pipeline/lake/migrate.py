"""`pipeline lake migrate`: upgrade, in place, a lake written by an earlier version.

    pipeline lake migrate --lake ./lake              # backfill what is missing; a no-op on a current lake
    pipeline lake migrate --lake ./lake --dry-run    # what it would rewrite

Lakes written before the write protocol lack the derived columns later versions
compute once, when a row lands (pipeline/landing/ingest.py ``stamp_derived``):
``row_key`` on every keyed table (what every append dedupes against), and on
trajectories ``oldest_version``, ``response_len`` and ``prompt_hash`` (what
admission decides on instead of token lists). Their rows read those columns as
null, so admission could not decide them and appends could not dedupe against
them.

A table is *current* when its schema declares every derived column required
(a table this version created: every file carries them) or a migration
recorded them in the table property ``pipeline.backfilled`` (a cheap check:
the log's schema and properties). A migration finds the outdated files from
their Parquet footers (a derived column absent, or with nulls). Each outdated file is
rewritten with the derived columns computed from its own rows, the same
functions ingest uses, and committed as remove + add with ``dataChange=false``
carrying the next ``pipeline.compact`` version (``Lake.rewrite``): rows do not
change, readers at any version see the same rows, and a concurrent compaction
or second migration makes one of the two commits fail and replan, so no row is
ever doubled. One commit per batch of files: a migration killed at any point
left committed batches current and the rest untouched (its unreferenced files
go to ``lake maintain``'s age-guarded orphan cleanup); running it again
continues with what is still outdated.

One migration at a time: a migration holds the lake's ``lake-migrate`` lease
(pipeline/lake/lease.py; bound to its process, so a killed one on this host
frees it at once, elsewhere after ``LEASE_TTL_S``) and renews it after every
commit; a second one is refused with one line naming the holder. (Two at once
raced on the table's schema and properties, metadata commits Delta refuses to
rebase.)

Every command opening an old lake fails up front with the instruction to run
this (``require_current``); only ``lake migrate`` and ``lake info`` open it as is.
Stop writers (rollout, ingest) while migrating: the rows not yet migrated carry
no ``row_key``, so an append cannot dedupe against them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import ConflictError, NotFoundError, PipelineError
from pipeline.schema import ALL_TABLES, ROW_KEY, table_spec

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake

BACKFILLED = (ROW_KEY, "oldest_version", "response_len", "prompt_hash")
BATCH_BYTES = 64 << 20      # input bytes per commit (at least one file)
BACKFILLED_PROPERTY = "pipeline.backfilled"   # table property: derived columns every live file carries


LEASE = "lake-migrate"
LEASE_TTL_S = 300.0


class MigrationRunning(ConflictError):
    """Another ``pipeline lake migrate`` holds the lake's migration lease."""


class OldLayoutError(PipelineError):
    """The lake was written by an earlier version: ``pipeline lake migrate`` upgrades it."""


def derived_columns(name: str) -> tuple[str, ...]:
    spec = table_spec(name)
    return tuple(c for c in BACKFILLED if c in spec.names)


# The tables with derived columns a migration may backfill (tests/lake/test_migrate.py checks this
# against schemas/): named here so that the check every command runs parses only their specs.
TABLES = ("trajectories", "events", "quarantine", "evaluations")


def tables() -> list[str]:
    """Tables that have derived columns a migration may backfill."""
    return list(TABLES)


def tables_from_specs() -> list[str]:
    return [t for t in ALL_TABLES if derived_columns(t)]


def missing_columns(lake: Lake, name: str, dt: Any = None) -> list[str]:
    """Derived columns of table ``name`` that some live files may lack: absent from
    the table's schema, or added to it by schema evolution (nullable: rows written
    before read null) and not yet recorded as backfilled by a migration (table
    property ``pipeline.backfilled``). A table this version created declares
    them required, so every file carries them. [] when the table does not exist."""
    if dt is None:
        try:
            dt = lake.table(name)
        except NotFoundError:
            return []
    fields = {f.name: f.nullable for f in dt.schema().fields}
    done = set(dt.metadata().configuration.get(BACKFILLED_PROPERTY, "").split(","))
    return [c for c in derived_columns(name) if c not in fields or (fields[c] and c not in done)]


def _file_current(lake: Lake, name: str, path: str, columns: tuple[str, ...]) -> bool:
    """The file's footer: every column of ``columns`` present, with zero nulls in every row group."""
    import pyarrow.parquet as pq

    fs, _ = lake.filesystem()
    base = lake.table_path(name)
    md = pq.ParquetFile(fs.open_input_file(f"{base}/{path}")).metadata
    names = md.schema.to_arrow_schema().names
    for c in columns:
        if c not in names:
            return False
        i = names.index(c)
        for rg in range(md.num_row_groups):
            st = md.row_group(rg).column(i).statistics
            if st is None or not st.has_null_count or st.null_count:
                return False
    return True


def outdated_files(lake: Lake, name: str, dt: Any = None) -> list[tuple[str, dict[str, str | None], int]]:
    """(path, partition values, size) of the live files of ``name`` lacking a derived
    column or holding nulls in one (read from their footers: for migrations only)."""
    if dt is None:
        dt = lake.table(name)
    adds = pa.table(dt.get_add_actions(flatten=True))
    pvs = dict(lake.live_files(dt))
    cols = derived_columns(name)
    return [(p, pvs.get(p, {}), int(size)) for p, size in
            zip(adds.column("path").to_pylist(), adds.column("size_bytes").to_pylist())
            if not _file_current(lake, name, p, cols)]


def status(lake: Lake) -> dict[str, list[str]]:
    """{table: derived columns it may lack} for every table that is not current."""
    out = {}
    for t in tables():
        cols = missing_columns(lake, t)
        if cols:
            out[t] = cols
    return out


def require_current(lake: Lake) -> None:
    """Raise :class:`OldLayoutError`, saying to run ``pipeline lake migrate``, when a
    table of ``lake`` may lack derived columns (every command but ``lake migrate``
    and ``lake info`` checks this when it opens a lake: a few log reads)."""
    old = status(lake)
    if old:
        what = "; ".join(f"{t} lacks {', '.join(cols)}" for t, cols in old.items())
        raise OldLayoutError(f"lake {lake.uri} was written by an earlier version ({what})",
                             hint=f"run `pipeline lake migrate --lake {lake.uri}` (in place, resumable; stop "
                                  "writers first)")


def backfill(name: str, rows: pa.Table) -> pa.Table:
    """``rows`` of table ``name`` with the derived columns computed where null
    (``row_key`` is computed by the lake's writer from the key columns)."""
    if name != "trajectories" or rows.num_rows == 0:
        return rows
    from pipeline.lake.derived import list_min_nonneg, prompt_hashes

    tpv = list_min_nonneg(rows.column("token_policy_versions"))
    pv = np.asarray(rows.column("policy_version").to_numpy(), np.int64)
    derived = {
        "oldest_version": pa.array(np.where(tpv >= 0, tpv, pv), pa.int64()),
        "response_len": pc.cast(pc.list_value_length(rows.column("response_ids")).fill_null(0), pa.int32()),
        "prompt_hash": prompt_hashes(rows.column("prompt_ids")),
    }
    for c, computed in derived.items():
        i = rows.schema.get_field_index(c)
        have = rows.column(i)
        col = computed if have.null_count == len(have) else pc.if_else(pc.is_null(have), computed, have)
        rows = rows.set_column(i, rows.schema.field(i).name, pc.cast(col, rows.schema.field(i).type))
    return rows


def _batches(files: list[tuple[str, dict[str, str | None], int]], batch_bytes: int
             ) -> list[list[tuple[str, dict[str, str | None], int]]]:
    out: list[list] = []
    size = 0
    for f in files:
        if not out or size + f[2] > batch_bytes:
            out.append([])
            size = 0
        out[-1].append(f)
        size += f[2]
    return out


def migrate(lake: Lake, *, dry_run: bool = False, max_attempts: int = 50,
            batch_bytes: int = BATCH_BYTES) -> dict[str, Any]:
    """Backfill every outdated file of every table that is not current (see the
    module docstring), then record the table as current.
    -> {"tables": {name: {"missing", "outdated_files", "rewritten", "commits"}}, "current": bool}."""
    if dry_run or not status(lake):     # nothing to write: no lease
        return _migrate(lake, dry_run=dry_run, max_attempts=max_attempts, batch_bytes=batch_bytes, renew=lambda: None)
    from pipeline.lake import lease

    held, holder = lease.try_acquire(lake, LEASE, owner=f"lake migrate on {lease.default_owner()}", ttl=LEASE_TTL_S,
                                     info={"pid_bound": True})
    if held is None:
        raise MigrationRunning(f"lake migrate: another migration runs on {lake.uri} "
                               f"({lease.describe_holder(LEASE, holder)})",
                               hint="wait for it to finish, then rerun (a no-op if it finished the job)")
    try:
        return _migrate(lake, dry_run=False, max_attempts=max_attempts, batch_bytes=batch_bytes, renew=held.renew)
    finally:
        held.release()


def _migrate(lake: Lake, *, dry_run: bool, max_attempts: int, batch_bytes: int, renew: Any) -> dict[str, Any]:
    report: dict[str, Any] = {"lake": lake.uri, "dry_run": dry_run, "tables": {}}
    for name in tables():
        missing = missing_columns(lake, name)
        if not missing:
            continue
        entry: dict[str, Any] = {"missing": missing, "outdated_files": len(outdated_files(lake, name)),
                                 "rewritten": 0, "commits": 0}
        report["tables"][name] = entry
        if dry_run:
            continue
        lake.evolve(name)   # the Delta schema gains the columns first (nullable)
        for _ in range(max_attempts):
            todo = outdated_files(lake, name)
            if not todo:
                break
            for batch in _batches(todo, batch_bytes):
                v = lake.rewrite(name, batch, lambda rows, n=name: backfill(n, rows), command="lake migrate")
                if v is None:
                    break          # a compaction or another migration moved first: replan
                entry["rewritten"] += len(batch)
                entry["commits"] += 1
                renew()     # still ours (LeaseLostError if another migration took it over: stop)
        else:
            raise PipelineError(f"lake migrate: {name} still has outdated files after {max_attempts} plans "
                                "(concurrent compactions kept winning)", hint="rerun pipeline lake migrate")
        # every live file now carries every derived column: say so where every command looks
        dt = lake.table(name)
        done = set(filter(None, dt.metadata().configuration.get(BACKFILLED_PROPERTY, "").split(",")))
        dt.alter.set_table_properties({BACKFILLED_PROPERTY: ",".join(sorted(done | set(derived_columns(name))))},
                                      raise_if_not_exists=False)
    report["current"] = not report["tables"] if dry_run else not status(lake)
    return report
