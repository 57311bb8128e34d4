"""The one adapter over ``deltalake`` (delta-rs). Nothing else imports it.

Every write is an append with commit metadata (who, which command, config
hash) and an application transaction, so a writer that retries after an
ambiguous failure can ask the log whether its batch already landed instead of
appending it again. delta-rs records ``app_transactions`` but does not refuse a
repeated version: the exactly-once check below is ours.
"""

from __future__ import annotations

import getpass
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, Transaction, WriterProperties
from deltalake.exceptions import CommitFailedError, TableNotFoundError

from pipeline import __version__
from pipeline.errors import CommitError, NotFoundError
from pipeline.schema import TableSpec, table_spec

DEFAULT_LAKE = "./lake"

# Old versions stay loadable until `pipeline lake maintain` says otherwise:
# delta-rs would otherwise clean expired logs (30 days) on checkpoint.
TABLE_PROPERTIES: dict[str, str] = {
    "delta.logRetentionDuration": "interval 36500 days",
    "delta.enableExpiredLogCleanup": "false",
    "delta.deletedFileRetentionDuration": "interval 7 days",
    "delta.checkpointInterval": "50",
}

# Raised from delta-rs's 15: with 8 writers on one table, 22/999 commits still
# failed at the default (shared/VERIFIED.md).
MAX_COMMIT_RETRIES = 100
MAX_ATTEMPTS = 8


@dataclass(frozen=True)
class AppendResult:
    """Outcome of one append. ``landed`` is False when the app transaction had
    already been committed (an exactly-once no-op)."""

    table: str
    landed: bool
    rows: int
    version: int | None
    app_id: str
    txn_version: int


def _writer_properties(spec: TableSpec) -> WriterProperties:
    from deltalake import ColumnProperties

    # Dictionary encoding of token lists costs time and buys nothing
    # (shared/VERIFIED.md: 1.7x faster writes with it off).
    # Min/max statistics of token ids prune nothing and cost write time.
    lists = {c.name: ColumnProperties(dictionary_enabled=False, statistics_enabled="NONE")
             for c in spec.columns if c.is_list}
    return WriterProperties(compression="ZSTD", compression_level=1, column_properties=lists or None)


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
        """Create table ``name`` from its spec if it does not exist (race-safe)."""
        if self.exists(name):
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
        return self.table(name, version).to_pyarrow_dataset()

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
    def stage(self, name: str, data: pa.Table) -> list:
        """Write ``data`` as data files of table ``name`` without committing them;
        pass the result to ``append(..., staged=...)``. Until that commit lands the
        files are invisible (vacuum removes them if it never does)."""
        spec = table_spec(name)
        return self._write_data_files(spec, data.select(spec.names).cast(spec.arrow_schema()))

    def discard(self, name: str, staged: list) -> None:
        """Best-effort removal of staged files that will not be committed."""
        fs, _ = self.filesystem()
        base = self.table_uri(name) if self.is_local else self.table_uri(name).split("://", 1)[1]
        for action in staged:
            try:
                fs.delete_file(f"{base}/{action.path}")
            except (FileNotFoundError, OSError):
                pass

    def append(self, name: str, data: pa.Table | None, *, command: str, config_hash: str | None = None,
               app_id: str | None = None, txn_version: int = 0,
               extra_transactions: list[str] | None = None,
               extra_metadata: dict[str, str] | None = None,
               staged: list | None = None, rows: int | None = None) -> AppendResult:
        """Append ``data`` to ``name`` exactly once per ``(app_id, txn_version)``.

        Retries ``CommitFailedError``. Any other failure after the write may have
        committed is ambiguous: we reload the log and ask whether our transaction
        landed before trying again, never blindly re-appending. Without an
        ``app_id`` a one-off id is used, so ambiguity is still resolvable.
        ``extra_transactions`` are further app ids (version 0) recorded in the
        same commit (ingest records one per source file). ``staged`` commits files
        written earlier with :meth:`stage` instead of writing ``data``.
        """
        self.ensure(name)
        spec = table_spec(name)
        if staged is None:
            data = data.select(spec.names).cast(spec.arrow_schema())
            rows = data.num_rows
        elif rows is None:
            raise ValueError("append(staged=...) needs rows=")
        app_id = app_id or f"write-{uuid.uuid4().hex}"
        meta = _metadata(command, config_hash)
        meta.update({"pipeline.app_id": app_id, "pipeline.txn_version": str(txn_version)})
        meta.update(extra_metadata or {})
        last_exc: Exception | None = None
        ambiguous = False  # an earlier attempt failed in a way that may have committed
        actions = staged
        for attempt in range(MAX_ATTEMPTS):
            # Check and write against the SAME table snapshot: delta-rs then refuses
            # (ConcurrentTransaction) a commit racing another with our app id, which
            # closes the window between the check and the write.
            dt = self.table(name)
            landed = dt.transaction_version(app_id)
            if landed is not None and landed >= txn_version:
                if not ambiguous:
                    # committed by someone else with this app id (or before this call)
                    return AppendResult(name, False, 0, None, app_id, txn_version)
                # our own earlier attempt committed before failing: done
                return AppendResult(name, True, rows, self.version(name), app_id, txn_version)
            try:
                if actions is None:  # data files are immutable: write once, commit as often as needed
                    actions = self._write_data_files(spec, data)
                dt.create_write_transaction(
                    actions,
                    mode="append",
                    schema=spec.arrow_schema(),
                    partition_by=list(spec.partition_by) or None,
                    commit_properties=CommitProperties(
                        custom_metadata=meta,
                        max_commit_retries=MAX_COMMIT_RETRIES,
                        app_transactions=[Transaction(app_id, txn_version, int(time.time() * 1000))]
                        + [Transaction(t, 0, int(time.time() * 1000)) for t in extra_transactions or []
                           if t != app_id],
                    ),
                )
                return AppendResult(name, True, rows, self.version(name), app_id, txn_version)
            except CommitFailedError as exc:
                last_exc = exc
            except Exception as exc:  # ambiguous: the commit may have landed
                last_exc = exc
                ambiguous = True
            time.sleep(min(0.05 * 2**attempt, 2.0))
        landed = self.transaction_version(name, app_id)
        if landed is not None and landed >= txn_version:
            return AppendResult(name, True, rows, self.version(name), app_id, txn_version)
        raise CommitError(
            f"could not append {rows} rows to {name} after {MAX_ATTEMPTS} attempts: {last_exc}",
            hint=f"retry with the same transaction id ({app_id}, {txn_version}); it lands at most once",
        )

    def _write_data_files(self, spec: TableSpec, data: pa.Table) -> list:
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
            actions.append(AddAction(rel_path, size, pvals, int(time.time() * 1000), True,
                                     _stats_json(part, scalar)))
        return actions

    # -- maintenance ------------------------------------------------------
    def compact(self, name: str) -> dict[str, Any]:
        spec = table_spec(name)
        dt = self.table(name)
        return dt.optimize.compact(
            writer_properties=_writer_properties(spec),
            commit_properties=CommitProperties(custom_metadata=_metadata("lake maintain: compact", None),
                                               max_commit_retries=MAX_COMMIT_RETRIES),
        )

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

