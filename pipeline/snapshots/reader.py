"""Read a training-batch snapshot from any trainer: ``pipeline.snapshots.open``.

    import pipeline.snapshots
    from pipeline.lake import Lake

    snap = pipeline.snapshots.open(Lake("s3://bucket/lake"), snapshot_id)   # verifies, or raises
    for batch in snap.batches(256):           # pyarrow.RecordBatch of members
        ...
    ds = snap.dataset()                       # torch.utils.data.Dataset, one member per item
    loader = torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=pipeline.snapshots.collate)

``open`` verifies before anything is read for training: every file's sha256
against the manifest, the manifest against the ``snapshots`` table row that
published it, and the snapshot id recomputed from the members (the format is
pipeline/snapshots/format.py; this module only reads it). A member is one
admitted trajectory: token ids (``prompt_ids``, ``response_ids``), the loss
mask (1 = policy-sampled token; observation tokens are 0), the behaviour
log-probs (``response_logprobs``, 0 where the mask is 0), the sequence
``advantage`` (per-token advantage = advantage * loss_mask; in a snapshot of
per-turn credit, manifest ``turn_credit: true``, ``turn_advantages`` give turn
k's advantage to the k-th run of policy tokens where not null), its ``group_id``
and ``group_size``, ``reward``, ``policy_version`` and ``policy_lag``. The
project's own trainer (pipeline/train/data.py) reads snapshots through this.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

MEMBER_COLUMNS = ["trajectory_id", "group_id", "group_size", "advantage", "reward", "policy_lag", "policy_version",
                  "token_policy_versions", "prompt_ids", "response_ids", "response_logprobs", "loss_mask"]
TURN_COLUMNS = ["turn_advantages"]   # in the payload of a snapshot whose manifest says turn_credit: true


def policy_turns(loss_mask: np.ndarray) -> np.ndarray:
    """Turn index of every response token: k on the k-th run of policy tokens (loss_mask 1), -1 on
    observation tokens.  # [T]"""
    m = np.asarray(loss_mask, np.int8) == 1
    starts = m & ~np.concatenate([[False], m[:-1]])
    return np.where(m, np.cumsum(starts) - 1, -1)


