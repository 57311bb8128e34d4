"""The key index: the ``row_key`` values of a keyed table version, which
every keyed append dedupes against (docs/write-protocol.md, "The key index").

``lake maintain`` writes a sorted index of a version's keys under
``<lake>/_index/<table>/``; a reader takes the newest one at or below the
version it checks and adds the keys of the files committed after it. A
process caches the set and brings it forward by reading only new files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from deltalake import DeltaTable

from pipeline.schema import ROW_KEY

if TYPE_CHECKING:
    from pipeline.lake.delta.root import LakeRoot


def key_member(table_keys: np.ndarray, probes: np.ndarray) -> np.ndarray:
    """Boolean mask: which ``probes`` occur in ``table_keys`` (unsorted, may repeat).

    O(N log n) for N table keys and n probes: the few probes are sorted and the
    many table keys binary-searched among them, so nothing of size N is sorted
    or hashed."""
    if len(probes) == 0 or len(table_keys) == 0:
        return np.zeros(len(probes), bool)
    sp = np.sort(probes)
    pos = np.searchsorted(sp, table_keys)
    pos[pos == len(sp)] = 0
    found = sp[pos][sp[pos] == table_keys]
    return np.isin(probes, found)


@dataclass(frozen=True)
class KeySet:
    """The ``row_key`` values of a table version: a sorted index written by
    ``lake maintain`` (memory-mapped on a local lake) plus the keys of files
    committed after it, unsorted. ``contains`` costs O(n log N) for n probes."""

    index: np.ndarray           # sorted (may be empty)
    loose: np.ndarray           # unsorted, may repeat

    def contains(self, probes: np.ndarray) -> np.ndarray:
        mask = key_member(self.loose, probes)
        if len(self.index) and len(probes):
            pos = np.searchsorted(self.index, probes)
            ok = pos < len(self.index)
            mask |= ok & (self.index[np.minimum(pos, len(self.index) - 1)] == probes)
        return mask

    def __len__(self) -> int:
        return len(self.index) + len(self.loose)


EMPTY_KEYS = np.empty(0, np.int64)
KEY_CACHE: dict[tuple[str, str], tuple[int, frozenset[str], KeySet]] = {}
INDEX_DIR = "_index"  # <lake>/_index/<table>/keys-<version>.idx: sorted row_keys of that version


def keys(lake: LakeRoot, name: str, dt: DeltaTable, *, since: int | None = None) -> KeySet:
    """``row_key`` of every row in ``dt`` (since=None) or in the files committed
    after version ``since``. The full set is the newest key index at or
    below ``dt``'s version (written by ``lake maintain``) plus the keys of the
    files committed after it, so its cost follows the data added since the
    last maintenance, not the table's history. Cached per process and
    brought forward by reading only files added since the cached version."""
    version = dt.version()
    if since is not None:
        if since >= version:
            return KeySet(EMPTY_KEYS, EMPTY_KEYS)
        return KeySet(EMPTY_KEYS, read_keys(lake, name, lake.files_added(name, dt, since=since)))
    cached = KEY_CACHE.get((lake.uri, name))
    live = lake.live_files(dt)
    names = frozenset(p for p, _ in live)
    if cached is not None and cached[0] <= version and cached[1] <= names:
        # only appends since the cached version: read just the new files
        extra = [f for f in live if f[0] not in cached[1]]
        ks = cached[2]
        if extra:
            ks = KeySet(ks.index, np.concatenate([ks.loose, read_keys(lake, name, extra)]))
    else:
        found, rejected = _load_key_index(lake, name, version, dt=dt)
        if found is None:
            ks = KeySet(EMPTY_KEYS, read_keys(lake, name, live))
            if rejected:   # rebuild from the keys just read: the next reader is fast again
                try:
                    write_key_index(lake, name, dt=dt, keys=ks.loose)
                except OSError as exc:
                    log.warning("could not rebuild the key index of %s: %s", name, exc)
        else:
            iv, index = found
            ks = KeySet(index, read_keys(lake, name, lake.files_added(name, dt, since=iv)))
    KEY_CACHE[(lake.uri, name)] = (version, names, ks)
    return ks


def index_base(lake: LakeRoot, name: str) -> str:
    _, root = lake.filesystem()
    return f"{root}/{INDEX_DIR}/{name}"



INDEX_FORMAT = "pipeline.key-index/1"
ANCHOR_META = "pipeline.key_index"    # commit metadata: the digest of the keys of the version that commit creates
INDEX_ATTEMPTS = 20
log = logging.getLogger("pipeline.lake")


def _index_name(version: int) -> str:
    return f"keys-{version:020d}.idx"


def commit_file(lake: LakeRoot, name: str, version: int) -> bytes | None:
    """The bytes of the log entry of commit ``version`` of table ``name``; None when it is gone."""
    fs, _ = lake.filesystem()
    base = lake.table_path(name)
    try:
        with fs.open_input_stream(f"{base}/_delta_log/{version:020d}.json") as f:
            return f.read()
    except (FileNotFoundError, OSError):
        return None


def _commit_sha(lake: LakeRoot, name: str, version: int) -> str | None:
    """sha256 of the log entry of ``version``: names that commit in this history of the table."""
    raw = commit_file(lake, name, version)
    return None if raw is None else hashlib.sha256(raw).hexdigest()


def index_anchor(raw: bytes | None) -> dict[str, Any] | None:
    """The key-index record (``pipeline.key_index`` in the commit's metadata) of a commit's log entry."""
    for line in (raw or b"").splitlines():
        try:
            info = json.loads(line).get("commitInfo")
            if isinstance(info, dict) and isinstance(info.get(ANCHOR_META), str):
                found = json.loads(info[ANCHOR_META])
                return found if isinstance(found, dict) else None
        except (ValueError, AttributeError):
            return None
    return None


def encode_index(header: dict[str, Any], keys: np.ndarray) -> bytes:
    """One JSON header line (padded to 8 bytes) followed by the keys as little-endian int64."""
    body = np.ascontiguousarray(keys, dtype="<i8").tobytes()
    head = json.dumps(dict(header, format=INDEX_FORMAT, rows=int(len(keys)),
                           sha256=hashlib.sha256(body).hexdigest()), sort_keys=True).encode()
    head += b" " * (-(len(head) + 1) % 8) + b"\n"
    return head + body


def decode_index(raw: bytes, *, table: str, table_id: str, version: int, commit: str | None,
                 anchor: dict[str, Any] | None = None) -> np.ndarray:
    """The sorted keys of an index file, or ValueError saying why it cannot be trusted. ``anchor``:
    the key-index record committed in the log at ``version`` (the digest of that version's keys, as
    the writer of the index read them from the table's files)."""
    nl = raw.find(b"\n")
    if nl < 0:
        raise ValueError("no header (empty, truncated or an older format)")
    try:
        head = json.loads(raw[:nl])
    except ValueError:
        raise ValueError("the header is not JSON (an older format, or damaged)") from None
    if not isinstance(head, dict) or head.get("format") != INDEX_FORMAT:
        raise ValueError(f"format {head.get('format') if isinstance(head, dict) else None!r}, not {INDEX_FORMAT}")
    if head.get("table") != table or head.get("table_id") != table_id:
        raise ValueError(f"built from table {head.get('table')!r} id {head.get('table_id')!r}, not this one")
    if head.get("version") != version:
        raise ValueError(f"its header says version {head.get('version')!r}")
    if commit is None or head.get("commit") != commit:
        raise ValueError(f"built from another history of the table (version {version}'s commit differs)")
    body = raw[nl + 1:]
    rows = head.get("rows")
    if not isinstance(rows, int) or len(body) != 8 * rows:
        raise ValueError(f"{len(body)} bytes of keys where the header says {rows!r} rows")
    digest = hashlib.sha256(body).hexdigest()
    if digest != head.get("sha256"):
        raise ValueError("its checksum does not match its keys")
    if anchor is None:
        raise ValueError(f"version {version}'s commit records no key digest (an older format, or not an index "
                         "commit)")
    if anchor.get("sha256") != digest or anchor.get("rows") != rows or anchor.get("table_id") != table_id:
        raise ValueError(f"its keys are not the keys version {version} committed (digest "
                         f"{str(anchor.get('sha256'))[:12]}..., {anchor.get('rows')} rows in the log): forged or "
                         "damaged")
    keys = np.frombuffer(body, dtype="<i8").astype(np.int64, copy=False)
    if len(keys) > 1 and not bool(np.all(keys[1:] >= keys[:-1])):
        raise ValueError("its keys are not sorted")
    return keys


def write_key_index(lake: LakeRoot, name: str, *, dt: DeltaTable | None = None, keys: np.ndarray | None = None
                    ) -> int | None:
    """Write the sorted ``row_key`` of every row of ``name``'s latest version (or of ``dt``, whose
    keys are ``keys`` when given) and delete older indexes; returns the version the index is of.

    First a commit without files records the keys' digest (``pipeline.key_index`` in its metadata:
    sha256 and row count of the sorted keys, the table id). It carries ``pipeline.keys`` at the next
    version, so it lands only if no keyed append landed after the version read: the table then holds
    exactly those keys at the version it creates. The index is written as
    ``_index/<name>/keys-<that version>.idx`` (one atomic put). A reader trusts it only when its keys
    hash to the digest that commit records (:func:`decode_index`): the digest is in the table's own
    log, so an index rewritten with other keys and a recomputed checksum does not match. None when
    keyed appends kept landing first (no index is written; readers read the table's keys)."""
    import random
    import time

    import pyarrow.fs as pafs
    from deltalake import CommitProperties, Transaction
    from deltalake.exceptions import CommitFailedError

    from pipeline.lake.delta.common import KEYS_APP, MAX_COMMIT_RETRIES, write_metadata
    from pipeline.schema import table_spec

    spec = table_spec(name)
    dt = dt or lake.table(name)
    version = None
    for attempt in range(INDEX_ATTEMPTS):
        if attempt:
            time.sleep(random.uniform(0, min(0.02 * 2 ** attempt, 1.0)))
            dt, keys = lake.table(name), None
        keys = np.sort(read_keys(lake, name, lake.live_files(dt)) if keys is None else keys)
        tid = str(dt.metadata().id)
        body = np.ascontiguousarray(keys, dtype="<i8").tobytes()
        anchor = {"sha256": hashlib.sha256(body).hexdigest(), "rows": int(len(keys)), "table_id": tid,
                  "read_version": dt.version()}
        n = (dt.transaction_version(KEYS_APP) or 0) + 1
        try:
            dt.create_write_transaction(
                [], mode="append", schema=spec.arrow_schema(), partition_by=list(spec.partition_by) or None,
                commit_properties=CommitProperties(
                    custom_metadata=dict(write_metadata("lake maintain: key index", None),
                                         **{ANCHOR_META: json.dumps(anchor, sort_keys=True)}),
                    max_commit_retries=MAX_COMMIT_RETRIES,
                    app_transactions=[Transaction(KEYS_APP, n, int(time.time() * 1000))]))
        except CommitFailedError:
            continue    # a keyed append landed after our read: read the keys again
        version = _carrying(lake, name, KEYS_APP, n, dt.version())
        if version is not None:
            break
    if version is None or keys is None:
        return None
    data = encode_index({"table": name, "table_id": tid, "version": version,
                         "commit": _commit_sha(lake, name, version)}, keys)
    fs, _ = lake.filesystem()
    base = index_base(lake, name)
    fs.create_dir(base, recursive=True)
    final = f"{base}/{_index_name(version)}"
    tmp = f"{base}/.tmp-{uuid.uuid4().hex}"
    with fs.open_output_stream(tmp if lake.is_local else final) as f:
        f.write(data)
    if lake.is_local:
        fs.move(tmp, final)  # atomic rename: a reader never sees half an index
    for info in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True)):
        fname = info.path.rsplit("/", 1)[-1]
        if fname.startswith("keys-") and fname != _index_name(version) and (
                fname.endswith(".npy") or fname < _index_name(version)):
            try:
                fs.delete_file(info.path)
            except (FileNotFoundError, OSError):
                pass
    return version


