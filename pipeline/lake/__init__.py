"""The lake: Delta tables under one root, idempotent appends, quarantine,
time travel and maintenance.

Public API: :class:`Lake`, :func:`ingest_files`, :func:`ingest_table` (an
in-memory Arrow table, pandas or polars frame), :class:`IngestReport`,
:func:`content_hash`, :func:`content_hashes`, :func:`validate_trajectories`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy: deltalake
    from pipeline.lake.delta import AppendResult, Lake

__all__ = ["Lake", "AppendResult", "ingest_files", "ingest_table", "IngestReport", "content_hash", "content_hashes", "validate_trajectories"]


def __getattr__(name: str) -> Any:  # lazy: `import pipeline.lake` must not import deltalake
    if name in ("Lake", "AppendResult", "resolve_lake_uri"):
        from pipeline.lake import delta

        return getattr(delta, name)
    if name in ("content_hash", "content_hashes"):
        from pipeline.lake import contenthash

        return getattr(contenthash, name)
    if name == "validate_trajectories":
        from pipeline.lake.validate import validate_trajectories

        return validate_trajectories
    if name in ("ingest_files", "ingest_table", "IngestReport"):
        from pipeline.lake import ingest

        return getattr(ingest, name)
    raise AttributeError(name)
