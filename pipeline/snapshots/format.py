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
Writing and publishing is :mod:`pipeline.snapshots.publish`; the reader
for trainers is :mod:`pipeline.snapshots.reader`.

snapshot_id = sha256 over the members sorted by trajectory_id, one line each
``trajectory_id \\t content_hash``, then ``config_hash`` and the estimator name.
"""


from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import IntegrityError, NotFoundError
from pipeline.lake.ref import as_lake

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

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


MIN_PREFIX = 6   # a shorter prefix of a sha256 id is too likely to match several snapshots to be worth accepting


def resolve_snapshot_id(lake: Lake, ref: str) -> str:
    """The full id for ``ref``: a full id as it is, or a unique prefix of a registered snapshot's id (the
    12-character ids reports and progress lines show). An ambiguous or unknown prefix is an error."""
    check_snapshot_id(ref)
    if len(ref) == 64 or not re.fullmatch(r"[0-9a-f]+", ref):
        return ref
    if len(ref) < MIN_PREFIX:
        raise NotFoundError(f"{ref!r} is too short for a snapshot id prefix (at least {MIN_PREFIX} characters)",
                            hint="pipeline snapshots list shows the snapshots of this lake")
    ids: list[str] = []
    if lake.exists("snapshots"):
        ids = [i for i in lake.read("snapshots", columns=["snapshot_id"]).column(0).to_pylist() if i.startswith(ref)]
    matches = sorted(set(ids))
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise NotFoundError(f"snapshot id prefix {ref} matches {len(matches)} snapshots: "
                            f"{', '.join(m[:16] + '…' for m in matches[:5])}",
                            hint="give more characters of the id (pipeline snapshots list)")
    return ref   # not registered: opening it says whether its files exist


def snapshot_dir(snapshot_id: str) -> str:
    """Directory of a snapshot relative to the lake root."""
    return f"_snapshots/{check_snapshot_id(snapshot_id)}"


@dataclass(frozen=True)
class Snapshot:
    snapshot_id: str
    path: str            # relative to the lake root
    manifest: dict[str, Any]
    manifest_sha256: str


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def try_open(lake: Lake, snapshot_id: str) -> Snapshot | None:
    fs, root = lake.filesystem()
    rel = snapshot_dir(snapshot_id)
    try:
        with fs.open_input_stream(f"{root}/{rel}/{MANIFEST}") as f:
            mbytes = f.read()
    except (FileNotFoundError, OSError):
        return None
    return Snapshot(snapshot_id, rel, _parse_manifest(snapshot_id, mbytes), sha256_hex(mbytes))


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


def _registered(lake: Lake, snapshot_id: str) -> bool:
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


def open_snapshot(lake: Lake | str | os.PathLike[str], snapshot_id: str) -> Snapshot:
    lake = as_lake(lake)
    check_snapshot_id(snapshot_id)
    snap = try_open(lake, snapshot_id)
    if snap is None:
        if _registered(lake, snapshot_id):
            raise IntegrityError(f"snapshot {snapshot_id} is registered but its {MANIFEST} is missing "
                                 f"({lake.uri}/{snapshot_dir(snapshot_id)})",
                                 hint="the snapshot's files were deleted; restore the directory from a copy")
        raise NotFoundError(f"snapshot {snapshot_id} not found under {lake.uri}/_snapshots",
                            hint="pipeline snapshots list shows the snapshots of this lake")
    return snap


def _read_file(lake: Lake, snap: Snapshot, name: str) -> pa.Buffer:
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


def verify_snapshot(lake: Lake | str | os.PathLike[str], snapshot_id: str) -> dict[str, Any]:
    """Rehash every file against the manifest, check the manifest against the
    snapshots table (when it has the row), and recompute the id from the members.
    Raises IntegrityError on any mismatch."""
    lake = as_lake(lake)
    snap = open_snapshot(lake, snapshot_id)
    for name, info in snap.manifest["files"].items():
        data = _read_file(lake, snap, name)
        if sha256_hex(data) != info["sha256"]:
            raise IntegrityError(f"snapshot {snapshot_id}: {name} has sha256 {sha256_hex(data)}, manifest says {info['sha256']}",
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


def read_snapshot_table(lake: Lake | str | os.PathLike[str], snap: Snapshot | str, *, verify: bool = True,
                        columns: list[str] | None = None) -> pa.Table:
    """The snapshot's members with payload. ``verify`` rehashes the files first."""
    lake = as_lake(lake)
    if isinstance(snap, str):
        snap = open_snapshot(lake, snap)
    name = data_file(snap)
    data = _read_file(lake, snap, name)
    if verify and sha256_hex(data) != snap.manifest["files"][name]["sha256"]:
        raise IntegrityError(f"snapshot {snap.snapshot_id}: {name} does not match its manifest")
    return pq.read_table(pa.BufferReader(data), columns=columns)
