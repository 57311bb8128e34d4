"""One owner per rollout run (the run lease), and shipping that is exactly-once
by key whoever ships: fast checks on real Delta tables and real processes. The
SIGKILL drills that use them are tests/drills/test_drill_run_owner.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import ConflictError
from pipeline.rollout.owner import RunOwner
from pipeline.rollout.run import RolloutConfig


def test_a_second_owner_is_refused_naming_the_live_one(lake):
    cfg = RolloutConfig(run_id="r/1", workers=3)
    first = RunOwner(lake, cfg)
    first.acquire()
    try:
        with pytest.raises(ConflictError, match=rf"run r/1 is owned by .*pid {os.getpid()} on host .*3 workers"):
            RunOwner(lake, cfg).acquire()
    finally:
        first.release()
    again = RunOwner(lake, cfg)          # released at the end: the next invocation owns it
    again.acquire()
    again.release()


def test_a_dead_owner_on_this_host_is_taken_over_at_once(lake):
    # a real process takes the lease for an hour and dies without releasing it
    from pipeline.lake.lease import holder

    code = ("import sys; from pipeline.lake.delta import Lake; from pipeline.lake.lease import try_acquire; "
            "assert try_acquire(Lake(sys.argv[1]), 'rollout-dead', ttl=3600, info={'pid_bound': True})[0]")
    subprocess.run([sys.executable, "-c", code, lake.uri], check=True, timeout=120)
    gen = sorted((Path(lake.uri) / "_locks" / "rollout-dead").iterdir())[-1]
    assert json.loads(gen.read_bytes())["expires"] > time.time() + 3000
    assert holder(lake, "rollout-dead") is None          # provably dead: nobody holds it
    owner = RunOwner(lake, RolloutConfig(run_id="dead", lease_s=3600))
    owner.acquire()                      # no need to wait an hour
    assert holder(lake, "rollout-dead")["pid"] == os.getpid()
    owner.release()


def test_an_expired_lease_of_another_host_is_taken_over_a_fresh_one_is_not(lake, monkeypatch):
    import socket

    from pipeline.lake.lease import try_acquire

    with monkeypatch.context() as m:     # an owner on another machine: only its expiry can end its lease
        m.setattr(socket, "gethostname", lambda: "elsewhere")
        far, _ = try_acquire(lake, "rollout-far", ttl=1.0, info={"workers": 8})
    with pytest.raises(ConflictError, match=rf"pid {os.getpid()} on host elsewhere \(8 workers\)"):
        RunOwner(lake, RolloutConfig(run_id="far")).acquire()
    while far.expires > time.time():
        time.sleep(0.05)
    owner = RunOwner(lake, RolloutConfig(run_id="far"))
    owner.acquire()
    owner.release()


def test_the_lease_is_renewed_and_a_lost_lease_stops_the_owner(lake):
    lost = []
    owner = RunOwner(lake, RolloutConfig(run_id="beat", lease_s=0.4), on_lost=lambda: lost.append(1))
    owner.acquire()
    from pipeline.lake.lease import holder

    first = holder(lake, "rollout-beat")["expires"]
    deadline = time.time() + 30
    while holder(lake, "rollout-beat")["expires"] == first and time.time() < deadline:
        time.sleep(0.05)
    assert holder(lake, "rollout-beat")["expires"] > first       # renewed in the background
    owner.check()
    # the lease stops being ours (as when another invocation took it over after a stall)
    owner.lease.release()
    newer = RunOwner(lake, RolloutConfig(run_id="beat", lease_s=60))
    newer.acquire()
    while not lost and time.time() < deadline:
        time.sleep(0.05)
    assert lost and owner.lost
    with pytest.raises(ConflictError, match="lost its lease or could not renew it"):
        owner.check()
    owner.release()
    assert holder(lake, "rollout-beat")["token"] == newer.lease.token   # never releases the new owner's lease
    newer.release()


def _spool_with(tmp_path, name, worker_id, trajs, events):
    from pipeline.rollout.spool import Spool

    s = Spool(tmp_path / name, worker_id, fsync=False)
    for r in events:
        s.append({"kind": "event", **r, "worker_id": worker_id})
    for r in trajs:
        s.append({"kind": "trajectory", **r})
    return s


def _records(n):
    from pipeline.testing.trajectories import make_trajectories

    trajs = []
    for r in make_trajectories(n, seed=4, group_size=2).drop_columns(["content_hash"]).to_pylist():
        r["created_at"], r["finished_at"] = r["created_at"].isoformat(), r["finished_at"].isoformat()
        r["reward_components"] = dict(r["reward_components"])
        trajs.append(r)
    events = [{"episode_id": t["trajectory_id"], "step_id": 0, "action_id": "", "event_type": et,
               "run_id": t["run_id"], "group_id": t["group_id"], "worker_id": "x", "policy_version": 0,
               "state": et, "payload": None, "created_at": t["created_at"]}
              for t in trajs for et in ("CREATED", "TERMINAL")]
    return trajs, events


def test_shipping_a_lost_and_rewritten_spool_lands_nothing_twice(lake, tmp_path):
    """The spool of the first shipment is gone; a rerun (another worker id, as with
    another --workers) spools the same finished episodes again: every trajectory id
    and event key lands once."""
    from pipeline.rollout.spool import ship, ship_all

    trajs, events = _records(6)
    first = _spool_with(tmp_path, "a", "run/w0", trajs[:4], events[:8])
    assert ship(lake, first).trajectories == 4
    shutil.rmtree(tmp_path / "a")
    again = _spool_with(tmp_path, "b", "run/w1", trajs, events)
    again.close()
    rep = ship_all(lake, tmp_path / "b", fsync=False)      # found by directory, worker id read from the spool
    assert (rep.trajectories, rep.events) == (2, 4)
    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0).to_pylist()
    assert sorted(ids) == sorted(t["trajectory_id"] for t in trajs)
    keys = lake.read("events", columns=["episode_id", "event_type"]).to_pylist()
    assert len(keys) == len({(k["episode_id"], k["event_type"]) for k in keys}) == 12
    assert ship_all(lake, tmp_path / "b", fsync=False).trajectories == 0


def test_reconcile_counts_a_landed_trajectory_as_finished_without_its_events(lake, tmp_path):
    """A spool lost after its trajectories landed and before its events did: the
    episode is finished, never run again."""
    from pipeline.rollout.recovery import reconcile
    from pipeline.rollout.spool import ship

    trajs, events = _records(2)
    ship(lake, _spool_with(tmp_path, "a", "w", trajs[:1], []))
    tid = trajs[0]["trajectory_id"]
    created = [e for e in events if e["episode_id"] == tid and e["event_type"] == "CREATED"][0]
    created["payload"] = json.dumps({"seed": 1, "prompt_ids": [1]})
    ship(lake, _spool_with(tmp_path, "b", "w2", [], [created]))
    state = reconcile(lake, RolloutConfig(run_id=trajs[0]["run_id"]), {tid: (None, trajs[0]["group_id"], 2)}, [])
    assert state == {tid: None}


OWNER = r"""
import os, sys, time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing as mp
from pipeline.rollout.owner import die_with_parent

