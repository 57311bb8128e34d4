"""The table/log core at the bottom of the store: a lake root, its Delta
tables, reads, time travel, the log, the files behind a version and the
lake's plain file system (:class:`LakeRoot`).

It imports nothing of the write modules: writes (:mod:`.writes`), the key
index (:mod:`.keyindex`), compaction (:mod:`.compact`) and group commit
(:mod:`.group`) are functions over a :class:`LakeRoot`, and the :class:`Lake`
facade (:mod:`.store`) is a :class:`LakeRoot` whose write methods call them
(docs/architecture.md, "Storage: one way up").
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import TableNotFoundError

from pipeline.errors import NotFoundError
from pipeline.lake.delta.common import TABLE_PROPERTIES, FilesMissing, partition_str, write_metadata
from pipeline.lake.uri import split_uri
from pipeline.schema import table_spec

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


class LakeRoot:
    """A lake root holding Delta tables (``<root>/<table>``) and plain files
    (snapshot payloads, checkpoints): everything but the writes. Local path or
    any object-store URI deltalake accepts. :class:`~pipeline.lake.delta.Lake`
    is the one to open; the write modules take this core."""

    def __init__(self, uri: str | os.PathLike[str] | None = None, *,
                 storage_options: dict[str, str] | None = None) -> None:
        self.uri = resolve_lake_uri(uri)
        self.storage_options = storage_options if storage_options is not None else storage_options_from_env()
        self.is_local = "://" not in self.uri
        if self.is_local:
            Path(self.uri).mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    # -- tables -----------------------------------------------------------
    def table_uri(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def table_path(self, name: str) -> str:
        """Table ``name``'s directory on :meth:`filesystem` (its URI without the scheme)."""
        return split_uri(self.table_uri(name))[1]

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
                commit_properties=CommitProperties(custom_metadata=write_metadata("create", None)),
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
                                         custom_metadata=write_metadata("schema: add columns", None)))
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
        base = self.table_path(name)
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

    @staticmethod
    def live_files(dt: DeltaTable) -> list[tuple[str, dict[str, str | None]]]:
        """(path relative to the table, partition values as log strings) of every live file."""
        t = pa.table(dt.get_add_actions(flatten=True))
        parts = [c for c in t.column_names if c.startswith("partition.")]
        paths = t.column("path").to_pylist()
        vals = {c[len("partition."):]: t.column(c).to_pylist() for c in parts}
        return [(p, {k: partition_str(v[i]) for k, v in vals.items()}) for i, p in enumerate(paths)]

    @staticmethod
    def live_file_uris(dt: DeltaTable) -> list[tuple[str, dict[str, str | None]]]:
        """(absolute file uri, partition values as log strings) of every live file
        of ``dt``: ``live_files`` with the uris delta-rs resolves (what readers
        outside delta-rs open: DuckDB, Dask workers)."""
        from urllib.parse import unquote

        rel = LakeRoot.live_files(dt)
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
        base = self.table_path(name)
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
        base = self.table_path(name)
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

    # -- maintenance primitives (compaction and cleanup: pipeline/lake/delta/compact.py) --
    def checkpoint(self, name: str) -> None:
        self.table(name).create_checkpoint()

    def vacuum(self, name: str, *, retention_hours: int, keep_versions: list[int] | None,
               dry_run: bool) -> list[str]:
        return self.table(name).vacuum(
            retention_hours=retention_hours,
            dry_run=dry_run,
            enforce_retention_duration=False,
            keep_versions=keep_versions or None,
            commit_properties=CommitProperties(custom_metadata=write_metadata("lake maintain: vacuum", None)),
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
                endpoint_override=split_uri(endpoint)[1] if endpoint else None,
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
