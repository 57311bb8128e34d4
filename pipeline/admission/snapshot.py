"""Immutable, content-addressed training-batch snapshots: the file format.

A snapshot is a directory of its own files under the lake root::

    <lake>/_snapshots/<snapshot_id>/members.parquet   schemas/snapshot_payload.yaml
    <lake>/_snapshots/<snapshot_id>/manifest.json     written last

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


def write_snapshot_stream(lake, parts: Iterable[pa.Table | pa.RecordBatch], *, snapshot_id: str,
                          manifest_extra: dict[str, Any] | None = None) -> Snapshot:
    """The streaming form of ``write_snapshot_files`` (same format): ``parts``
    must already be in (group_id, trajectory_id) order; memory stays at one part.

    Files go to a temporary directory renamed into place at the end, so a
    reader (or a concurrent writer of the same id) never sees a partial
    snapshot; if the id already exists it is verified and returned untouched.
    """
    import uuid

    rel = snapshot_dir(snapshot_id)
    existing = _try_open(lake, snapshot_id)
    if existing is not None:
        verify_snapshot(lake, snapshot_id)
        return existing
    schema = table_spec("snapshot_payload").arrow_schema()
    fs, root = lake.filesystem()
    tmp = f"{root}/_snapshots/.tmp-{snapshot_id[:16]}-{uuid.uuid4().hex[:8]}"
    fs.create_dir(tmp, recursive=True)
    rows = 0
    last_key: tuple[str, str] | None = None
    try:
        with fs.open_output_stream(f"{tmp}/{DATA_FILE}") as raw:
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
            data_sha, data_bytes = sink.h.hexdigest(), sink.n
        manifest = {
            "format": FORMAT_VERSION,
            "snapshot_id": snapshot_id,
            "files": {DATA_FILE: {"sha256": data_sha, "bytes": data_bytes, "rows": rows}},
            "num_members": rows,
            **(manifest_extra or {}),
        }
        mbytes = json.dumps(manifest, sort_keys=True, indent=1, default=str).encode()
        with fs.open_output_stream(f"{tmp}/{MANIFEST}") as f:
            f.write(mbytes)
        try:
            if lake.is_local:
                fs.move(tmp, f"{root}/{rel}")  # atomic directory rename
            else:
                # object stores have no directory rename: copy the data, then the
                # manifest, whose presence marks the snapshot complete
                if _try_open(lake, snapshot_id) is not None:
                    raise OSError("published concurrently")
                fs.copy_file(f"{tmp}/{DATA_FILE}", f"{root}/{rel}/{DATA_FILE}")
                fs.copy_file(f"{tmp}/{MANIFEST}", f"{root}/{rel}/{MANIFEST}")
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
            or DATA_FILE not in files:
        raise bad
    return manifest


def _registered(lake, snapshot_id: str) -> bool:
    if not lake.exists("snapshots"):
        return False
    import pyarrow.compute as pc

    rows = lake.read("snapshots", columns=["snapshot_id"])
    return bool(pc.any(pc.equal(rows.column("snapshot_id"), snapshot_id)).as_py())


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


def _read_file(lake, snap: Snapshot, name: str) -> bytes:
    fs, root = lake.filesystem()
    try:
        with fs.open_input_stream(f"{root}/{snap.path}/{name}") as f:
            return f.read()
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
    data = _read_file(lake, snap, DATA_FILE)
    if verify and _sha(data) != snap.manifest["files"][DATA_FILE]["sha256"]:
        raise IntegrityError(f"snapshot {snap.snapshot_id}: {DATA_FILE} does not match its manifest")
    return pq.read_table(pa.BufferReader(data), columns=columns)
