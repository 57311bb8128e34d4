"""`pipeline admit --follow`: one resident process admits groups as they
complete, decides exactly what per-run admissions decide, reports the latency
from a group's last member landing to its snapshot, races a per-run admitter
like any admitter (every group decided once) and ends cleanly on SIGTERM after
the pass it is in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline.admission.config import AdmissionConfig
from pipeline.admission.follow import StopFlag, follow
from pipeline.admission.run import PAUSE_ENV, admit
from pipeline.lake.delta import Lake
from pipeline.ingest import ingest_table

CFG = AdmissionConfig(quality=False, group_timeout_s=3600)


def _halves(make_traj, n=48, seed=1):
    """A batch of whole groups of 4, split so that every group is half there after the first part."""
    t = make_traj(n, seed=seed, group_size=4, start=datetime.now(timezone.utc) - timedelta(minutes=5))
    first = pa.array(np.arange(t.num_rows) % 4 < 2)          # rows 4g..4g+3 are group g
    return t.filter(first), t.filter(pc.invert(first))


def _receipts(lake):
    return sorted((r["group_id"], r["decision"], tuple(sorted(r["valid_members"] or [])))
                  for r in lake.read("receipts", columns=["group_id", "decision", "valid_members"]).to_pylist())


def test_follow_admits_groups_as_they_complete_and_decides_what_per_run_admission_decides(tmp_path, make_traj):
    a, b = _halves(make_traj)
    resident, per_run = Lake(tmp_path / "resident"), Lake(tmp_path / "per-run")
    for lake in (resident, per_run):
        ingest_table(lake, a, source="first")
    stop = StopFlag()
    seen = []

    def on_pass(rep):
        seen.append(rep)
        if rep.n == 1:   # nothing ready yet: land the other halves, the next pass admits them
            assert rep.result.receipts.num_rows == 0 and rep.pending_rows == a.num_rows
            ingest_table(resident, b, source="second")
        if rep.result.receipts.num_rows:
            stop.event.set()

    reports = follow(resident, CFG, interval_s=0.05, stop=stop, max_passes=10, on_pass=on_pass,
                     current_policy_version=0)
    assert [r.n for r in reports] == [1, 2] and len(seen) == 2
    done = reports[-1]
    assert done.result.receipts.num_rows == 12 and done.pending_rows == 0
    lat = done.latency_s
    assert lat["groups"] == 12 and 0 <= lat["min"] <= lat["p50"] <= lat["max"] < 120
    # the same landings admitted by one fresh admission each
    assert admit(per_run, CFG, current_policy_version=0).receipts.num_rows == 0
    ingest_table(per_run, b, source="second")
    r = admit(per_run, CFG, current_policy_version=0)
    assert r.snapshot_id == done.result.snapshot_id
    assert _receipts(resident) == _receipts(per_run)


def test_rows_landing_right_after_a_pass_with_nothing_pending_get_the_next_pass(tmp_path, make_traj):
    """The rows land while the pass that decided everything before them is being
    reported (nothing pending: only the table's new version can trigger the next pass)."""
    lake = Lake(tmp_path / "lake")
    a, b = _halves(make_traj)
    ingest_table(lake, pa.concat_tables([a, b]), source="first")
    later = make_traj(16, seed=2, group_size=4, id_prefix="later-",
                      start=datetime.now(timezone.utc) - timedelta(minutes=5))
    stop = StopFlag()

    def on_pass(rep):
        assert rep.result.receipts.num_rows and rep.pending_rows == 0
        if rep.n == 1:
            ingest_table(lake, later, source="later")
        else:
            stop.event.set()

    reports = follow(lake, CFG, interval_s=0.05, stop=stop, max_seconds=60, on_pass=on_pass,
                     current_policy_version=0)
    assert [r.result.receipts.num_rows for r in reports] == [12, 4]


def test_follow_skips_passes_when_nothing_moved(tmp_path, make_traj):
    lake = Lake(tmp_path / "lake")
    a, b = _halves(make_traj)
    ingest_table(lake, pa.concat_tables([a, b]), source="all")
    t0 = time.monotonic()
    reports = follow(lake, CFG, interval_s=0.05, max_seconds=0.6, current_policy_version=0)
    assert time.monotonic() - t0 >= 0.6
    assert len(reports) == 1 and reports[0].result.receipts.num_rows == 12   # then nothing to do: no pass


def _follow_cli(lake: Lake, env_extra: dict[str, str], *extra: str) -> subprocess.Popen:
    env = {**os.environ, **(lake.storage_options or {}), **env_extra}
    return subprocess.Popen([sys.executable, "-m", "pipeline", "admit", "--lake", lake.uri, "--json", "--follow",
                             "--interval", "0.1", "--current-policy-version", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_ready(barrier, n, procs):
    deadline = time.time() + 240
    while len(list(barrier.glob("ready-*"))) < n:
        assert time.time() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate()[1][-3000:] for p in procs if p.poll() is not None]
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_ends_follow_after_the_current_pass_with_the_quality_suites_on(tmp_path, make_traj):
    """SIGTERM arrives while the pass has decided and not yet committed (held at
    the barrier hook): the pass commits, no further pass starts, exit code 0. The
    great-expectations suites run (quality on, the default) and their results
    are in the snapshot's row."""
    lake = Lake(tmp_path / "lake")
    a, b = _halves(make_traj)
    ingest_table(lake, pa.concat_tables([a, b]), source="all")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    p = _follow_cli(lake, {PAUSE_ENV: f"barrier:{barrier}"}, "--set", "group_timeout_s=3600")
    try:
        _wait_ready(barrier, 1, [p])
        # SIGTERM is pending before "go" exists: the process can only see "go" after it returns from a
        # system call, and Python runs the handler there first (PEP 475). No sleep needed: exit code 0 and
        # the one pass below say the handler ran and the held pass still committed.
        p.send_signal(signal.SIGTERM)
        (barrier / "go").write_text("")
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    passes = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(passes) == 1 and passes[0]["decided_groups"] == 12 and passes[0]["latency_s"]["groups"] == 12
    assert "SIGTERM" in err and "stopped after 1 pass" in err
    assert len(_receipts(lake)) == 12
    q = json.loads(lake.read("snapshots", columns=["quality_json"]).column("quality_json")[0].as_py())
    assert q["candidates"]["suite"] == "trajectories" and q["candidates"]["expectations"] > 0
    assert q["snapshot"]["suite"] == "snapshot_members" and q["snapshot"]["success"] is True


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_resident_and_a_per_run_admitter_that_decided_the_same_groups_commit_once(kind, tmp_path, make_traj,
                                                                                    request):
    lake = request.getfixturevalue("s3_lake") if kind == "s3" else Lake(tmp_path / "lake")
    a, b = _halves(make_traj)
    ingest_table(lake, pa.concat_tables([a, b]), source="all")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**(lake.storage_options or {}), PAUSE_ENV: f"barrier:{barrier}"}
    resident = _follow_cli(lake, env, "--set", "quality=false", "--set", "group_timeout_s=3600")
    lines: dict[str, list[str]] = {"out": [], "err": []}
    first_line = threading.Event()

    def read(stream, key):
        for line in stream:
            lines[key].append(line)
            if key == "out" and line.startswith("{"):
                first_line.set()

    readers = [threading.Thread(target=read, args=(resident.stdout, "out"), daemon=True),
               threading.Thread(target=read, args=(resident.stderr, "err"), daemon=True)]
    for t in readers:
        t.start()
    once = subprocess.Popen([sys.executable, "-m", "pipeline", "admit", "--lake", lake.uri, "--json",
                             "--current-policy-version", "0", "--set", "quality=false", "--set",
                             "group_timeout_s=3600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env))
    try:
        _wait_ready(barrier, 2, [resident, once])   # both decided all 12 groups; neither committed
        (barrier / "go").write_text("")
        out1, err1 = once.communicate(timeout=240)
        assert once.returncode == 0, err1[-3000:]
        # the resident's held pass ends (committed, or found its groups decided): its first JSON line. Later
        # passes see no new landing and are skipped, so this pass is the one that could decide twice.
        assert first_line.wait(240), "the resident never finished its first pass"
        resident.send_signal(signal.SIGTERM)
        resident.wait(timeout=240)
        for t in readers:
            t.join(timeout=60)
        out2, err2 = "".join(lines["out"]), "".join(lines["err"])
    finally:
        for p in (resident, once):
            if p.poll() is None:
                p.kill()
    assert resident.returncode == 0, err2[-3000:]
    decided = [json.loads(out1.strip().splitlines()[-1])["decided_groups"]] + \
        [json.loads(line)["decided_groups"] for line in out2.splitlines() if line.startswith("{")]
    assert sorted(decided)[-1] == 12 and sum(decided) == 12
    ids = [g for g, _, _ in _receipts(lake)]
    assert len(ids) == len(set(ids)) == 12
    assert len(lake.read("snapshots", columns=["snapshot_id"])) == 1


def test_a_per_run_admission_imports_great_expectations_only_when_a_suite_runs(tmp_path, make_traj):
    lake = Lake(tmp_path / "lake")
    a, b = _halves(make_traj)
    ingest_table(lake, a, source="first")        # half groups: nothing is ready, no candidates reach a suite
    code = ("import sys, json; from pipeline.admission.config import AdmissionConfig; "
            "from pipeline.admission.run import admit; from pipeline.lake.delta import Lake; "
            "cfg = AdmissionConfig(group_timeout_s=3600, quality=sys.argv[2] == '1'); "
            "r = admit(Lake(sys.argv[1]), cfg, current_policy_version=0, dry_run=True); "
            "print(json.dumps([r.receipts.num_rows, 'great_expectations' in sys.modules]))")

    def run(quality: str) -> list:
        p = subprocess.run([sys.executable, "-c", code, lake.uri, quality], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode in (0, -6), p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    assert run("0") == [0, False]      # suites off
    ingest_table(lake, b, source="second")
    assert run("0") == [12, False]     # suites off, groups decided: still no import
    assert run("1") == [12, True]      # suites on and candidates to validate