def turn_token_advantages(turn_adv: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """Per-token advantage: turn k's advantage on the tokens of the k-th policy turn, 0 on
    observations; a turn count that does not match the mask's policy runs is an error.  # [T]"""
    turn = policy_turns(loss_mask)
    adv = np.asarray(turn_adv, np.float64)
    runs = int(turn.max()) + 1 if turn.size else 0
    if runs != adv.size:
        raise ValueError(f"{adv.size} turn advantages for {runs} policy turns in loss_mask")
    return np.where(turn >= 0, adv[np.maximum(turn, 0)], 0.0)


class SnapshotReader:
    """A verified snapshot. ``table``/``batches`` give Arrow, ``dataset`` torch."""

    def __init__(self, lake: Lake, snapshot_id: str, *, verify: bool = True) -> None:
        from pipeline.snapshots.format import open_snapshot, verify_snapshot

        self.lake = lake
        self.snapshot_id = snapshot_id
        self.verification: dict[str, Any] | None = verify_snapshot(lake, snapshot_id) if verify else None
        self._snap = open_snapshot(lake, snapshot_id)
        self._table: pa.Table | None = None

    @property
    def manifest(self) -> dict[str, Any]:
        """manifest.json: files and their sha256, member count, admission config, estimator."""
        return self._snap.manifest

    def __len__(self) -> int:
        return int(self.manifest["num_members"])

    @property
    def columns(self) -> list[str]:
        """The member columns a trainer reads: MEMBER_COLUMNS, and TURN_COLUMNS in a snapshot of per-turn credit."""
        return MEMBER_COLUMNS + (TURN_COLUMNS if self.manifest.get("turn_credit") else [])

    def table(self, columns: list[str] | None = None) -> pa.Table:
        """The members (schemas/snapshot_payload.yaml), in snapshot order
        (group_id, trajectory_id). ``columns`` default: MEMBER_COLUMNS."""
        from pipeline.snapshots.format import read_snapshot_table

        cols = list(columns or self.columns)
        if self._table is None or not set(cols) <= set(self._table.column_names):
            # verified at open (files rehashed just before): read without hashing twice;
            # an unverified reader rehashes the bytes it parses
            self._table = read_snapshot_table(self.lake, self._snap, verify=self.verification is None, columns=cols)
        return self._table.select(cols)

    def batches(self, batch_size: int = 1024, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
        """The members as Arrow record batches of at most ``batch_size`` rows."""
        yield from self.table(columns).to_batches(max_chunksize=batch_size)

    def dataset(self):
        """A ``torch.utils.data.Dataset``: item i is member i as a dict of
        tensors (see ``member``); pad a list of them with ``collate``."""
        return _dataset_class()(self.table())


def open(lake: Lake | str | os.PathLike[str], snapshot_id: str, *,
         verify: bool = True) -> SnapshotReader:  # noqa: A001 - the public name
    """Open snapshot ``snapshot_id`` of ``lake`` (a pipeline.lake.Lake, or its
    path / URI), verified unless ``verify=False``. Raises NotFoundError /
    IntegrityError."""
    from pipeline.lake.ref import as_lake

    return SnapshotReader(as_lake(lake), snapshot_id, verify=verify)


def member(table: pa.Table, i: int) -> dict[str, Any]:
    """Member ``i`` of a member table as tensors: ``prompt_ids``, ``response_ids``
    (int64), ``loss_mask`` (int8), ``behaviour_logprobs`` (float32),
    ``advantage`` / ``reward`` (float64 scalars), ``group_id``, ``group_size``,
    ``trajectory_id``, ``policy_version``, ``policy_lag``."""
    import torch

    row = {c: table.column(c)[i] for c in MEMBER_COLUMNS + TURN_COLUMNS if c in table.column_names}

    def arr(name, dtype):
        return torch.from_numpy(np.asarray(row[name].values.to_numpy(zero_copy_only=False), dtype=dtype).copy())

    return {
        "trajectory_id": row["trajectory_id"].as_py(),
        "group_id": row["group_id"].as_py(),
        "group_size": int(row["group_size"].as_py()),
        "policy_version": int(row["policy_version"].as_py()),
        "policy_lag": int(row["policy_lag"].as_py()),
        "prompt_ids": arr("prompt_ids", np.int64),
        "response_ids": arr("response_ids", np.int64),
        "loss_mask": arr("loss_mask", np.int8),
        "behaviour_logprobs": arr("response_logprobs", np.float32),
        "advantage": torch.tensor(float(row["advantage"].as_py()), dtype=torch.float64),
        "reward": torch.tensor(float(row["reward"].as_py()), dtype=torch.float64),
        **({"turn_advantages": arr("turn_advantages", np.float64)}
           if "turn_advantages" in row and row["turn_advantages"].is_valid else {}),
    }


@functools.cache
def _dataset_class():
    import torch.utils.data

    class SnapshotDataset(torch.utils.data.Dataset):
        """Members of a verified snapshot; item i is ``member(table, i)``."""

        def __init__(self, table: pa.Table) -> None:
            self.table = table.combine_chunks()

        def __len__(self) -> int:
            return self.table.num_rows

        def __getitem__(self, i: int) -> dict[str, Any]:
            if not -len(self) <= i < len(self):
                raise IndexError(i)
            return member(self.table, i % len(self))

    return SnapshotDataset


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Right-padded causal-LM batch from ``member`` dicts, aligned to input positions:

    - ``input_ids [B, L]``: prompt then response, 0-padded; ``attention_mask [B, L]``;
    - ``loss_mask [B, L]``: 1.0 at the positions of policy-sampled response tokens;
    - ``behaviour_logprobs [B, L]``, ``advantages [B, L]`` (= advantage * loss_mask)
      at the same positions. The logits that predict position t sit at t - 1.
    """
    import torch

    B = len(items)
    L = max(len(x["prompt_ids"]) + len(x["response_ids"]) for x in items)
    out: dict[str, Any] = {k: torch.zeros(B, L, dtype=d) for k, d in (("input_ids", torch.int64), ("attention_mask", torch.int64),
                                                     ("loss_mask", torch.float32),
                                                     ("behaviour_logprobs", torch.float32),
                                                     ("advantages", torch.float32))}
    for b, x in enumerate(items):
        p, r = len(x["prompt_ids"]), len(x["response_ids"])
        out["input_ids"][b, :p] = x["prompt_ids"]
        out["input_ids"][b, p:p + r] = x["response_ids"]
        out["attention_mask"][b, :p + r] = 1
        m = x["loss_mask"].to(torch.float32)
        out["loss_mask"][b, p:p + r] = m
        out["behaviour_logprobs"][b, p:p + r] = x["behaviour_logprobs"] * m
        if "turn_advantages" in x:   # per-turn credit: turn k's advantage on turn k's tokens
            out["advantages"][b, p:p + r] = torch.from_numpy(
                turn_token_advantages(x["turn_advantages"].numpy(), x["loss_mask"].numpy()).astype(np.float32))
        else:
            out["advantages"][b, p:p + r] = float(x["advantage"]) * m
    out["group_id"] = [x["group_id"] for x in items]
    out["trajectory_id"] = [x["trajectory_id"] for x in items]
    return out
