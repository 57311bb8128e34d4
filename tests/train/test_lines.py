"""Lines: the trainer trains only data sampled by the policy it updates or by one
of its ancestors (the parent chain), whatever the version numbers say. A
sibling line's version, or a version published nowhere, gave a negative lag
that passed ``max_train_lag``; now ``--batch-snapshot`` refuses it with one
line and ``--follow`` skips it with reason ``other_line``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import ForeignSnapshotError
from pipeline.testing.train_fixtures import publish_payload_snapshot, publish_tiny_policy, synthetic_payload
from pipeline.train.config import TrainConfig
from pipeline.train.follow import follow, pending_snapshots
from pipeline.train.run import train_snapshot

ROOT = Path(__file__).resolve().parents[2]
CFG = TrainConfig(lr=1e-3, micro_batch_tokens=512, max_steps=1)   # max_train_lag 2 (the default)


def _two_lines(lake) -> tuple[str, str]:
    """v0 (tiny-v0) -> v1 (tiny-b, line B) and v0 -> v2 (tiny-a, line A, the newest: the head).
    Returns (a snapshot sampled by v1, by line B; a snapshot sampled by version 9, published nowhere)."""
    publish_tiny_policy(lake, checkpoint_id="tiny-b", seed=1, parent="tiny-v0")   # v1
    publish_tiny_policy(lake, checkpoint_id="tiny-a", seed=2, parent="tiny-v0")   # v2
    sibling = publish_payload_snapshot(lake, synthetic_payload(16, seed=41, median_len=18, prompt_len=6,
                                                               policy_version=1))
    ghost = publish_payload_snapshot(lake, synthetic_payload(16, seed=42, median_len=18, prompt_len=6,
                                                             policy_version=9))
    return sibling, ghost


def test_batch_snapshot_refuses_data_of_another_line_and_trains_the_ancestors(tlake):
    lake, s1 = tlake                                   # s1: sampled by v0, an ancestor of both lines
    sibling, ghost = _two_lines(lake)
    # lag 2 - 1 = 1 and 2 - 9 = -7 both pass max_train_lag=2: only lineage tells them apart
    with pytest.raises(ForeignSnapshotError, match=r"sampled by policy version 1, a version of another line "
                                                   r"\(not an ancestor of it\).*version 2, tiny-a\) or its "
                                                   r"ancestors \[2, 0\]"):
        train_snapshot(lake, sibling, CFG, progress=False)
    with pytest.raises(ForeignSnapshotError, match="sampled by policy version 9, a version that is published nowhere"):
        train_snapshot(lake, ghost, CFG, progress=False)
    assert not lake.exists("metrics")                  # nothing trained, nothing published
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--lake", lake.uri, "--batch-snapshot", sibling,
                           "--set", "max_steps=1", "--no-progress"], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "sampled by another line" in errors[0], proc.stderr[-2000:]
    # from line B's own head the same snapshot is its line's data; v0's data trains from either head
    assert train_snapshot(lake, sibling, CFG, from_checkpoint="tiny-b", progress=False).policy_version == 3
    res = train_snapshot(lake, s1, CFG, from_checkpoint="tiny-a", progress=False)
    assert res.policy_version == 4 and res.metrics["train_lag_max"] == 2


def test_follow_skips_data_of_another_line_with_its_reason_and_trains_the_rest(tlake):
    lake, s1 = tlake
    sibling, ghost = _two_lines(lake)
    res = follow(lake, CFG, idle_timeout_s=0.1, progress=False)        # the head: v2 (line A)
    assert [v["snapshot_id"] for v in res.versions] == [s1]            # v0's data: trained as v3 from v2
    assert res.versions[0]["policy_version"] == 3
    assert [(s["snapshot_id"], s["reason"]) for s in res.skipped] == [(sibling, "other_line"), (ghost, "other_line")]
    assert "a version of another line" in res.skipped[0]["message"]
    assert "published nowhere" in res.skipped[1]["message"]
    assert pending_snapshots(lake) == [sibling, ghost]                 # never consumed
