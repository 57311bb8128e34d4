"""`pipeline lake maintain`: compact, checkpoint, vacuum what nothing needs.

Snapshots materialize their members' payload into their own files, so vacuum
of the source tables can never change what a snapshot id means. We still keep
every source-table version a snapshot was admitted from (``keep_versions``),
so `--as-of` queries and lineage can read the exact rows it saw.
"""

from __future__ import annotations

from typing import Any

from pipeline.schema import TABLES


def snapshot_source_versions(lake) -> dict[str, set[int]]:
    """table -> versions some snapshot was materialized from."""
    out: dict[str, set[int]] = {}
    if not lake.exists("snapshots"):
        return out
    t = lake.read("snapshots", columns=["source_versions"])
    for m in t.column("source_versions").to_pylist():
        for table, version in m or []:
            if version is not None and int(version) >= 0:  # -1: the table did not exist yet
                out.setdefault(table, set()).add(int(version))
    return out


def maintain(lake, *, retention_hours: int = 168, dry_run: bool = False,
             tables: list[str] | None = None) -> dict[str, Any]:
    keep = snapshot_source_versions(lake)
    report: dict[str, Any] = {"tables": {}}
    for name in tables or list(TABLES) + ["metrics"]:
        if not lake.exists(name):
            continue
        before = lake.file_count(name)
        if not dry_run:
            lake.compact(name)
            lake.checkpoint(name)
        kept = sorted(keep.get(name, ()))
        vac = lake.vacuum(name, retention_hours=retention_hours, keep_versions=kept, dry_run=dry_run)
        report["tables"][name] = {
            "files_before": before,
            "files_after": lake.file_count(name),
            "version": lake.version(name),
            "vacuumed": len(vac),
            "kept_versions": kept,
        }
    return report
