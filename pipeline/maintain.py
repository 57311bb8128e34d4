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
from typing import TYPE_CHECKING, Any

from pipeline.lake.ref import as_lake

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


@dataclass(frozen=True)
class MaintainConfig:
    """Config keys of ``pipeline lake maintain`` (``--config`` / ``--set``)."""

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
        if keep_checkpoints:
            from pipeline.policy_store import retire_checkpoints

            report["checkpoints"] = retire_checkpoints(lake, keep_checkpoints, dry_run=dry_run)
        lineage.maintain_done(run, lake, report, dry_run)
    return report
