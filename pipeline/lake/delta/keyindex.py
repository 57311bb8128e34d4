"""The key index: the ``row_key`` values of a keyed table version, which
every keyed append dedupes against (docs/write-protocol.md, "The key index").

``lake maintain`` writes a sorted index of a version's keys under
``<lake>/_index/<table>/``; a reader takes the newest one at or below the
version it checks and adds the keys of the files committed after it. A
process caches the set and brings it forward by reading only new files.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
from deltalake import DeltaTable

from pipeline.schema import ROW_KEY

if TYPE_CHECKING:
    from pipeline.lake.delta.store import Lake


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


_EMPTY = np.empty(0, np.int64)
_KEY_CACHE: dict[tuple[str, str], tuple[int, frozenset[str], KeySet]] = {}
INDEX_DIR = "_index"  # <lake>/_index/<table>/keys-<version>.npy: sorted row_keys of that version


def keys(lake: Lake, name: str, dt: DeltaTable, *, since: int | None = None) -> KeySet:
    """``row_key`` of every row in ``dt`` (since=None) or in the files committed
    after version ``since``. The full set is the newest key index at or
    below ``dt``'s version (written by ``lake maintain``) plus the keys of the
    files committed after it, so its cost follows the data added since the
    last maintenance, not the table's history. Cached per process and
    brought forward by reading only files added since the cached version."""
    version = dt.version()
    if since is not None:
        if since >= version:
            return KeySet(_EMPTY, _EMPTY)
        return KeySet(_EMPTY, read_keys(lake, name, lake.files_added(name, dt, since=since)))
    cached = _KEY_CACHE.get((lake.uri, name))
    live = lake.live_files(dt)
    names = frozenset(p for p, _ in live)
    if cached is not None and cached[0] <= version and cached[1] <= names:
        # only appends since the cached version: read just the new files
        extra = [f for f in live if f[0] not in cached[1]]
        ks = cached[2]
        if extra:
            ks = KeySet(ks.index, np.concatenate([ks.loose, read_keys(lake, name, extra)]))
    else:
        found = load_key_index(lake, name, version)
        if found is None:
            ks = KeySet(_EMPTY, read_keys(lake, name, live))
        else:
            iv, index = found
            ks = KeySet(index, read_keys(lake, name, lake.files_added(name, dt, since=iv)))
    _KEY_CACHE[(lake.uri, name)] = (version, names, ks)
    return ks


def index_base(lake: Lake, name: str) -> str:
    _, root = lake.filesystem()
    return f"{root}/{INDEX_DIR}/{name}"



def write_key_index(lake: Lake, name: str) -> int:
    """Write the sorted ``row_key`` of every row of ``name``'s latest version as
    ``_index/<name>/keys-<version>.npy`` (one atomic put) and delete older
    indexes. Any index is valid forever: readers add the keys of files
    committed after its version."""
    import io

    import pyarrow.fs as pafs

    dt = lake.table(name)
    version = dt.version()
    keys = np.sort(read_keys(lake, name, lake.live_files(dt)))
    buf = io.BytesIO()
    np.save(buf, keys, allow_pickle=False)
    fs, _ = lake.filesystem()
    base = index_base(lake, name)
    fs.create_dir(base, recursive=True)
    final = f"{base}/keys-{version:020d}.npy"
    tmp = f"{base}/.tmp-{uuid.uuid4().hex}"
    with fs.open_output_stream(tmp if lake.is_local else final) as f:
        f.write(buf.getvalue())
    if lake.is_local:
        fs.move(tmp, final)  # atomic rename: a reader never sees half an index
    for info in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True)):
        fname = info.path.rsplit("/", 1)[-1]
        if fname.startswith("keys-") and fname < f"keys-{version:020d}.npy":
            try:
                fs.delete_file(info.path)
            except (FileNotFoundError, OSError):
                pass
    return version



def load_key_index(lake: Lake, name: str, version: int) -> tuple[int, np.ndarray] | None:
    """(index version, sorted keys) of the newest index at or below ``version``."""
    import pyarrow.fs as pafs

    fs, _ = lake.filesystem()
    base = index_base(lake, name)
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except (FileNotFoundError, OSError):
        return None
    found = []
    for info in infos:
        fname = info.path.rsplit("/", 1)[-1]
        if fname.startswith("keys-") and fname.endswith(".npy"):
            v = int(fname[len("keys-"):-len(".npy")])
            if v <= version:
                found.append((v, info.path))
    for v, path in sorted(found, reverse=True):
        try:
            if lake.is_local:
                return v, np.load(path, mmap_mode="r", allow_pickle=False)
            import io

            with fs.open_input_file(path) as f:
                return v, np.load(io.BytesIO(f.read()), allow_pickle=False)
        except (FileNotFoundError, OSError, ValueError):
            continue  # deleted by a newer maintain meanwhile: try the next
    return None



def read_keys(lake: Lake, name: str, files: list[tuple[str, dict[str, str | None]]]) -> np.ndarray:
    if not files:
        return np.empty(0, np.int64)
    t = lake.files_dataset(name, files, schema=pa.schema([pa.field(ROW_KEY, pa.int64())])).to_table(
        columns=[ROW_KEY])
    return t.column(ROW_KEY).to_numpy()

