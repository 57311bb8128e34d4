"""Appends: the write protocol (docs/write-protocol.md).

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
re-checks only the files committed since and retries.
"""

from __future__ import annotations

import math
import random
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError

from pipeline.errors import CommitError
from pipeline.lake.delta import keyindex
from pipeline.lake import staging
from pipeline.lake.delta.common import (
    KEYS_APP,
    MAX_ATTEMPTS,
    MAX_COMMIT_RETRIES,
    MAX_KEYED_ATTEMPTS,
    STAGE_MAX_AGE_S,
    FilesMissing,
    partition_str,
    pause_point,
    write_metadata,
)
from pipeline.schema import ROW_KEY, TableSpec, table_spec

if TYPE_CHECKING:
    from pipeline.lake.delta.root import LakeRoot


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


class StagedFilesMissing(KeyRace):
    """Staged files are gone (or changed) at commit time: nothing was committed;
    stage the rows again (ingest does, as after a lost race)."""

    def __init__(self, missing: FilesMissing) -> None:
        super().__init__(np.empty(0, np.int64))
        self.args = (f"{missing.message}; stage the rows again (Lake.stage) and append those",)
        self.missing = missing.missing


@dataclass(kw_only=True)
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



@dataclass(frozen=True, kw_only=True)
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



def prepare(lake: LakeRoot, spec: TableSpec, data: pa.Table) -> pa.Table:
    """``data`` in the table's column order and types, with ``row_key`` computed."""
    if spec.enforces_key and (ROW_KEY not in data.column_names or data.column(ROW_KEY).null_count):
        if ROW_KEY in data.column_names:
            data = data.drop_columns([ROW_KEY])
        data = data.append_column(ROW_KEY, row_keys(spec, data))
    return data.select(spec.names).cast(spec.arrow_schema())



def stage(lake: LakeRoot, name: str, data: pa.Table) -> Staged:
    """Write ``data`` as data files of table ``name`` without committing them;
    pass the result to ``append(..., staged=[...])`` (or to ``discard``). Until
    that commit lands the files are invisible; they are declared in the staging
    registry, so maintenance leaves them alone while this process lives
    (orphan cleanup removes them if it dies without committing)."""
    spec = table_spec(name)
    data = prepare(lake, spec, data)
    keys = (data.column(ROW_KEY).to_numpy() if spec.enforces_key else np.empty(0, np.int64))
    return Staged(actions=write_data_files(lake, spec, data), keys=keys, rows=data.num_rows, written_at=time.time())



def discard(lake: LakeRoot, name: str, staged: list) -> None:
    """Best-effort removal of staged files that will not be committed (and of
    their staging-registry records)."""
    fs, _ = lake.filesystem()
    base = lake.table_path(name)
    actions = [a for item in staged for a in (item.actions if isinstance(item, Staged) else [item])]
    for action in actions:
        try:
            fs.delete_file(f"{base}/{action.path}")
        except (FileNotFoundError, OSError):
            pass
    release(lake, name, actions)


def intent_id(name: str, path: str) -> str:
    """The staging-registry record of one data file of table ``name`` (named after the file)."""
    return f"{name}.{path.rsplit('/', 1)[-1].removesuffix('.parquet')}"


def release(lake: LakeRoot, name: str, actions: list) -> None:
    """Remove the staging-registry records of ``actions`` (committed or given up)."""
    for action in actions:
        staging.release(lake, intent_id(name, action.path))


def check_actions(lake: LakeRoot, name: str, actions: list, *, what: str) -> None:
    """:meth:`Lake.check_files` for the data files of add actions of table ``name``."""
    lake.check_files({f"{name}/{a.path}": a.size for a in actions if hasattr(a, "size")}, what=what)



