"""Land trajectories: read files, validate (pure core in lake/validate.py),
stamp, dedupe against the table, write valid rows and quarantine the rest.

This is the landing half of ingest (:func:`land_files`, :func:`land_table`),
above the storage layer (``lake/``: tables, writes, compaction); the job that
users call, which also reports an OpenLineage run, is :mod:`pipeline.ingest`
(``ingest_files`` / ``ingest_table``), a layer above. The per-source step
(:func:`check_source`: validate, stamp, dedupe, quarantine entries) is also
what the committer runs once per flush (:mod:`pipeline.landing.door`), and
its validate-and-stamp core (:func:`validate_stamp`) is what
:func:`pipeline.landing.rows.land_rows` (spool shipping, the simulator) runs:
one door. Until 2026-12 this module was ``pipeline.lake.ingest`` (a shim that
warns keeps that path working).

Idempotence, at two levels:
- file: each file's sha256 is an application transaction (``ingest:<sha>``) on
  both tables, so re-ingesting a file is a no-op, and a run that died between
  the two commits converges when rerun;
- row: a trajectory_id that already landed with the same content_hash is a
  duplicate (no-op); with a different one it is a ``conflict`` (quarantined).
  Ids are checked against the table's compact key column (``row_key``, 8 bytes
  a row), never against every id string ever landed; the commit is serialised
  with every other append to the table (docs/write-protocol.md), so two
  ingests of overlapping ids at the same moment land each id once.

Every file is read and validated before anything is written: a corrupt file
fails the command with no new table version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import CommitError, InputFileError
from pipeline.lake.derived import list_max, list_min_nonneg, prompt_hashes
from pipeline.lake.quarantine import FILE_ROW, quarantine_rows, row_trajectory_id
from pipeline.lake.validate import Reject, Validated, safe_raw, validate_table
from pipeline.schema import table_spec

if TYPE_CHECKING:
    from pipeline.lake.delta import KeySet, Lake

FORMATS = ("parquet", "ipc", "jsonl")


@dataclass(kw_only=True)
class IngestReport:
    ingest_id: str
    files: int = 0
    rows_read: int = 0
    landed: int = 0
    duplicates: int = 0
    quarantined: int = 0
    skipped_files: list[str] = field(default_factory=list)  # already ingested (same bytes)
    trajectories_version: int | None = None
    quarantine_version: int | None = None
    reasons: dict[str, int] = field(default_factory=dict)   # quarantine entries per reason_code
    rejected_rows: int = 0          # rows read that did not land because of a problem (quarantined)
    file_problems: list[str] = field(default_factory=list)   # "<file>: <problem>", one per problem of a whole file

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# -- reading ----------------------------------------------------------------------------
FileFormat = Literal["parquet", "ipc", "jsonl"]   # the input file formats the door reads


def detect_format(path: Path, head: bytes) -> FileFormat:
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".arrow", ".ipc", ".feather", ".arrows"):
        return "ipc"
    if suffix in (".jsonl", ".ndjson", ".json"):
        # binary bytes under a JSON name would quarantine one binary "line" per newline byte
        real = "Parquet" if head.startswith(b"PAR1") else "Arrow IPC" if (
            head.startswith(b"ARROW1") or head[:4] == b"\xff\xff\xff\xff") else None
        if real:
            raise InputFileError(f"{path}: named {suffix} but holds {real} bytes (it starts with {head[:6]!r})",
                                 hint=f"rename it *.{'parquet' if real == 'Parquet' else 'arrow'}")
        if b"\x00" in head:
            raise InputFileError(f"{path}: named {suffix} but holds binary bytes (NUL in its first bytes), "
                                 f"not JSON lines", hint="write one JSON object per line in UTF-8, "
                                 "or name a Parquet / Arrow file *.parquet / *.arrow")
        return "jsonl"
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1") or head[:4] == b"\xff\xff\xff\xff":
        return "ipc"
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    raise InputFileError(f"{path}: cannot tell the format",
                         hint="name it *.parquet, *.arrow (Arrow IPC) or *.jsonl")


def read_bytes(path: str | os.PathLike[str]) -> tuple[pa.Buffer, str]:
    """(the file's bytes in an Arrow-owned buffer, their sha256)."""
    p = Path(path)
    try:
        with pa.OSFile(str(p)) as f:
            data = f.read_buffer()
    except FileNotFoundError:
        raise InputFileError(f"{p}: no such file") from None
    except (OSError, pa.ArrowIOError) as exc:
        if not p.exists():
            raise InputFileError(f"{p}: no such file") from None
        raise InputFileError(f"{p}: cannot read: {exc}") from None
    if not data:
        raise InputFileError(f"{p}: the file is empty (0 bytes)",
                             hint="write at least one row, or leave the file out")
    return data, hashlib.sha256(data).hexdigest()


def _arrow_owned(data: bytes | pa.Buffer) -> pa.Buffer:
    """``data`` in memory Arrow owns. Arrow's reader threads may drop the last
    reference to their input after a read returned; releasing Python-owned bytes
    there needs the interpreter, which aborts the process if it is shutting down
    (docs/clean-exit.md). A copy only for callers that pass bytes."""
    if isinstance(data, pa.Buffer):  # read_bytes: read from a seekable file, so Arrow-allocated
        return data
    buf = pa.allocate_buffer(len(data))
    memoryview(buf).cast("B")[:] = memoryview(data).cast("B")
    return buf


def count_rows(path: str | os.PathLike[str], data: bytes | pa.Buffer) -> int:
    """Row count without parsing rows (for files skipped as already ingested)."""
    fmt = detect_format(Path(path), bytes(data[:8]))
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(pa.BufferReader(_arrow_owned(data))).metadata.num_rows
    if fmt == "ipc":
        return read_file(path, data)[0].num_rows
    return sum(1 for ln in _py_bytes(data).split(b"\n") if ln.strip())


def _py_bytes(data: bytes | pa.Buffer) -> bytes:
    return data.to_pybytes() if isinstance(data, pa.Buffer) else bytes(data)


def read_file(path: str | os.PathLike[str], data: bytes | pa.Buffer | None = None
              ) -> tuple[pa.Table, list[str] | None, list[Reject], str]:
    """(raw table, raw JSON lines or None, parse rejects, sha256 of the bytes)."""
    p = Path(path)
    if data is None:
        data, fp = read_bytes(p)
    else:
        fp = hashlib.sha256(data).hexdigest()
    fmt = detect_format(p, bytes(data[:8]))
    try:
        if fmt in ("parquet", "ipc"):
            data = _arrow_owned(data)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(pa.BufferReader(data)), None, [], fp
        if fmt == "ipc":
            try:
                return pa.ipc.open_file(pa.BufferReader(data)).read_all(), None, [], fp
            except pa.ArrowInvalid:
                return pa.ipc.open_stream(pa.BufferReader(data)).read_all(), None, [], fp
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise InputFileError(f"{p}: not a readable {fmt} file ({exc})",
                             hint="the file is corrupt or truncated; re-export it") from None
    from pipeline.lake.jsonl import parse_jsonl

    table, lines, rejects = parse_jsonl(_py_bytes(data), p)
    return table, lines, rejects, fp


# -- the pure part ------------------------------------------------------------------------
def dedupe(valid: pa.Table, existing: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``valid`` rows into (new, duplicate, conflict) boolean masks.

    ``existing`` has trajectory_id and content_hash of landed rows. Within
    ``valid`` itself, repeated ids with equal content keep the first occurrence;
    repeated ids with different content are all conflicts.
    """
    n = valid.num_rows
    ids = valid.column("trajectory_id").to_numpy(zero_copy_only=False).astype(object)
    hashes = valid.column("content_hash").to_numpy(zero_copy_only=False).astype(object)
    new = np.ones(n, bool)
    dup = np.zeros(n, bool)
    conflict = np.zeros(n, bool)
    # within the batch
    seen: dict[str, tuple[int, str]] = {}
    in_batch_conflict: set[str] = set()
    for i in range(n):
        prev = seen.get(ids[i])
        if prev is None:
            seen[ids[i]] = (i, hashes[i])
        elif prev[1] == hashes[i]:
            new[i], dup[i] = False, True
        else:
            in_batch_conflict.add(ids[i])
    if in_batch_conflict:
        m = np.isin(ids, list(in_batch_conflict))
        conflict |= m
        new &= ~m
        dup &= ~m
    # against the table
    if existing.num_rows:
        idx = pc.index_in(valid.column("trajectory_id"), value_set=existing.column("trajectory_id"))
        hit = np.asarray(idx.is_valid().to_numpy(zero_copy_only=False), bool)
        if hit.any():
            ex_hash = existing.column("content_hash").combine_chunks().take(idx.fill_null(0))
            same = np.asarray(pc.equal(ex_hash, valid.column("content_hash")).to_numpy(zero_copy_only=False), bool)
            dup |= hit & same & new
            conflict |= hit & ~same & new
            new &= ~hit
    return new, dup, conflict


def stamp_derived(valid: pa.Table, ingest_id: str) -> pa.Table:
    """Add the lake-derived columns: created_day, ingest_id, row_key, and the
    per-trajectory scalars admission needs from the token lists (computed once
    here so admission never reads token payload): oldest_version = min sampled
    version over the response tokens (>= 0; observation tokens carry -1),
    policy_version when there is none; response_len = len(response_ids);
    prompt_hash = the prompt's identity (``prompt_hashes``); max_token_id =
    the largest id in prompt_ids and response_ids (admission's vocabulary check)."""
    from pipeline.lake.delta import row_keys
    from pipeline.schema import ROW_KEY, table_spec

    day = pc.cast(pc.cast(valid.column("created_at"), pa.timestamp("us", tz="UTC")), pa.date32())
    t = valid.append_column("created_day", day)
    t = t.append_column("ingest_id", pa.array([ingest_id] * valid.num_rows, pa.string()))
    t = t.append_column(ROW_KEY, row_keys(table_spec("trajectories"), valid))
    tpv = list_min_nonneg(valid.column("token_policy_versions"))
    pv = np.asarray(valid.column("policy_version").to_numpy(zero_copy_only=False), np.int64)
    t = t.append_column("oldest_version", pa.array(np.where(tpv >= 0, tpv, pv), pa.int64()))
    lens = pc.list_value_length(valid.column("response_ids")).fill_null(0)
    t = t.append_column("response_len", pc.cast(lens, pa.int32()))
    t = t.append_column("prompt_hash", prompt_hashes(valid.column("prompt_ids")))
    top = np.maximum(list_max(valid.column("prompt_ids")), list_max(valid.column("response_ids")))
    return t.append_column("max_token_id", pa.array(top, pa.int32()))


def stamp(valid: pa.Table, table: str, ingest_id: str) -> pa.Table:
    """``valid`` rows of ``table`` with what the lake derives at landing: the
    trajectories' columns (:func:`stamp_derived`); events carry none (their
    ``row_key`` is added by the append)."""
    return stamp_derived(valid, ingest_id) if table == "trajectories" else valid


def validate_stamp(raw: pa.Table, ingest_id: str, *, table: str = "trajectories", pre: list[Reject] | None = None,
                   stamped: bool = True) -> tuple[Validated, pa.Table | None]:
    """The landing door's first two steps, the same for a file, an in-memory
    table, a spool batch and a committer flush: ``raw`` validated against the
    table's contract (schemas/), and its valid rows stamped (None when none is
    valid or ``stamped`` is false: :func:`check_source` stamps after its file-level checks)."""
    validated = validate_table(raw, pre_rejected=pre or [], table=table)
    if not stamped or not validated.valid.num_rows:
        return validated, None
    return validated, stamp(validated.valid, table, ingest_id)


# -- the wrapper --------------------------------------------------------------------------
def precheck(path: str, data: bytes | pa.Buffer) -> None:
    """Cheap structural check (Parquet footer, Arrow IPC schema) so a corrupt or
    truncated file fails the command before anything is written."""
    fmt = detect_format(Path(path), bytes(data[:8]))
    if fmt in ("parquet", "ipc"):
        data = _arrow_owned(data)
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            _ = pq.ParquetFile(pa.BufferReader(data)).metadata  # parses the footer
        elif fmt == "ipc":
            try:
                _ = pa.ipc.open_file(pa.BufferReader(data)).schema
            except pa.ArrowInvalid:
                _ = pa.ipc.open_stream(pa.BufferReader(data)).schema
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise InputFileError(f"{path}: not a readable {fmt} file ({exc})",
                             hint="the file is corrupt or truncated; re-export it") from None


def land_files(lake: Lake, paths: Iterable[str | os.PathLike[str]], *, command: str = "ingest",
               progress: bool = False) -> IngestReport:
    """Land valid rows (one commit) and quarantine the rest (one commit).

    Every file is fingerprinted and structurally checked first: an unreadable
    file raises InputFileError before anything is written. Then, file by file in
    input order, rows are parsed, validated and deduplicated (against the table
    and the files before it: the first occurrence of an id wins), and their data
    files are staged on a writer thread while the next file is validated. The
    staged files become visible in one trajectories commit at the end; if
    anything fails first, they are removed and no table version is written.
    """
    ingest_id = _new_ingest_id()
    report = IngestReport(ingest_id=ingest_id)
    heads: list[tuple[str, str]] = []
    seen_fp: set[str] = set()
    dt = lake.table("trajectories") if lake.exists("trajectories") else None
    for path in [str(p) for p in paths]:
        data, fp = read_bytes(path)
        report.files += 1
        # A file whose rows landed before (its transaction is in the trajectories
        # log; quarantine commits first) is a no-op: skip parsing it at all.
        if fp in seen_fp or (dt is not None and dt.transaction_version(f"ingest:{fp}") is not None):
            n = count_rows(path, data)
            report.rows_read += n
            report.skipped_files.append(path)
            report.duplicates += n
            continue
        precheck(path, data)
        seen_fp.add(fp)
        heads.append((path, fp))
        del data

    def sources() -> Iterator[tuple[str, str, pa.Table, list[str] | None, list[Reject]]]:
        for path, fp in heads:
            raw, lines, pre, _ = read_file(path)
            yield path, fp, raw, lines, pre

    return _land(lake, sources, [fp for _, fp in heads], report, command=command)


def land_table(lake: Lake, table, *, source: str = "memory", command: str = "ingest_table") -> IngestReport:
    """Land an in-memory ``pyarrow.Table`` (or pandas / polars DataFrame) with
    the same validation, quarantine, dedupe and exactly-once guarantees as
    ``pipeline ingest``. The table's content fingerprint (sha256 of its Arrow IPC
    stream) is the application transaction, so landing the same table twice is
    a no-op. ``source`` names it in quarantine rows."""
    raw = as_arrow(table)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, raw.schema) as w:
        w.write_table(raw)
    fp = hashlib.sha256(sink.getvalue()).hexdigest()
    report = IngestReport(ingest_id=_new_ingest_id(), files=1, rows_read=0)
    if lake.exists("trajectories") and lake.transaction_version("trajectories", f"ingest:{fp}") is not None:
        report.rows_read = raw.num_rows
        report.duplicates = raw.num_rows
        report.skipped_files.append(source)
        return report
    report.files = 1
    return _land(lake, lambda: iter([(source, fp, raw, None, [])]), [fp], report, command=command)


def as_arrow(table) -> pa.Table:
    """Any frame ``ingest_table`` accepts as one Arrow table in types validation
    understands; a frame that cannot be converted is one InputFileError naming
    the column, never a raw Arrow or pandas exception."""
    mod = type(table).__module__.split(".")[0]
    try:
        if isinstance(table, pa.Table):
            out = table
        elif isinstance(table, pa.RecordBatch):
            out = pa.Table.from_batches([table])
        elif mod == "polars":
            if hasattr(table, "collect") and not hasattr(table, "to_arrow"):   # a LazyFrame: run its plan
                table = table.collect()
            out = table.to_arrow()
        elif mod == "pandas":
            out = _from_pandas(table)
        elif hasattr(table, "__arrow_c_stream__"):
            out = pa.table(table)
        elif isinstance(table, (list, tuple)) and table and all(isinstance(r, dict) for r in table):
            out = pa.Table.from_pylist(list(table))      # rows as dicts: types inferred, then validated exactly
        else:
            raise TypeError(f"ingest_table needs a pyarrow Table, pandas or polars DataFrame (or LazyFrame) or a "
                            f"non-empty list of row dicts, not {type(table).__name__}")
        return _plain_types(out)
    except (pa.ArrowException, ValueError) as exc:
        if isinstance(exc, InputFileError):
            raise
        raise InputFileError(f"ingest_table: the {type(table).__name__} cannot be read as a table: {exc}",
                             hint="give each column one type the ingest contract names (docs/how-to/land-rollouts.md, Ingest contract)"
                             ) from None


def _from_pandas(df) -> pa.Table:
    """A pandas frame column by column, each in the Arrow type pandas' own
    conversion gives it (what ``df.to_parquet`` writes), so validation applies
    the rules a file gets: a naive datetime column is a ``naive_timestamp``, a
    number given as a string a ``wrong_type`` (converting to the contract type
    first would assume UTC and parse the strings). Only a map column given as
    lists of (key, value) tuples, which has no Arrow type of its own, is
    converted to its contract type. A column Arrow cannot convert is named in
    the error."""
    spec = table_spec("trajectories")
    maps = {c.name: c.arrow_type for c in spec.ingest_columns if pa.types.is_map(c.arrow_type)}
    names = [str(c) for c in df.columns]
    arrays = []
    for k, name in enumerate(names):
        col = df.iloc[:, k]
        try:
            arrays.append(pa.array(col, from_pandas=True))
            continue
        except (pa.ArrowException, ValueError, TypeError) as exc:
            first = exc
        if name in maps:
            try:
                arrays.append(pa.array(col, type=maps[name], from_pandas=True))
                continue
            except (pa.ArrowException, ValueError, TypeError):
                pass    # not pairs of a string and a number: say what the column holds
        kinds = sorted({type(v).__name__ for v in col.tolist() if v is not None})
        raise InputFileError(f"ingest_table: column {name!r} (pandas dtype {col.dtype}) cannot be converted to "
                             f"one Arrow type: it holds {', '.join(kinds)} values ({first})",
                             hint=f"give the column one type, e.g. df[{name!r}].astype(str), or drop it") from None
    return pa.Table.from_arrays(arrays, names=names)


def _plain_types(t: pa.Table) -> pa.Table:
    """View and dictionary encodings decoded to the plain types validation and
    the contract use (list_view -> list, string_view -> string, dictionary ->
    its values), recursively inside lists."""
    def plain(typ: pa.DataType) -> pa.DataType:
        if pa.types.is_dictionary(typ):
            return plain(typ.value_type)
        if pa.types.is_list_view(typ):
            return pa.list_(plain(typ.value_type))
        if pa.types.is_large_list_view(typ):
            return pa.large_list(plain(typ.value_type))
        if pa.types.is_list(typ):
            return pa.list_(plain(typ.value_type))
        if pa.types.is_large_list(typ):
            return pa.large_list(plain(typ.value_type))
        if pa.types.is_string_view(typ):
            return pa.string()
        if pa.types.is_binary_view(typ):
            return pa.binary()
        return typ

    def view_to_list(arr: pa.Array) -> pa.Array:
        # built by hand: pyarrow 26.0.1's cast of a list_view chunk to list gives an offsets buffer one entry short
        valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), bool)
        sizes = np.where(valid, np.asarray(arr.sizes.fill_null(0).to_numpy(zero_copy_only=False), np.int64), 0)
        large = pa.types.is_large_list_view(arr.type)
        offsets = pa.array(np.concatenate([[0], np.cumsum(sizes)]), pa.int64() if large else pa.int32())
        cls = pa.LargeListArray if large else pa.ListArray
        return cls.from_arrays(offsets, arr.flatten(), mask=pa.array(~valid) if not valid.all() else None)

    cols = []
    changed = False
    for col in t.columns:
        want = plain(col.type)
        if want != col.type:
            if pa.types.is_list_view(col.type) or pa.types.is_large_list_view(col.type):
                col = pa.chunked_array([view_to_list(c) for c in col.chunks], type=None if col.chunks else want)
            col, changed = col.cast(want), True
        cols.append(col)
    return pa.Table.from_arrays(cols, names=t.column_names) if changed else t


