"""The table store: a lake root, its Delta tables, reads, time travel, the
log and the files behind a version, and the settings every write shares.

Writes (:mod:`.writes`), the key index (:mod:`.keyindex`) and compaction and
cleanup (:mod:`.compact`) are functions over a :class:`Lake`; the methods of
the same names here call them.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import TableNotFoundError

from pipeline.errors import NotFoundError
from pipeline.lake.delta.common import (  # noqa: F401 - re-exported: importable from the store as before
    COMPACT_APP,
    KEYS_APP,
    MAX_ATTEMPTS,
    MAX_COMMIT_RETRIES,
    MAX_KEYED_ATTEMPTS,
    ORPHAN_MIN_AGE_S,
    PAUSE_AT_ENV,
    STAGE_MAX_AGE_S,
    TABLE_PROPERTIES,
    FilesMissing,
    _metadata,
    _partition_str,
    pause_point,
)
from pipeline.schema import table_spec

if TYPE_CHECKING:
    import numpy as np

    from pipeline.lake.delta.keyindex import KeySet
    from pipeline.lake.delta.writes import AppendResult, Staged

DEFAULT_LAKE = "./lake"

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

    # -- writes (pipeline/lake/delta/writes.py) ---------------------------
    def stage(self, name: str, data: pa.Table) -> Staged:
        """Write ``data`` as data files of ``name`` without committing them (:func:`.writes.stage`)."""
        from pipeline.lake.delta import writes

        return writes.stage(self, name, data)

    def discard(self, name: str, staged: list) -> None:
        """Best-effort removal of staged files that will not be committed."""
        from pipeline.lake.delta import writes

        writes.discard(self, name, staged)

    def append(self, name: str, data: pa.Table | None, *, command: str, config_hash: str | None = None,
               app_id: str | None = None, txn_version: int = 0,
               extra_transactions: list[str] | None = None,
               extra_metadata: dict[str, str] | None = None,
               staged: list[Staged] | None = None, read_version: int | None = None,
               lock: tuple[str, int] | None = None, snapshot: DeltaTable | None = None) -> AppendResult:
        """Append ``data`` to ``name`` exactly once per ``(app_id, txn_version)``
        (:func:`.writes.append` has the protocol). Rows in memory for a keyed table, with
        no ``lock``, ``staged`` files, ``extra_metadata`` or ``snapshot``, go through a group
        commit (:func:`.group.append`: concurrent appends share one commit, same guarantees)."""
        from pipeline.lake.delta import group, writes

        if staged is None and lock is None and not extra_metadata and snapshot is None \
                and table_spec(name).enforces_key and group.enabled(self):
            return group.append(self, name, data, command=command, config_hash=config_hash, app_id=app_id,
                                txn_version=txn_version, extra=list(extra_transactions or []))
        return writes.append(self, name, data, command=command, config_hash=config_hash, app_id=app_id,
                             txn_version=txn_version, extra_transactions=extra_transactions,
                             extra_metadata=extra_metadata, staged=staged, read_version=read_version,
                             lock=lock, snapshot=snapshot)

    def sweep_intents(self, name: str, *, dry_run: bool = False) -> list[str]:
        """Remove the group-commit intent records of ``name`` whose transaction is committed (:func:`.group.sweep`)."""
        from pipeline.lake.delta import group

        return group.sweep(self, name, dry_run=dry_run)

    def tidy_damaged_intents(self, name: str, *, dry_run: bool = False) -> tuple[list[str], list[str]]:
        """Set aside the damaged group-commit intents of ``name`` and remove the set-aside records that
        protect nothing any more (:func:`.group.tidy_damaged`): (set aside, removed)."""
        from pipeline.lake.delta import group

        live = {p for p, _ in self.live_files(self.table(name))} if self.exists(name) else set()
        return group.tidy_damaged(self, name, live=live, dry_run=dry_run)

    # -- keys (pipeline/lake/delta/keyindex.py) ----------------------------
    def keys(self, name: str, dt: DeltaTable, *, since: int | None = None) -> KeySet:
        """``row_key`` of every row in ``dt`` (or of the files committed after ``since``)."""
        from pipeline.lake.delta import keyindex

        return keyindex.keys(self, name, dt, since=since)

    def write_key_index(self, name: str) -> int | None:
        """Write the sorted key index of ``name``'s latest version; returns the version it is of
        (None when keyed appends kept landing first)."""
        from pipeline.lake.delta import keyindex

        return keyindex.write_key_index(self, name)

    def load_key_index(self, name: str, version: int) -> tuple[int, np.ndarray] | None:
        """(index version, sorted keys) of the newest index at or below ``version``."""
        from pipeline.lake.delta import keyindex

        return keyindex.load_key_index(self, name, version)

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

    # -- maintenance (pipeline/lake/delta/compact.py) ----------------------
    def compact(self, name: str, *, target_bytes: int = 128 << 20) -> dict[str, Any]:
        """Rewrite each partition's small files into files of up to ``target_bytes``."""
        from pipeline.lake.delta import compact

        return compact.compact(self, name, target_bytes=target_bytes)

    def rewrite(self, name: str, files: list[tuple[str, dict[str, str | None], int]], transform: Any, *,
                command: str) -> int | None:
        """Replace live ``files`` by ``transform(their rows)`` in one ``dataChange=false`` commit (see
        :func:`pipeline.lake.delta.compact.rewrite`); None when it must be replanned."""
        from pipeline.lake.delta import compact

        return compact.rewrite(self, name, files, transform, command=command)

    def remove_orphans(self, name: str, *, min_age_s: float = ORPHAN_MIN_AGE_S,
                       dry_run: bool = False, future: list[str] | None = None) -> list[str]:
        """Delete data files of ``name`` no commit ever referenced, older than ``min_age_s``
        (``future``: filled with the future-dated ones still waiting)."""
        from pipeline.lake.delta import compact

        return compact.remove_orphans(self, name, min_age_s=min_age_s, dry_run=dry_run, future=future)

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

    def check_files(self, expected: dict[str, int], *, what: str) -> None:
        """Raise :class:`FilesMissing` unless every path (relative to the lake root)
        exists with the size given. Every commit calls it after its last write and
        right before committing, so no version ever references a missing file
        (docs/write-protocol.md, "Nothing committed without its files")."""
        import pyarrow.fs as pafs

        if not expected:
            return
        fs, root = self.filesystem()
        rels = sorted(expected)
        try:
            infos = fs.get_file_info([f"{root}/{r}" for r in rels])
        except FileNotFoundError:
            infos = [pafs.FileInfo(f"{root}/{r}", pafs.FileType.NotFound) for r in rels]
        missing = []
        for rel, info in zip(rels, infos):
            got = info.size if info.type == pafs.FileType.File else None
            if got != expected[rel]:
                missing.append((rel, expected[rel], got))
        if missing:
            raise FilesMissing(what, missing)
