"""Compaction and cleanup of one table: our own serialised compaction,
removal of files no commit ever referenced, checkpoints and vacuum."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import CommitProperties, Transaction
from deltalake.exceptions import CommitFailedError

from pipeline.lake import staging
from pipeline.lake.delta import writes
from pipeline.lake.delta.common import (
    COMPACT_APP,
    MAX_COMMIT_RETRIES,
    MAX_KEYED_ATTEMPTS,
    ORPHAN_MIN_AGE_S,
    FilesMissing,
    partition_str,
    pause_point,
    write_metadata,
)
from pipeline.schema import table_spec

if TYPE_CHECKING:
    from pipeline.lake.delta.root import LakeRoot


def compact(lake: LakeRoot, name: str, *, target_bytes: int = 128 << 20) -> dict[str, Any]:
    """Rewrite each partition's small files into files of up to ``target_bytes``.

    Our own rewrite instead of delta-rs's ``optimize.compact``: two of those
    running at once both commit, each re-adding the same rows (measured:
    every compacted row twice). Ours commits remove + add actions carrying the
    next version of ``pipeline.compact``, so of two concurrent compactions
    exactly one commits; the other discards its files and plans again on the
    new version, where those files are gone. Rows never change: the added
    files carry ``dataChange=false``."""
    from deltalake.transaction import RemoveAction

    spec = table_spec(name)
    removed = added = 0
    for attempt in range(MAX_KEYED_ATTEMPTS):
        dt = lake.table(name)
        plan = plan_compaction(pa.table(dt.get_add_actions(flatten=True)), target_bytes)
        if not plan:
            break
        lock_v = (dt.transaction_version(COMPACT_APP) or 0) + 1
        new_actions: list = []
        try:
            for files in plan:
                part = lake.files_dataset(name, [(p, pv) for p, pv, _ in files]).to_table()
                new_actions += writes.write_data_files(lake, spec, writes.prepare(lake, spec, part), data_change=False)
            pause_point(f"compact:{name}:written")
            writes.check_actions(lake, name, new_actions, what=f"compaction of {name}")
            now_ms = int(time.time() * 1000)
            removes = [RemoveAction(p, False, now_ms, size, pv) for files in plan for p, pv, size in files]
            dt.create_write_transaction(
                removes + new_actions, mode="append", schema=spec.arrow_schema(),
                partition_by=list(spec.partition_by) or None,
                commit_properties=CommitProperties(
                    custom_metadata=write_metadata("lake maintain: compact", None),
                    max_commit_retries=MAX_COMMIT_RETRIES,
                    app_transactions=[Transaction(COMPACT_APP, lock_v, now_ms)]))
            writes.release(lake, name, new_actions)
            removed += len(removes)
            added += len(new_actions)
            break
        except (CommitFailedError, FilesMissing):
            # another compaction committed first (our rewrite may repeat its rows), or our
            # files were deleted under us: plan again
            writes.discard(lake, name, new_actions)
            time.sleep(random.uniform(0, min(0.02 * 2 ** min(attempt, 6), 1.0)))
        except BaseException:
            writes.discard(lake, name, new_actions)
            raise
    return {"numFilesRemoved": removed, "numFilesAdded": added}



def rewrite(lake: LakeRoot, name: str, files: list[tuple[str, dict[str, str | None], int]], transform, *,
            command: str) -> int | None:
    """Replace ``files`` ((path, partition values, size) of live files of ``name``)
    by ``transform(their rows)`` in one commit: their removes plus the new files'
    adds with ``dataChange=false``, carrying the next version of
    ``pipeline.compact`` like a compaction (the rows must stay the same rows:
    ``lake migrate`` backfills derived columns). The new files are checked to be
    there as written right before the commit, like every commit path. Returns the
    version committed, or None when a file is no longer live, another compaction
    or rewrite committed first, or our files vanished (nothing of ours is left
    behind: replan and call again)."""
    from deltalake.transaction import RemoveAction

    spec = table_spec(name)
    dt = lake.table(name)
    live = {p for p, _ in lake.live_files(dt)}
    if not files or any(p not in live for p, _, _ in files):
        return None
    lock_v = (dt.transaction_version(COMPACT_APP) or 0) + 1
    new_actions: list = []
    try:
        rows = lake.files_dataset(name, [(p, pv) for p, pv, _ in files]).to_table()
        new_actions = writes.write_data_files(lake, spec, writes.prepare(lake, spec, transform(rows)),
                                              data_change=False)
        pause_point(f"rewrite:{name}:written")
        writes.check_actions(lake, name, new_actions, what=f"rewrite of {name}")
        now_ms = int(time.time() * 1000)
        dt.create_write_transaction(
            [RemoveAction(p, False, now_ms, size, pv) for p, pv, size in files] + new_actions, mode="append",
            schema=spec.arrow_schema(), partition_by=list(spec.partition_by) or None,
            commit_properties=CommitProperties(custom_metadata=write_metadata(command, None),
                                               max_commit_retries=MAX_COMMIT_RETRIES,
                                               app_transactions=[Transaction(COMPACT_APP, lock_v, now_ms)]))
        writes.release(lake, name, new_actions)
        pause_point(f"rewrite:{name}:committed")
        return lake.table(name).version()
    except (CommitFailedError, FilesMissing):
        writes.discard(lake, name, new_actions)
        return None
    except BaseException:
        try:  # an error after the commit landed (post-commit hooks): its files are live, keep them
            landed = {p for p, _ in lake.live_files(lake.table(name))} & {a.path for a in new_actions}
        except Exception:  # noqa: BLE001 - cannot tell: leave the files to the age-guarded orphan cleanup
            landed = {a.path for a in new_actions}
        if not landed:
            writes.discard(lake, name, new_actions)
        raise


def remove_orphans(lake: LakeRoot, name: str, *, min_age_s: float = ORPHAN_MIN_AGE_S,
                   dry_run: bool = False, future: list[str] | None = None) -> list[str]:
    """Delete data files under table ``name`` that no commit ever referenced
    (staged by a writer that died before committing, or that lost a race), that
    no live writer declared in the staging registry, and that are older than
    ``min_age_s`` (the backstop for writers that died on another host).

    The order of the three reads is the argument (docs/write-protocol.md,
    "Cleanup"): the files are listed first, then the declarations, then the
    log. A writer declares a file before writing it and withdraws the
    declaration only after its commit landed, so a listed file is either still
    declared when the declarations are read, or referenced by the log read
    after them. No clock is involved.

    The age guard reads the store's modification time, except for a file dated more than
    ``FUTURE_SKEW_S`` ahead of this clock: its age counts from when maintenance first saw it
    (a marker under ``_maintain/``; ``future`` lists those still waiting), so a future-dated
    orphan goes like any other instead of never."""
    import pyarrow.fs as pafs
    from urllib.parse import unquote

    fs, _ = lake.filesystem()
    base = lake.table_path(name)
    listed = [i for i in fs.get_file_info(pafs.FileSelector(base, recursive=True)) if i.type == pafs.FileType.File]
    declared = staging.declared(lake, remove_expired=not dry_run)
    dt = lake.table(name)
    referenced = {p for p, _ in lake.live_files(dt)}
    for v in range(dt.version() + 1):
        for e in lake.log_entries(name, v) or []:
            for kind in ("add", "remove"):
                if kind in e:
                    referenced.add(unquote(e[kind]["path"]))
    now = time.time()
    cutoff = now - min_age_s
    out = []
    seen = FirstSeen(lake, name, now, dry_run=dry_run)
    for info in listed:
        rel = info.path[len(base) + 1:]
        if rel.startswith("_delta_log/") or rel in referenced or not rel.endswith(".parquet") \
                or declared.covers(f"{name}/{rel}"):
            continue
        mtime = info.mtime.timestamp() if info.mtime is not None else now
        if mtime > now + FUTURE_SKEW_S:     # dated ahead of any sane skew: age from our first sighting
            if now - seen.first(rel) < min_age_s:
                if future is not None:
                    future.append(rel)
                continue
        elif mtime > cutoff:
            continue
        out.append(rel)
        if not dry_run:
            try:
                fs.delete_file(info.path)
            except (FileNotFoundError, OSError):
                pass  # a concurrent maintain removed it first
    seen.forget_others()
    return out


FUTURE_SKEW_S = 10 * 60
SEEN_DIR = "_maintain/first-seen"


class FirstSeen:
    """When maintenance first saw each future-dated orphan of a table (by its own clock): one marker
    object per file, created put-if-absent (the first sighting wins), removed once the file is gone."""

    def __init__(self, lake: LakeRoot, name: str, now: float, *, dry_run: bool) -> None:
        self.lake, self.name, self.now, self.dry_run = lake, name, now, dry_run
        self.touched: set[str] = set()
        self.ok = lake.is_local or lake.uri.startswith("s3://")   # plain objects: local and S3 only

    def _rel(self, path: str) -> str:
        import hashlib

        return f"{SEEN_DIR}/{self.name}/{hashlib.sha256(path.encode()).hexdigest()[:32]}.json"

    def first(self, path: str) -> float:
        import json

        from pipeline.lake import objects

        if not self.ok:
            return self.now       # nowhere to remember it: such a file waits (reported) as before
        rel = self._rel(path)
        self.touched.add(rel.rsplit("/", 1)[-1])
        raw = objects.get(self.lake, rel)
        if raw is None and not self.dry_run:
            objects.put_if_absent(self.lake, rel, json.dumps({"path": path, "first_seen": self.now}).encode())
            raw = objects.get(self.lake, rel)
        try:
            return float(json.loads(raw)["first_seen"]) if raw else self.now
        except (ValueError, KeyError, TypeError):
            return self.now

    def forget_others(self) -> None:
        """Remove the markers of files that are no longer future-dated orphans (deleted, or committed)."""
        from pipeline.lake import objects

        if not self.ok or self.dry_run:
            return
        for n in objects.list_names(self.lake, f"{SEEN_DIR}/{self.name}"):
            if n not in self.touched:
                objects.delete(self.lake, f"{SEEN_DIR}/{self.name}/{n}")



def plan_compaction(adds: pa.Table, target_bytes: int) -> list[list[tuple[str, dict[str, str | None], int]]]:
    """Bins of small files (same partition, up to ``target_bytes`` each, >= 2 files)."""
    parts = [c for c in adds.column_names if c.startswith("partition.")]
    by_part: dict[tuple, list[tuple[str, dict[str, str | None], int]]] = {}
    rows = adds.select(["path", "size_bytes"] + parts).to_pylist()
    for r in sorted(rows, key=lambda r: r["path"]):
        if r["size_bytes"] >= target_bytes:
            continue
        pv = {c[len("partition."):]: partition_str(r[c]) for c in parts}
        by_part.setdefault(tuple(sorted(pv.items(), key=lambda kv: kv[0])), []).append(
            (r["path"], pv, r["size_bytes"]))
    plan = []
    for files in by_part.values():
        bin_: list[tuple[str, dict[str, str | None], int]] = []
        size = 0
        for f in files:
            if bin_ and size + f[2] > target_bytes:
                if len(bin_) > 1:
                    plan.append(bin_)
                bin_, size = [], 0
            bin_.append(f)
            size += f[2]
        if len(bin_) > 1:
            plan.append(bin_)
    return plan

