"""Past one machine, tested here: the demo's training step in two DeepSpeed
processes (gloo) equals one process up to reduction order; a double-started
admission job yields one snapshot."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit
from pipeline.lake.delta import Lake
from pipeline.query.duck import query
from pipeline.rollout.policy import init_policy
from pipeline.rollout.run import run_rollout
from pipeline.train.config import TrainConfig
from pipeline.train.run import train_snapshot


@pytest.fixture(scope="module")
def demo_lake(tmp_path_factory):
    """A lake as the demo leaves it after one rollout: policy v0, 8 groups of 4."""
    root = tmp_path_factory.mktemp("demo")
    lake = Lake(root / "lake")
    init_policy(lake, seed=0)
    run_rollout(lake, groups=8, group_size=4, seed=1, run_id="scale")
    return lake


@pytest.mark.slow
def test_demo_training_step_in_two_processes_matches_one(demo_lake, tmp_path):
    lakes = {}
    for n in (1, 2):
        dst = tmp_path / f"lake{n}"
        shutil.copytree(demo_lake.uri, dst)
        lakes[n] = Lake(dst)
    a = admit(lakes[1], AdmissionConfig())
    assert a.snapshot_id is not None
    b = admit(lakes[2], AdmissionConfig())
    assert b.snapshot_id == a.snapshot_id, "same data + config -> same snapshot id"
    cfg = TrainConfig(lr=3e-4, epochs=1, zero_stage=2)
    r1 = train_snapshot(lakes[1], a.snapshot_id, cfg, nproc=1, progress=False)
    r2 = train_snapshot(lakes[2], a.snapshot_id, cfg, nproc=2, progress=False)
    assert r1.policy_version == r2.policy_version == 1
    w1 = load_file(str(Path(r1.hf_dir) / "model.safetensors"))
    w2 = load_file(str(Path(r2.hf_dir) / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=2e-5, msg=f"{k} differs beyond reduction order")
    ws = query(lakes[2], "SELECT world_size FROM checkpoints WHERE policy_version = 1").column(0).to_pylist()
    assert ws == [2]


@pytest.mark.slow
def test_double_start_of_the_admission_job_yields_one_snapshot(demo_lake, tmp_path):
    dst = tmp_path / "lake"
    shutil.copytree(demo_lake.uri, dst)
    lake = Lake(dst)
    cmd = [sys.executable, "-m", "pipeline", "jobs", "run", "admission", "--lake", lake.uri, "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    snaps = query(lake, "SELECT snapshot_id FROM snapshots").column(0).to_pylist()
    assert len(snaps) == 1
    dup = query(lake, "SELECT group_id FROM receipts GROUP BY 1 HAVING count(*) > 1")
    assert dup.num_rows == 0
    # the lease lock is one guard; admission's own idempotence is the other: with the
    # lock broken, a second run right after still decides nothing twice
    again = subprocess.run([sys.executable, "-m", "pipeline", "admit", "--lake", lake.uri, "--json"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert query(lake, "SELECT count(*) FROM snapshots").column(0)[0].as_py() == 1


@pytest.mark.slow
def test_snapshot_and_checkpoint_files_survive_a_full_vacuum_of_every_table(demo_lake, tmp_path):
    """Payload files live outside every Delta table's directory (<lake>/_snapshots,
    <lake>/_checkpoints), so even a full vacuum (which deletes every file in a table
    directory that the log does not reference) cannot touch them."""
    from deltalake import DeltaTable

    from pipeline.snapshots.format import verify_snapshot
    from pipeline.policy_store import resolve_policy
    from pipeline.schema import ALL_TABLES

    dst = tmp_path / "lake"
    shutil.copytree(demo_lake.uri, dst)
    lake = Lake(dst)
    a = admit(lake, AdmissionConfig())
    r = train_snapshot(lake, a.snapshot_id, TrainConfig(epochs=1), progress=False)
    for name in ALL_TABLES:
        if lake.exists(name):
            DeltaTable(lake.table_uri(name)).vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False,
                                                    full=True)
    assert verify_snapshot(lake, a.snapshot_id)["ok"]
    ref = resolve_policy(lake)  # rehashes every file of the newest checkpoint
    assert ref.checkpoint_id == r.checkpoint_id and (ref.hf_dir / "config.json").exists()
