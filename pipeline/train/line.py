"""The resident trainer's line (pipeline.train.follow): which snapshot is next,
which are not admission's to train, and what a restart must replay.

The rules are docs/resident-trainer.md, sections 2 and 4.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.errors import IntegrityError

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake


# -- which snapshot is next ---------------------------------------------------------


def _checkpoint_rows(lake: Lake) -> dict[str, dict[str, Any]]:
    if not lake.exists("checkpoints"):
        return {}
    cols = ["checkpoint_id", "parent_checkpoint_id", "snapshot_ids", "policy_version", "train_config_json",
            "world_size"]
    return {r["checkpoint_id"]: r for r in lake.read("checkpoints", columns=cols).to_pylist()}


def pending_snapshots(lake: Lake, skipped: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """Snapshot ids no published version consumed, oldest admission first
    (``created_at``, then id), without those in ``skipped``."""
    if not lake.exists("snapshots"):
        return []
    consumed = {s for r in _checkpoint_rows(lake).values() for s in (r["snapshot_ids"] or [])}
    rows = lake.read("snapshots", columns=["snapshot_id", "created_at"]).to_pylist()
    rows.sort(key=lambda r: (r["created_at"], r["snapshot_id"]))
    return [r["snapshot_id"] for r in rows if r["snapshot_id"] not in consumed and r["snapshot_id"] not in skipped]


def superseded(lake: Lake, snapshot_id: str) -> str | None:
    """Why ``snapshot_id`` is not admission's to train, or None: a snapshot whose
    groups' receipts name another snapshot was materialized by an admission run
    that lost the receipts commit (its decisions never landed; the winner's
    snapshot holds those groups). A snapshot no receipt speaks for (written by
    another producer through pipeline.snapshots) is admission's as it is."""
    if not lake.exists("receipts") or not lake.exists("snapshot_members"):
        return None
    import pyarrow.dataset as ds

    groups = set(lake.read("snapshot_members", columns=["group_id"],
                           filter=ds.field("snapshot_id") == snapshot_id).column("group_id").to_pylist())
    if not groups:
        return None
    named = lake.read("receipts", columns=["group_id", "snapshot_id"],
                      filter=ds.field("group_id").isin(sorted(groups))).to_pylist()
    other = sorted({r["snapshot_id"] or "none" for r in named if r["snapshot_id"] != snapshot_id})
    if not other:
        return None
    return (f"its groups were decided into {', '.join(o[:16] for o in other)} by the admission run that committed "
            "them; this snapshot's own admission lost the race and never landed its receipts")


def recorded_skips(lake: Lake, head_id: str) -> set[str]:
    """Snapshots the versions of this line recorded as skipped (``skipped_snapshots``)."""
    rows = _checkpoint_rows(lake)
    out: set[str] = set()
    cid: str | None = head_id
    while cid in rows:
        tc = json.loads(rows[cid]["train_config_json"] or "{}")
        out |= {s["snapshot_id"] for s in tc.get("skipped_snapshots", [])}
        cid = rows[cid]["parent_checkpoint_id"]
    return out


def line_versions(lake: Lake, head_id: str) -> set[int]:
    """The policy versions of ``head_id`` and of every ancestor (the parent chain):
    the versions whose samples this line may train on."""
    rows = _checkpoint_rows(lake)
    out: set[int] = set()
    seen: set[str] = set()
    cid: str | None = head_id
    while cid in rows and cid not in seen:
        seen.add(cid)
        out.add(int(rows[cid]["policy_version"]))
        cid = rows[cid]["parent_checkpoint_id"]
    return out


# -- recovery -------------------------------------------------------------------------


@dataclass(frozen=True)
class Recovery:
    start: str                    # the checkpoint whose weights the engine starts from
    load_state: bool              # and whose DeepSpeed state (optimizer moments) it loads
    replay: list[dict[str, Any]]  # checkpoints rows to re-train and verify, oldest first


def recovery_plan(lake: Lake, head_id: str) -> Recovery:
    """How to rebuild the in-memory state after ``head_id``: walk the line back
    to the newest version with a full state (load it), or to a version whose
    optimizer started fresh (start from its parent's weights), or to a version
    no trainer produced (the initial policy: fresh); every version passed on
    the way is replayed."""
    from pipeline.policy_store import resolve_policy
    from pipeline.train.checkpoint import has_full_state

    rows = _checkpoint_rows(lake)
    replay: list[dict[str, Any]] = []
    cid = head_id
    while True:
        row = rows.get(cid)
        if row is None:
            raise IntegrityError(f"checkpoint {cid} of the line is not published", hint="pass --from-checkpoint")
        ref = resolve_policy(lake, cid, verify=False, weights=False)   # files as recorded, less what retention removed
        if has_full_state(ref.path, ref.file_sha256):
            return Recovery(cid, True, replay[::-1])
        if not row["snapshot_ids"]:
            return Recovery(cid, False, replay[::-1])
        replay.append(row)
        tc = json.loads(row["train_config_json"] or "{}")
        parent = row["parent_checkpoint_id"]
        if parent is None:
            raise IntegrityError(f"checkpoint {cid} has no recorded parent: its state cannot be replayed",
                                 hint="start a new line: pass --from-checkpoint with a version that has a full state")
        if "optimizer_from" in tc and tc["optimizer_from"] is None:
            return Recovery(parent, False, replay[::-1])      # it started with a fresh optimizer from its parent
        cid = parent
