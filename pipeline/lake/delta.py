"""The one adapter over ``deltalake`` (delta-rs). Nothing else imports it.

Every write is an append with commit metadata (who, which command, config
hash) and an application transaction, so a writer that retries after an
ambiguous failure can ask the log whether its batch already landed instead of
appending it again. delta-rs records ``app_transactions`` but does not refuse a
repeated version: the exactly-once check below is ours.

Tables with a ``row_key`` column (trajectories, events) never hold two rows
with one key, under any number of concurrent writers: every append dedupes
against the keys in the table and commits carrying the next version of one
shared application transaction (``pipeline.keys``), so of two appends that
read the same table version delta-rs lets exactly one commit; the other
re-checks only the files committed since and retries. Compaction commits
carry ``pipeline.compact`` the same way. docs/write-protocol.md has the
whole argument.
"""

from __future__ import annotations

import getpass
import os
import random
import socket
import sys
import time
import uuid
from dataclasses import dataclass
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, TableNotFoundError

from pipeline import __version__
from pipeline.errors import CommitError, NotFoundError
from pipeline.schema import ROW_KEY, TableSpec, table_spec

DEFAULT_LAKE = "./lake"

# Old versions stay loadable until `pipeline lake maintain` says otherwise:
# delta-rs would otherwise clean expired logs (30 days) on checkpoint.
TABLE_PROPERTIES: dict[str, str] = {
    "delta.logRetentionDuration": "interval 36500 days",
    "delta.enableExpiredLogCleanup": "false",
    "delta.deletedFileRetentionDuration": "interval 7 days",
    "delta.checkpointInterval": "50",
}

# Raised from delta-rs's 15: with 8 writers on one table, 22 of 999 commits
# still failed at the default in our measurements.
MAX_COMMIT_RETRIES = 100
MAX_ATTEMPTS = 8
# Keyed appends lose the serialising transaction to every concurrent keyed
# append that commits first; each loss costs one log reload and a check of the
# files committed meanwhile, so they get more attempts.
MAX_KEYED_ATTEMPTS = 200

KEYS_APP = "pipeline.keys"         # bumped by every append to a keyed table
COMPACT_APP = "pipeline.compact"   # bumped by every compaction commit
# A staged (written, uncommitted) data file older than this is rewritten before
# it is committed, so orphan cleanup, which only removes unreferenced files
# older than ORPHAN_MIN_AGE_S, can never delete a file a live writer commits.
STAGE_MAX_AGE_S = 30 * 60
ORPHAN_MIN_AGE_S = 2 * STAGE_MAX_AGE_S
# Test hook for kill tests: "<point>=<marker path>" makes the process write the
# marker at that point of the write path and block there until it is killed.
PAUSE_AT_ENV = "PIPELINE_TEST_PAUSE_AT"


def pause_point(point: str) -> None:
    raw = os.environ.get(PAUSE_AT_ENV)
    if not raw:
        return
    want, _, marker = raw.partition("=")
    if want != point:
        return
    tmp = Path(f"{marker}.tmp{os.getpid()}")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, marker)  # whole or absent: a test reading the marker never sees it half written
    while True:  # inside the critical section until the test kills us
        time.sleep(60)


class LockTaken(Exception):
    """The serialising transaction version this commit needed was taken by
    another writer: the caller must re-read and decide again."""

    def __init__(self, app: str, version: int) -> None:
        super().__init__(f"{app} version {version} already committed")
        self.app, self.version = app, version


class KeyRace(Exception):
    """Staged rows whose keys a concurrent append committed first (or staged
    files too old to commit safely, with ``keys`` empty): the caller must
    re-read, dedupe and stage again."""

    def __init__(self, keys: np.ndarray) -> None:
        super().__init__(f"{len(keys)} staged keys were landed by a concurrent append")
        self.keys = keys


@dataclass
class Staged:
    """Data files written by :meth:`Lake.stage`, not yet committed."""

    actions: list
    keys: np.ndarray          # row_key of every staged row (empty for unkeyed tables)
    rows: int
    written_at: float


def row_keys(spec: TableSpec, data: pa.Table) -> pa.Array:
    """``row_key`` of each row: the first 8 bytes of sha256 over the key columns
    (values as text, joined by U+001F), as a signed big-endian int64."""
    import hashlib

    cols = [data.column(c).to_pylist() for c in spec.key]
    out = np.empty(data.num_rows, np.int64)
    if len(cols) == 1:
        for i, v in enumerate(cols[0]):
            out[i] = int.from_bytes(hashlib.sha256(str(v).encode()).digest()[:8], "big", signed=True)
    else:
        for i, vals in enumerate(zip(*cols)):
            text = "\x1f".join("" if v is None else str(v) for v in vals)
            out[i] = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)
    return pa.array(out, pa.int64())


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


@dataclass(frozen=True)
class AppendResult:
    """Outcome of one append. ``landed`` is False when the app transaction had
    already been committed (an exactly-once no-op), or when every row was
    already in the table. On keyed tables ``duplicates`` counts rows whose key
    had landed with the same content and ``conflicts`` holds the rows whose key
    had landed with different content (neither is written)."""

    table: str
    landed: bool
    rows: int
    version: int | None
    app_id: str
    txn_version: int
    duplicates: int = 0
    conflicts: pa.Table | None = None


