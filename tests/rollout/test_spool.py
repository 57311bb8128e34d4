"""The spool survives being torn or lost: a killed writer's fragment is dropped
before appending, and a worker whose spool is gone never reuses a batch number
the lake already holds (its new batches would be skipped as shipped)."""

from __future__ import annotations

import shutil

from pipeline.rollout.run import run_rollout
from pipeline.rollout.spool import Spool


def test_torn_last_line_is_dropped_before_appending(tmp_path):
    s = Spool(tmp_path, "w1")
    s.append({"kind": "event", "a": 1})
    s.close()
    with open(tmp_path / "w1.spool.jsonl", "a") as f:
        f.write('{"kind":"ev')  # killed mid-write
    s = Spool(tmp_path, "w1")
    s.append({"kind": "event", "a": 2})
    s.close()
    assert [r["a"] for r in Spool(tmp_path, "w1").records()] == [1, 2]


def test_lost_spool_does_not_drop_new_batches(lake, published, tmp_path):
    published(0)
    spool = tmp_path / "spool"
    first = run_rollout(lake, groups=2, group_size=2, seed=3, run_id="lost", spool_dir=str(spool))
    assert first.landed == 4
    shutil.rmtree(spool)  # the worker's disk is gone; the lake remembers its batches
    more = run_rollout(lake, groups=4, group_size=2, seed=3, run_id="lost", spool_dir=str(spool))
    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0).to_pylist()
    assert len(ids) == len(set(ids)) == 8, f"{more.landed} landed on the second run"