def _new_ingest_id() -> str:
    return f"ingest-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"


MAX_RACES = 20
# What _land reads (again after a lost race): per source, (path, fingerprint, raw table, raw JSONL lines or
# None, parse rejects).
Sources = Callable[[], Iterator[tuple[str, str, pa.Table, list[str] | None, list[Reject]]]]


def _land(lake: Lake, sources: Sources, fingerprints: list[str], report: IngestReport, *, command: str) -> IngestReport:
    """Validate, dedupe, stage and commit ``sources()`` (path, fingerprint, raw
    table, raw JSONL lines or None, parse rejects). If a concurrent append lands
    some of the same ids between our read and our commit (KeyRace), everything
    staged is discarded and the sources are read again against the new version."""
    from pipeline.lake.delta import KeyRace

    if not fingerprints:
        return report
    base = dataclasses.replace(report)
    for _ in range(MAX_RACES):
        report = dataclasses.replace(base, reasons=dict(base.reasons), skipped_files=list(base.skipped_files),
                                     file_problems=list(base.file_problems))
        try:
            return _land_once(lake, sources, fingerprints, report, command=command)
        except KeyRace:
            continue
    raise CommitError(f"ingest lost {MAX_RACES} races in a row to concurrent appends of the same ids",
                      hint="rerun: what landed is not landed twice")