def append(lake: LakeRoot, name: str, data: pa.Table | None, *, command: str, config_hash: str | None = None,
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
    run = _Append(lake, name, data, command=command, config_hash=config_hash, app_id=app_id,
                  txn_version=txn_version, extra_transactions=extra_transactions, extra_metadata=extra_metadata,
                  staged=staged, read_version=read_version, lock=lock)
    last_exc: Exception | None = None
    for attempt in range(run.attempts):
        # Check and write against the SAME table snapshot: delta-rs then refuses
        # (ConcurrentTransaction) a commit racing another with our app id (or the
        # serialising one), which closes the window between the check and the write.
        dt = snapshot if attempt == 0 and snapshot is not None else lake.table(name)
        done = run.settled(dt)
        if done is not None:
            return done
        now_ms = int(time.time() * 1000)
        txns = run.transactions(dt, now_ms)
        if run.keyed:
            done = run.dedupe(dt)
            if done is not None:
                return done
            txns.append(Transaction(KEYS_APP, (dt.transaction_version(KEYS_APP) or 0) + 1, now_ms))
        try:
            return run.commit(dt, txns)
        except FilesMissing as exc:
            if staged is not None:
                raise StagedFilesMissing(exc) from None
            last_exc = exc     # deleted under us: write them again on the next attempt
            discard(lake, name, run.actions or [])
            run.actions = None
            continue
        except CommitFailedError as exc:
            last_exc = exc
            run.check_lock()
        except Exception as exc:  # ambiguous: the commit may have landed
            last_exc = exc
            run.ambiguous = True
        if run.keyed or lock:  # lost a serialising race: jittered back-off, then re-check
            time.sleep(random.uniform(0, min(0.02 * 2 ** min(attempt, 6), 1.0)))
        else:
            time.sleep(min(0.05 * 2**attempt, 2.0))
    return run.give_up(last_exc)


class _Append:
    """One call of :func:`append`: its inputs, and what its attempts learned so far (the files
    written, the table version the keys are checked up to, the duplicates and conflicts found)."""

    def __init__(self, lake: LakeRoot, name: str, data: pa.Table | None, *, command: str,
                 config_hash: str | None, app_id: str | None, txn_version: int,
                 extra_transactions: list[str] | None, extra_metadata: dict[str, str] | None,
                 staged: list[Staged] | None, read_version: int | None, lock: tuple[str, int] | None) -> None:
        lake.ensure(name)
        self.lake, self.name, self.spec = lake, name, table_spec(name)
        self.keyed = self.spec.enforces_key
        self.staged, self.lock, self.txn_version = staged, lock, txn_version
        self.extra_transactions = extra_transactions
        if staged is None:
            data = prepare(lake, self.spec, data)
            self.rows = data.num_rows
        else:
            self.rows = sum(s.rows for s in staged)
        self.data = data
        self.app_id = app_id or f"write-{uuid.uuid4().hex}"
        self.meta = write_metadata(command, config_hash)
        self.meta.update({"pipeline.app_id": self.app_id, "pipeline.txn_version": str(txn_version)})
        self.meta.update(extra_metadata or {})
        self.ambiguous = False  # an earlier attempt failed in a way that may have committed
        self.actions: list | None = [a for s in staged for a in s.actions] if staged is not None else None
        self.written_at = 0.0   # when this call wrote ``actions`` (rows in memory only)
        self.checked = read_version if staged is not None else None  # keys up to here are checked
        self.duplicates, self.conflicts = 0, None
        self.attempts = MAX_KEYED_ATTEMPTS if self.keyed or lock else MAX_ATTEMPTS

    def result(self, *, landed: bool, rows: int, version: int | None) -> AppendResult:
        return AppendResult(table=self.name, landed=landed, rows=rows, version=version, app_id=self.app_id,
                            txn_version=self.txn_version, duplicates=self.duplicates, conflicts=self.conflicts)

    def discard_written(self) -> None:
        """Remove the files this call wrote itself (never the caller's staged ones)."""
        if self.staged is None and self.actions:
            discard(self.lake, self.name, self.actions)

    def settled(self, dt: DeltaTable) -> AppendResult | None:
        """The result when our transaction is already in ``dt``; None when it is not."""
        landed = dt.transaction_version(self.app_id)
        if landed is None or landed < self.txn_version:
            return None
        if not self.ambiguous:
            # committed by someone else with this app id (or before this call)
            self.discard_written()    # ours were never committed: unreferenced files
            return self.result(landed=False, rows=0, version=None)
        # our own earlier attempt committed before failing: done
        release(self.lake, self.name, self.actions or [])
        return self.result(landed=True, rows=self.rows, version=self.lake.version(self.name))

    def transactions(self, dt: DeltaTable, now_ms: int) -> list[Transaction]:
        """The application transactions of the commit on ``dt`` (:class:`LockTaken` if the lock is taken)."""
        txns = [Transaction(self.app_id, self.txn_version, now_ms)] + [
            Transaction(t, 0, now_ms) for t in self.extra_transactions or [] if t != self.app_id]
        if self.lock is not None:
            held = dt.transaction_version(self.lock[0])
            if held is not None and held >= self.lock[1]:
                self.discard_written()
                raise LockTaken(*self.lock)
            txns.append(Transaction(self.lock[0], self.lock[1], now_ms))
        return txns

    def dedupe(self, dt: DeltaTable) -> AppendResult | None:
        """Keyed tables: leave out the rows whose key landed (in memory), or raise :class:`KeyRace` when
        a staged key did; the result when no row is left to write."""
        if self.staged is None:
            try:
                self.data, dups, confl = drop_landed(self.lake, self.spec, dt, self.data, since=self.checked)
            except BaseException:
                if self.actions and not self.ambiguous:   # never committed: nothing of this call stays behind
                    discard(self.lake, self.name, self.actions)
                raise
            if dups or confl is not None:
                self.duplicates += dups
                if confl is not None:   # a retry may find duplicates only (conflicts of an earlier pass stay)
                    self.conflicts = confl if self.conflicts is None else pa.concat_tables([self.conflicts, confl])
                if self.actions is not None:  # written before a concurrent append landed some keys
                    discard(self.lake, self.name, self.actions)
                    self.actions = None
            self.rows = self.data.num_rows
            if self.rows == 0:
                return self.result(landed=False, rows=0, version=None)
        else:
            if time.time() - min(s.written_at for s in self.staged) > STAGE_MAX_AGE_S:
                raise KeyRace(np.empty(0, np.int64))
            ours = np.concatenate([s.keys for s in self.staged])
            hits = ours[keyindex.keys(self.lake, self.name, dt, since=self.checked).contains(ours)]
            if hits.size:
                raise KeyRace(hits)
        self.checked = dt.version()
        return None

    def commit(self, dt: DeltaTable, txns: list[Transaction]) -> AppendResult:
        """Write the data files (once; again when too old) and commit them on ``dt``."""
        lake, name, spec = self.lake, self.name, self.spec
        if self.actions is None:  # data files are immutable: write once, commit as often as needed
            self.actions = write_data_files(lake, spec, self.data)
            self.written_at = time.time()
        elif self.staged is None and time.time() - self.written_at > STAGE_MAX_AGE_S:
            discard(lake, name, self.actions)
            self.actions = write_data_files(lake, spec, self.data)
            self.written_at = time.time()
        pause_point(f"append:{name}:staged")
        check_actions(lake, name, self.actions, what=f"append to {name}")   # nothing committed without its files
        dt.create_write_transaction(
            self.actions,
            mode="append",
            schema=spec.arrow_schema(),
            partition_by=list(spec.partition_by) or None,
            commit_properties=CommitProperties(
                custom_metadata=self.meta,
                max_commit_retries=MAX_COMMIT_RETRIES,
                app_transactions=txns,
            ),
        )
        pause_point(f"append:{name}:committed")
        release(lake, name, self.actions)
        # delta-rs does not move `dt` to the version it committed: find the commit by its transaction
        return self.result(landed=True, rows=self.rows,
                           version=committed_version(lake, name, self.app_id, self.txn_version, dt.version()))

    def check_lock(self) -> None:
        """After a lost commit race: :class:`LockTaken` when another writer took the lock (and not with
        our transaction)."""
        if self.lock is None:
            return
        held = self.lake.table(self.name).transaction_version(self.lock[0])
        if held is not None and held >= self.lock[1] and \
                (self.lake.table(self.name).transaction_version(self.app_id) or -1) < self.txn_version:
            if self.staged is None:
                discard(self.lake, self.name, self.actions or [])
            raise LockTaken(*self.lock) from None

    def give_up(self, last_exc: Exception | None) -> AppendResult:
        """Out of attempts: the result if our transaction landed after all, else :class:`CommitError`."""
        landed = self.lake.transaction_version(self.name, self.app_id)
        if landed is not None and landed >= self.txn_version:
            release(self.lake, self.name, self.actions or [])
            return self.result(landed=True, rows=self.rows, version=self.lake.version(self.name))
        self.discard_written()     # never committed: unreferenced files
        raise CommitError(
            f"could not append {self.rows} rows to {self.name} after {self.attempts} attempts: {last_exc}",
            hint=f"retry with the same transaction id ({self.app_id}, {self.txn_version}); it lands at most once",
        )


def drop_landed(lake: LakeRoot, spec: TableSpec, dt: DeltaTable, data: pa.Table, *, since: int | None
                 ) -> tuple[pa.Table, int, pa.Table | None]:
    """``data`` without rows whose key is in ``dt`` (only files committed after
    version ``since`` are looked at when given) or repeats earlier in ``data``.
    -> (rows to write, duplicates, conflicting rows or None)."""
    keys = data.column(ROW_KEY).to_numpy()
    hit = keyindex.keys(lake, spec.name, dt, since=since).contains(keys)
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
        landed = lake.read(spec.name, columns=key_cols + ([cc] if cc else []) + [ROW_KEY],
                           version=dt.version(),
                           # Arrow-owned (not numpy's buffer): see docs/clean-exit.md, filters
                           filter=ds.field(ROW_KEY).isin(pa.array(np.unique(keys[hit]).tolist(), pa.int64())))
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



def write_data_files(lake: LakeRoot, spec: TableSpec, data: pa.Table, *, data_change: bool = True) -> list:
    """Write ``data`` as Parquet files (one per partition) under the table and
    return their add actions. pyarrow's writer with dictionary encoding and
    statistics off for token lists was ~2x faster than delta-rs's writer on
    this table here; the commit itself stays delta-rs's (log, retries,
    conflict checks, checkpoints). Each file is declared in the staging
    registry before it is written (the caller releases it after its commit).
    A commit that never lands leaves only unreferenced files, which orphan
    cleanup removes once their writer is gone."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from deltalake.transaction import AddAction

    fs, _ = lake.filesystem()
    base_path = lake.table_path(spec.name)
    parts = list(spec.partition_by)
    scalar = [c.name for c in spec.columns if not c.is_list and not pa.types.is_map(c.arrow_type)
              and c.name not in parts]
    dict_cols = [c for c in scalar if pa.types.is_string(spec.column(c).arrow_type)]
    groups: list[tuple[dict[str, str | None], pa.Table]] = []
    if parts:
        keys = data.select(parts).group_by(parts).aggregate([]).to_pylist()
        if len(keys) == 1:  # the common case; filtering would copy every token list
            groups.append(({k: partition_str(v) for k, v in keys[0].items()}, data.drop_columns(parts)))
            keys = []
        for key in keys:
            mask = None
            for col, val in key.items():
                m = pc.is_null(data.column(col)) if val is None else pc.equal(data.column(col), val)
                mask = m if mask is None else pc.and_(mask, m)
            groups.append(({k: partition_str(v) for k, v in key.items()}, data.filter(mask).drop_columns(parts)))
    else:
        groups.append(({}, data))
    actions: list = []
    rel_path = ""
    try:
        for pvals, part in groups:
            rel = "/".join(f"{k}={path_safe(v)}" for k, v in pvals.items())
            fname = f"part-00000-{uuid.uuid4()}-c000.zstd.parquet"
            rel_path = f"{rel}/{fname}" if rel else fname
            staging.declare(lake, [f"{spec.name}/{rel_path}"], rid=intent_id(spec.name, rel_path))
            if rel:
                fs.create_dir(f"{base_path}/{rel}", recursive=True)
            with fs.open_output_stream(f"{base_path}/{rel_path}") as f:
                pq.write_table(part, f, compression="zstd", compression_level=1, use_dictionary=dict_cols,
                               write_statistics=scalar)
            size = fs.get_file_info(f"{base_path}/{rel_path}").size
            actions.append(AddAction(rel_path, size, pvals, int(time.time() * 1000), data_change,
                                     stats_json(part, scalar)))
            rel_path = ""
    except BaseException:
        # nothing half-written stays behind (a full disk, an interrupt): this file and those before it
        if rel_path:
            try:
                fs.delete_file(f"{base_path}/{rel_path}")
            except (FileNotFoundError, OSError):
                pass
            staging.release(lake, intent_id(spec.name, rel_path))
        discard(lake, spec.name, actions)
        raise
    return actions


def path_safe(v: str | None) -> str:
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


def stats_json(t: pa.Table, columns: list[str]) -> str:
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


def committed_version(lake: LakeRoot, name: str, app_id: str, txn_version: int, read_version: int) -> int | None:
    """The version of the commit that carried the application transaction ``(app_id, txn_version)``, looked
    for from the newest commit down to the one after ``read_version`` (the version the writer read: its commit
    lands after it, after any rebase onto commits that landed meanwhile). Each (app_id, version) is committed
    once, so the match is the commit."""
    latest = lake.version(name)
    if latest is None:
        return None
    for v in range(latest, read_version, -1):
        for entry in lake.log_entries(name, v) or []:
            t = entry.get("txn")
            if t and t.get("appId") == app_id and int(t.get("version", -1)) == txn_version:
                return v
    return latest
