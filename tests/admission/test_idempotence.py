"""`pipeline admit` twice in a row, twice at the same time (two real processes),
and after a crash between any two of its writes: one snapshot, no duplicate receipts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import CRASH_ENV, PAUSE_ENV, admit
from pipeline.snapshots.format import verify_snapshot
from pipeline.lake.delta import Lake

pytestmark = pytest.mark.slow
CFG = AdmissionConfig(quality=False)


def _seed(lake, make_traj, n=80, seed=1):
    from pipeline.lake.ingest import stamp_derived

    lake.append("trajectories", stamp_derived(make_traj(n, seed=seed, group_size=4), f"ing-{seed}"),
                command="test", app_id=f"seed-{seed}")


def _cli(lake_dir: Path | str, env_extra: dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ, **env_extra)
    return subprocess.Popen([sys.executable, "-m", "pipeline", "admit", "--lake", str(lake_dir), "--json",
                             "--set", "quality=false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _assert_one_decision_per_group(lake, n_groups):
    r = lake.read("receipts", columns=["group_id", "snapshot_id"])
    ids = r.column("group_id").to_pylist()
    assert len(ids) == len(set(ids)) == n_groups
    snaps = lake.read("snapshots", columns=["snapshot_id"]).column("snapshot_id").to_pylist()
    assert len(snaps) == 1
    members = lake.read("snapshot_members", columns=["trajectory_id"]).column("trajectory_id").to_pylist()
    assert len(members) == len(set(members))
    admitted = r.filter(pc.is_valid(r.column("snapshot_id")))
    assert set(admitted.column("snapshot_id").to_pylist()) == set(snaps)
    return snaps[0]


def test_twice_in_a_row_is_a_no_op(lake, make_traj):
    _seed(lake, make_traj)
    first = admit(lake, CFG)
    second = admit(lake, CFG)
    assert first.snapshot_id and second.snapshot_id is None and second.receipts.num_rows == 0
    assert _assert_one_decision_per_group(lake, 20) == first.snapshot_id


@pytest.mark.parametrize("offsets", [(0.0, 0.0), (0.0, 0.05), (0.0, 0.5)])
def test_two_processes_at_once_make_one_snapshot(tmp_path, make_traj, offsets):
    """Both processes read the same lake state and decide the same groups, then
    wait for the same instant (plus an offset) before writing: with equal
    offsets both pass the pre-write check and race in the Delta commits; with
    larger ones the second sees the first's writes part-way."""
    lake = Lake(tmp_path / "lake")
    _seed(lake, make_traj)
    start = time.time() + 10  # both processes have imported and decided by then
    procs = [_cli(tmp_path / "lake", {PAUSE_ENV: f"@{start + o}"}) for o in offsets]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    snap = _assert_one_decision_per_group(Lake(tmp_path / "lake"), 20)
    # exactly one run decided the groups; the other found nothing left
    assert sorted(r["decided_groups"] for r in results) == [0, 20]
    assert [r["snapshot_id"] for r in results if r["decided_groups"]] == [snap]
    verify_snapshot(Lake(tmp_path / "lake"), snap)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_two_processes_that_decided_the_same_groups_commit_once(kind, tmp_path, make_traj, request):
    """Both processes have read the lake and decided every group before either
    commits (each says so in the barrier directory; the test releases them
    together): only one run's receipts land, on a local lake and on S3."""
    if kind == "s3":
        lake = request.getfixturevalue("s3_lake")
        env = dict(lake.storage_options)
    else:
        lake, env = Lake(tmp_path / "lake"), {}
    _seed(lake, make_traj)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [_cli(lake.uri, {**env, PAUSE_ENV: f"barrier:{barrier}"}) for _ in range(2)]
    deadline = time.time() + 240
    while len(list(barrier.glob("ready-*"))) < 2:      # both decided; neither has committed
        assert time.time() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate()[1][-3000:] for p in procs if p.poll() is not None]
        time.sleep(0.02)
    assert not lake.exists("receipts")
    (barrier / "go").write_text("")
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    snap = _assert_one_decision_per_group(lake, 20)
    assert sorted(r["decided_groups"] for r in results) == [0, 20]
    assert [r["snapshot_id"] for r in results if r["decided_groups"]] == [snap]
    verify_snapshot(lake, snap)


@pytest.mark.parametrize("step", ["snapshot_files", "snapshots", "snapshot_members"])
def test_crash_between_writes_converges_to_the_same_snapshot(tmp_path, make_traj, step):
    lake = Lake(tmp_path / "lake")
    _seed(lake, make_traj)
    dry = admit(lake, CFG, dry_run=True)
    p = _cli(tmp_path / "lake", {CRASH_ENV: step})
    out, err = p.communicate(timeout=240)
    assert p.returncode == 70, (out, err)  # killed mid-run
    assert not lake.exists("receipts") or lake.read("receipts", columns=["group_id"]).num_rows == 0
    rerun = admit(lake, CFG)
    assert rerun.snapshot_id == dry.snapshot_id
    assert _assert_one_decision_per_group(lake, 20) == dry.snapshot_id
    assert verify_snapshot(lake, rerun.snapshot_id)["registered"]
    # one snapshot directory (temporary ones are dot-named and removed)
    names = [d.name for d in (tmp_path / "lake" / "_snapshots").iterdir() if (d / "manifest.json").exists()]
    assert names == [dry.snapshot_id]
    assert not [d for d in (tmp_path / "lake" / "_snapshots").iterdir() if d.name.startswith(".tmp-")]


def test_new_data_after_a_decision_makes_a_new_snapshot(lake, make_traj):
    _seed(lake, make_traj, seed=1)
    a = admit(lake, CFG)
    _seed(lake, make_traj, seed=2)
    b = admit(lake, CFG)
    assert a.snapshot_id and b.snapshot_id and a.snapshot_id != b.snapshot_id
    ids = lake.read("receipts", columns=["group_id"]).column("group_id").to_pylist()
    assert len(ids) == len(set(ids)) == 40
    assert set(b.members.column("group_id").to_pylist()).isdisjoint(a.members.column("group_id").to_pylist())