def resolve_lake_uri(uri: str | os.PathLike[str] | None = None) -> str:
    """``--lake`` > ``$PIPELINE_LAKE`` > ``./lake``; local paths made absolute."""
    raw = str(uri) if uri is not None else os.environ.get("PIPELINE_LAKE", DEFAULT_LAKE)
    if "://" in raw and not raw.startswith("file://"):
        return raw.rstrip("/")
    if raw.startswith("file://"):
        raw = raw[len("file://"):]
    return str(Path(raw).expanduser().resolve())


def storage_options_from_env() -> dict[str, str] | None:
    """Object-store options from the environment (AWS_* for S3-compatible stores)."""
    opts = {}
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                "AWS_ALLOW_HTTP", "AWS_S3_ALLOW_UNSAFE_RENAME", "AWS_CONDITIONAL_PUT",
                "AWS_SESSION_TOKEN"):
        if os.environ.get(key):
            opts[key] = os.environ[key]
    return opts or None


class Lake:
    """A lake root holding Delta tables (``<root>/<table>``) and plain files
    (snapshot payloads, checkpoints). Local path or any object-store URI
    deltalake accepts."""

    def __init__(self, uri: str | os.PathLike[str] | None = None, *,
                 storage_options: dict[str, str] | None = None) -> None:
        self.uri = resolve_lake_uri(uri)
        self.storage_options = storage_options if storage_options is not None else storage_options_from_env()
        self.is_local = "://" not in self.uri
        if self.is_local:
            Path(self.uri).mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Lake({self.uri!r})"

    # -- tables -----------------------------------------------------------
    def table_uri(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def exists(self, name: str) -> bool:
        return DeltaTable.is_deltatable(self.table_uri(name), storage_options=self.storage_options)

    def ensure(self, name: str) -> None:
        """Create table ``name`` from its spec if it does not exist (race-safe);
        an existing table gets the spec's columns it lacks (``evolve``)."""
        if self.exists(name):
            self.evolve(name)
            return
        spec = table_spec(name)
        try:
            DeltaTable.create(
                self.table_uri(name),
                schema=spec.arrow_schema(),
                mode="ignore",
                partition_by=list(spec.partition_by) or None,
                name=name,
                description=spec.description,
                configuration=TABLE_PROPERTIES,
                storage_options=self.storage_options,
                commit_properties=CommitProperties(custom_metadata=_metadata("create", None)),
            )
        except Exception:
            if not self.exists(name):  # another process created it first: fine
                raise

    def evolve(self, name: str) -> list[str]:
        """Add the columns ``schemas/<name>.yaml`` declares (new columns go at the
        end) and the existing table lacks, as nullable Delta columns: rows
        written before read them as null. Checked once per table per Lake
        object; a concurrent evolution of the same columns is fine. Returns the
        columns added."""
        done = self.__dict__.setdefault("_evolved", set())
        if name in done:
            return []
        from deltalake.schema import Field

        dt = DeltaTable(self.table_uri(name), storage_options=self.storage_options)
        have = {f.name for f in dt.schema().fields}
        missing = [f for f in table_spec(name).arrow_schema() if f.name not in have]
        if missing:
            try:
                dt.alter.add_columns([Field.from_arrow(f.with_nullable(True)) for f in missing],
                                     commit_properties=CommitProperties(
                                         custom_metadata=_metadata("schema: add columns", None)))
            except Exception:
                dt = DeltaTable(self.table_uri(name), storage_options=self.storage_options)
                if {f.name for f in missing} - {f.name for f in dt.schema().fields}:
                    raise  # not a concurrent evolution of the same columns
        done.add(name)
        return [f.name for f in missing]

    def table(self, name: str, version: int | str | datetime | None = None) -> DeltaTable:
        """The DeltaTable at ``version`` (int, ISO timestamp or datetime); latest when None."""
        try:
            dt = DeltaTable(self.table_uri(name), storage_options=self.storage_options)
        except TableNotFoundError:
            raise NotFoundError(
                f"table {name!r} does not exist in lake {self.uri}",
                hint="ingest or produce data first (pipeline ingest / pipeline demo), or check --lake",
            ) from None
        if version is not None:
            try:
                dt.load_as_version(version)
            except Exception as exc:
                raise NotFoundError(f"{name} has no version {version!r}: {exc}") from None
        return dt

    def version(self, name: str) -> int | None:
        """Latest version of ``name``, None when the table does not exist."""
        if not self.exists(name):
            return None
        return self.table(name).version()

    def dataset(self, name: str, version: int | str | datetime | None = None) -> ds.Dataset:
        """The pyarrow dataset of ``name`` at ``version`` (see :meth:`arrow_dataset`)."""
        return self.arrow_dataset(name, self.table(name, version))

    def arrow_dataset(self, name: str, dt: DeltaTable) -> ds.Dataset:
        """A pyarrow dataset over exactly the data files of ``dt`` (table ``name``),
        read through pyarrow's native filesystem (docs/clean-exit.md).

        delta-rs still computes the fragments from the log (file list, partition
        values, statistics as fragment guarantees, so filters prune files), but
        ``to_pyarrow_dataset()``'s default filesystem is a Python handler: Arrow's
        scanner threads call into it and drop the last reference to it after the
        read returned, which made processes abort at interpreter exit (SIGABRT,
        delta-rs #2184). A native filesystem keeps those threads out of Python.
        Where no native filesystem can be built for the URI, delta-rs's handler is
        the fallback.
        """
        import pyarrow.fs as pafs

        try:
            fs, _ = self.filesystem()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
            return dt.to_pyarrow_dataset()
        base = self.table_uri(name) if self.is_local else self.table_uri(name).split("://", 1)[1]
        return dt.to_pyarrow_dataset(filesystem=pafs.SubTreeFileSystem(base, fs))

    def read(self, name: str, *, columns: list[str] | None = None, version: int | None = None,
             filter: ds.Expression | None = None) -> pa.Table:
        """Read ``columns`` of ``name`` (the whole table when None: avoid for token payloads).
        A missing table reads as empty."""
        if not self.exists(name):
            schema = table_spec(name).arrow_schema()
            if columns is not None:
                schema = pa.schema([schema.field(c) for c in columns])
            return schema.empty_table()
        return self.dataset(name, version).to_table(columns=columns, filter=filter)

    def transaction_version(self, name: str, app_id: str) -> int | None:
        """Highest transaction version committed by ``app_id`` on ``name``."""
        if not self.exists(name):
            return None
        return self.table(name).transaction_version(app_id)

    def history(self, name: str, limit: int | None = None) -> list[dict[str, Any]]:
        return self.table(name).history(limit)

    # -- writes -----------------------------------------------------------
    def _prepare(self, spec: TableSpec, data: pa.Table) -> pa.Table:
        """``data`` in the table's column order and types, with ``row_key`` computed."""
        if spec.enforces_key and (ROW_KEY not in data.column_names or data.column(ROW_KEY).null_count):
            if ROW_KEY in data.column_names:
                data = data.drop_columns([ROW_KEY])
            data = data.append_column(ROW_KEY, row_keys(spec, data))
        return data.select(spec.names).cast(spec.arrow_schema())

    def stage(self, name: str, data: pa.Table) -> Staged:
        """Write ``data`` as data files of table ``name`` without committing them;
        pass the result to ``append(..., staged=[...])``. Until that commit lands
        the files are invisible (orphan cleanup removes them if it never does)."""
        spec = table_spec(name)
        data = self._prepare(spec, data)
        keys = (data.column(ROW_KEY).to_numpy() if spec.enforces_key else np.empty(0, np.int64))
        return Staged(self._write_data_files(spec, data), keys, data.num_rows, time.time())

    def discard(self, name: str, staged: list) -> None:
        """Best-effort removal of staged files that will not be committed."""
        fs, _ = self.filesystem()
        base = self.table_uri(name) if self.is_local else self.table_uri(name).split("://", 1)[1]
        for item in staged:
            for action in (item.actions if isinstance(item, Staged) else [item]):
                try:
                    fs.delete_file(f"{base}/{action.path}")
                except (FileNotFoundError, OSError):
                    pass

    def append(self, name: str, data: pa.Table | None, *, command: str, config_hash: str | None = None,
               app_id: str | None = None, txn_version: int = 0,
               extra_transactions: list[str] | None = None,
               extra_metadata: dict[str, str] | None = None,
               staged: list[Staged] | None = None, read_version: int | None = None,
               lock: tuple[str, int] | None = None, snapshot: DeltaTable | None = None) -> AppendResult:
        """Append ``data`` to ``name`` exactly once per ``(app_id, txn_version)``.

        Retries ``CommitFailedError``. Any other failure after the write may have
        committed is ambiguous: we reload the log and ask whether our transaction
        landed before trying again, never blindly re-appending. Without an
        ``app_id`` a one-off id is used, so ambiguity is still resolvable.
        ``extra_transactions`` are further app ids (version 0) recorded in the
        same commit (ingest records one per source file).

        Keyed tables (``row_key``): rows whose key is already in the table are
        not written (``duplicates`` / ``conflicts`` in the result). With
        ``staged`` (files written earlier by :meth:`stage`), the caller deduped
        against version ``read_version``; if a commit since then landed one of
        the staged keys, :class:`KeyRace` is raised and nothing is committed.

        ``lock=(app, version)`` additionally commits that application
        transaction and raises :class:`LockTaken` if ``version`` of it is
        already committed (or gets committed concurrently): the primitive for
        read-decide-commit steps such as publishing the next policy version.
        ``snapshot`` is a freshly loaded table the first attempt may use instead
        of loading it again.
        """
        self.ensure(name)
        spec = table_spec(name)
        keyed = spec.enforces_key
        if staged is None:
            data = self._prepare(spec, data)
            rows = data.num_rows
        else:
            rows = sum(s.rows for s in staged)
        app_id = app_id or f"write-{uuid.uuid4().hex}"
        meta = _metadata(command, config_hash)
        meta.update({"pipeline.app_id": app_id, "pipeline.txn_version": str(txn_version)})
        meta.update(extra_metadata or {})
        last_exc: Exception | None = None
        ambiguous = False  # an earlier attempt failed in a way that may have committed
        actions = [a for s in staged for a in s.actions] if staged is not None else None
        checked = read_version if staged is not None else None  # keys up to here are checked
        duplicates, conflicts = 0, None
        attempts = MAX_KEYED_ATTEMPTS if keyed or lock else MAX_ATTEMPTS
        for attempt in range(attempts):
            # Check and write against the SAME table snapshot: delta-rs then refuses
            # (ConcurrentTransaction) a commit racing another with our app id (or the
            # serialising one), which closes the window between the check and the write.
            dt = snapshot if attempt == 0 and snapshot is not None else self.table(name)
            landed = dt.transaction_version(app_id)
            if landed is not None and landed >= txn_version:
                if not ambiguous:
                    # committed by someone else with this app id (or before this call)
                    return AppendResult(name, False, 0, None, app_id, txn_version, duplicates, conflicts)
                # our own earlier attempt committed before failing: done
                return AppendResult(name, True, rows, self.version(name), app_id, txn_version,
                                    duplicates, conflicts)
            now_ms = int(time.time() * 1000)
            txns = [Transaction(app_id, txn_version, now_ms)] + [
                Transaction(t, 0, now_ms) for t in extra_transactions or [] if t != app_id]
            if lock is not None:
                held = dt.transaction_version(lock[0])
                if held is not None and held >= lock[1]:
                    raise LockTaken(*lock)
                txns.append(Transaction(lock[0], lock[1], now_ms))
            if keyed:
                if staged is None:
                    data, dups, confl = self._drop_landed(spec, dt, data, since=checked)
                    if dups or confl is not None:
                        duplicates += dups
                        conflicts = confl if conflicts is None else pa.concat_tables([conflicts, confl])
                        if actions is not None:  # written before a concurrent append landed some keys
                            self.discard(name, [Staged(actions, np.empty(0, np.int64), 0, 0.0)])
                            actions = None
                    rows = data.num_rows
                    if rows == 0:
                        return AppendResult(name, False, 0, None, app_id, txn_version, duplicates, conflicts)
                else:
                    if time.time() - min(s.written_at for s in staged) > STAGE_MAX_AGE_S:
                        raise KeyRace(np.empty(0, np.int64))
                    ours = np.concatenate([s.keys for s in staged])
                    hits = ours[self.keys(name, dt, since=checked).contains(ours)]
                    if hits.size:
                        raise KeyRace(hits)
                checked = dt.version()
                txns.append(Transaction(KEYS_APP, (dt.transaction_version(KEYS_APP) or 0) + 1, now_ms))
            try:
                if actions is None:  # data files are immutable: write once, commit as often as needed
                    actions = self._write_data_files(spec, data)
                    written_at = time.time()
                elif staged is None and time.time() - written_at > STAGE_MAX_AGE_S:
                    self.discard(name, [Staged(actions, np.empty(0, np.int64), 0, 0.0)])
                    actions = self._write_data_files(spec, data)
                    written_at = time.time()
                pause_point(f"append:{name}:staged")
                dt.create_write_transaction(
                    actions,
                    mode="append",
                    schema=spec.arrow_schema(),
                    partition_by=list(spec.partition_by) or None,
                    commit_properties=CommitProperties(
                        custom_metadata=meta,
                        max_commit_retries=MAX_COMMIT_RETRIES,
                        app_transactions=txns,
                    ),
                )
                pause_point(f"append:{name}:committed")
                # delta-rs moved `dt` to the version it committed (after any rebase onto newer commits)
                return AppendResult(name, True, rows, dt.version(), app_id, txn_version,
                                    duplicates, conflicts)
            except CommitFailedError as exc:
                last_exc = exc
                if lock is not None:
                    held = self.table(name).transaction_version(lock[0])
                    if held is not None and held >= lock[1] and \
                            (self.table(name).transaction_version(app_id) or -1) < txn_version:
                        raise LockTaken(*lock) from None
            except Exception as exc:  # ambiguous: the commit may have landed
                last_exc = exc
                ambiguous = True
            if keyed or lock:  # lost a serialising race: jittered back-off, then re-check
                time.sleep(random.uniform(0, min(0.02 * 2 ** min(attempt, 6), 1.0)))
            else:
                time.sleep(min(0.05 * 2**attempt, 2.0))
        landed = self.transaction_version(name, app_id)
        if landed is not None and landed >= txn_version:
            return AppendResult(name, True, rows, self.version(name), app_id, txn_version, duplicates, conflicts)
        raise CommitError(
            f"could not append {rows} rows to {name} after {attempts} attempts: {last_exc}",
            hint=f"retry with the same transaction id ({app_id}, {txn_version}); it lands at most once",
        )

    # -- keys and the files behind versions ----------------------------------
    def _drop_landed(self, spec: TableSpec, dt: DeltaTable, data: pa.Table, *, since: int | None
                     ) -> tuple[pa.Table, int, pa.Table | None]:
        """``data`` without rows whose key is in ``dt`` (only files committed after
        version ``since`` are looked at when given) or repeats earlier in ``data``.
        -> (rows to write, duplicates, conflicting rows or None)."""
        keys = data.column(ROW_KEY).to_numpy()
        hit = self.keys(spec.name, dt, since=since).contains(keys)
        # within the batch: the first occurrence of a key wins
        _, first = np.unique(keys, return_index=True)
        repeat = np.ones(len(keys), bool)
        repeat[first] = False
        if not hit.any() and not repeat.any():
            return data, 0, None
        drop = hit | repeat
        conflict = np.zeros(len(keys), bool)
        key_cols = list(spec.key)
        cc = spec.conflict_column
        if hit.any():
            landed = self.read(spec.name, columns=key_cols + ([cc] if cc else []) + [ROW_KEY],
                               version=dt.version(),
                               filter=ds.field(ROW_KEY).isin(pa.array(np.unique(keys[hit]), pa.int64())))
            by_key = {tuple(r[c] for c in key_cols): (r[cc] if cc else None) for r in landed.to_pylist()}
            mine = data.select(key_cols + ([cc] if cc else [])).to_pylist()
            for i in np.flatnonzero(hit):
                k = tuple(mine[i][c] for c in key_cols)
                if k not in by_key:       # a 64-bit digest collision, not the same key: keep it
                    drop[i] = hit[i] = repeat[i]
                elif cc and by_key[k] != mine[i][cc]:
                    conflict[i] = True
        if repeat.any() and cc:
            seen: dict[tuple, Any] = {}
            mine = data.select(key_cols + [cc]).to_pylist()
            for i in range(len(keys)):
                k = tuple(mine[i][c] for c in key_cols)
                if k in seen and seen[k] != mine[i][cc]:
                    conflict[i] = True
                seen.setdefault(k, mine[i][cc])
        n_conflict = int(conflict.sum())
        kept = data.filter(pa.array(~drop)) if drop.any() else data
        confl = data.filter(pa.array(conflict)) if n_conflict else None
        return kept, int(drop.sum()) - n_conflict, confl

    def keys(self, name: str, dt: DeltaTable, *, since: int | None = None) -> KeySet:
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
            return KeySet(_EMPTY, self._read_keys(name, self.files_added(name, dt, since=since)))
        cached = _KEY_CACHE.get((self.uri, name))
        live = self.live_files(dt)
        names = frozenset(p for p, _ in live)
        if cached is not None and cached[0] <= version and cached[1] <= names:
            # only appends since the cached version: read just the new files
            extra = [f for f in live if f[0] not in cached[1]]
            ks = cached[2]
            if extra:
                ks = KeySet(ks.index, np.concatenate([ks.loose, self._read_keys(name, extra)]))
        else:
            found = self.load_key_index(name, version)
            if found is None:
                ks = KeySet(_EMPTY, self._read_keys(name, live))
            else:
                iv, index = found
                ks = KeySet(index, self._read_keys(name, self.files_added(name, dt, since=iv)))
        _KEY_CACHE[(self.uri, name)] = (version, names, ks)
        return ks

    def _index_base(self, name: str) -> str:
        _, root = self.filesystem()
        return f"{root}/{INDEX_DIR}/{name}"

    def write_key_index(self, name: str) -> int:
        """Write the sorted ``row_key`` of every row of ``name``'s latest version as
        ``_index/<name>/keys-<version>.npy`` (one atomic put) and delete older
        indexes. Any index is valid forever: readers add the keys of files
        committed after its version."""
        import io

        import pyarrow.fs as pafs

        dt = self.table(name)
        version = dt.version()
        keys = np.sort(self._read_keys(name, self.live_files(dt)))
        buf = io.BytesIO()
        np.save(buf, keys, allow_pickle=False)
        fs, _ = self.filesystem()
        base = self._index_base(name)
        fs.create_dir(base, recursive=True)
        final = f"{base}/keys-{version:020d}.npy"
        tmp = f"{base}/.tmp-{uuid.uuid4().hex}"
        with fs.open_output_stream(tmp if self.is_local else final) as f:
            f.write(buf.getvalue())
        if self.is_local:
            fs.move(tmp, final)  # atomic rename: a reader never sees half an index
        for info in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True)):
            fname = info.path.rsplit("/", 1)[-1]
            if fname.startswith("keys-") and fname < f"keys-{version:020d}.npy":
                try:
                    fs.delete_file(info.path)
                except (FileNotFoundError, OSError):
                    pass
        return version

    def load_key_index(self, name: str, version: int) -> tuple[int, np.ndarray] | None:
        """(index version, sorted keys) of the newest index at or below ``version``."""
        import pyarrow.fs as pafs

        fs, _ = self.filesystem()
        base = self._index_base(name)
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
                if self.is_local:
                    return v, np.load(path, mmap_mode="r", allow_pickle=False)
                import io

                with fs.open_input_file(path) as f:
                    return v, np.load(io.BytesIO(f.read()), allow_pickle=False)
            except (FileNotFoundError, OSError, ValueError):
                continue  # deleted by a newer maintain meanwhile: try the next
        return None

    def _read_keys(self, name: str, files: list[tuple[str, dict[str, str | None]]]) -> np.ndarray:
        if not files:
            return np.empty(0, np.int64)
        t = self.files_dataset(name, files, schema=pa.schema([pa.field(ROW_KEY, pa.int64())])).to_table(
            columns=[ROW_KEY])
        return t.column(ROW_KEY).to_numpy()

    @staticmethod
    def live_files(dt: DeltaTable) -> list[tuple[str, dict[str, str | None]]]:
        """(path relative to the table, partition values as log strings) of every live file."""
        t = pa.table(dt.get_add_actions(flatten=True))
        parts = [c for c in t.column_names if c.startswith("partition.")]
        paths = t.column("path").to_pylist()
        vals = {c[len("partition."):]: t.column(c).to_pylist() for c in parts}
        return [(p, {k: _partition_str(v[i]) for k, v in vals.items()}) for i, p in enumerate(paths)]

    @staticmethod
    def live_file_uris(dt: DeltaTable) -> list[tuple[str, dict[str, str | None]]]:
        """(absolute file uri, partition values as log strings) of every live file
        of ``dt``: ``live_files`` with the uris delta-rs resolves (what readers
        outside delta-rs open: DuckDB, Dask workers)."""
        from urllib.parse import unquote

        rel = Lake.live_files(dt)
        uris = dt.file_uris()
        if len(rel) == len(uris) and all(unquote(u).endswith(unquote(p)) for u, (p, _) in zip(uris, rel)):
            return [(u, pv) for u, (_, pv) in zip(uris, rel)]     # the same order (the usual case)
        by_rel = {unquote(p): pv for p, pv in rel}
        out = []
        for uri in uris:
            plain = unquote(uri)
            out.append((uri, next((pv for r, pv in by_rel.items() if plain.endswith(r)), {})))
        return out

    def log_entries(self, name: str, version: int) -> list[dict[str, Any]] | None:
        """The actions of commit ``version`` from its JSON log file; None if that file is gone."""
        import json

        fs, _ = self.filesystem()
        base = self.table_uri(name) if self.is_local else self.table_uri(name).split("://", 1)[1]
        try:
            with fs.open_input_stream(f"{base}/_delta_log/{version:020d}.json") as f:
                raw = f.read()
        except (FileNotFoundError, OSError):
            return None
        return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]

    def commit_metadata(self, name: str, version: int) -> dict[str, Any]:
        """The commitInfo of ``version`` (our ``pipeline.*`` metadata included); {} if unknown."""
        for entry in self.log_entries(name, version) or []:
            if "commitInfo" in entry:
                return entry["commitInfo"]
        return {}

    def files_added(self, name: str, dt: DeltaTable, *, since: int) -> list[tuple[str, dict[str, str | None]]]:
        """Live files of ``dt`` that were added by a commit after version ``since``:
        every row committed after ``since`` is in one of them (a compaction since
        then rewrote such rows into a file it added). Falls back to every live
        file when a commit's log file is missing (a superset, never fewer)."""
        from urllib.parse import unquote

        added: set[str] = set()
        for v in range(since + 1, dt.version() + 1):
            entries = self.log_entries(name, v)
            if entries is None:
                return self.live_files(dt)
            added.update(unquote(e["add"]["path"]) for e in entries if "add" in e)
        return [f for f in self.live_files(dt) if f[0] in added or unquote(f[0]) in added]

    def files_dataset(self, name: str, files: list[tuple[str, dict[str, str | None]]], *,
                      schema: pa.Schema | None = None) -> ds.Dataset:
        """A pyarrow dataset over some data files of ``name`` (as from ``files_added``),
        partition columns filled from the log's partition values."""
        spec = table_spec(name)
        full = spec.arrow_schema()
        schema = schema or full
        fs, _ = self.filesystem()
        base = self.table_uri(name) if self.is_local else self.table_uri(name).split("://", 1)[1]
        parts = []
        for _, pvals in files:
            expr = ds.scalar(True)
            for col, val in pvals.items():
                if col not in schema.names:
                    continue
                typ = full.field(col).type
                expr = expr & (ds.field(col).is_null() if val is None
                               else ds.field(col) == pa.scalar(val).cast(typ))
            parts.append(expr)
        return ds.FileSystemDataset.from_paths([f"{base}/{p}" for p, _ in files], schema=schema,
                                               format=ds.ParquetFileFormat(), filesystem=fs,
                                               partitions=parts)

    def _write_data_files(self, spec: TableSpec, data: pa.Table, *, data_change: bool = True) -> list:
        """Write ``data`` as Parquet files (one per partition) under the table and
        return their add actions. pyarrow's writer with dictionary encoding and
        statistics off for token lists was ~2x faster than delta-rs's writer on
        this table here; the commit itself stays delta-rs's (log, retries,
        conflict checks, checkpoints). A commit that never lands leaves only
        unreferenced files, which vacuum removes."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        from deltalake.transaction import AddAction

        fs, _ = self.filesystem()
        base = self.table_uri(spec.name)
        base_path = base if self.is_local else base.split("://", 1)[1]
        parts = list(spec.partition_by)
        scalar = [c.name for c in spec.columns if not c.is_list and not pa.types.is_map(c.arrow_type)
                  and c.name not in parts]
        dict_cols = [c for c in scalar if pa.types.is_string(spec.column(c).arrow_type)]
        groups: list[tuple[dict[str, str | None], pa.Table]] = []
        if parts:
            keys = data.select(parts).group_by(parts).aggregate([]).to_pylist()
            if len(keys) == 1:  # the common case; filtering would copy every token list
                groups.append(({k: _partition_str(v) for k, v in keys[0].items()}, data.drop_columns(parts)))
                keys = []
            for key in keys:
                mask = None
                for col, val in key.items():
                    m = pc.is_null(data.column(col)) if val is None else pc.equal(data.column(col), val)
                    mask = m if mask is None else pc.and_(mask, m)
                groups.append(({k: _partition_str(v) for k, v in key.items()}, data.filter(mask).drop_columns(parts)))
        else:
            groups.append(({}, data))
        actions = []
        for pvals, part in groups:
            rel = "/".join(f"{k}={_path_safe(v)}" for k, v in pvals.items())
            fname = f"part-00000-{uuid.uuid4()}-c000.zstd.parquet"
            rel_path = f"{rel}/{fname}" if rel else fname
            if rel:
                fs.create_dir(f"{base_path}/{rel}", recursive=True)
            with fs.open_output_stream(f"{base_path}/{rel_path}") as f:
                pq.write_table(part, f, compression="zstd", compression_level=1, use_dictionary=dict_cols,
                               write_statistics=scalar)
            size = fs.get_file_info(f"{base_path}/{rel_path}").size
            actions.append(AddAction(rel_path, size, pvals, int(time.time() * 1000), data_change,
                                     _stats_json(part, scalar)))
        return actions

    # -- maintenance ------------------------------------------------------
    def compact(self, name: str, *, target_bytes: int = 128 << 20) -> dict[str, Any]:
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
            dt = self.table(name)
            plan = _compaction_plan(pa.table(dt.get_add_actions(flatten=True)), target_bytes)
            if not plan:
                break
            lock_v = (dt.transaction_version(COMPACT_APP) or 0) + 1
            new_actions: list = []
            try:
                for files in plan:
                    part = self.files_dataset(name, [(p, pv) for p, pv, _ in files]).to_table()
                    new_actions += self._write_data_files(spec, self._prepare(spec, part), data_change=False)
                pause_point(f"compact:{name}:written")
                now_ms = int(time.time() * 1000)
                removes = [RemoveAction(p, False, now_ms, size, pv) for files in plan for p, pv, size in files]
                dt.create_write_transaction(
                    removes + new_actions, mode="append", schema=spec.arrow_schema(),
                    partition_by=list(spec.partition_by) or None,
                    commit_properties=CommitProperties(
                        custom_metadata=_metadata("lake maintain: compact", None),
                        max_commit_retries=MAX_COMMIT_RETRIES,
                        app_transactions=[Transaction(COMPACT_APP, lock_v, now_ms)]))
                removed += len(removes)
                added += len(new_actions)
                break
            except CommitFailedError:
                # another compaction committed first: our rewrite may repeat its rows
                self.discard(name, new_actions)
                time.sleep(random.uniform(0, min(0.02 * 2 ** min(attempt, 6), 1.0)))
            except BaseException:
                self.discard(name, new_actions)
                raise
        return {"numFilesRemoved": removed, "numFilesAdded": added}

    def rewrite(self, name: str, files: list[tuple[str, dict[str, str | None], int]], transform, *,
                command: str) -> int | None:
        """Replace ``files`` ((path, partition values, size) of live files of ``name``)
        by ``transform(their rows)`` in one commit: their removes plus the new files'
        adds with ``dataChange=false``, carrying the next version of
        ``pipeline.compact`` like a compaction (the rows must stay the same rows:
        ``lake migrate`` backfills derived columns). Returns the version committed,
        or None when a file is no longer live or another compaction or rewrite
        committed first (nothing of ours is left behind: replan and call again)."""
        from deltalake.transaction import RemoveAction

        spec = table_spec(name)
        dt = self.table(name)
        live = {p for p, _ in self.live_files(dt)}
        if not files or any(p not in live for p, _, _ in files):
            return None
        lock_v = (dt.transaction_version(COMPACT_APP) or 0) + 1
        new_actions: list = []
        try:
            rows = self.files_dataset(name, [(p, pv) for p, pv, _ in files]).to_table()
            new_actions = self._write_data_files(spec, self._prepare(spec, transform(rows)), data_change=False)
            pause_point(f"rewrite:{name}:written")
            now_ms = int(time.time() * 1000)
            dt.create_write_transaction(
                [RemoveAction(p, False, now_ms, size, pv) for p, pv, size in files] + new_actions, mode="append",
                schema=spec.arrow_schema(), partition_by=list(spec.partition_by) or None,
                commit_properties=CommitProperties(custom_metadata=_metadata(command, None),
                                                   max_commit_retries=MAX_COMMIT_RETRIES,
                                                   app_transactions=[Transaction(COMPACT_APP, lock_v, now_ms)]))
            pause_point(f"rewrite:{name}:committed")
            return dt.version()
        except CommitFailedError:
            self.discard(name, new_actions)
            return None
        except BaseException:
            try:  # an error after the commit landed (post-commit hooks): its files are live, keep them
                landed = {p for p, _ in self.live_files(self.table(name))} & {a.path for a in new_actions}
            except Exception:  # noqa: BLE001 - cannot tell: leave the files to the age-guarded orphan cleanup
                landed = {a.path for a in new_actions}
            if not landed:
                self.discard(name, new_actions)
            raise

    def remove_orphans(self, name: str, *, min_age_s: float = ORPHAN_MIN_AGE_S,
                       dry_run: bool = False) -> list[str]:
        """Delete data files under table ``name`` that no commit ever referenced
        (staged by a writer that died before committing, or that lost a race) and
        that are older than ``min_age_s``. A live writer never commits a staged
        file older than ``STAGE_MAX_AGE_S`` (half the default age), so this never
        removes a file that is about to be committed."""
        import pyarrow.fs as pafs
        from urllib.parse import unquote

        dt = self.table(name)
        referenced = {p for p, _ in self.live_files(dt)}
        for v in range(dt.version() + 1):
            for e in self.log_entries(name, v) or []:
                for kind in ("add", "remove"):
                    if kind in e:
                        referenced.add(unquote(e[kind]["path"]))
        fs, _ = self.filesystem()
        base = self.table_uri(name) if self.is_local else self.table_uri(name).split("://", 1)[1]
        cutoff = time.time() - min_age_s
        out = []
        for info in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
            if info.type != pafs.FileType.File:
                continue
            rel = info.path[len(base) + 1:]
            if rel.startswith("_delta_log/") or rel in referenced or not rel.endswith(".parquet"):
                continue
            mtime = info.mtime.timestamp() if info.mtime is not None else time.time()
            if mtime > cutoff:
                continue
            out.append(rel)
            if not dry_run:
                try:
                    fs.delete_file(info.path)
                except (FileNotFoundError, OSError):
                    pass  # a concurrent maintain removed it first
        return out

    def checkpoint(self, name: str) -> None:
        self.table(name).create_checkpoint()

    def vacuum(self, name: str, *, retention_hours: int, keep_versions: list[int] | None,
               dry_run: bool) -> list[str]:
        return self.table(name).vacuum(
            retention_hours=retention_hours,
            dry_run=dry_run,
            enforce_retention_duration=False,
            keep_versions=keep_versions or None,
            commit_properties=CommitProperties(custom_metadata=_metadata("lake maintain: vacuum", None)),
        )

    def file_count(self, name: str) -> int:
        return len(self.table(name).file_uris())

    # -- plain files (snapshot payloads, checkpoints) ----------------------
    def filesystem(self):
        """``(pyarrow FileSystem, root path)`` for the lake's plain files."""
        import pyarrow.fs as pafs

        if self.is_local:
            return pafs.LocalFileSystem(), self.uri
        opts = self.storage_options or {}
        if self.uri.startswith("s3://"):
            endpoint = opts.get("AWS_ENDPOINT_URL")
            scheme = "http" if endpoint and endpoint.startswith("http://") else "https"
            fs = pafs.S3FileSystem(
                access_key=opts.get("AWS_ACCESS_KEY_ID"),
                secret_key=opts.get("AWS_SECRET_ACCESS_KEY"),
                session_token=opts.get("AWS_SESSION_TOKEN"),
                region=opts.get("AWS_REGION", "us-east-1"),
                endpoint_override=endpoint.split("://", 1)[1] if endpoint else None,
                scheme=scheme,
            )
            return fs, self.uri[len("s3://"):]
        fs, root = pafs.FileSystem.from_uri(self.uri)
        return fs, root


