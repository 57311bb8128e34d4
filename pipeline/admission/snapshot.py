"""Immutable, content-addressed training-batch snapshots: the file format.

A snapshot is a directory of its own files under the lake root::

    <lake>/_snapshots/<snapshot_id>/members.parquet   schemas/snapshot_payload.yaml
    <lake>/_snapshots/<snapshot_id>/manifest.json     written last: the commit point

(on object stores the payload is ``members.<rand>.parquet``, the name the
manifest gives it; see ``write_snapshot_stream``).

``manifest.json`` lists the sha256 of every data file, the member count, the
admission config and estimator. The ``snapshots`` table row (committed after
the files) is what publishes it; ``manifest_sha256`` there pins the manifest.
Because the payload lives in the snapshot's own files, appends, compaction,
checkpointing, log cleanup or vacuum of the source tables, or copying the lake
elsewhere, cannot change what an id means. ``verify_snapshot`` rehashes.

snapshot_id = sha256 over the members sorted by trajectory_id, one line each
``trajectory_id \\t content_hash``, then ``config_hash`` and the estimator name.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import IntegrityError, NotFoundError
from pipeline.schema import table_spec

FORMAT_VERSION = 1
DATA_FILE = "members.parquet"
MANIFEST = "manifest.json"
# Names of uncommitted payload, for cleanup: a local publication in progress
# (or killed) is a directory _snapshots/.tmp-*; on object stores a payload
# _snapshots/<id>/members.<rand>.parquet that the id's manifest does not name
# (or with no manifest) is a loser's or a killed writer's.
TMP_PREFIX = ".tmp-"
PENDING_DATA_PREFIX = "members."


def compute_snapshot_id(members: Iterable[tuple[str, str]], config_hash: str, estimator: str) -> str:
    """sha256 over sorted (trajectory_id, content_hash), the config hash and the estimator."""
    h = hashlib.sha256(f"snapshot-v{FORMAT_VERSION}\n".encode())
    for tid, chash in sorted(members):
        h.update(f"{tid}\t{chash}\n".encode())
    h.update(f"config\t{config_hash}\nestimator\t{estimator}\n".encode())
    return h.hexdigest()


# what a snapshot id may look like (ids are sha256 hex; never a path: no '/', no '..')
SNAPSHOT_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_snapshot_id(snapshot_id: str) -> str:
    if not isinstance(snapshot_id, str) or not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
        raise NotFoundError(f"{snapshot_id!r} is not a snapshot id (64 hexadecimal characters)",
                            hint="pipeline snapshots list shows the snapshots of this lake")
    return snapshot_id


def snapshot_dir(snapshot_id: str) -> str:
    """Directory of a snapshot relative to the lake root."""
    return f"_snapshots/{check_snapshot_id(snapshot_id)}"


@dataclass(frozen=True)
class Snapshot:
    snapshot_id: str
    path: str            # relative to the lake root
    manifest: dict[str, Any]
    manifest_sha256: str


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_snapshot_files(lake, payload: pa.Table, *, snapshot_id: str,
                         manifest_extra: dict[str, Any] | None = None) -> Snapshot:
    """Write ``payload`` (schemas/snapshot_payload.yaml; sorted here) and the manifest.

    Idempotent: if a complete snapshot with this id exists (manifest present and
    verifying), it is returned untouched: immutable means never rewritten.
    """
    spec = table_spec("snapshot_payload")
    payload = payload.select(spec.names).cast(spec.arrow_schema())
    payload = payload.sort_by([("group_id", "ascending"), ("trajectory_id", "ascending")])
    return write_snapshot_stream(lake, [payload], snapshot_id=snapshot_id, manifest_extra=manifest_extra)


class _HashingWriter:
    """File-like sink that sha256-hashes and counts what passes through."""

    def __init__(self, sink) -> None:
        self.sink, self.h, self.n, self.closed = sink, hashlib.sha256(), 0, False

    def write(self, data) -> int:
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
    import time
    from pathlib import Path

    d = os.environ.get(PUBLISH_BARRIER_ENV)
    if not d:
        return
    Path(d, f"ready-{os.getpid()}").write_text(snapshot_id)
    deadline = time.time() + 120
    while not Path(d, "go").exists() and time.time() < deadline:
        time.sleep(0.0005)


def _write_payload(fs, path: str, parts: Iterable[pa.Table | pa.RecordBatch]) -> tuple[str, int, int]:
    """Stream the sorted parts into one Parquet file -> (sha256, bytes, rows)."""
    schema = table_spec("snapshot_payload").arrow_schema()
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


def write_snapshot_stream(lake, parts: Iterable[pa.Table | pa.RecordBatch], *, snapshot_id: str,
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
    existing = _try_open(lake, snapshot_id)
    if existing is not None:
        verify_snapshot(lake, snapshot_id)
        return existing
    if lake.is_local:
        return _publish_local(lake, parts, snapshot_id, manifest_extra)
    return _publish_object_store(lake, parts, snapshot_id, manifest_extra)


def _publish_local(lake, parts, snapshot_id: str, manifest_extra: dict[str, Any] | None) -> Snapshot:
    import uuid

    rel = snapshot_dir(snapshot_id)
    fs, root = lake.filesystem()
    tmp = f"{root}/_snapshots/{TMP_PREFIX}{snapshot_id[:16]}-{uuid.uuid4().hex[:8]}"
    fs.create_dir(tmp, recursive=True)
    try:
        sha, nbytes, rows = _write_payload(fs, f"{tmp}/{DATA_FILE}", parts)
        manifest, mbytes = _manifest_bytes(snapshot_id, DATA_FILE, sha, nbytes, rows, manifest_extra)
        with fs.open_output_stream(f"{tmp}/{MANIFEST}") as f:
            f.write(mbytes)
        _barrier_point(snapshot_id)
        try:
            fs.move(tmp, f"{root}/{rel}")  # atomic directory rename; fails if the id exists
        except OSError:
            # another writer published this id first: its files are the snapshot
            if _try_open(lake, snapshot_id) is None:
                raise
            verify_snapshot(lake, snapshot_id)
            return _try_open(lake, snapshot_id)  # type: ignore[return-value]
    finally:
        try:
            fs.delete_dir(tmp)
        except (FileNotFoundError, OSError):
            pass
    return Snapshot(snapshot_id, rel, manifest, _sha(mbytes))


def _publish_object_store(lake, parts, snapshot_id: str, manifest_extra: dict[str, Any] | None) -> Snapshot:
    import uuid

    from pipeline.lake import objects

    rel = snapshot_dir(snapshot_id)
    fs, root = lake.filesystem()
    data_name = f"{PENDING_DATA_PREFIX}{uuid.uuid4().hex[:16]}.parquet"
    data_path = f"{root}/{rel}/{data_name}"
    committed = False
    try:
        sha, nbytes, rows = _write_payload(fs, data_path, parts)
        manifest, mbytes = _manifest_bytes(snapshot_id, data_name, sha, nbytes, rows, manifest_extra)
        _barrier_point(snapshot_id)
        for attempt in range(5):
            committed = objects.put_if_absent(lake, f"{rel}/{MANIFEST}", mbytes)   # the commit point
            published = None if committed else _try_open(lake, snapshot_id)
            if published is not None and published.manifest_sha256 == _sha(mbytes):
                committed = True  # ours (it names our payload): a retried PUT whose first attempt landed
            if committed or published is not None:
                break
            # refused, yet no manifest: a concurrent conditional write was in flight (409) and failed
            import time

            time.sleep(0.2 * (attempt + 1))
    finally:
        if not committed:
            try:
                fs.delete_file(data_path)
            except (FileNotFoundError, OSError):
                pass
    if committed:
        return Snapshot(snapshot_id, rel, manifest, _sha(mbytes))
    # another writer published this id first: verify it, return it, never overwrite it
    verify_snapshot(lake, snapshot_id)
    return _try_open(lake, snapshot_id)  # type: ignore[return-value]


def remove_unpublished_payloads(lake, *, min_age_s: float, dry_run: bool = False) -> list[str]:
    """Payload files ``_snapshots/<id>/members.<rand>.parquet`` that the id's
    manifest does not name (a losing or killed publisher's on an object store),
    older than ``min_age_s`` (a publication in progress looks the same until
    its manifest lands). Returns ``<id>/<file>`` of each one removed."""
    import time

    import pyarrow.fs as pafs

    fs, root = lake.filesystem()
    try:
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/_snapshots", allow_not_found=True, recursive=True))
    except (FileNotFoundError, OSError):
        return []
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
            snap = _try_open(lake, sid)
        except IntegrityError:
            continue  # a damaged manifest: leave the directory for a person to restore
        named = set(snap.manifest.get("files", {})) if snap is not None else set()
        for info in files:
            name = info.base_name
            if name == MANIFEST or name in named or not (name.startswith(PENDING_DATA_PREFIX)
                                                           and name.endswith(".parquet")):
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


def _try_open(lake, snapshot_id: str) -> Snapshot | None:
    fs, root = lake.filesystem()
    rel = snapshot_dir(snapshot_id)
    try:
        with fs.open_input_stream(f"{root}/{rel}/{MANIFEST}") as f:
            mbytes = f.read()
    except (FileNotFoundError, OSError):
        return None
    return Snapshot(snapshot_id, rel, _parse_manifest(snapshot_id, mbytes), _sha(mbytes))


def _parse_manifest(snapshot_id: str, mbytes: bytes) -> dict[str, Any]:
    bad = IntegrityError(f"snapshot {snapshot_id}: {MANIFEST} is not a valid manifest",
                         hint="the snapshot's files were damaged; restore the snapshot directory from a copy, "
                              "or re-run admission on a lake copy to rebuild it")
    try:
        manifest = json.loads(mbytes)
    except (ValueError, UnicodeDecodeError):
        raise bad from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) and "sha256" in v for v in files.values()) \
            or len(_payload_names(files)) != 1:
        raise bad
    return manifest


def _registered(lake, snapshot_id: str) -> bool:
    if not lake.exists("snapshots"):
        return False
    import pyarrow.compute as pc

    rows = lake.read("snapshots", columns=["snapshot_id"])
    return bool(pc.any(pc.equal(rows.column("snapshot_id"), snapshot_id)).as_py())


def _payload_names(files: dict[str, Any]) -> list[str]:
    return [n for n in files if n == DATA_FILE or (n.startswith(PENDING_DATA_PREFIX) and n.endswith(".parquet"))]


def data_file(snap: Snapshot) -> str:
    """The payload file the manifest names (``members.parquet`` on a local lake,
    ``members.<rand>.parquet`` when published on an object store)."""
    names = _payload_names(snap.manifest["files"])
    if len(names) != 1:
        raise IntegrityError(f"snapshot {snap.snapshot_id}: manifest names {sorted(snap.manifest['files'])}, "
                             "expected one payload")
    return names[0]


def open_snapshot(lake, snapshot_id: str) -> Snapshot:
    check_snapshot_id(snapshot_id)
    snap = _try_open(lake, snapshot_id)
    if snap is None:
        if _registered(lake, snapshot_id):
            raise IntegrityError(f"snapshot {snapshot_id} is registered but its {MANIFEST} is missing "
                                 f"({lake.uri}/{snapshot_dir(snapshot_id)})",
                                 hint="the snapshot's files were deleted; restore the directory from a copy")
        raise NotFoundError(f"snapshot {snapshot_id} not found under {lake.uri}/_snapshots",
                            hint="pipeline snapshots list shows the snapshots of this lake")
    return snap


def _read_file(lake, snap: Snapshot, name: str) -> pa.Buffer:
    fs, root = lake.filesystem()
    try:
        with fs.open_input_file(f"{root}/{snap.path}/{name}") as f:
            # Arrow-allocated memory, not Python bytes (which a stream's read_buffer() wraps):
            # the Parquet reader's threads may drop the last reference after we return, and
            # releasing Python bytes there needs the interpreter, which aborts the process
            # when it is shutting down (docs/clean-exit.md)
            return f.read_buffer()
    except (FileNotFoundError, OSError):
        raise IntegrityError(f"snapshot {snap.snapshot_id}: {name} listed in the manifest is missing",
                             hint="the snapshot's files were deleted; restore the directory from a copy") from None


def verify_snapshot(lake, snapshot_id: str) -> dict[str, Any]:
    """Rehash every file against the manifest, check the manifest against the
    snapshots table (when it has the row), and recompute the id from the members.
    Raises IntegrityError on any mismatch."""
    snap = open_snapshot(lake, snapshot_id)
    for name, info in snap.manifest["files"].items():
        data = _read_file(lake, snap, name)
        if _sha(data) != info["sha256"]:
            raise IntegrityError(f"snapshot {snapshot_id}: {name} has sha256 {_sha(data)}, manifest says {info['sha256']}",
                                 hint="the snapshot's files were modified; restore them from a copy")
    table = read_snapshot_table(lake, snap, verify=False)
    if "config_hash" not in snap.manifest or "advantage_estimator" not in snap.manifest:
        raise IntegrityError(f"snapshot {snapshot_id}: the manifest lacks config_hash/advantage_estimator",
                             hint="the manifest was edited or truncated; restore it from a copy")
    recomputed = compute_snapshot_id(
        zip(table.column("trajectory_id").to_pylist(), table.column("content_hash").to_pylist()),
        snap.manifest["config_hash"], snap.manifest["advantage_estimator"])
    if recomputed != snapshot_id:
        raise IntegrityError(f"snapshot {snapshot_id}: members hash to {recomputed}")
    row_sha = None
    if lake.exists("snapshots"):
        import pyarrow.compute as pc

        rows = lake.read("snapshots", columns=["snapshot_id", "manifest_sha256"])
        rows = rows.filter(pc.equal(rows.column("snapshot_id"), snapshot_id))  # in Arrow: never pruned by stats
        if rows.num_rows:
            row_sha = rows.column("manifest_sha256")[0].as_py()
            if row_sha != snap.manifest_sha256:
                raise IntegrityError(f"snapshot {snapshot_id}: manifest sha256 {snap.manifest_sha256} differs from "
                                     f"the snapshots table ({row_sha})")
    return {"snapshot_id": snapshot_id, "ok": True, "files": len(snap.manifest["files"]),
            "members": table.num_rows, "manifest_sha256": snap.manifest_sha256, "registered": row_sha is not None}


def read_snapshot_table(lake, snap: Snapshot | str, *, verify: bool = True, columns: list[str] | None = None) -> pa.Table:
    """The snapshot's members with payload. ``verify`` rehashes the files first."""
    if isinstance(snap, str):
        snap = open_snapshot(lake, snap)
    name = data_file(snap)
    data = _read_file(lake, snap, name)
    if verify and _sha(data) != snap.manifest["files"][name]["sha256"]:
        raise IntegrityError(f"snapshot {snap.snapshot_id}: {name} does not match its manifest")
    return pq.read_table(pa.BufferReader(data), columns=columns)
