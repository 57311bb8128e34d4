"""Several real processes appending at once; writers killed with SIGKILL and
restarted with the same transaction ids."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

WRITER = str(Path(__file__).with_name("writer_proc.py"))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
def test_four_processes_append_without_loss_or_duplicates(lake):
    lake.ensure("trajectories")
    procs = [subprocess.Popen([sys.executable, WRITER, lake.uri, f"w{i}", "25", "100", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for i in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "CommitFailedError" not in err
    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0)
    assert len(ids) == 10_000
    assert pc.count_distinct(ids).as_py() == 10_000
    for i in range(4):
        assert lake.transaction_version("trajectories", f"w{i}") == 24


@pytest.mark.slow
def test_sigkill_at_random_points_never_duplicates_or_loses_a_batch(lake, tmp_path):
    """Each run is killed at a random point of its append loop: after its readiness
    marker (imports done, appends next), once 0-3 more of its batches landed, plus
    up to about one batch's time. Only kills of a process still running after its
    marker count: a kill in interpreter start-up tests nothing."""
    lake.ensure("trajectories")
    rng = random.Random(1234)
    n_batches, rows = 150, 10
    kills = 0
    for run in range(24):
        before = lake.transaction_version("trajectories", "crashy")
        ready = tmp_path / f"ready-{run}"
        p = subprocess.Popen([sys.executable, WRITER, lake.uri, "crashy", str(n_batches), str(rows)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env() | {"WRITER_READY": str(ready)})
        target = (-1 if before is None else before) + rng.randint(0, 3)
        deadline = time.monotonic() + 120
        while not ready.exists() or (lake.transaction_version("trajectories", "crashy") or -1) < target:
            if p.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.06))
        in_section = ready.exists() and int(ready.read_text()) == p.pid and p.poll() is None
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        if in_section and p.returncode == -signal.SIGKILL:
            kills += 1
        landed = lake.transaction_version("trajectories", "crashy")
        ids = lake.read("trajectories", columns=["trajectory_id"]).column(0)
        # every committed batch is complete and present exactly once
        assert len(ids) == pc.count_distinct(ids).as_py() == ((landed + 1) * rows if landed is not None else 0)
    assert kills >= 20, f"only {kills} runs were killed inside their appends; the test did not exercise crashes"
    done = subprocess.run([sys.executable, WRITER, lake.uri, "crashy", str(n_batches), str(rows)],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0)
    assert len(ids) == pc.count_distinct(ids).as_py() == n_batches * rows
    # the table loads at every version
    latest = lake.version("trajectories")
    for v in range(latest + 1):
        DeltaTable(lake.table_uri("trajectories"), version=v).to_pyarrow_table(columns=["trajectory_id"])


def test_append_is_exactly_once_per_transaction(lake):
    from writer_proc import batch  # noqa: E402  (tests/lake on sys.path via rootdir)

    t = batch("solo", 0, 10, 0)
    r1 = lake.append("trajectories", t, command="t", app_id="solo", txn_version=0)
    r2 = lake.append("trajectories", t, command="t", app_id="solo", txn_version=0)
    assert (r1.landed, r2.landed) == (True, False)
    assert lake.read("trajectories", columns=["trajectory_id"]).num_rows == 10
    meta = lake.history("trajectories", limit=1)[0]
    assert meta.get("pipeline.command") == "t" and meta.get("pipeline.app_id") == "solo"
