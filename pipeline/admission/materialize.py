"""Snapshot materialization: stream the admitted members' token payload from
the Delta version admission read into the snapshot's own files.

Memory stays bounded at any batch size (docs/dependency-notes.md: whole-table reads of
token lists are the memory danger). It is an external merge sort: pass 1
streams only the admitted rows (a ``trajectory_id`` filter, ``batch_rows`` at
a time), sorts each batch by its rank in (group_id, trajectory_id) order and
appends it as one sorted run to an uncompressed Arrow IPC spill file; pass 2
produces the output ``batch_rows`` ranks at a time by slicing each run's
contiguous share of that rank window out of a fresh memory map, so every
spill page is touched once and released with its window, and writes the parts
through ``snapshot.write_snapshot_stream``.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.snapshots.format import Snapshot

from pipeline.snapshots.publish import write_snapshot_stream
from pipeline.errors import IntegrityError

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

SOURCE = ("trajectory_id", "content_hash", "run_id", "task_id", "group_size", "policy_version",
          "token_policy_versions", "prompt_ids", "response_ids", "response_logprobs", "loss_mask",
          "num_turns", "num_tool_calls")
RANK = "__rank"


def _spill(sources, admitted: pa.Table, path: str, batch_rows: int) -> tuple[int, int, list[np.ndarray]]:
    """Pass 1: admitted rows -> IPC file of sorted runs. Returns (rows, response tokens, run ranks)."""
    ids = admitted.column("trajectory_id").combine_chunks()
    want_hash = admitted.column("content_hash").combine_chunks()
    # The id filter runs on each batch in Arrow: ids are random, file statistics
    # could prune nothing, and a row must never be hidden by them.
    # Modest readahead: token payload batches are large (docs/dependency-notes.md: whole-table
    # reads are the memory danger); pyarrow's defaults buffer up to 16 x 4.
    scanners = [dataset.scanner(columns=list(SOURCE), filter=flt, batch_size=batch_rows, batch_readahead=4,
                                fragment_readahead=2) for dataset, flt in sources]
    schema = scanners[0].projected_schema.append(pa.field(RANK, pa.int64()))
    rows = tokens = 0
    runs: list[np.ndarray] = []
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, schema) as w:
        for b in (b for sc in scanners for b in sc.to_batches()):
            if b.num_rows == 0:
                continue
            rank = pc.index_in(b.column("trajectory_id"), value_set=ids)
            keep = pc.is_valid(rank)
            if not pc.all(keep).as_py():
                b, rank = b.filter(keep), rank.filter(keep)
            if b.num_rows == 0:
                continue
            if not pc.equal(b.column("content_hash"), pc.take(want_hash, rank)).to_numpy(False).all():
                raise IntegrityError("a trajectory's content_hash changed between admission and materialization",
                                     hint="rerun pipeline admit")
            r = rank.cast(pa.int64()).to_numpy()
            order = np.argsort(r, kind="stable")
            run = pa.RecordBatch.from_arrays(list(b.columns) + [pa.array(r)], schema=schema).take(pa.array(order))
            w.write_batch(run)
            runs.append(r[order])
            rows += b.num_rows
            tokens += int(pc.sum(pc.list_value_length(b.column("response_ids"))).as_py() or 0)
    return rows, tokens, runs


def _parts(path: str, runs: list[np.ndarray], admitted: pa.Table, snapshot_id: str,
           batch_rows: int) -> Iterator[pa.Table]:
    """Pass 2: merge the sorted runs window by window, joined with the decision columns."""
    total = sum(len(r) for r in runs)
    for lo in range(0, total, batch_rows):
        hi = lo + batch_rows
        with pa.memory_map(path, "r") as src:
            reader = pa.ipc.open_file(src)
            pieces, ranks = [], []
            for i, r in enumerate(runs):
                a, z = np.searchsorted(r, lo), np.searchsorted(r, hi)
                if z > a:
                    pieces.append(reader.get_batch(i).slice(a, z - a))
                    ranks.append(r[a:z])
            window = pa.Table.from_batches(pieces).combine_chunks()                  # copies: window-sized
            del pieces
        t = window.take(pa.array(np.argsort(np.concatenate(ranks), kind="stable")))
        del window
        dec = admitted.slice(lo, t.num_rows)  # admitted is in rank order
        cols: dict[str, Any] = {"snapshot_id": pa.array([snapshot_id] * t.num_rows, pa.string())}
        for c in ("trajectory_id", "group_id", "content_hash", "advantage", "reward", "policy_lag",
                  "difficulty", "length_bucket", "tool_call_bucket", "reward_std_bucket"):
            cols[c] = dec.column(c)
        if not t.column("trajectory_id").equals(dec.column("trajectory_id")):
            raise AssertionError("materialization merge out of order")
        for c in SOURCE:
            if c not in cols:
                cols[c] = t.column(c)
        yield pa.table(cols)
        del t, dec


def materialize(lake: Lake, version: int, admitted: pa.Table, *, snapshot_id: str, batch_rows: int,
                manifest_extra: dict[str, Any], spill_dir: str | None = None,
                sources: list[tuple[Any, Any]] | None = None) -> tuple[Snapshot, int]:
    """Write snapshot ``snapshot_id`` of ``admitted`` (snapshot_members columns,
    sorted by group_id, trajectory_id). Returns (snapshot, response tokens).

    ``sources`` -- (dataset, filter) pairs that hold every admitted row (the
    ones admission read its candidates from); by default the whole version."""
    if not sources:
        sources = [(lake.dataset("trajectories", version), None)]
    spill_dir = spill_dir or os.environ.get("PIPELINE_SPILL_DIR") or None
    with tempfile.TemporaryDirectory(prefix="admit-spill-", dir=spill_dir) as tmp:
        path = os.path.join(tmp, "payload.arrow")
        rows, tokens, runs = _spill(sources, admitted, path, batch_rows)
        if rows != admitted.num_rows:
            raise IntegrityError(f"materialization found {rows} of {admitted.num_rows} admitted trajectories "
                                 f"in trajectories@{version}", hint="rerun pipeline admit")
        extra = dict(manifest_extra)
        extra["num_tokens"] = tokens
        snap = write_snapshot_stream(lake, _parts(path, runs, admitted, snapshot_id, batch_rows),
                                     snapshot_id=snapshot_id, manifest_extra=extra)
    return snap, tokens
