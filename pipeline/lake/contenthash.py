"""The canonical content hash of a trajectory (``trajectories.content_hash``).

The specification is schemas/README.md ("Canonical content hash", hash
version 1); this module implements it and must agree with that text byte for
byte: schemas/hash_vectors.jsonl holds golden vectors and
tests/lake/test_hash_spec.py checks them with an independent implementation
written from the text alone. In short: SHA-256 over
``HEADER ‖ STRINGS ‖ MAPS ‖ LISTS`` where the header has, per hashed column
(the ingest columns except ``content_hash``, in schema order), the name,
0x00, a presence byte and 8 bytes (i64 value, binary64 bits, µs since epoch,
or the byte length / element / entry count), and the payload sections hold
the variable-length bytes the header counts; a ``TRAILER`` then holds each
``hashed: when_present`` column that is not null (name, 0x00, u64 byte length,
bytes), so a row that leaves them null hashes as it always did.

The layout is fixed-width where it can be so the whole table hashes in a few
vectorized passes plus one SHA-256 per row. NaN/±inf, null list elements, null
map values and repeated map keys have no hash (the contract rejects them before
hashing): ValueError.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.schema import ColumnSpec, table_spec

HASH_VERSION = 1
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


def hashed_columns(table_name: str = "trajectories") -> list[ColumnSpec]:
    return [c for c in table_spec(table_name).ingest_columns if c.name != "content_hash" and c.hashed]


def trailer_columns(table_name: str = "trajectories") -> list[ColumnSpec]:
    """The ``hashed: when_present`` columns: in the trailer when not null."""
    return [c for c in table_spec(table_name).ingest_columns if c.hashed_when_present]


def _trailer(table: pa.Table, spec: ColumnSpec) -> list[bytes]:
    """Per row: ``name 0x00 u64(len) utf8`` when the value is not null, else nothing
    (a column absent from ``table`` is null)."""
    if spec.name not in table.column_names:
        return [b""] * table.num_rows
    head = spec.name.encode() + b"\x00"
    return [b"" if v is None else head + struct.pack("<Q", len(b := v.encode())) + b
            for v in table.column(spec.name).to_pylist()]


def _header_field(col: pa.ChunkedArray | pa.Array, spec: ColumnSpec) -> tuple[np.ndarray, np.ndarray]:
    """(presence uint8[n], 8-byte field uint8[n, 8]) for one column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    n = len(arr)
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    t = arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        val = pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype("<i8")
    elif pa.types.is_map(t):
        val = np.diff(arr.offsets.to_numpy().astype(np.int64)).astype("<i8")
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        val = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype("<i8")
    elif pa.types.is_floating(t):
        val = arr.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False).astype("<f8")
        if not np.isfinite(val).all():
            raise ValueError(f"content hash: {spec.name} holds NaN or ±inf, which the contract rejects")
    elif pa.types.is_timestamp(t):
        val = arr.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).astype("<i8")
    elif pa.types.is_integer(t):
        val = arr.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).astype("<i8")
    else:
        raise TypeError(f"content hash: unsupported type {t} for {spec.name}")
    field8 = np.ascontiguousarray(val).view(np.uint8).reshape(n, 8).copy()
    field8[~valid] = 0
    return valid.astype(np.uint8), field8


def _list_values(arr: pa.Array, spec: ColumnSpec) -> tuple[np.ndarray, memoryview, int]:
    """(offsets int64[n+1] in bytes, values buffer, width) of a list column."""
    width = spec.arrow_type.value_type.bit_width // 8
    if arr.null_count:
        arr = pc.if_else(arr.is_null(), pa.scalar([], type=arr.type), arr)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    # Normalize to a zero-offset list so offsets index `values` directly.
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values
    if values.slice(offsets[0], offsets[-1] - offsets[0]).null_count:
        raise ValueError(f"content hash: {spec.name} holds null elements, which the contract rejects")
    vals = values.to_numpy(zero_copy_only=False)
    np_dtype = {1: "<i1", 4: "<f4" if pa.types.is_floating(values.type) else "<i4"}[width]
    vals = np.ascontiguousarray(vals.astype(np_dtype, copy=False))
    if width == 4 and np_dtype == "<f4" and not np.isfinite(vals[offsets[0]:offsets[-1]]).all():
        raise ValueError(f"content hash: {spec.name} holds NaN or ±inf elements, which the contract rejects")
    return offsets * width, vals.data.cast("B"), width


