"""The :class:`Lake` facade: the top of the store. A :class:`Lake` is the
table/log core (:class:`~pipeline.lake.delta.root.LakeRoot`: tables, reads,
time travel, the log, plain files) plus the write methods, each calling the
module that implements it: :mod:`.writes` (appends, staged files),
:mod:`.group` (group commit), :mod:`.keyindex` (the key index) and
:mod:`.compact` (compaction and cleanup). Those modules take the core and never
call back into this facade (docs/architecture.md, "Storage: one way up").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import DeltaTable

from pipeline.lake.delta import compact, group, keyindex, writes
from pipeline.lake.delta.common import (  # noqa: F401 - re-exported: importable from the store as before
    COMPACT_APP,
    KEYS_APP,
    MAX_ATTEMPTS,
    MAX_COMMIT_RETRIES,
    MAX_KEYED_ATTEMPTS,
    ORPHAN_MIN_AGE_S,
    PAUSE_AT_ENV,
    STAGE_MAX_AGE_S,
    TABLE_PROPERTIES,
    FilesMissing,
    pause_point,
)
from pipeline.lake.delta.root import (  # noqa: F401 - re-exported: importable from the store as before
    DEFAULT_LAKE,
    LakeRoot,
    resolve_lake_uri,
    storage_options_from_env,
)
from pipeline.schema import table_spec

if TYPE_CHECKING:
    import numpy as np

    from pipeline.lake.delta.keyindex import KeySet
    from pipeline.lake.delta.writes import AppendResult, Staged


class Lake(LakeRoot):
    """A lake root holding Delta tables (``<root>/<table>``) and plain files
    (snapshot payloads, checkpoints). Local path or any object-store URI
    deltalake accepts. Tables, reads, time travel, the log and the plain files
    are :class:`~pipeline.lake.delta.root.LakeRoot`'s; the writes are here."""

    # -- writes (pipeline/lake/delta/writes.py) ---------------------------
    def stage(self, name: str, data: pa.Table) -> Staged:
        """Write ``data`` as data files of ``name`` without committing them (:func:`.writes.stage`)."""
        return writes.stage(self, name, data)

    def discard(self, name: str, staged: list) -> None:
        """Best-effort removal of staged files that will not be committed."""
        writes.discard(self, name, staged)

    def append(self, name: str, data: pa.Table | None, *, command: str, config_hash: str | None = None,
               app_id: str | None = None, txn_version: int = 0,
               extra_transactions: list[str] | None = None,
               extra_metadata: dict[str, str] | None = None,
               staged: list[Staged] | None = None, read_version: int | None = None,
               lock: tuple[str, int] | None = None, snapshot: DeltaTable | None = None) -> AppendResult:
        """Append ``data`` to ``name`` exactly once per ``(app_id, txn_version)``
        (:func:`.writes.append` has the protocol). Rows in memory for a keyed table, with
        no ``lock``, ``staged`` files, ``extra_metadata`` or ``snapshot``, go through a group
        commit (:func:`.group.append`: concurrent appends share one commit, same guarantees)."""
        if staged is None and lock is None and not extra_metadata and snapshot is None \
                and table_spec(name).enforces_key and group.enabled(self):
            return group.append(self, name, data, command=command, config_hash=config_hash, app_id=app_id,
                                txn_version=txn_version, extra=list(extra_transactions or []))
        return writes.append(self, name, data, command=command, config_hash=config_hash, app_id=app_id,
                             txn_version=txn_version, extra_transactions=extra_transactions,
                             extra_metadata=extra_metadata, staged=staged, read_version=read_version,
                             lock=lock, snapshot=snapshot)

    def sweep_intents(self, name: str, *, dry_run: bool = False) -> list[str]:
        """Remove the group-commit intent records of ``name`` whose transaction is committed (:func:`.group.sweep`)."""
        return group.sweep(self, name, dry_run=dry_run)

    def tidy_damaged_intents(self, name: str, *, dry_run: bool = False) -> tuple[list[str], list[str]]:
        """Set aside the damaged group-commit intents of ``name`` and remove the set-aside records that
        protect nothing any more (:func:`.group.tidy_damaged`): (set aside, removed)."""
        live = {p for p, _ in self.live_files(self.table(name))} if self.exists(name) else set()
        return group.tidy_damaged(self, name, live=live, dry_run=dry_run)

    # -- keys (pipeline/lake/delta/keyindex.py) ----------------------------
    def keys(self, name: str, dt: DeltaTable, *, since: int | None = None) -> KeySet:
        """``row_key`` of every row in ``dt`` (or of the files committed after ``since``)."""
        return keyindex.keys(self, name, dt, since=since)

    def write_key_index(self, name: str) -> int | None:
        """Write the sorted key index of ``name``'s latest version; returns the version it is of
        (None when keyed appends kept landing first)."""
        return keyindex.write_key_index(self, name)

    def load_key_index(self, name: str, version: int) -> tuple[int, np.ndarray] | None:
        """(index version, sorted keys) of the newest index at or below ``version``."""
        return keyindex.load_key_index(self, name, version)

    # -- maintenance (pipeline/lake/delta/compact.py) ----------------------
    def compact(self, name: str, *, target_bytes: int = 128 << 20) -> dict[str, Any]:
        """Rewrite each partition's small files into files of up to ``target_bytes``."""
        return compact.compact(self, name, target_bytes=target_bytes)

    def rewrite(self, name: str, files: list[tuple[str, dict[str, str | None], int]], transform: Any, *,
                command: str) -> int | None:
        """Replace live ``files`` by ``transform(their rows)`` in one ``dataChange=false`` commit (see
        :func:`pipeline.lake.delta.compact.rewrite`); None when it must be replanned."""
        return compact.rewrite(self, name, files, transform, command=command)

    def remove_orphans(self, name: str, *, min_age_s: float = ORPHAN_MIN_AGE_S,
                       dry_run: bool = False, future: list[str] | None = None) -> list[str]:
        """Delete data files of ``name`` no commit ever referenced, older than ``min_age_s``
        (``future``: filled with the future-dated ones still waiting)."""
        return compact.remove_orphans(self, name, min_age_s=min_age_s, dry_run=dry_run, future=future)

