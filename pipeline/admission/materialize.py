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


def _spill(sources, admitted: pa.Table, path: str, batch_rows: int,
           turns: dict[int, tuple[np.ndarray | None, int]] | None = None) -> tuple[int, int, list[np.ndarray]]:
    """Pass 1: admitted rows -> IPC file of sorted runs. Returns (rows, response tokens, run ranks).

    ``turns`` (per-turn credit): filled with rank -> (the row's turn_rewards or None, its number of
    policy turns), small per row, for ``turn_advantage_column`` before pass 2."""
    ids = admitted.column("trajectory_id").combine_chunks()
    want_hash = admitted.column("content_hash").combine_chunks()
    # The id filter runs on each batch in Arrow: ids are random, file statistics
    # could prune nothing, and a row must never be hidden by them.
    # Modest readahead: token payload batches are large (docs/dependency-notes.md: whole-table
    # reads are the memory danger); pyarrow's defaults buffer up to 16 x 4.
    extra = ["turn_rewards"] if turns is not None else []
    scanners = [dataset.scanner(columns=list(SOURCE) + [c for c in extra if c in dataset.schema.names], filter=flt,
                                batch_size=batch_rows, batch_readahead=4, fragment_readahead=2)
                for dataset, flt in sources]
    proj = scanners[0].projected_schema
    schema = pa.schema([f for f in proj if f.name in SOURCE]).append(pa.field(RANK, pa.int64()))
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
            if turns is not None:
                from pipeline.admission.advantages import policy_turns

                tr = (b.column("turn_rewards").to_pylist() if "turn_rewards" in b.schema.names
                      else [None] * b.num_rows)
                for k, (rk, mask) in enumerate(zip(r.tolist(), b.column("loss_mask").to_pylist())):
                    pt = policy_turns(np.asarray(mask, np.int8))
                    turns[rk] = (None if tr[k] is None else np.asarray(tr[k], np.float64),
                                 int(pt.max()) + 1 if pt.size else 0)
                b = b.drop_columns(["turn_rewards"]) if "turn_rewards" in b.schema.names else b
            order = np.argsort(r, kind="stable")
            run = pa.RecordBatch.from_arrays(list(b.columns) + [pa.array(r)], schema=schema).take(pa.array(order))
            w.write_batch(run)
            runs.append(r[order])
            rows += b.num_rows
            tokens += int(pc.sum(pc.list_value_length(b.column("response_ids"))).as_py() or 0)
    return rows, tokens, runs


def turn_advantage_column(admitted: pa.Table, turns: dict[int, tuple[np.ndarray | None, int]], *,
                          eps: float) -> pa.Array:
    """Per admitted member (rank order), its turn advantages (advantages.turn_advantages over its
    group), or null for every member of a group where one member lacks turn rewards or records a
    count other than its policy turns: that group trains on the sequence-level advantage."""
    from pipeline.admission.advantages import turn_advantages

    gid = admitted.column("group_id").to_pylist()
    out: list[list[float] | None] = [None] * len(gid)
    by_group: dict[str, list[int]] = {}
    for rk, g in enumerate(gid):
        by_group.setdefault(g, []).append(rk)
    for ranks in by_group.values():
        recs = [turns[rk] for rk in ranks]
        if any(tr is None or tr.size != n or n == 0 for tr, n in recs):
            continue
        adv = turn_advantages([tr for tr, _ in recs], np.zeros(len(ranks), np.int64), eps=eps)  # type: ignore[misc]
        for rk, a in zip(ranks, adv):
            out[rk] = a.tolist()
    return pa.array(out, pa.list_(pa.float64()))


def _parts(path: str, runs: list[np.ndarray], admitted: pa.Table, snapshot_id: str,
           batch_rows: int, turn_adv: pa.Array | None = None) -> Iterator[pa.Table]:
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
        if turn_adv is not None:
            cols["turn_advantages"] = turn_adv.slice(lo, t.num_rows)
        yield pa.table(cols)
        del t, dec


def materialize(lake: Lake, version: int, admitted: pa.Table, *, snapshot_id: str, batch_rows: int,
                manifest_extra: dict[str, Any], spill_dir: str | None = None,
                sources: list[tuple[Any, Any]] | None = None,
                turn_eps: float | None = None) -> tuple[Snapshot, int]:
    """Write snapshot ``snapshot_id`` of ``admitted`` (snapshot_members columns,
    sorted by group_id, trajectory_id). Returns (snapshot, response tokens).

    ``sources`` -- (dataset, filter) pairs that hold every admitted row (the
    ones admission read its candidates from); by default the whole version.
    ``turn_eps`` -- per-turn credit (advantage grpo_turn): the payload gains
    ``turn_advantages`` (``turn_advantage_column``, this eps); None: it has no such column."""
    if not sources:
        sources = [(lake.dataset("trajectories", version), None)]
    spill_dir = spill_dir or os.environ.get("PIPELINE_SPILL_DIR") or None
    with tempfile.TemporaryDirectory(prefix="admit-spill-", dir=spill_dir) as tmp:
        path = os.path.join(tmp, "payload.arrow")
        turns: dict[int, tuple[np.ndarray | None, int]] | None = {} if turn_eps is not None else None
        rows, tokens, runs = _spill(sources, admitted, path, batch_rows, turns)
        if rows != admitted.num_rows:
            raise IntegrityError(f"materialization found {rows} of {admitted.num_rows} admitted trajectories "
                                 f"in trajectories@{version}", hint="rerun pipeline admit")
        extra = dict(manifest_extra)
        extra["num_tokens"] = tokens
        turn_adv = turn_advantage_column(admitted, turns, eps=turn_eps) \
            if turns is not None and turn_eps is not None else None
        snap = write_snapshot_stream(lake, _parts(path, runs, admitted, snapshot_id, batch_rows, turn_adv),
                                     snapshot_id=snapshot_id, manifest_extra=extra)
    return snap, tokens
