"""The storage half of `pipeline lake maintain` (:func:`maintain_tables`):
compact, checkpoint, vacuum what nothing needs, and clean up what crashed
writers left. The job (pipeline/maintain.py) runs it and, from the layer above
storage, removes unpublished snapshot payloads, retires old checkpoints and
verifies the result (every table file and every snapshot; `pipeline lake verify`).

Safe to run while writers run and while another maintain runs: compaction
commits are serialised (pipeline/lake/delta/compact.py), and the cleanup
only removes files no commit ever referenced, that no live writer declared in
the staging registry (pipeline/lake/staging.py) and that are older than an age
guard (``orphan_min_age_s``, default one hour). docs/write-protocol.md has the
argument.

Snapshots materialize their members' payload into their own files, so vacuum
of the source tables can never change what a snapshot id means. We still keep
every source-table version a snapshot was admitted from (``keep_versions``),
so `--as-of` queries and lineage can read the exact rows it saw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline.schema import ALL_TABLES, table_spec

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


def snapshot_source_versions(lake: Lake) -> dict[str, set[int]]:
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


def maintain_tables(lake: Lake, *, retention_hours: int = 168, dry_run: bool = False,
                    tables: list[str] | None = None, orphan_min_age_s: float | None = None) -> dict[str, Any]:
    """Compact, checkpoint, vacuum and clean every table (``tables``: only these),
    and remove the temporary snapshot directories of dead admissions; the report
    ``pipeline lake maintain`` prints."""
    age = orphan_age(orphan_min_age_s)
    keep = snapshot_source_versions(lake)
    report: dict[str, Any] = {"tables": {}, "dry_run": dry_run}
    for name in tables or list(ALL_TABLES):
        if not lake.exists(name):
            continue
        before = lake.file_count(name)
        if dry_run:   # compaction and checkpoints write; plan them, and ask vacuum what it would delete now
            kept = sorted(keep.get(name, ()))
            vac = lake.vacuum(name, retention_hours=retention_hours, keep_versions=kept, dry_run=True)
            rewrite, after = compaction_plan(lake, name)
            report["tables"][name] = {
                "files_before": before,
                "would_compact_files": rewrite,
                "files_after_estimate": after,
                "version": lake.version(name),
                "would_vacuum": len(vac),
                "would_remove_orphans": len(lake.remove_orphans(name, min_age_s=age, dry_run=True)),
                "kept_versions": kept,
            }
            continue
        compacted: dict[str, Any] = {}
        index_version = None
        damaged = None
        try:
            compacted = lake.compact(name)
            lake.checkpoint(name)
            if table_spec(name).enforces_key:  # the sorted key index appends dedupe against
                index_version = lake.write_key_index(name)
        except (OSError, pa.ArrowInvalid) as exc:   # a referenced file is gone or unreadable: verify lists it
            damaged = f"{type(exc).__name__}: {exc}"
        kept = sorted(keep.get(name, ()))
        vac = lake.vacuum(name, retention_hours=retention_hours, keep_versions=kept, dry_run=dry_run)
        future: list[str] = []    # unreferenced files dated in the future: aged from their first sighting
        orphans = lake.remove_orphans(name, min_age_s=age, dry_run=dry_run, future=future)
        swept = lake.sweep_intents(name) if table_spec(name).enforces_key else []
        aside, dropped = lake.tidy_damaged_intents(name) if table_spec(name).enforces_key else ([], [])
        report["tables"][name] = {
            "files_before": before,
            "files_after": lake.file_count(name),
            "files_compacted": compacted.get("numFilesRemoved", 0),
            "version": lake.version(name),
            "vacuumed": len(vac),
            "orphans_removed": len(orphans),
            "future_dated_orphans_waiting": len(future),
            "commit_intents_removed": len(swept),
            "damaged_intents_set_aside": len(aside),
            "damaged_intents_removed": len(dropped),
            "key_index_version": index_version,
            "kept_versions": kept,
        } | ({"not_compacted": damaged} if damaged else {})
    report["snapshot_temp_dirs_removed"] = remove_snapshot_temps(lake, min_age_s=age, dry_run=dry_run)
    return report


def orphan_age(orphan_min_age_s: float | None) -> float:
    """The age guard for removing unreferenced files: ``orphan_min_age_s``, or the
    default (``ORPHAN_MIN_AGE_S``, one hour) when None."""
    from pipeline.lake.delta import ORPHAN_MIN_AGE_S

    return ORPHAN_MIN_AGE_S if orphan_min_age_s is None else orphan_min_age_s


def remove_snapshot_temps(lake: Lake, *, min_age_s: float, dry_run: bool = False) -> list[str]:
    """Temporary snapshot directories (``_snapshots/.tmp-*``) left by admissions
    that died before publishing: not declared by a live admission in the staging
    registry, and older than ``min_age_s``."""
    import time

    import pyarrow.fs as pafs

    from pipeline.lake import staging

    fs, root = lake.filesystem()
    base = f"{root}/_snapshots"
    try:
        entries = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=False))
    except (FileNotFoundError, OSError):
        return []
    from pipeline.lake.delta.compact import FUTURE_SKEW_S, FirstSeen

    declared = staging.declared(lake)   # after the listing (docs/write-protocol.md, "Cleanup")
    now = time.time()
    cutoff = now - min_age_s
    seen = FirstSeen(lake, "_snapshots", now, dry_run=dry_run)
    out = []
    for info in entries:
        name = info.path.rsplit("/", 1)[-1]
        if not name.startswith(".tmp") or declared.covers(f"_snapshots/{name}/"):
            continue
        newest = info.mtime.timestamp() if info.mtime is not None else None
        if info.type == pafs.FileType.Directory:
            inner = fs.get_file_info(pafs.FileSelector(info.path, allow_not_found=True, recursive=True))
            times = [i.mtime.timestamp() for i in inner if i.mtime is not None]
            newest = max(times + ([newest] if newest is not None else []), default=None)
        if newest is not None and newest > now + FUTURE_SKEW_S:    # dated ahead: age from our first sighting
            if now - seen.first(f"_snapshots/{name}") < min_age_s:
                continue
        elif newest is not None and newest > cutoff:
            continue  # a live admission may still be writing it
        out.append(name)
        if not dry_run:
            try:
                if info.type == pafs.FileType.Directory:
                    fs.delete_dir(info.path)
                else:
                    fs.delete_file(info.path)
            except (FileNotFoundError, OSError):
                pass  # removed by a concurrent maintain
    seen.forget_others()
    return out


def compaction_plan(lake: Lake, name: str) -> tuple[int, int]:
    """(files ``lake.compact(name)`` would rewrite, files the table would have after it),
    from the same bin plan compaction itself uses."""
    import inspect

    import pyarrow as pa

    from pipeline.lake.delta import Lake
    from pipeline.lake.delta.compact import plan_compaction

    target = inspect.signature(Lake.compact).parameters["target_bytes"].default
    adds = pa.table(lake.table(name).get_add_actions(flatten=True))
    plan = plan_compaction(adds, target)
    rewrite = sum(len(b) for b in plan)
    return rewrite, adds.num_rows - rewrite + len(plan)