def _land_once(lake: Lake, sources: Sources, fingerprints: list[str], report: IngestReport, *, command: str) -> IngestReport:
    # tables are created only when something is committed: a file that fails to parse leaves no version
    seen = Seen.read(lake)
    staged, landed, q_tables = _stage_sources(lake, sources, seen, report)
    _commit(lake, seen, staged, landed, q_tables, fingerprints, report, command=command)
    return report


@dataclass
class Seen:
    """What new rows are deduplicated against: the trajectories version read
    (its key index and keys committed since, int64 per row) and the rows this
    ingest accepted so far (the first occurrence of an id wins)."""

    lake: Lake
    dt: Any                         # the DeltaTable read, None before the table exists
    read_version: int | None
    table_keys: KeySet
    accepted: pa.Table              # trajectory_id, content_hash

    @classmethod
    def read(cls, lake: Lake) -> Seen:
        from pipeline.lake.delta import KeySet

        accepted = pa.table({"trajectory_id": pa.array([], pa.string()), "content_hash": pa.array([], pa.string())})
        if not lake.exists("trajectories"):
            return cls(lake, None, None, KeySet(np.empty(0, np.int64), np.empty(0, np.int64)), accepted)
        dt = lake.table("trajectories")
        return cls(lake, dt, dt.version(), lake.keys("trajectories", dt), accepted)

    def existing(self, valid: pa.Table) -> pa.Table:
        """Id + content hash of the rows ``valid`` may repeat: only rows whose key
        digest is in the table are fetched, plus the rows accepted so far."""
        from pipeline.schema import ROW_KEY

        keys = valid.column(ROW_KEY).to_numpy()
        hit = self.table_keys.contains(keys)
        if not hit.any():
            return self.accepted
        found = self.lake.read("trajectories", columns=["trajectory_id", "content_hash"], version=self.read_version,
                               filter=_key_filter(np.unique(keys[hit])))
        return pa.concat_tables([found, self.accepted], promote_options="permissive")

    def accept(self, rows: pa.Table) -> None:
        self.accepted = pa.concat_tables([self.accepted, rows.select(["trajectory_id", "content_hash"])],
                                         promote_options="permissive")


