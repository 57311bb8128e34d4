"""The one adapter over ``deltalake`` (delta-rs): nothing outside this package
imports it. One-way, bottom to top (docs/architecture.md, "Storage: one way up"):

- :mod:`.common`: the write settings, test pause points, commit metadata;
- :mod:`.root`: the table/log core (:class:`LakeRoot`): the lake root, its
  tables, reads, time travel, the log and the files behind a version;
- :mod:`.keyindex`: the key index keyed appends dedupe against;
- :mod:`.writes`: appends and the write protocol (exactly-once transactions,
  keyed appends, staged files);
- :mod:`.compact`: compaction and cleanup of unreferenced files;
- :mod:`.damaged` and :mod:`.group`: group commit of concurrent keyed appends;
- :mod:`.store`: the :class:`Lake` facade, a :class:`LakeRoot` whose write
  methods call the modules above; none of them calls back into it.

docs/write-protocol.md has the whole argument. Every public name stays
importable from ``pipeline.lake.delta``.
"""

from __future__ import annotations

import warnings
from typing import Any

from pipeline.lake.delta.common import partition_str, write_metadata
from pipeline.lake.delta.compact import plan_compaction
from pipeline.lake.delta.keyindex import EMPTY_KEYS, INDEX_DIR, KEY_CACHE, KeySet, key_member
from pipeline.lake.delta.root import LakeRoot
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
    path_safe,
    row_keys,
    stats_json,
)

__all__ = [
    "COMPACT_APP", "DEFAULT_LAKE", "EMPTY_KEYS", "INDEX_DIR", "KEY_CACHE", "KEYS_APP", "MAX_ATTEMPTS",
    "MAX_COMMIT_RETRIES", "MAX_KEYED_ATTEMPTS", "ORPHAN_MIN_AGE_S", "PAUSE_AT_ENV", "STAGE_MAX_AGE_S",
    "STATS_PREFIX", "TABLE_PROPERTIES", "AppendResult", "KeyRace", "KeySet", "Lake", "LakeRoot", "LockTaken",
    "Staged", "key_member", "partition_str", "path_safe", "pause_point", "plan_compaction", "resolve_lake_uri",
    "row_keys", "stats_json", "storage_options_from_env", "write_metadata",
]

# The private names this package used to re-export, and their public names now (kept working, with a warning).
_RENAMED = {"_EMPTY": "EMPTY_KEYS", "_KEY_CACHE": "KEY_CACHE", "_compaction_plan": "plan_compaction",
            "_metadata": "write_metadata", "_partition_str": "partition_str", "_path_safe": "path_safe",
            "_stats_json": "stats_json"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"pipeline.lake.delta.{name} is now pipeline.lake.delta.{_RENAMED[name]}",
                      DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
