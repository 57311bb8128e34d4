"""`pipeline ingest FILE...`: land externally produced trajectories (valid rows land, the rest is quarantined)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import common

    p = common(sub.add_parser(
        "ingest", help="land externally produced trajectories (Parquet, Arrow IPC, JSONL)",
        description="Validate every row against schemas/trajectories.yaml; land valid rows, quarantine "
                    "the rest with a reason. Idempotent: re-ingesting a file or a landed row is a no-op. "
                    "Creates the lake if it does not exist. Exit code 1 when rows were read but none landed "
                    "(every row quarantined)."))
    p.add_argument("files", nargs="+", metavar="FILE", help="Parquet, Arrow IPC or JSON-lines files")
    p.set_defaults(handler=_ingest)


def _ingest(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.clikit import emit, note, open_lake, with_lake
    from pipeline.errors import InputFileError
    from pipeline.ingest import ingest_files

    for f in args.files:   # before the lake is created: a typo must not leave a new empty lake behind
        if not Path(f).is_file():
            raise InputFileError(f"{f}: no such file" if not Path(f).exists() else f"{f}: not a file",
                                 hint="give Parquet, Arrow IPC or JSON-lines files")
    report = ingest_files(open_lake(args, create=True), args.files, command="pipeline ingest")
    out = report.as_dict()
    emit(out, args, lambda r: with_lake(
        f"ingest {r['ingest_id']}: {r['rows_read']} rows read from {r['files']} file(s): "
        f"{r['landed']} landed, {r['duplicates']} duplicate, {r['rejected_rows']} quarantined"
        + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(r['reasons'].items()))})" if r["reasons"] and not
           r["file_problems"] else "")
        + "".join(f"\n  whole file, recorded once: {p}" for p in r["file_problems"])
        + (f"\n  already ingested (no-op): {', '.join(r['skipped_files'])}" if r["skipped_files"] else "")
        + (f"\n  trajectories version {r['trajectories_version']}" if r["trajectories_version"] is not None else "")
        + (f"\n  quarantine version {r['quarantine_version']}; see: pipeline sql \"SELECT source_row, reason "
           f"FROM quarantine WHERE ingest_id = '{r['ingest_id']}'\"" if r["quarantine_version"] is not None else "")))
    code = ingest_exit_code(out)
    if code:
        note(f"nothing landed: all {out['rows_read']} row(s) were quarantined (exit code {code})")
    return code


def ingest_exit_code(r: dict[str, Any]) -> int:
    """1 when rows were read and none landed or was already there (every row
    quarantined): the command achieved nothing. 0 otherwise (re-ingesting is a no-op)."""
    from pipeline.clikit import EXIT_NOTHING_DONE, EXIT_OK

    if r["rows_read"] > 0 and r["landed"] == 0 and r["duplicates"] == 0 and r["quarantined"] > 0:
        return EXIT_NOTHING_DONE
    return EXIT_OK