def work(marker):
    open(marker, "w").write(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=die_with_parent,
                             initargs=(os.getpid(), sys.argv[2] == "1")) as pool:
        pool.submit(work, sys.argv[1]).result()
"""


@pytest.mark.parametrize("pdeathsig", [True, False], ids=["pdeathsig", "watchdog-only"])
def test_a_worker_dies_with_its_owner(tmp_path, pdeathsig):
    """SIGKILL the owner while its worker runs: the worker is gone within seconds,
    by the kernel's parent-death signal, or by the watchdog alone."""
    import signal

    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    marker = tmp_path / "worker.pid"
    owner = subprocess.Popen([sys.executable, str(script), str(marker), "1" if pdeathsig else "0"])
    deadline = time.time() + 120
    while not (marker.exists() and marker.read_text()) and time.time() < deadline:
        assert owner.poll() is None
        time.sleep(0.05)
    worker = int(marker.read_text())
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    deadline = time.time() + 20
    while time.time() < deadline and _running(worker):
        time.sleep(0.05)
    alive = _running(worker)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the worker outlived its owner"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_stalled_owner_stops_writing_before_its_lease_can_be_taken(lake):
    """An owner whose renewals stop (stalled, not dead) must not write on once
    another invocation could take the run over: ``check`` (the guard before every
    wave and shipment, also read by the worker processes) refuses first."""
    owner = RunOwner(lake, RolloutConfig(run_id="stall", lease_s=0.8))
    owner.acquire()
    owner.check()
    owner._stop.set()                    # the renewals stop, as in a SIGSTOPped process
    owner._thread.join()
    from pipeline.lake.lease import holder

    expires = holder(lake, "rollout-stall")["expires"]
    assert expires >= owner.valid_until.value
    time.sleep(max(0.0, owner.valid_until.value - 0.8 / 4 + 0.02 - time.time()))
    with pytest.raises(ConflictError, match="could not renew it in time"):
        owner.check()
    assert time.time() < expires         # refused while the lease was still ours: nobody could have taken it
    owner.release()
