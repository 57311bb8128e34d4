"""Damaged group-commit intents are set aside (docs/write-protocol.md, "Damaged intents").

An intent record (``_staging/commit.<table>.<id>.json``, pipeline/lake/delta/group.py) is
damaged when it does not parse as an intent (a field missing or of the wrong type, keys of
the wrong length) or when a file it names is gone or has another size than recorded. Such
an intent can never be committed: no writer takes a record it cannot parse, and every
committing writer checks the files of what it commits. Left in place it would be chosen
first (the oldest intent leads) and hold every overlapping intent back as a ``repeat``.

So the first writer that finds one damaged -- while parsing the intents, or in the file
check right before its commit -- *sets it aside*: it creates
``_staging/damaged.<record id>.json`` (put-if-absent) and removes the intent record.
Group commit lists only ``commit.*`` records, so nobody chooses it again. The set-aside
record is a staging-registry record bound to the original writer's process (its host,
pid and process identity, its ``created``): it keeps protecting the files the intent
named while that writer may be alive, because a live writer still holds the intent in
memory and may commit it itself if its files are whole (or writes them again if not).
``pipeline lake verify`` reports set-aside records; ``pipeline lake maintain`` removes
them once they protect nothing (:func:`prune`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from pipeline.lake import objects, staging
from pipeline.lake.liveness import holder_is_dead

if TYPE_CHECKING:
    from pipeline.lake.delta.root import LakeRoot

DAMAGED_PREFIX = "damaged."


class DamageKind(StrEnum):
    """Why an intent was set aside (the ``kind`` its set-aside record stores, as this text): its files
    (it can never be committed by anyone) or its record (it cannot be parsed; its live writer may still
    commit it from memory)."""

    FILES = "files"
    RECORD = "record"


FILES, RECORD = DamageKind.FILES, DamageKind.RECORD
log = logging.getLogger("pipeline.lake")


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _rel(rid: str) -> str:
    return f"{staging.STAGING_DIR}/{rid}.json"


def set_aside(lake: LakeRoot, rid: str, raw: bytes | None, *, kind: DamageKind, reason: str) -> bool:
    """Move intent record ``rid`` (whose bytes were ``raw``) aside as ``damaged.<rid>``; False when the
    record is already gone (committed, given up by its writer, or set aside by another process)."""
    body: dict[str, Any] = {}
    try:
        parsed = json.loads(raw) if raw else {}
        body = parsed if isinstance(parsed, dict) else {}
    except ValueError:
        pass
    paths: Any = body.get("paths")
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        commit: dict[str, Any] = _dict(body.get("commit"))
        table = commit.get("table") if isinstance(commit.get("table"), str) else None
        actions: Any = commit.get("actions") if isinstance(commit.get("actions"), list) else []
        paths = sorted(f"{table}/{a['path']}" for a in actions
                       if table and isinstance(a, dict) and isinstance(a.get("path"), str))
    created = body.get("created") if isinstance(body.get("created"), (int, float)) else time.time()
    record: dict[str, Any] = {k: body[k] for k in ("host", "pid", "boot_id", "pidns", "pid_start") if k in body}
    record.update({"paths": paths, "created": created, "pid_bound": True,   # protects only while its writer lives
                   "set_aside": {"rid": rid, "kind": kind, "reason": reason, "at": time.time(),
                                 "by": f"{socket.gethostname()}:{os.getpid()}"}})
    if objects.get(lake, _rel(rid)) is None:
        return False
    objects.put_if_absent(lake, _rel(DAMAGED_PREFIX + rid), json.dumps(record, sort_keys=True).encode())
    staging.release(lake, rid)
    log.warning("set aside the damaged commit intent %s: %s", rid, reason)
    return True


def records(lake: LakeRoot, name: str) -> list[tuple[str, dict[str, Any]]]:
    """(set-aside record id, its body) of table ``name``'s set-aside intents, in name order."""
    prefix = f"{DAMAGED_PREFIX}commit.{name}."
    out = []
    for n in sorted(objects.list_names(lake, staging.STAGING_DIR, prefix=prefix)):
        if not n.endswith(".json"):
            continue
        raw = objects.get(lake, f"{staging.STAGING_DIR}/{n}")
        if raw is None:
            continue
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        out.append((n[:-len(".json")], body if isinstance(body, dict) else {}))
    return out


def describe(body: dict[str, Any]) -> str:
    return str(_dict(body.get("set_aside")).get("reason", "unreadable set-aside record"))


def prune(lake: LakeRoot, name: str, *, live: set[str], dry_run: bool = False) -> list[str]:
    """Remove the set-aside records of table ``name`` that protect nothing any more: set aside for their
    files (no commit can take them), naming no file, their writer provably dead or the record expired
    (as any staging record), or every file they name committed (``live``: paths relative to the table)
    or absent. -> the records removed."""
    import pyarrow.fs as pafs

    removed = []
    fs, root = lake.filesystem()
    now = time.time()
    for rid, body in records(lake, name):
        info = _dict(body.get("set_aside"))
        paths = [p for p in body.get("paths") or [] if isinstance(p, str)]
        gone = True
        if paths and info.get("kind") != FILES and not holder_is_dead(body) \
                and staging.record_age_s(body, None, now) <= staging.INTENT_MAX_AGE_S:
            rest = [p for p in paths if p.split("/", 1)[-1] not in live]
            infos = fs.get_file_info([f"{root}/{p}" for p in rest]) if rest else []
            gone = all(i.type == pafs.FileType.NotFound for i in infos)
        if gone:
            removed.append(rid)
            if not dry_run:
                staging.release(lake, rid)
    return removed
