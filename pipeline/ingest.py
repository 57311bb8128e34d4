"""Ingest: land externally produced trajectories, as a job.

The producer API (docs/how-to/land-rollouts.md "Ingest contract")::

    from pipeline.ingest import ingest_table
    ingest_table("s3://bucket/lake", rows)       # a Lake, a path or a URI

:func:`ingest_files` (Parquet, Arrow IPC, JSON lines: what ``pipeline ingest
FILE...`` runs) and :func:`ingest_table` (an in-memory Arrow table, pandas or
polars frame) land the valid rows and quarantine the rest through the
landing door (pipeline/landing/ingest.py: validation, stamp, dedupe,
quarantine, over the lake's write protocol), inside one OpenLineage run
(pipeline/lineage.py). The landing package sits below lineage, so the job that
joins them lives here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable

from pipeline.lake.ref import as_lake

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake
    from pipeline.landing.ingest import IngestReport


def ingest_files(lake: Lake | str | os.PathLike[str], paths: Iterable[str | os.PathLike[str]], *,
                 command: str = "ingest", progress: bool = False) -> IngestReport:
    """Land the valid rows of ``paths`` (one commit) and quarantine the rest
    (pipeline.landing.ingest.land_files); reported as an OpenLineage run."""
    from pipeline import lineage
    from pipeline.landing.ingest import land_files

    lake = as_lake(lake)
    paths = [str(p) for p in paths]
    with lineage.ingest_run(lake, paths, command) as run:
        report = land_files(lake, paths, command=command, progress=progress)
        lineage.ingest_done(run, lake, report)
    return report


def ingest_table(lake: Lake | str | os.PathLike[str], table: Any, *, source: str = "memory",
                 command: str = "ingest_table") -> IngestReport:
    """Land an in-memory table with the guarantees of ``pipeline ingest``
    (pipeline.landing.ingest.land_table); reported as an OpenLineage run."""
    from pipeline import lineage
    from pipeline.landing.ingest import land_table

    lake = as_lake(lake)
    with lineage.ingest_run(lake, [], command) as run:
        report = land_table(lake, table, source=source, command=command)
        lineage.ingest_done(run, lake, report)
    return report
