"""The one adapter over ``deltalake`` (delta-rs): nothing outside this package
imports it.

- :mod:`.store`: the lake root, its tables, reads, time travel, the log and the
  files behind a version (:class:`Lake`);
- :mod:`.writes`: appends and the write protocol (exactly-once transactions,
  keyed appends, staged files);
- :mod:`.keyindex`: the key index keyed appends dedupe against;
- :mod:`.compact`: compaction and cleanup of unreferenced files.

docs/write-protocol.md has the whole argument. Every public name stays
importable from ``pipeline.lake.delta``.
"""

from __future__ import annotations

from pipeline.lake.delta.compact import _compaction_plan
from pipeline.lake.delta.keyindex import _EMPTY, _KEY_CACHE, INDEX_DIR, KeySet, key_member
from pipeline.lake.delta.store import (
    COMPACT_APP,
    DEFAULT_LAKE,
    KEYS_APP,
    MAX_ATTEMPTS,
    MAX_COMMIT_RETRIES,
    MAX_KEYED_ATTEMPTS,
    ORPHAN_MIN_AGE_S,
    PAUSE_AT_ENV,
    STAGE_MAX_AGE_S,
    TABLE_PROPERTIES,
    Lake,
    _metadata,
    _partition_str,
    pause_point,
    resolve_lake_uri,
    storage_options_from_env,
)
from pipeline.lake.delta.writes import (
    STATS_PREFIX,
    AppendResult,
    KeyRace,
    LockTaken,
    Staged,
    _path_safe,
    _stats_json,
    row_keys,
)

__all__ = [
    "COMPACT_APP", "DEFAULT_LAKE", "INDEX_DIR", "KEYS_APP", "MAX_ATTEMPTS", "MAX_COMMIT_RETRIES",
    "MAX_KEYED_ATTEMPTS", "ORPHAN_MIN_AGE_S", "PAUSE_AT_ENV", "STAGE_MAX_AGE_S", "STATS_PREFIX",
    "TABLE_PROPERTIES", "AppendResult", "KeyRace", "KeySet", "Lake", "LockTaken", "Staged", "key_member",
    "pause_point", "resolve_lake_uri", "row_keys", "storage_options_from_env",
    "_EMPTY", "_KEY_CACHE", "_compaction_plan", "_metadata", "_partition_str", "_path_safe", "_stats_json",
]
