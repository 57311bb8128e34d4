"""What every module of the table store shares: the write settings, the test
pause points, the commit metadata and :class:`FilesMissing`: the bottom of the
store (docs/architecture.md, "Storage: one way up"). It imports nothing of the store.
"""

from __future__ import annotations

import getpass
import os
import socket
from typing import Any

from pipeline import __version__
from pipeline.errors import IntegrityError
from pipeline.hooks import mark_and_wait

# Old versions stay loadable until `pipeline lake maintain` says otherwise:
# delta-rs would otherwise clean expired logs (30 days) on checkpoint.
TABLE_PROPERTIES: dict[str, str] = {
    "delta.logRetentionDuration": "interval 36500 days",
    "delta.enableExpiredLogCleanup": "false",
    "delta.deletedFileRetentionDuration": "interval 7 days",
    "delta.checkpointInterval": "50",
}

# Raised from delta-rs's 15: with 8 writers on one table, 22 of 999 commits
# still failed at the default in our measurements.
MAX_COMMIT_RETRIES = 100
MAX_ATTEMPTS = 8
# Keyed appends lose the serialising transaction to every concurrent keyed
# append that commits first; each loss costs one log reload and a check of the
# files committed meanwhile, so they get more attempts.
MAX_KEYED_ATTEMPTS = 200

KEYS_APP = "pipeline.keys"         # bumped by every append to a keyed table
COMPACT_APP = "pipeline.compact"   # bumped by every compaction commit
# A staged (written, uncommitted) data file older than this is rewritten before
# it is committed, so orphan cleanup, which only removes unreferenced files
# older than ORPHAN_MIN_AGE_S, can never delete a file a live writer commits.
STAGE_MAX_AGE_S = 30 * 60
ORPHAN_MIN_AGE_S = 2 * STAGE_MAX_AGE_S
# Test hook for kill tests: "<point>=<marker path>" makes the process write the
# marker at that point of the write path and block there until it is killed (or,
# for tests that act on the lake meanwhile, until "<marker>.go" exists).
PAUSE_AT_ENV = "PIPELINE_TEST_PAUSE_AT"


def pause_point(point: str) -> None:
    raw = os.environ.get(PAUSE_AT_ENV)
    if not raw:
        return
    want, _, marker = raw.partition("=")
    if want != point:
        return
    # inside the critical section until the test kills (or releases) us; the marker appears whole or not at all
    mark_and_wait(marker, f"{marker}.go", text=str(os.getpid()), timeout_s=None, poll_s=0.01, atomic=True)


class FilesMissing(IntegrityError):
    """Files a commit was about to reference are gone or have another size than
    written; nothing was committed. ``missing`` holds (path, expected size, found
    size or None)."""

    def __init__(self, what: str, missing: list[tuple[str, int, int | None]]) -> None:
        shown = ", ".join(f"{p} ({'absent' if got is None else f'{got} bytes'}, wrote {want})"
                          for p, want, got in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        super().__init__(f"{what}: {len(missing)} file(s) it wrote are no longer there as written: {shown}{more}; "
                         "nothing was committed",
                         hint="something deleted or changed files under the lake while it ran (a cleanup without "
                              "the staging registry, a person); rerun it: it writes them again")
        self.missing = missing


def partition_str(v: Any) -> str | None:
    """A partition value as the Delta log writes it (ISO text for dates and times)."""
    if v is None:
        return None
    return v.isoformat() if hasattr(v, "isoformat") else str(v)


def write_metadata(command: str, config_hash: str | None) -> dict[str, str]:
    """The ``pipeline.*`` commit metadata of a write: command, user, host, pid, version, config hash."""
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = os.environ.get("USER", "unknown")
    meta = {
        "pipeline.command": command,
        "pipeline.user": user,
        "pipeline.host": socket.gethostname(),
        "pipeline.pid": str(os.getpid()),
        "pipeline.version": __version__,
    }
    if config_hash:
        meta["pipeline.config_hash"] = config_hash
    return meta

