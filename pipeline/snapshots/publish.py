"""Publishing a snapshot: write the payload and manifest, then make them visible
atomically (first complete publication of an id wins; never overwritten).
The format itself is in :mod:`pipeline.snapshots.format`."""

from __future__ import annotations

import itertools

import hashlib
import json
from typing import TYPE_CHECKING, Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import IntegrityError
from pipeline.schema import table_spec
from pipeline.snapshots.format import (DATA_FILE, FORMAT_VERSION, MANIFEST, PENDING_DATA_PREFIX, SNAPSHOT_ID_RE, TMP_PREFIX, Snapshot,
                                       open_snapshot, sha256_hex, snapshot_dir, try_open, verify_snapshot)

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


def write_snapshot_files(lake: Lake, payload: pa.Table, *, snapshot_id: str,
                         manifest_extra: dict[str, Any] | None = None) -> Snapshot:
    """Write ``payload`` (schemas/snapshot_payload.yaml; sorted here) and the manifest.

    Idempotent: if a complete snapshot with this id exists (manifest present and
    verifying), it is returned untouched: immutable means never rewritten.
    """
    schema = payload_schema(payload.column_names)
    payload = payload.select(schema.names).cast(schema)
    payload = payload.sort_by([("group_id", "ascending"), ("trajectory_id", "ascending")])
    return write_snapshot_stream(lake, [payload], snapshot_id=snapshot_id, manifest_extra=manifest_extra)


class _HashingWriter:
    """File-like sink that sha256-hashes and counts what passes through."""

    def __init__(self, sink: Any) -> None:  # a pyarrow NativeFile
        self.sink, self.h, self.n, self.closed = sink, hashlib.sha256(), 0, False

    def write(self, data: bytes | memoryview) -> int:
        mv = memoryview(data)
        self.h.update(mv)
        self.sink.write(mv)
        self.n += mv.nbytes
        return mv.nbytes

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True


PUBLISH_BARRIER_ENV = "PIPELINE_SNAPSHOT_PUBLISH_BARRIER"  # test hook: a directory (racing publications)


def _barrier_point(snapshot_id: str) -> None:
    """Test hook: with the files written and the commit point next, announce it
    (``ready-<pid>`` in the barrier directory) and wait for ``go`` there."""
    import os
    from pathlib import Path

    from pipeline.hooks import mark_and_wait

    d = os.environ.get(PUBLISH_BARRIER_ENV)
    if not d:
        return
    mark_and_wait(Path(d, f"ready-{os.getpid()}"), Path(d, "go"), text=snapshot_id, timeout_s=120, poll_s=0.0005)


# payload columns present only in some snapshots (schemas/snapshot_payload.yaml): a snapshot without them
# has none, so its bytes are what they were before the column existed
OPTIONAL_PAYLOAD = ("turn_advantages",)


def payload_schema(names: Iterable[str]) -> pa.Schema:
    """The payload schema of a snapshot whose parts have columns ``names``."""
    have = set(names)
    full = table_spec("snapshot_payload").arrow_schema()
    return pa.schema([f for f in full if f.name not in OPTIONAL_PAYLOAD or f.name in have])


def _write_payload(fs: Any, path: str, parts: Iterable[pa.Table | pa.RecordBatch]) -> tuple[str, int, int]:
    """Stream the sorted parts into one Parquet file -> (sha256, bytes, rows)."""
    it = iter(parts)
    head = next(it, None)
    schema = payload_schema(head.schema.names if head is not None else ())
    parts = itertools.chain([head] if head is not None else [], it)
    rows = 0
    last_key: tuple[str, str] | None = None
    with fs.open_output_stream(path) as raw:
        sink = _HashingWriter(raw)
        with pq.ParquetWriter(sink, schema, compression="zstd", use_dictionary=False,
                              write_statistics=True) as writer:
            for part in parts:
                t = pa.Table.from_batches([part]) if isinstance(part, pa.RecordBatch) else part
                t = t.select(schema.names).cast(schema)
                if t.num_rows == 0:
                    continue
                first = (t.column("group_id")[0].as_py(), t.column("trajectory_id")[0].as_py())
                if last_key is not None and first <= last_key:
                    raise ValueError("snapshot parts must be sorted by (group_id, trajectory_id)")
                last_key = (t.column("group_id")[-1].as_py(), t.column("trajectory_id")[-1].as_py())
                writer.write_table(t)
                rows += t.num_rows
    return sink.h.hexdigest(), sink.n, rows