def _compaction_plan(adds: pa.Table, target_bytes: int) -> list[list[tuple[str, dict[str, str | None], int]]]:
    """Bins of small files (same partition, up to ``target_bytes`` each, >= 2 files)."""
    parts = [c for c in adds.column_names if c.startswith("partition.")]
    by_part: dict[tuple, list[tuple[str, dict[str, str | None], int]]] = {}
    rows = adds.select(["path", "size_bytes"] + parts).to_pylist()
    for r in sorted(rows, key=lambda r: r["path"]):
        if r["size_bytes"] >= target_bytes:
            continue
        pv = {c[len("partition."):]: _partition_str(r[c]) for c in parts}
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


def _partition_str(v: Any) -> str | None:
    if v is None:
        return None
    return v.isoformat() if hasattr(v, "isoformat") else str(v)


def _path_safe(v: str | None) -> str:
    """A directory name for a partition value. Readers take partition values from
    the log, never from paths, so unusual values get a hashed name instead of
    escaping rules that differ between engines."""
    import hashlib
    import re

    if v is None:
        return "__HIVE_DEFAULT_PARTITION__"
    if re.fullmatch(r"[A-Za-z0-9._-]{1,100}", v):
        return v
    return "h" + hashlib.sha256(v.encode()).hexdigest()[:16]