def _stage_sources(lake: Lake, sources: Sources, seen: Seen, report: IngestReport) -> tuple[list[Any], int, list[pa.Table]]:
    """(staged files, rows staged, quarantine tables): each source validated and
    deduplicated in order while a writer thread stages the previous one's rows.
    On any error the files staged so far are removed."""
    from concurrent.futures import ThreadPoolExecutor

    staged: list = []
    futures = []
    landed = 0
    q_tables = []
    try:
        with ThreadPoolExecutor(max_workers=1) as writer:
            for path, fp, raw, lines, pre in sources():
                to_land, rej = check_source(seen, raw, lines, pre, report, source=path)
                if to_land is not None:
                    landed += to_land.num_rows
                    futures.append(writer.submit(lake.stage, "trajectories", to_land))
                if rej:
                    q_tables.append(quarantine_rows(sorted(rej), raw=safe_raw(raw), raw_lines=lines, source=path,
                                                    fingerprint=fp, ingest_id=report.ingest_id))
                del raw, lines, to_land
            for f in futures:
                staged.append(f.result())
    except BaseException:
        for f in futures:
            if f.done() and not f.exception():
                staged.append(f.result())
        lake.discard("trajectories", staged)
        raise
    return staged, landed, q_tables


def check_source(seen: Seen, raw: pa.Table, lines: list[str] | None, pre: list[Reject], report: IngestReport,
                 *, source: str) -> tuple[pa.Table | None, list[tuple[int, str, str, str | None]]]:
    """(the new rows to land or None, quarantine entries (row, code, message, id)) of one source: validated
    and stamped (:func:`validate_stamp`), deduplicated against ``seen``. The step every file of
    ``pipeline ingest`` and every flush of the committer (:mod:`pipeline.landing.door`) goes through."""
    report.rows_read += raw.num_rows
    validated, _ = validate_stamp(raw, report.ingest_id, pre=pre, stamped=False)
    valid = validated.valid
    if validated.file_problems and raw.num_rows:
        # every row fails alike: one quarantine entry per problem for the file (source_row -1), not one per row
        n = raw.num_rows
        report.rejected_rows += n
        report.file_problems.extend(f"{source}: {msg}" for _, msg in dict.fromkeys(validated.file_problems))
        by_code: dict[str, list[str]] = {}     # one entry per code (the quarantine key): its messages joined
        for code, msg in dict.fromkeys(validated.file_problems):
            by_code.setdefault(code, []).append(msg)
        return None, [(FILE_ROW, code, f"{'; '.join(msgs)} (a problem of the whole file: none of its {n} row(s) "
                                        f"landed; fix the file and ingest it again)", None)
                      for code, msgs in by_code.items()]
    shown = safe_raw(raw) if validated.rejects else raw  # renders bad UTF-8 / repeated columns
    rej = [(r.row, r.code, r.message, row_trajectory_id(shown, lines, r.row)) for r in validated.rejects]
    report.rejected_rows += len(rej)
    if not valid.num_rows:
        return None, rej
    valid = stamp(valid, "trajectories", report.ingest_id)
    new, dup, conflict = dedupe(valid, seen.existing(valid))
    report.duplicates += int(dup.sum())
    for i in np.flatnonzero(conflict):
        tid = valid.column("trajectory_id")[int(i)].as_py()
        report.rejected_rows += 1
        rej.append((int(validated.valid_rows[i]), "conflict",
                    f"trajectory_id {tid!r} already exists (or repeats in this input) with different "
                    f"content (content_hash {valid.column('content_hash')[int(i)].as_py()[:12]}…); "
                    f"ids are idempotency keys: use a new id for new content", tid))
    if not new.any():
        return None, rej
    to_land = valid if new.all() else valid.filter(pa.array(new))  # filter copies every token list
    seen.accept(to_land)
    return to_land, rej


