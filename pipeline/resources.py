"""Locate the project's declarative resources: schemas/, sql/ and jobs/.

In a wheel they ship as ``pipeline/_resources/<name>``; in a source checkout
(editable install, tests) they sit at the repository root next to the package.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """Directory of resource ``name`` (``schemas``, ``sql`` or ``jobs``)."""
    for candidate in (_PACKAGE_DIR / "_resources" / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"resource directory {name!r} not found next to the package or in "
        f"pipeline/_resources; reinstall the package (pip install .)"
    )


def sql_path(name: str) -> Path:
    """Path of the named query ``sql/<name>.sql`` (``name`` may include .sql)."""
    stem = name[:-4] if name.endswith(".sql") else name
    path = resource_dir("sql") / f"{stem}.sql"
    if not path.is_file():
        known = sorted(p.stem for p in resource_dir("sql").glob("*.sql"))
        raise FileNotFoundError(f"no named query {stem!r}; known: {', '.join(known)}")
    return path


def machine_cache(kind: str = "", lake_uri: str | None = None) -> Path:
    """This machine's cache folder: ``$PIPELINE_CACHE`` (default ``~/.cache/pipeline``), then ``kind``, then,
    for one lake, the first 12 hex digits of the sha256 of its URI (one folder per lake)."""
    path = Path(os.environ.get("PIPELINE_CACHE", Path.home() / ".cache" / "pipeline")) / kind
    return path / hashlib.sha256(lake_uri.encode()).hexdigest()[:12] if lake_uri is not None else path