STATS_PREFIX = 64


def _stats_json(t: pa.Table, columns: list[str]) -> str:
    """Delta file statistics (numRecords, nullCount; min/max for numbers, times and strings)."""
    import json

    import pyarrow.compute as pc

    mins, maxs, nulls = {}, {}, {}
    for name in columns:
        col = t.column(name)
        nulls[name] = col.null_count
        typ = col.type
        # strings too: delta-rs turns a column with a nullCount but no min/max into the fragment
        # guarantee `col >= null`, which prunes the file from every filter on that column
        if (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_timestamp(typ)
                or pa.types.is_string(typ) or pa.types.is_large_string(typ)) \
                and col.null_count < len(col):
            mm = pc.min_max(col)
            lo, hi = mm["min"].as_py(), mm["max"].as_py()
            if pa.types.is_timestamp(typ):
                lo = lo.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                hi = hi.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            elif pa.types.is_floating(typ) and not (math.isfinite(lo) and math.isfinite(hi)):
                # JSON has no inf/NaN, and leaving min/max out would prune the file:
                # widen to the finite extremes
                lo, hi = -sys.float_info.max, sys.float_info.max
            elif isinstance(lo, str):
                # bounded stats (a quarantine raw_row can be megabytes): a prefix is a valid
                # minimum; a prefix followed by the highest code point a valid maximum
                lo = lo[:STATS_PREFIX]
                if len(hi) > STATS_PREFIX:
                    hi = hi[:STATS_PREFIX] + "\U0010ffff"
            mins[name], maxs[name] = lo, hi
    return json.dumps({"numRecords": t.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def _metadata(command: str, config_hash: str | None) -> dict[str, str]:
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = os.environ.get("USER", "unknown")
    meta = {
        "pipeline.command": command,
        "pipeline.user": user,
        "pipeline.host": socket.gethostname(),
        "pipeline.pid": str(os.getpid()),
        "pipeline.version": __version__,
    }
    if config_hash:
        meta["pipeline.config_hash"] = config_hash
    return meta