def _manifest_bytes(snapshot_id: str, data_name: str, sha: str, nbytes: int, rows: int,
                    manifest_extra: dict[str, Any] | None) -> tuple[dict[str, Any], bytes]:
    manifest = {
        "format": FORMAT_VERSION,
        "snapshot_id": snapshot_id,
        "files": {data_name: {"sha256": sha, "bytes": nbytes, "rows": rows}},
        "num_members": rows,
        **(manifest_extra or {}),
    }
    return manifest, json.dumps(manifest, sort_keys=True, indent=1, default=str).encode()


def write_snapshot_stream(lake: Lake, parts: Iterable[pa.Table | pa.RecordBatch], *, snapshot_id: str,
                          manifest_extra: dict[str, Any] | None = None) -> Snapshot:
    """The streaming form of ``write_snapshot_files`` (same format): ``parts``
    must already be in (group_id, trajectory_id) order; memory stays at one part.

    Publication is atomic per id and the first complete one wins; a later (or
    concurrent) writer of the same id verifies the published snapshot and
    returns it, never overwriting it (docs/leases.md, "Snapshot publication"):

    - local lake: files go to ``_snapshots/.tmp-<id16>-<rand>/``, renamed into
      place (a directory rename fails when the target exists);
    - object stores: the payload goes straight to a name of its own,
      ``_snapshots/<id>/members.<rand>.parquet``, then the manifest naming it is
      created with a conditional put (If-None-Match): the commit point. A
      loser deletes its payload. Readers trust only a manifest, and read the
      payload it names.
    """
    existing = try_open(lake, snapshot_id)
    if existing is not None:
        verify_snapshot(lake, snapshot_id)
        return existing
    if lake.is_local:
        return _publish_local(lake, parts, snapshot_id, manifest_extra)
    return _publish_object_store(lake, parts, snapshot_id, manifest_extra)


def _publish_local(lake: Lake, parts: Iterable[pa.Table | pa.RecordBatch],
                   snapshot_id: str, manifest_extra: dict[str, Any] | None) -> Snapshot:
    import uuid

    from pipeline.lake import staging

    rel = snapshot_dir(snapshot_id)
    fs, root = lake.filesystem()
    tmp_rel = f"_snapshots/{TMP_PREFIX}{snapshot_id[:16]}-{uuid.uuid4().hex[:8]}"
    tmp = f"{root}/{tmp_rel}"
    intent = staging.declare(lake, [f"{tmp_rel}/"])   # maintenance leaves the directory alone while we live
    try:
        fs.create_dir(tmp, recursive=True)
        sha, nbytes, rows = _write_payload(fs, f"{tmp}/{DATA_FILE}", parts)
        manifest, mbytes = _manifest_bytes(snapshot_id, DATA_FILE, sha, nbytes, rows, manifest_extra)
        with fs.open_output_stream(f"{tmp}/{MANIFEST}") as f:
            f.write(mbytes)
        _barrier_point(snapshot_id)
        # nothing published without its files: a vanished payload fails here, before the rename
        lake.check_files({f"{tmp_rel}/{DATA_FILE}": nbytes, f"{tmp_rel}/{MANIFEST}": len(mbytes)},
                         what=f"publication of snapshot {snapshot_id}")
        try:
            fs.move(tmp, f"{root}/{rel}")  # atomic directory rename; fails if the id exists
        except OSError:
            # another writer published this id first: its files are the snapshot
            if try_open(lake, snapshot_id) is None:
                raise
            verify_snapshot(lake, snapshot_id)
            return open_snapshot(lake, snapshot_id)
    finally:
        try:
            fs.delete_dir(tmp)
        except (FileNotFoundError, OSError):
            pass
        staging.release(lake, intent)
    return Snapshot(snapshot_id, rel, manifest, sha256_hex(mbytes))


