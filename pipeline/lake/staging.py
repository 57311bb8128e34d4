"""The staging registry: what live writers are about to commit.

A writer declares the files it will write (paths relative to the lake root; a
path ending in ``/`` declares everything under it) in an intent record
``_staging/<id>.json`` *before* it writes the first of them, and removes the
record after its commit landed (or after it gave the files up). Maintenance
deletes an unreferenced file only if no live record declares it, so a file a
writer will commit is never deleted whatever the clocks of the writer, the
store and the maintainer say (docs/write-protocol.md, "Cleanup").

A record stops protecting its files when its writer is provably dead (same
host, boot and pid namespace, pid gone: :mod:`pipeline.lake.liveness`) or when
both the writer's own timestamp in it and the store's modification time are
older than ``INTENT_MAX_AGE_S``: the backstop for writers that crashed on
another host. Expired records are removed by maintenance.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.lake import objects
from pipeline.lake.liveness import holder_is_dead, identity


class StagingRoot(objects.ObjectRoot, Protocol):
    """What the registry needs of a lake: the object primitives' root and the
    lake's plain file system (``(pyarrow FileSystem, root path)``). A
    :class:`~pipeline.lake.delta.Lake` is one; this module imports nothing of
    the table store."""

    def filesystem(self) -> Any: ...

STAGING_DIR = "_staging"
# A writer holds a record for as long as it writes and commits; no writer stays
# uncommitted this long (ingest restages files older than 30 minutes).
INTENT_MAX_AGE_S = 24 * 3600


def declare(lake: StagingRoot, paths: list[str], *, rid: str | None = None) -> str:
    """Create intent record ``rid`` (a fresh id when None) naming ``paths``;
    returns its id (for :func:`release`)."""
    if not lake.is_local and not lake.uri.startswith("s3://"):
        return ""   # no plain-object primitives on this store: the age guard alone protects its files
    rid = rid or f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex}"
    body = {"paths": sorted(paths), "created": time.time(), "host": socket.gethostname(),
            "pid": os.getpid(), "pid_bound": True, **identity()}
    objects.put_if_absent(lake, f"{STAGING_DIR}/{rid}.json", json.dumps(body, sort_keys=True).encode())
    return rid


def release(lake: StagingRoot, rid: str | None) -> None:
    """Remove intent record ``rid`` (its files are committed or given up). Best effort:
    a record left behind only delays cleanup until it expires."""
    if not rid:
        return
    try:
        objects.delete(lake, f"{STAGING_DIR}/{rid}.json")
    except Exception:  # noqa: BLE001 - never fail a landed commit over its bookkeeping
        pass


@dataclass(frozen=True)
class Declared:
    """The paths live writers declared (exact paths and ``dir/`` prefixes)."""

    paths: frozenset[str]
    prefixes: tuple[str, ...]

    def covers(self, rel: str) -> bool:
        """Is ``rel`` (relative to the lake root) declared by a live writer?"""
        return rel in self.paths or any(rel.startswith(p) for p in self.prefixes)


def record_age_s(body: dict[str, Any], mtime: float | None, now: float) -> float:
    """The younger of the two ages (writer's clock, store's clock): skew in one
    of them alone never makes a record look old."""
    ages = [now - float(body["created"])] if isinstance(body.get("created"), (int, float)) else []
    if mtime is not None:
        ages.append(now - mtime)
    return min(ages) if ages else 0.0


def declared(lake: StagingRoot, *, remove_expired: bool = False) -> Declared:
    """Every path declared by a live intent record. Records of provably dead
    writers and expired ones do not count (and are deleted when ``remove_expired``)."""
    import pyarrow.fs as pafs

    fs, root = lake.filesystem()
    try:
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/{STAGING_DIR}", allow_not_found=True))
    except (FileNotFoundError, OSError):
        return Declared(frozenset(), ())
    now = time.time()
    paths: set[str] = set()
    for info in infos:
        if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
            continue
        raw = objects.get(lake, f"{STAGING_DIR}/{info.base_name}")
        if raw is None:
            continue  # released meanwhile
        try:
            body = json.loads(raw)
            listed = [str(p) for p in body["paths"]]
        except (ValueError, KeyError, TypeError):
            body, listed = {}, []   # damaged: it protects nothing, and goes once old
        mtime = info.mtime.timestamp() if info.mtime is not None else None
        if not body or holder_is_dead(body) or record_age_s(body, mtime, now) > INTENT_MAX_AGE_S:
            if remove_expired:
                release(lake, info.base_name[:-len(".json")])
            continue
        paths.update(listed)
    return Declared(frozenset(p for p in paths if not p.endswith("/")),
                    tuple(sorted(p for p in paths if p.endswith("/"))))
