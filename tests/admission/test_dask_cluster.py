"""Dask admission on a real cluster (scheduler and worker processes, their
environment without AWS_*): an S3 lake (moto) admits with the storage options
the driver sends; no live worker and a lost scheduler are one-line CLI errors;
PIPELINE_DASK_SCHEDULER selects the cluster for `pipeline admit`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dask_cluster import Cluster
from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit
from pipeline.snapshots.format import verify_snapshot
from pipeline.lake.ingest import stamp_derived

pytestmark = pytest.mark.slow
CFG = AdmissionConfig(quality=False)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def _cli(args, env_extra, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and not k.startswith("PIPELINE_DASK")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_s3_lake_admits_on_workers_without_aws_variables(s3_lake, make_traj, cluster, monkeypatch):
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)                    # the driver uses the lake's explicit options
    s3_lake.append("trajectories", stamp_derived(make_traj(48, seed=4), "i1"), command="test")
    want = admit(s3_lake, CFG, dry_run=True)    # DuckDB
    got = admit(s3_lake, CFG, engine="dask", dask_scheduler=cluster.address)
    assert got.counts == want.counts and got.snapshot_id == want.snapshot_id is not None
    assert got.receipts.select(["group_id", "decision"]).to_pylist() == \
        want.receipts.select(["group_id", "decision"]).to_pylist()
    assert verify_snapshot(s3_lake, got.snapshot_id)["registered"]


def _wait_for_task(hold, proc):
    deadline = time.time() + 240
    while not list(hold.glob("task-*")):          # a read task is running on a worker
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.02)


def test_env_selects_the_cluster_and_losing_every_worker_is_one_line(lake, make_traj, tmp_path):
    lake.append("trajectories", stamp_derived(make_traj(24, seed=5), "i1"), command="test")
    hold = tmp_path / "hold"
    hold.mkdir()
    c = Cluster(tmp_path, n_workers=1, env={"PIPELINE_DASK_TEST_HOLD": str(hold)})
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(PIPELINE_DASK_SCHEDULER=c.address, PIPELINE_DASK_WORKER_TIMEOUT_S="3")
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", "admit", "--lake", lake.uri],  # engine: auto
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        _wait_for_task(hold, proc)
        c.kill_workers()                            # every worker dies mid-admission
        (hold / "go").write_text("")
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 2, out + err
        assert "Traceback" not in err, err[-3000:]
        assert err.startswith(f"error: no Dask worker alive at {c.address} for 3s"), err[-3000:]
        assert len(err.strip().splitlines()) <= 2, err  # the error and its hint
        assert time.monotonic() - t0 < 120
        assert not lake.exists("receipts")
        # with a worker again, the scheduled admission job (jobs/admission.yaml) admits on that cluster
        c.workers = [c.add_worker(1)]
        c.wait_for(1)
        ok = _cli(["jobs", "run", "admission", "--lake", lake.uri, "--json"], {"PIPELINE_DASK_SCHEDULER": c.address})
        assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
        job = json.loads(ok.stdout)
        assert job["status"] == "ok", job
        res = json.loads(job["stdout"].strip().splitlines()[-1])
        assert res["engine"] == "dask" and "dask_s" in res["timings"] and res["decided_groups"] > 0, res
    finally:
        c.close()


def test_lost_scheduler_is_one_line(lake, make_traj, tmp_path):
    lake.append("trajectories", stamp_derived(make_traj(24, seed=6), "i1"), command="test")
    hold = tmp_path / "hold"
    hold.mkdir()
    c = Cluster(tmp_path, n_workers=1, env={"PIPELINE_DASK_TEST_HOLD": str(hold)})
    try:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", "admit", "--lake", lake.uri, "--engine", "dask",
                                 "--dask-scheduler", c.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ, PIPELINE_DASK_WORKER_TIMEOUT_S="20"))
        _wait_for_task(hold, proc)
        c.scheduler.kill()
        c.scheduler.wait(timeout=30)
        (hold / "go").write_text("")
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 2, out + err
        assert "Traceback" not in err, err[-3000:]
        assert err.startswith(f"error: lost the Dask scheduler at {c.address}"), err[-3000:]
        assert len(err.strip().splitlines()) <= 2, err
        assert not lake.exists("receipts")
    finally:
        c.close()


def test_no_worker_at_start_times_out(lake, make_traj, tmp_path, monkeypatch):
    from pipeline.errors import PipelineError

    lake.append("trajectories", stamp_derived(make_traj(8, seed=7), "i1"), command="test")
    c = Cluster(tmp_path, n_workers=0)
    try:
        monkeypatch.setenv("PIPELINE_DASK_WORKER_TIMEOUT_S", "2")
        with pytest.raises(PipelineError, match=f"no Dask worker alive at {c.address} after 2s"):
            admit(lake, CFG, engine="dask", dask_scheduler=c.address)
        assert not lake.exists("receipts")
    finally:
        c.close()
