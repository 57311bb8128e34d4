"""The lake: Delta tables under one root, idempotent appends, quarantine,
time travel and maintenance (the storage layer: docs/architecture.md).

Public API: :class:`Lake`, :func:`as_lake` (a Lake from a Lake, path or URI),
:class:`IngestReport`, :func:`content_hash`, :func:`content_hashes`,
:func:`validate_trajectories`. Landing rows as a job is
``pipeline.ingest.ingest_files`` / ``ingest_table``, a layer above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy: deltalake
    from pipeline.lake.delta import AppendResult, Lake

__all__ = ["Lake", "AppendResult", "as_lake", "IngestReport", "content_hash", "content_hashes", "validate_trajectories"]


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
    if name == "as_lake":
        from pipeline.lake.ref import as_lake

        return as_lake
    if name == "IngestReport":  # defined by the landing layer above (pipeline.landing.ingest): resolved at run
        import importlib           # time, never a static upward import (pipeline/lake/ingest.py says why)

        return importlib.import_module("pipeline.landing.ingest").IngestReport
    raise AttributeError(name)