def _commit(lake: Lake, seen: Seen, staged: list[Any], landed: int, q_tables: list[pa.Table],
            fingerprints: list[str], report: IngestReport, *, command: str) -> None:
    """Quarantine first (one commit), then the staged trajectories (one commit);
    both carry every source's ``ingest:<fingerprint>`` transaction."""
    txns = [f"ingest:{fp}" for fp in fingerprints]
    app_id = _batch_app_id(txns)
    quarantine = pa.concat_tables(q_tables) if q_tables else None
    try:
        if quarantine is not None and quarantine.num_rows:
            # keyed by (fingerprint, row, code): a rerun or a race retry never quarantines a row twice
            res = lake.append("quarantine", quarantine, command=command, extra_transactions=txns)
            report.quarantined = quarantine.num_rows
            report.quarantine_version = res.version if res.landed else lake.version("quarantine")
            for code in quarantine.column("reason_code").to_pylist():
                report.reasons[code] = report.reasons.get(code, 0) + 1
        if staged:
            res = lake.append("trajectories", None, command=command, app_id=app_id, txn_version=0,
                              extra_transactions=txns, staged=staged, read_version=seen.read_version,
                              snapshot=seen.dt)
            report.landed = landed if res.landed else 0
            report.trajectories_version = res.version
            if not res.landed:  # the same batch landed concurrently: our copies are garbage
                report.duplicates += landed
                report.trajectories_version = lake.version("trajectories")
                lake.discard("trajectories", staged)
    except BaseException:
        if staged and lake.transaction_version("trajectories", app_id) is None:
            lake.discard("trajectories", staged)
        raise


def _key_filter(keys: np.ndarray):
    import pyarrow.dataset as ds

    from pipeline.schema import ROW_KEY

    # an Arrow-owned copy: pa.array(ndarray) wraps numpy's buffer, and a scanner thread dropping the
    # filter's last reference to it at interpreter exit aborted the process (docs/clean-exit.md)
    return ds.field(ROW_KEY).isin(pa.array(keys.tolist(), pa.int64()))


def _batch_app_id(txns: list[str]) -> str:
    return "ingest-batch:" + hashlib.sha256("\n".join(sorted(txns)).encode()).hexdigest()[:32]