def _publish_object_store(lake: Lake, parts: Iterable[pa.Table | pa.RecordBatch],
                          snapshot_id: str, manifest_extra: dict[str, Any] | None) -> Snapshot:
    import uuid

    from pipeline.lake import objects, staging

    rel = snapshot_dir(snapshot_id)
    fs, root = lake.filesystem()
    data_name = f"{PENDING_DATA_PREFIX}{uuid.uuid4().hex[:16]}.parquet"
    data_path = f"{root}/{rel}/{data_name}"
    committed = False
    intent = staging.declare(lake, [f"{rel}/{data_name}"])   # maintenance leaves the payload alone while we live
    try:
        sha, nbytes, rows = _write_payload(fs, data_path, parts)
        manifest, mbytes = _manifest_bytes(snapshot_id, data_name, sha, nbytes, rows, manifest_extra)
        _barrier_point(snapshot_id)
        # nothing published without its files: a vanished payload fails here, before the manifest
        lake.check_files({f"{rel}/{data_name}": nbytes}, what=f"publication of snapshot {snapshot_id}")
        for attempt in range(5):
            committed = objects.put_if_absent(lake, f"{rel}/{MANIFEST}", mbytes)   # the commit point
            published = None if committed else try_open(lake, snapshot_id)
            if published is not None and published.manifest_sha256 == sha256_hex(mbytes):
                committed = True  # ours (it names our payload): a retried PUT whose first attempt landed
            if committed or published is not None:
                break
            # refused, yet no manifest: a concurrent conditional write was in flight (409) and failed
            import time

            time.sleep(0.2 * (attempt + 1))
        if committed:
            try:   # the payload vanished while the manifest went up: take the publication back
                lake.check_files({f"{rel}/{data_name}": nbytes}, what=f"publication of snapshot {snapshot_id}")
            except IntegrityError:
                objects.delete(lake, f"{rel}/{MANIFEST}")
                committed = False
                raise
    finally:
        if not committed:
            try:
                fs.delete_file(data_path)
            except (FileNotFoundError, OSError):
                pass
        staging.release(lake, intent)
    if committed:
        return Snapshot(snapshot_id, rel, manifest, sha256_hex(mbytes))
    # another writer published this id first: verify it, return it, never overwrite it
    verify_snapshot(lake, snapshot_id)
    return open_snapshot(lake, snapshot_id)


def remove_unpublished_payloads(lake: Lake, *, min_age_s: float, dry_run: bool = False) -> list[str]:
    """Payload files ``_snapshots/<id>/members.<rand>.parquet`` that the id's
    manifest does not name (a losing or killed publisher's on an object store),
    older than ``min_age_s`` and not declared by a live publisher in the staging
    registry (a publication in progress looks the same until its manifest
    lands). Returns ``<id>/<file>`` of each one removed."""
    import time

    import pyarrow.fs as pafs

    from pipeline.lake import staging

    fs, root = lake.filesystem()
    try:
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/_snapshots", allow_not_found=True, recursive=True))
    except (FileNotFoundError, OSError):
        return []
    declared = staging.declared(lake)   # after the listing, before the manifests (docs/write-protocol.md)
    by_dir: dict[str, list] = {}
    for info in infos:
        parts = info.path[len(root) + 1:].split("/")
        if info.type == pafs.FileType.File and len(parts) == 3 and not parts[1].startswith(TMP_PREFIX):
            by_dir.setdefault(parts[1], []).append(info)
    cutoff = time.time() - min_age_s
    out = []
    for sid, files in sorted(by_dir.items()):
        if not SNAPSHOT_ID_RE.fullmatch(sid):
            continue  # not a snapshot directory: not ours to clean
        try:
            snap = try_open(lake, sid)
        except IntegrityError:
            continue  # a damaged manifest: leave the directory for a person to restore
        named = set(snap.manifest.get("files", {})) if snap is not None else set()
        for info in files:
            name = info.base_name
            if name == MANIFEST or name in named or not (name.startswith(PENDING_DATA_PREFIX)
                                                           and name.endswith(".parquet")) \
                    or declared.covers(f"_snapshots/{sid}/{name}"):
                continue
            if info.mtime is not None and info.mtime.timestamp() > cutoff:
                continue
            out.append(f"{sid}/{name}")
            if not dry_run:
                try:
                    fs.delete_file(info.path)
                except (FileNotFoundError, OSError):
                    pass  # removed by a concurrent maintain
    return out
