"""SIGTERM and SIGINT to the long commands (docs/signals.md): each stops its
children, finishes or abandons the unit in progress, prints one line and exits
0 (SIGTERM) or 130 (SIGINT), with no process of its tree left behind; children
die with their parent even when it is killed with -9. And one demo per lake:
a default demo lake is unique per run, a second demo on a shared --lake is
refused before its warm start.

Real signals against real commands; each is sent as soon as the command's
children (or its unit of work) are up, found by polling a marker the command's
own code writes (a lease in the lake, a pause point), never after a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from pipeline.lake.delta import Lake
from pipeline.lake.lease import holder
from pipeline.lake.liveness import pid_start

ROOT = Path(__file__).resolve().parents[1]
STOPPED = {signal.SIGTERM: (0, "stopped by SIGTERM"), signal.SIGINT: (130, "stopped by SIGINT")}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PIPELINE_TEST_PAUSE_AT", "RANK", "WORLD_SIZE")}
    return env | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | extra


def _start(tmp_path: Path, name: str, args: list[str], **env: str) -> subprocess.Popen:
    """``pipeline ARGS`` with stdout / stderr in files (a full pipe never blocks it)."""
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    # SIGINT at its default, as a shell's foreground command gets it: a test run started as a background
    # job of a script inherits SIGINT ignored, and a command started so rightly ignores it (docs/signals.md)
    return subprocess.Popen([sys.executable, "-m", "pipeline", *args], stdout=out, stderr=err, env=_env(**env),
                            preexec_fn=_sigint_default)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """The body signals ``proc`` and waits for it; whatever happens there, no process of the test is left."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _output(tmp_path: Path, name: str) -> tuple[str, str]:
    return (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()


def _tree(pid: int) -> dict[int, tuple[int | None, str]]:
    """Every descendant of ``pid`` now: {pid: (start time, command line)} (walks /proc by ppid)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in parent.items():
            if pp == p and c not in found:
                try:
                    cmd = (Path("/proc") / str(c) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    cmd = ""
                found[c] = (pid_start(c), cmd)
                frontier.append(c)
    return found


def _left(seen: dict[int, tuple[int | None, str]]) -> list[str]:
    """The processes of ``seen`` still running (same pid, same start time; a zombie is gone)."""
    return [cmd for p, (start, cmd) in seen.items() if start is not None and pid_start(p) == start]


def _wait(cond, proc: subprocess.Popen, what: str, timeout: float = 600, seen: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if seen is not None:
            seen.update(_tree(proc.pid))
        assert proc.poll() is None, f"ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


def _lease_taken(lake_dir: Path, name: str):
    return lambda: any((lake_dir / "_locks" / name).glob("lease.*"))


def _demo(lake_dir: Path, *extra: str) -> list[str]:
    return ["demo", "--lake", str(lake_dir), "--iterations", "2", "--groups", "4", "--set", "group_size=2",
            "--set", "eval_n=2", "--set", "report=false", "--set", "epochs=1", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_async_demo_leaves_no_process_behind(tmp_path, sig):
    """The async demo's rollout worker and resident trainer run in their own
    processes: stopping the demo stops them (SIGTERM: forwarded, waited for, exit
    0 with one line) and killing it with -9 kills them (parent-death signal), so
    no orphan keeps landing rollouts."""
    lake_dir = tmp_path / "lake"
    proc = _start(tmp_path, "demo", _demo(lake_dir, "--mode", "async", "--set", "warm_start_steps=0"))
    seen: dict[int, tuple[int | None, str]] = {}
    with _reaped(proc):
        # the worker holds its run's lease once it is rolling out; the trainer was started with it
        _wait(_lease_taken(lake_dir, "rollout-demo-async-0"), proc, "rollout worker", seen=seen)
        _wait(lambda: any("--follow" in c for _, c in seen.values()), proc, "resident trainer", seen=seen)
        seen.update(_tree(proc.pid))
        assert any("--worker" in c for _, c in seen.values()), seen
        proc.send_signal(sig)
        proc.wait(timeout=600)
    out, err = _output(tmp_path, "demo")
    if sig == signal.SIGTERM:
        assert proc.returncode == 0, err[-3000:]
        assert [ln for ln in err.splitlines() if ln.startswith("stopped by")] == [
            "stopped by SIGTERM: pipeline demo abandoned the work in progress (what it committed stays; rerunning "
            "continues from there)"], err[-3000:]
        assert "Traceback" not in err
        assert not _left(seen), _left(seen)          # stopped and reaped before the demo exited
    else:
        assert proc.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while _left(seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _left(seen), _left(seen)
    lake = Lake(lake_dir)
    assert holder(lake, "rollout-demo-async-0") is None and holder(lake, "demo") is None
    if lake.exists("trajectories"):                   # nobody lands anything any more
        n = lake.read("trajectories", columns=["trajectory_id"]).num_rows
        time.sleep(1.0)
        assert Lake(lake_dir).read("trajectories", columns=["trajectory_id"]).num_rows == n


@pytest.mark.slow
def test_a_second_demo_on_a_shared_lake_is_refused_before_its_warm_start(tmp_path):
    """A demo holds its lake's ``demo`` lease from its first step: a second demo on
    that --lake fails at once with one line; SIGTERM ends the first (exit 0, one
    line) and releases it; a demo killed with -9 leaves a claim that the next demo
    on the host takes over at once."""
    shared = tmp_path / "shared"
    first = _start(tmp_path, "first", _demo(shared))
    try:
        _wait(_lease_taken(shared, "demo"), first, "the first demo's lease")
        second = subprocess.run([sys.executable, "-m", "pipeline", *_demo(shared)], capture_output=True, text=True,
                                env=_env(), timeout=600)
        assert first.poll() is None, "the first demo still runs: the second was refused while it held the lake"
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert second.returncode == 2, second.stderr[-3000:]
    errors = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"lake {shared} is in use by another demo (pipeline demo pid {first.pid}" in errors[0], \
        second.stderr[-3000:]
    assert "lake:" not in second.stdout and "warm start" not in second.stdout    # refused before it began
    out, err = _output(tmp_path, "first")
    assert first.returncode == 0, err[-3000:]
    assert len([ln for ln in err.splitlines() if ln.startswith("stopped by SIGTERM: pipeline demo")]) == 1, err
    assert holder(Lake(shared), "demo") is None                                  # released on the way out

    other = tmp_path / "other"
    killed = _start(tmp_path, "killed", _demo(other))
    try:
        _wait(_lease_taken(other, "demo"), killed, "the demo's lease")
    finally:
        killed.kill()
        killed.wait()
    from pipeline.demo import demo_lease

    with demo_lease(Lake(other)) as lease:   # the dead holder does not block: taken over at once
        assert lease.generation >= 2


def test_default_demo_lakes_are_unique_and_created_exclusively(tmp_path, monkeypatch):
    from pipeline.demo import default_lake_uri

    monkeypatch.setenv("PIPELINE_LAKE", str(tmp_path / "lakes"))
    uris = [default_lake_uri() for _ in range(50)]                  # many in the same second
    assert len(set(uris)) == 50
    assert all(Path(u).is_dir() and not any(Path(u).iterdir()) for u in uris)
    assert all(Path(u).name.startswith("demo-") for u in uris)
    monkeypatch.setenv("PIPELINE_LAKE", "s3://bucket/lakes")
    a, b = default_lake_uri(), default_lake_uri()
    assert a != b and a.startswith("s3://bucket/lakes/demo-")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_batch_training_stopped_mid_run_exits_with_one_line_and_publishes_nothing(tlake, tmp_path, sig):
    from pipeline.policy_store import latest_policy_version

    lake, sid = tlake
    marker = tmp_path / "at-step"
    proc = _start(tmp_path, "train", ["train", "--lake", lake.uri, "--batch-snapshot", sid, "--set", "max_steps=3",
                                      "--set", "micro_batch_tokens=256", "--no-progress"],
                  PIPELINE_TEST_PAUSE_AT=f"train:step:1={marker}")
    with _reaped(proc):
        _wait(marker.exists, proc, "step 1")
        proc.send_signal(sig)
        proc.wait(timeout=300)
    out, err = _output(tmp_path, "train")
    code, line = STOPPED[sig]
    assert proc.returncode == code, err[-3000:]
    assert len([ln for ln in err.splitlines() if ln.startswith(f"{line}: pipeline train abandoned")]) == 1, err
    assert "Traceback" not in err and out == ""
    assert latest_policy_version(lake) == 0                      # abandoned: nothing published
    if sig == signal.SIGTERM:                                    # and a rerun trains it cleanly
        from pipeline.train.config import TrainConfig
        from pipeline.train.run import train_snapshot

        res = train_snapshot(lake, sid, TrainConfig(max_steps=3, micro_batch_tokens=256), progress=False)
        assert res.policy_version == 1 and res.global_step == 3


@pytest.mark.slow
def test_follow_exits_0_on_a_sigterm_right_after_its_result(tlake, tmp_path):
    """The resident trainer used to exit -15 when SIGTERM arrived while it shut
    down after printing its result."""
    lake, _ = tlake
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "train", "--follow", "--lake", lake.uri, "--json",
                             "--no-progress", "--stop-after", "1", "--set", "max_steps=1",
                             "--set", "micro_batch_tokens=256"],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "err", "w"), text=True, env=_env())
    with _reaped(proc):
        line = proc.stdout.readline()                            # the result: the process now tears down
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    assert proc.returncode == 0, (tmp_path / "err").read_text()[-3000:]
    assert json.loads(line)["stopped_by"] == "stop_after"


@pytest.mark.slow
def test_rollout_stops_its_workers_and_releases_its_run(tmp_path):
    from pipeline.rollout.policy import init_policy

    lake_dir = tmp_path / "lake"
    init_policy(Lake(lake_dir), seed=0, warm_start_steps=0)
    proc = _start(tmp_path, "rollout", ["rollout", "--lake", str(lake_dir), "--groups", "64", "--group-size", "4",
                                        "--workers", "2", "--run-id", "sig"])
    seen: dict[int, tuple[int | None, str]] = {}
    with _reaped(proc):
        _wait(_lease_taken(lake_dir, "rollout-sig"), proc, "the run's lease", seen=seen)
        _wait(lambda: sum("spawn_main" in c for _, c in seen.values()) >= 2, proc, "two workers", seen=seen)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    out, err = _output(tmp_path, "rollout")
    assert proc.returncode == 0, err[-3000:]
    assert len([ln for ln in err.splitlines() if ln.startswith("stopped by SIGTERM: pipeline rollout")]) == 1, err
    # the workers are stopped and reaped before it exits, except one caught starting (it dies by its parent-death
    # signal) and multiprocessing's resource tracker, which ends when it reads its parent's end of file: a moment
    deadline = time.monotonic() + 10
    while _left(seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _left(seen), _left(seen)
    assert holder(Lake(lake_dir), "rollout-sig") is None


@pytest.mark.slow
def test_admit_follow_ends_after_the_pass_and_exits_130_on_sigint(tmp_path, make_traj):
    from pipeline.ingest import ingest_table

    lake = Lake(tmp_path / "lake")
    ingest_table(lake, make_traj(16, seed=3, group_size=4), source="t")
    proc = _start(tmp_path, "admit", ["admit", "--lake", lake.uri, "--json", "--follow", "--interval", "0.1",
                                      "--current-policy-version", "0", "--set", "quality=false"])
    with _reaped(proc):
        _wait(lambda: (tmp_path / "admit.out").read_text().strip() != "", proc, "the first pass")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    out, err = _output(tmp_path, "admit")
    assert proc.returncode == 130, err[-3000:]
    assert len([ln for ln in err.splitlines() if ln.startswith("follow: SIGINT: stopped after")]) == 1, err
