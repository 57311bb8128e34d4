"""Per-row scalars the lake derives from a trajectory's token lists when it
lands (``pipeline.landing.ingest.stamp_derived``) and when an old table is
migrated to today's layout (:mod:`pipeline.lake.migrate`): pure functions
over Arrow list arrays, so the storage layer and the landing door compute
them identically."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa


def list_min_nonneg(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per list: min of elements >= 0 as int64; -1 when none (or the list is null)."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    n = len(arr)
    out = np.full(n, -1, np.int64)
    if n == 0:
        return out
    offsets = np.asarray(arr.offsets, np.int64)                           # [n+1]
    vals = arr.values
    if vals.null_count:
        vals = vals.fill_null(-1)
    values = vals.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]  # [T] int32, no copy
    offsets = offsets - offsets[0]
    # viewed as unsigned, every negative (observation tokens carry -1) sorts above every
    # version: the unsigned min is the smallest version >= 0, without copying the tokens
    v = values.astype(np.int32, copy=False).view(np.uint32)              # [T]
    lens = np.diff(offsets)
    nonempty = lens > 0
    if v.size and nonempty.any():
        mins = np.minimum.reduceat(v, offsets[:-1][nonempty]).astype(np.int64)
        out[nonempty] = np.where(mins >= 2**31, -1, mins)
    if arr.null_count:
        out[np.asarray(arr.is_null())] = -1
    return out


def list_max(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per list of int32: its largest element as int64; -1 when empty or null."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    out = np.full(len(arr), -1, np.int64)
    if len(arr) == 0:
        return out
    offsets = np.asarray(arr.offsets, np.int64)
    vals = arr.values.fill_null(-1) if arr.values.null_count else arr.values
    values = np.asarray(vals.to_numpy(zero_copy_only=False))[offsets[0]:offsets[-1]]
    offsets = offsets - offsets[0]
    nonempty = np.diff(offsets) > 0
    if values.size and nonempty.any():
        out[nonempty] = np.maximum.reduceat(values, offsets[:-1][nonempty]).astype(np.int64)
    if arr.null_count:
        out[np.asarray(arr.is_null())] = -1
    return out


def prompt_hashes(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Per list of prompt token ids: hex of the first 16 bytes of sha256 over the
    ids as little-endian int32 (the prompt identity admission compares); a null
    list hashes as an empty one."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if len(arr) == 0:
        return pa.array([], pa.string())
    offsets = np.asarray(arr.offsets, np.int64)
    vals = arr.values.fill_null(0) if arr.values.null_count else arr.values
    buf = np.ascontiguousarray(np.asarray(vals.to_numpy(zero_copy_only=False), dtype="<i4")).tobytes()
    out = [hashlib.sha256(buf[4 * a:4 * b]).hexdigest()[:32] for a, b in zip(offsets[:-1], offsets[1:])]
    if arr.null_count:
        empty = hashlib.sha256(b"").hexdigest()[:32]
        out = [empty if null else h for h, null in zip(out, np.asarray(arr.is_null()))]
    return pa.array(out, pa.string())
