"""Drill 3: the admission job is killed part-way; rerunning converges to one snapshot with the same id.

docs/drills.md "Drill 3". The job (pipeline/admission/run.py) writes, in order:
snapshot files -> snapshots row -> snapshot_members rows -> receipts (the commit
that decides the groups). A real subprocess running ``admit`` is SIGKILLed at
each of those boundaries (and once right after the receipts commit, and at
random moments in a crash loop); after every crash a plain rerun must leave:
every group decided exactly once, exactly one snapshot, whose id equals the id
of an uninterrupted run on an identical copy of the lake, whose files verify,
with one snapshots row and one snapshot_members row per admitted member.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit
from pipeline.snapshots.format import verify_snapshot
from pipeline.lake.delta import Lake
from pipeline.lake.ingest import stamp_derived

NOW = datetime(2026, 11, 2, tzinfo=timezone.utc)
CFG = dict(quality=False)

ADMIT = r"""
import json, os, signal, sys
from datetime import datetime, timezone
from pipeline.lake.delta import Lake
from pipeline.admission.config import AdmissionConfig
import pipeline.admission.run as run

lake, kill_at = Lake(sys.argv[1]), sys.argv[2]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if kill_at.startswith("step:"):
    step = kill_at[5:]
    run._crash_point = lambda s: die() if s == step else None
elif kill_at == "after_receipts":
    orig = Lake.append
    def append(self, name, *a, **k):
        r = orig(self, name, *a, **k)
        if name == "receipts":
            die()
        return r
    Lake.append = append
elif kill_at.startswith("ready="):  # a readiness marker: imports done, the job starts now
    open(kill_at[6:] + ".tmp", "w").write(str(os.getpid()))
    os.replace(kill_at[6:] + ".tmp", kill_at[6:])   # whole or absent
res = run.admit(lake, AdmissionConfig(quality=False), current_policy_version=0,
                now=datetime(2026, 11, 2, tzinfo=timezone.utc))
print(json.dumps({"snapshot_id": res.snapshot_id, "decided": res.receipts.num_rows}))
"""


def admit_process(lake: Lake, kill_at: str = "none") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ADMIT, lake.uri, kill_at], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory, make_traj_module):
    """A lake with 12 complete groups of 4, never admitted, and the reference (uninterrupted) outcome."""
    root = tmp_path_factory.mktemp("drill3")
    lake = Lake(root / "base")
    t = make_traj_module(48, seed=11, group_size=4, reward_p=0.5)
    lake.append("trajectories", stamp_derived(t, "drill3"), command="drill", app_id="drill3", txn_version=0)
    ref_lake = Lake(copy_lake(lake, root / "reference"))
    res = admit(ref_lake, AdmissionConfig(**CFG), current_policy_version=0, now=NOW)
    assert res.snapshot_id is not None and res.admitted_members > 0
    decisions = {r["group_id"]: (r["decision"], r["snapshot_id"])
                 for r in ref_lake.read("receipts", columns=["group_id", "decision", "snapshot_id"]).to_pylist()}
    return lake, res.snapshot_id, res.admitted_members, decisions


@pytest.fixture(scope="module")
def make_traj_module():
    from pipeline.testing.trajectories import make_trajectories

    return make_trajectories


def copy_lake(lake: Lake, dst) -> str:
    shutil.copytree(lake.uri, dst)
    return str(dst)


def assert_converged(lake: Lake, snapshot_id: str, members: int, decisions: dict) -> None:
    receipts = lake.read("receipts", columns=["group_id", "decision", "snapshot_id"]).to_pylist()
    assert len(receipts) == len(decisions), "a group was decided twice or not at all"
    assert {r["group_id"]: (r["decision"], r["snapshot_id"]) for r in receipts} == decisions
    snaps = lake.read("snapshots", columns=["snapshot_id", "num_members"]).to_pylist()
    assert snaps == [{"snapshot_id": snapshot_id, "num_members": members}]
    sm = lake.read("snapshot_members", columns=["snapshot_id", "trajectory_id"])
    assert sm.num_rows == members and set(sm.column("snapshot_id").to_pylist()) == {snapshot_id}
    assert len(set(sm.column("trajectory_id").to_pylist())) == members
    assert verify_snapshot(lake, snapshot_id)["ok"]
    on_disk = sorted(p.name for p in (Path(lake.uri) / "_snapshots").iterdir()
                     if p.is_dir() and not p.name.startswith((".", "_")) and len(p.name) == 64)
    assert on_disk == [snapshot_id]


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["step:snapshot_files", "step:snapshots", "step:snapshot_members",
                                     "after_receipts"])
def test_killed_admission_converges_on_rerun(base, tmp_path, kill_at):
    lake0, snapshot_id, members, decisions = base
    lake = Lake(copy_lake(lake0, tmp_path / "lake"))
    proc = admit_process(lake, kill_at)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, (out, err)
    receipts_after_crash = lake.read("receipts", columns=["group_id"]).num_rows
    if kill_at == "after_receipts":
        assert receipts_after_crash == len(decisions)  # the deciding commit landed before the kill
    else:
        assert receipts_after_crash == 0  # nothing decided: the rerun decides the same groups
    # recovery: just rerun the job
    res = admit(lake, AdmissionConfig(**CFG), current_policy_version=0, now=NOW)
    assert res.snapshot_id == (None if kill_at == "after_receipts" else snapshot_id)
    assert_converged(lake, snapshot_id, members, decisions)
    # and once more: a no-op
    versions = {n: lake.version(n) for n in ("receipts", "snapshots", "snapshot_members")}
    again = admit(lake, AdmissionConfig(**CFG), current_policy_version=0, now=NOW)
    assert again.snapshot_id is None and again.receipts.num_rows == 0
    assert {n: lake.version(n) for n in versions} == versions


@pytest.mark.slow
def test_crash_loop_at_random_moments_converges(base, tmp_path):
    """Killed at moments spread over the job (measured from its readiness marker, written
    when the imports are done and ``admit`` starts); only a kill of a job still running
    after its marker counts as a crash of the job (one in interpreter start-up does not)."""
    lake0, snapshot_id, members, decisions = base
    lake = Lake(copy_lake(lake0, tmp_path / "lake"))
    killed = 0
    for k, delay in enumerate((0.0, 0.15, 0.4, 0.8, 1.6)):
        ready = tmp_path / f"ready-{k}"
        proc = admit_process(lake, f"ready={ready}")
        deadline = time.monotonic() + 300
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        in_job = ready.exists() and int(ready.read_text()) == proc.pid and proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=300)
        if in_job and proc.returncode == -signal.SIGKILL:
            killed += 1
    proc = admit_process(lake)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert killed >= 3, f"only {killed} kills landed inside the admission job"
    assert_converged(lake, snapshot_id, members, decisions)