def _map_payloads(arr: pa.Array) -> list[bytes]:
    out = []
    pack_q, pack_d = struct.Struct("<Q").pack, struct.Struct("<d").pack
    isfinite = math.isfinite
    for entry in arr.to_pylist():
        if not entry:
            out.append(b"")
            continue
        entry.sort(key=_first)  # code point order of str == byte order of their UTF-8 encodings
        parts = []
        prev = None
        for k, v in entry:
            if k == prev:
                raise ValueError(f"content hash: map key {k!r} repeats; map keys must be unique")
            if v is None or not isfinite(v):
                raise ValueError(f"content hash: map value {k!r}={v} is not a finite number")
            kb = k.encode()
            parts.append(pack_q(len(kb)) + kb + pack_d(v))
            prev = k
        out.append(b"".join(parts))
    return out


def _first(kv: tuple[str, Any]) -> str:
    return kv[0]


def content_hashes(table: pa.Table, table_name: str = "trajectories") -> pa.Array:
    """Canonical content hash of every row of ``table`` (already of the schema's
    types; run the validator first for raw input). Returns a string array."""
    cols = hashed_columns(table_name)
    n = table.num_rows
    if n == 0:
        return pa.array([], pa.string())
    # -- header matrix [n, W] -------------------------------------------------
    pieces: list[np.ndarray] = []
    for spec in cols:
        name = np.frombuffer(spec.name.encode() + b"\x00", dtype=np.uint8)
        presence, field8 = _header_field(table.column(spec.name), spec)
        pieces.append(np.broadcast_to(name, (n, len(name))))
        pieces.append(presence.reshape(n, 1))
        pieces.append(field8)
    header = np.ascontiguousarray(np.concatenate(pieces, axis=1))  # [n, W]
    width = header.shape[1]
    header_mv = header.data.cast("B")
    # -- payload sections -------------------------------------------------------
    strings = [table.column(c.name).combine_chunks().fill_null("") for c in cols
               if pa.types.is_string(c.arrow_type)]
    if strings:
        joined = pc.binary_join_element_wise(*strings, "").cast(pa.binary())
        bufs = joined.buffers()
        s_off = np.frombuffer(bufs[1], dtype=np.int32).astype(np.int64)
        s_buf = memoryview(bufs[2] or b"")
        s_base = joined.offset
    maps = [_map_payloads(table.column(c.name).combine_chunks()) for c in cols
            if pa.types.is_map(c.arrow_type)]
    lists = [_list_values(table.column(c.name).combine_chunks(), c) for c in cols if c.is_list]
    trailers = [_trailer(table, c) for c in trailer_columns(table_name)]
    sha = hashlib.sha256

    def digest(lo: int, hi: int) -> list[str]:
        out = []
        for i in range(lo, hi):
            h = sha(header_mv[i * width:(i + 1) * width])
            if strings:
                h.update(s_buf[s_off[s_base + i]:s_off[s_base + i + 1]])
            for m in maps:
                h.update(m[i])
            for off, buf, _w in lists:
                h.update(buf[off[i]:off[i + 1]])
            for tr in trailers:
                h.update(tr[i])
            out.append(h.hexdigest())
        return out

    # hashlib releases the GIL while hashing large buffers: token payloads hash
    # in parallel threads.
    workers = min(_HASH_THREADS, max(1, n // 2000))
    if workers == 1:
        return pa.array(digest(0, n), pa.string())
    from concurrent.futures import ThreadPoolExecutor

    bounds = np.linspace(0, n, workers + 1).astype(int)
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(digest, bounds[:-1], bounds[1:]))
    return pa.array([h for part in parts for h in part], pa.string())


def content_hash(row: Mapping[str, Any], table_name: str = "trajectories") -> str:
    """Canonical content hash of one row given as a dict (Python values;
    timestamps as timezone-aware datetimes). ``content_hash`` and derived keys
    in ``row`` are ignored."""
    cols = hashed_columns(table_name)
    schema = pa.schema([c.arrow_field().with_nullable(True) for c in cols])
    missing = [c.name for c in cols if c.name not in row]
    if missing:
        raise KeyError(f"row lacks column(s) {missing}")
    more = trailer_columns(table_name)             # absent == null: hashed as before they existed
    schema = pa.schema(list(schema) + [c.arrow_field().with_nullable(True) for c in more])
    t = pa.Table.from_pylist([{c.name: row[c.name] for c in cols} | {c.name: row.get(c.name) for c in more}],
                             schema=schema)
    return content_hashes(t, table_name)[0].as_py()