def _carrying(lake: LakeRoot, name: str, app: str, txn_version: int, after: int) -> int | None:
    """The version of the commit after ``after`` that carries ``(app, txn_version)`` (each is committed once)."""
    latest = lake.version(name)
    for v in range(latest if latest is not None else after, after, -1):
        for e in lake.log_entries(name, v) or []:
            t = e.get("txn")
            if t and t.get("appId") == app and int(t.get("version", -1)) == txn_version:
                return v
    return None


def load_key_index(lake: LakeRoot, name: str, version: int, *, dt: DeltaTable | None = None
                   ) -> tuple[int, np.ndarray] | None:
    """(index version, sorted keys) of the newest trustworthy index at or below ``version``."""
    return _load_key_index(lake, name, version, dt=dt)[0]


def _load_key_index(lake: LakeRoot, name: str, version: int, *, dt: DeltaTable | None = None
                    ) -> tuple[tuple[int, np.ndarray] | None, bool]:
    """(what ``load_key_index`` returns, whether an index was ignored as untrustworthy).

    An index costs time, never correctness: anything in ``_index/`` that does not
    verify (another table or history, a damaged or unsorted file, a failed
    checksum, an older format) is ignored with a warning, and the keys come from
    the table itself."""
    import pyarrow.fs as pafs

    fs, _ = lake.filesystem()
    base = index_base(lake, name)
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except (FileNotFoundError, OSError):
        return None, False
    found = []
    for info in infos:
        fname = info.path.rsplit("/", 1)[-1]
        stem, _, ext = fname.partition(".")
        if fname.startswith("keys-") and ext in ("idx", "npy") and stem[len("keys-"):].isdigit():
            v = int(stem[len("keys-"):])
            if v <= version:
                found.append((v, ext, info.path))
    if not found:
        return None, False
    dt = dt or lake.table(name)
    table_id = str(dt.metadata().id)
    rejected = False
    for v, ext, path in sorted(found, reverse=True):
        try:
            with fs.open_input_stream(path) as f:
                raw = f.read()
        except (FileNotFoundError, OSError):
            continue  # deleted by a newer maintain meanwhile: try the next
        try:
            if ext != "idx":
                raise ValueError("an older format without table identity or checksum")
            entry = commit_file(lake, name, v)
            return (v, decode_index(raw, table=name, table_id=table_id, version=v,
                                    commit=None if entry is None else hashlib.sha256(entry).hexdigest(),
                                    anchor=index_anchor(entry))), rejected
        except ValueError as exc:
            rejected = True
            log.warning("ignoring the key index %s of table %s: %s; reading the keys from the table "
                        "(the index is rebuilt)", path.rsplit("/", 1)[-1], name, exc)
    return None, rejected


def read_keys(lake: LakeRoot, name: str, files: list[tuple[str, dict[str, str | None]]]) -> np.ndarray:
    if not files:
        return np.empty(0, np.int64)
    t = lake.files_dataset(name, files, schema=pa.schema([pa.field(ROW_KEY, pa.int64())])).to_table(
        columns=[ROW_KEY])
    return t.column(ROW_KEY).to_numpy()

