"""CLI: `pipeline ingest FILE…`, `pipeline lake maintain|info`."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.cli import common

    p = common(sub.add_parser(
        "ingest", help="land externally produced trajectories (Parquet, Arrow IPC, JSONL)",
        description="Validate every row against schemas/trajectories.yaml; land valid rows, quarantine "
                    "the rest with a reason. Idempotent: re-ingesting a file or a landed row is a no-op."))
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(handler=_ingest)

    lake = sub.add_parser("lake", help="lake maintenance and inspection")
    lsub = lake.add_subparsers(dest="lake_command", metavar="ACTION")
    m = common(lsub.add_parser("maintain", help="compact small files, write checkpoints, vacuum what no snapshot needs"))
    m.add_argument("--retention-hours", type=int, default=168,
                   help="vacuum files removed from the log longer ago than this (default 168 = 7 days)")
    m.add_argument("--dry-run", action="store_true", help="report what vacuum would delete")
    m.add_argument("--table", action="append", default=None, help="only these tables (repeatable)")
    m.add_argument("--orphan-age-minutes", type=float, default=None,
                   help="remove data files no commit references (and _snapshots/.tmp-* directories) once they "
                        "are this old (default 60: a live writer never commits a file older than 30 minutes)")
    m.set_defaults(handler=_maintain)
    i = common(lsub.add_parser("info", help="tables, versions, row and file counts"))
    i.set_defaults(handler=_info)
    lake.set_defaults(handler=lambda a: lake.print_help())


def _ingest(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.cli import emit
    from pipeline.lake.delta import Lake
    from pipeline.lake.ingest import ingest_files

    report = ingest_files(Lake(args.lake), args.files, command="pipeline ingest")
    out = report.as_dict()
    emit(out, args, lambda r: (
        f"ingest {r['ingest_id']}: {r['rows_read']} rows read from {r['files']} file(s): "
        f"{r['landed']} landed, {r['duplicates']} duplicate, {r['quarantined']} quarantined"
        + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(r['reasons'].items()))})" if r["reasons"] else "")
        + (f"\n  already ingested (no-op): {', '.join(r['skipped_files'])}" if r["skipped_files"] else "")
        + (f"\n  trajectories version {r['trajectories_version']}" if r["trajectories_version"] is not None else "")
        + (f"\n  quarantine version {r['quarantine_version']}; see: pipeline sql \"SELECT source_row, reason "
           f"FROM quarantine WHERE ingest_id = '{r['ingest_id']}'\"" if r["quarantine_version"] is not None else "")))
    return None  # type: ignore[return-value]


def _maintain(args: argparse.Namespace) -> None:
    from pipeline.cli import emit
    from pipeline.lake.delta import Lake
    from pipeline.lake.maintain import maintain

    age = None if args.orphan_age_minutes is None else args.orphan_age_minutes * 60
    out = maintain(Lake(args.lake), retention_hours=args.retention_hours, dry_run=args.dry_run, tables=args.table,
                   orphan_min_age_s=age)
    emit(out, args, lambda r: ("\n".join(
        f"{t}: files {v['files_before']} -> {v['files_after']}, checkpoint at version {v['version']}, "
        f"vacuum {'would delete' if args.dry_run else 'deleted'} {v['vacuumed']} file(s), "
        f"{'would remove' if args.dry_run else 'removed'} {v['orphans_removed']} orphan file(s)"
        + (f" (kept versions {v['kept_versions']})" if v.get("kept_versions") else "")
        for t, v in r["tables"].items()) or "no tables")
        + (f"\n_snapshots: {'would remove' if args.dry_run else 'removed'} "
           f"{len(r['snapshot_temp_dirs_removed'])} temporary director(ies)"
           if r["snapshot_temp_dirs_removed"] else ""))


def _info(args: argparse.Namespace) -> None:
    from pipeline.cli import emit
    from pipeline.lake.delta import Lake
    from pipeline.schema import TABLES

    lake = Lake(args.lake)
    tables = {}
    for name in TABLES + ("metrics",):
        try:
            if not lake.exists(name):
                continue
        except Exception:
            continue
        dt = lake.table(name)
        tables[name] = {"version": dt.version(), "files": len(dt.file_uris()), "rows": dt.count()}
    emit({"lake": lake.uri, "tables": tables}, args, lambda r: f"lake {r['lake']}\n" + "\n".join(
        f"  {t}: version {v['version']}, {v['rows']} rows in {v['files']} files" for t, v in r["tables"].items()))
