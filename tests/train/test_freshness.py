"""Freshness at use: the trainer measures how far the snapshot's data is behind
the policy it would update, refuses beyond ``max_train_lag`` with one clear
line, and records when it consumed the snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from pipeline.errors import StaleSnapshotError
from pipeline.train.config import TrainConfig
from pipeline.train.run import kl_reference_spec, train_snapshot

ROOT = Path(__file__).resolve().parents[2]


def _publish_versions(lake, n: int) -> None:
    from pipeline.testing.train_fixtures import publish_tiny_policy

    for v in range(1, n + 1):   # newer versions of the line that sampled the data (lineage: docs/training.md)
        publish_tiny_policy(lake, checkpoint_id=f"tiny-v{v}", seed=v, parent=f"tiny-v{v - 1}")


def test_stale_snapshot_is_refused_at_training(tlake):
    lake, sid = tlake                       # the snapshot's data: sampled by policy version 0
    _publish_versions(lake, 3)              # the newest policy is now version 3: lag 3 > max_train_lag 2
    with pytest.raises(StaleSnapshotError, match=r"3 versions behind .*version 3; max_train_lag=2"):
        train_snapshot(lake, sid, TrainConfig(max_steps=1, micro_batch_tokens=256), progress=False)
    assert not lake.exists("metrics")       # nothing trained, nothing published
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--lake", lake.uri, "--batch-snapshot", sid,
                           "--set", "max_steps=1"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    msg = [ln for ln in proc.stderr.splitlines() if "stale at use" in ln]
    assert len(msg) == 1 and "max_train_lag=2" in msg[0], proc.stderr[-2000:]


def test_fresh_enough_snapshot_trains_and_records_consumption(tlake):
    lake, sid = tlake
    _publish_versions(lake, 2)              # lag 2: at the bound, allowed
    before = datetime.now(timezone.utc)
    res = train_snapshot(lake, sid, TrainConfig(max_steps=1, micro_batch_tokens=256), from_checkpoint="tiny-v2",
                         progress=False)
    row = next(r for r in lake.read("checkpoints").to_pylist() if r["checkpoint_id"] == res.checkpoint_id)
    metrics = json.loads(row["metrics_json"])
    assert metrics["train_lag_max"] == 2 and metrics["train_lag_mean"] == 2.0 and metrics["parent_version"] == 2
    consumed = datetime.fromisoformat(metrics["consumed_at"])
    assert before <= consumed <= datetime.now(timezone.utc)
    assert json.loads(row["train_config_json"])["consumed_at"] == metrics["consumed_at"]
    snap = lake.read("snapshots").to_pylist()[0]
    assert metrics["snapshot_wait_ms"] == int((consumed - snap["created_at"]).total_seconds() * 1000)
    # no limit: the same data from a newer version is accepted when the operator says so
    _publish_versions_from(lake, 3)         # (published as version 4: the run above published version 3)
    ok = train_snapshot(lake, sid, TrainConfig(max_steps=1, micro_batch_tokens=256, max_train_lag=None),
                        from_checkpoint="tiny-v3", force=True, progress=False)
    assert ok.metrics["parent_version"] == 4 and ok.metrics["train_lag_max"] == 4


def _publish_versions_from(lake, v: int) -> None:
    from pipeline.testing.train_fixtures import publish_tiny_policy

    publish_tiny_policy(lake, checkpoint_id=f"tiny-v{v}", seed=v, parent=f"tiny-v{v - 1}")


class _Ref:
    def __init__(self, cid, v):
        self.checkpoint_id, self.policy_version = cid, v


def test_the_bound_is_not_part_of_the_run_identity():
    from pipeline.train.config import identity_hash

    assert identity_hash(TrainConfig(max_train_lag=None)) == identity_hash(TrainConfig(max_train_lag=5))


def test_kl_reference_defaults_to_the_frozen_initial_policy():
    assert TrainConfig().kl_reference == "initial"
    assert kl_reference_spec("initial", _Ref("c5", 5)) == "0"          # a fixed anchor, not the moving parent
    assert kl_reference_spec("initial", _Ref("c0", 0)) == "parent"     # version 0 is the parent: reuse it
    assert kl_reference_spec("initial", _Ref("dir", -1)) == "parent"   # an unpublished directory
    assert kl_reference_spec("parent", _Ref("c5", 5)) == "parent"
    assert kl_reference_spec("3", _Ref("c5", 5)) == "3"
    assert kl_reference_spec("5", _Ref("c5", 5)) == "parent"


def test_lag_over_the_oldest_sampled_token_else_the_starting_version():
    import numpy as np

    from pipeline.train.run import check_freshness

    class M(list):
        pass

    m = M(["a", "b", "c"])
    m.trajectory_id = ["a", "b", "c"]
    m.token_versions = [np.array([4, -1, 3], np.int32), None, np.array([-1, -1], np.int32)]
    m.policy_version = np.array([4, 2, 5])
    # a: oldest sampled token 3 -> lag 2; b: no per-token versions, started by 2 -> lag 3; c: observations only -> 5
    got = check_freshness(m, 5, None, "s")
    assert got["train_lag_max"] == 3 and got["train_lag_mean"] == (2 + 3 + 0) / 3
    with pytest.raises(StaleSnapshotError, match="trajectory b was sampled by policy version 2"):
        check_freshness(m, 5, 2, "s")
