"""`pipeline lake maintain` as a job: the lake's table maintenance
(pipeline/lake/maintain.py: compact, checkpoint, vacuum, orphans), the
unpublished snapshot payloads an object store keeps (pipeline/snapshots/publish.py)
and checkpoint retention (pipeline/policy_store.py, ``keep_checkpoints``), inside
one OpenLineage run (pipeline/lineage.py).

The storage package sits below snapshots, the policy store and lineage, so the
job that calls all four lives here, a layer above them (docs/architecture.md)::

    from pipeline.maintain import maintain
    maintain("s3://bucket/lake", keep_checkpoints=3)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pipeline.errors import PipelineError

from pipeline.lake.ref import as_lake

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


@dataclass(frozen=True)
class MaintainConfig:
    """Config keys of ``pipeline lake maintain`` (``--config`` / ``--set``)."""

    config_section: ClassVar[str] = "maintain"   # its section in an experiment file (pipeline.config.SECTIONS)

    keep_checkpoints: int = field(default=0, metadata={"ge": 0, "help":
        "keep the DeepSpeed state (optimizer, RNG) of the newest N policy versions and remove it from older ones "
        "(their hf/ model always stays); 0 = keep every state (like verl's max checkpoints to keep)"})


def maintain(lake: Lake | str | os.PathLike[str], *, retention_hours: int = 168, dry_run: bool = False,
             tables: list[str] | None = None, orphan_min_age_s: float | None = None,
             keep_checkpoints: int = 0) -> dict[str, Any]:
    """Compact, checkpoint, vacuum and clean every table, remove unpublished
    snapshot payloads older than the orphan age guard, and apply checkpoint
    retention (``keep_checkpoints``); an OpenLineage run."""
    from pipeline import lineage
    from pipeline.lake.maintain import maintain_tables, orphan_age

    lake = as_lake(lake)
    config = {"retention_hours": retention_hours, "dry_run": dry_run, "tables": tables,
              "orphan_min_age_s": orphan_min_age_s} | ({"keep_checkpoints": keep_checkpoints} if keep_checkpoints else {})
    with lineage.maintain_run(lake, config) as run:
        report = maintain_tables(lake, retention_hours=retention_hours, dry_run=dry_run, tables=tables,
                                 orphan_min_age_s=orphan_min_age_s)
        from pipeline.snapshots.publish import remove_unpublished_payloads  # object stores' unpublished payloads

        report["snapshot_temp_dirs_removed"] += remove_unpublished_payloads(
            lake, min_age_s=orphan_age(orphan_min_age_s), dry_run=dry_run)
        from pipeline.policy_store.care import remove_unpublished_checkpoints   # runs killed before publishing

        report["checkpoint_dirs_removed"] = remove_unpublished_checkpoints(
            lake, min_age_s=orphan_age(orphan_min_age_s), dry_run=dry_run)
        if keep_checkpoints:
            from pipeline.policy_store import retire_checkpoints

            report["checkpoints"] = retire_checkpoints(lake, keep_checkpoints, dry_run=dry_run)
        if not dry_run:   # after compaction and cleanup: every file the current versions reference is there
            report["verify"] = verify(lake, tables, rehash=False)   # sizes, not hashes: `lake verify` rehashes
        lineage.maintain_done(run, lake, report, dry_run)
    return report


# -- `pipeline lake verify`: the storage check (pipeline/lake/verify.py) plus every snapshot, from the layer
# that may read snapshots ------------------------------------------------------------------------------------

def verify_snapshots(lake: Lake, *, rehash: bool = True) -> dict[str, Any]:
    """{checked, problems: [...]} over every snapshot the ``snapshots`` table registers:
    each verifies (``rehash``: every file rehashed against its manifest), or, without
    ``rehash``, its manifest opens and names files present with their recorded sizes."""
    from pipeline.snapshots.format import open_snapshot, verify_snapshot

    if not lake.exists("snapshots"):
        return {"checked": 0, "problems": []}
    ids = sorted(set(lake.read("snapshots", columns=["snapshot_id"]).column(0).to_pylist()))
    problems = []
    for sid in ids:
        try:
            if rehash:
                verify_snapshot(lake, sid)
            else:
                snap = open_snapshot(lake, sid)
                lake.check_files({f"{snap.path}/{n}": int(i["bytes"]) for n, i in snap.manifest["files"].items()},
                                 what=f"snapshot {sid}")
        except PipelineError as exc:
            problems.append(f"snapshot {sid}: {exc.message}")
        except Exception as exc:  # noqa: BLE001 - a payload that does not read at all
            problems.append(f"snapshot {sid}: {type(exc).__name__}: {exc}")
    return {"checked": len(ids), "problems": problems}


def verify(lake: Lake | str | os.PathLike[str], tables: list[str] | None = None, *, snapshots: bool = True,
           rehash: bool = True, checkpoints: bool = True) -> dict[str, Any]:
    """The whole check: ``ok`` is False when anything is missing or unreadable;
    ``problems`` lists each finding as one line. ``rehash=False`` checks snapshot
    files by size instead of rehashing them (what ``lake maintain`` runs).
    ``checkpoints``: every published checkpoint's files against the sha256 in its
    row, as rollout and the trainer check them before loading (with
    ``rehash=False``: the newest version's only)."""
    from pipeline.lake.verify import verify_tables
    from pipeline.policy_store.care import verify_checkpoints

    lake = as_lake(lake)
    t = verify_tables(lake, tables)
    s: dict[str, Any] = verify_snapshots(lake, rehash=rehash) if snapshots else {"checked": 0, "problems": []}
    c: dict[str, Any] = verify_checkpoints(lake, newest_only=not rehash) if checkpoints and \
        (tables is None or "checkpoints" in tables) else {"checked": 0, "problems": []}
    problems = [p for v in t.values() for p in v["problems"]] + s["problems"] + c["problems"]
    return {"ok": not problems, "tables": t, "snapshots": s, "checkpoints": c, "problems": problems}
