"""Freshness at use: how stale a snapshot's data is against the policy it would update."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.train.data import Members


def snapshot_wait_ms(lake: Lake, snapshot_id: str, consumed_at: datetime) -> int | None:
    """How long the snapshot waited between its publication and its use (ms);
    with the members' ``queue_wait_ms`` (finish -> landing) this measures the
    queue to the point of use. None when the snapshots table has no row for it."""
    import pyarrow.dataset as ds

    if not lake.exists("snapshots"):
        return None
    rows = lake.read("snapshots", columns=["created_at"], filter=ds.field("snapshot_id") == snapshot_id).to_pylist()
    if not rows:
        return None
    return max(0, int((consumed_at - rows[0]["created_at"]).total_seconds() * 1000))


def check_freshness(members: Members, parent_version: int, max_train_lag: int | None, snapshot_id: str) -> dict[str, Any]:
    """Freshness at use: the lag between the snapshot's data and the policy this
    update starts from, ``parent_version - oldest sampled token version`` per
    member (the version that started it when the row has no per-token versions).
    Raises StaleSnapshotError beyond ``max_train_lag``; returns the figures
    recorded with the checkpoint (``train_lag_max``, ``train_lag_mean``)."""
    import numpy as np

    from pipeline.errors import StaleSnapshotError

    if parent_version < 0 or len(members) == 0:      # an unpublished directory has no version to compare
        return {"train_lag_max": None, "train_lag_mean": None, "parent_version": parent_version}
    oldest = []
    started = members.policy_version
    for i, tv in enumerate(members.token_versions):
        sampled = tv[tv >= 0] if tv is not None else np.zeros(0)
        oldest.append(int(sampled.min()) if sampled.size else
                      (int(started[i]) if started is not None else None))
    lags = np.array([parent_version - o if o is not None else np.nan for o in oldest], np.float64)
    known = lags[~np.isnan(lags)]
    worst = int(known.max()) if known.size else None
    if max_train_lag is not None and worst is not None and worst > max_train_lag:
        i = int(np.nanargmax(lags))
        raise StaleSnapshotError(
            f"snapshot {snapshot_id} is stale at use: trajectory {members.trajectory_id[i]} was sampled by policy "
            f"version {oldest[i]}, {worst} versions behind the policy it would update (version {parent_version}; "
            f"max_train_lag={max_train_lag})",
            hint="admit fresher data (pipeline admit) and train on that snapshot, or raise --set max_train_lag=N "
                 "(null: no limit) if this off-policy lag is intended")
    return {"train_lag_max": worst, "train_lag_mean": float(known.mean()) if known.size else None,
            "parent_version": parent_version}


