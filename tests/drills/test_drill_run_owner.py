"""Drills 4 and 5: the rollout run's owner dies, and a worker's spool is lost.

docs/drills.md "Drill 4" and "Drill 5". Real `pipeline rollout` processes are
SIGKILLed at a readiness marker: a worker writes ``<hold>.<pid>`` right after
its Nth tool execution is durable in its spool (ACTION_EXECUTED recorded, the
observation not yet persisted) and waits to be killed. The environment is the
drill's calculator declared NOT idempotent, so "a tool ran twice" is never
allowed and is observable in the tool log (one line per real execution).

Drill 4: the parent of a 2-worker run is killed while both workers hold; every process of that run must
die with it; two reruns of the same run id with another --workers (1) start at once:
one refuses, naming the live owner; the other finishes the run.
Drill 5: a 1-worker run is killed and its spool deleted (local lake, and a lake
on the moto S3 server); the rerun recovers from the lake alone.
Both end with: every planned trajectory id once, every event key once, one
TERMINAL per episode, no tool key executed twice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ENV = "drill_envs:SideEffectCalculator"
GROUPS, G = 6, 4


@pytest.fixture(scope="module")
def tool_policy(policy_lake) -> Path:
    """The drills' policy that mostly calls the calculator, as an HF directory (any lake can use it)."""
    from pipeline.policy_store import resolve_policy

    return resolve_policy(policy_lake, "0").hf_dir


def _env(extra: dict | None = None) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", **(extra or {}),
                PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def _rollout(lake_uri, policy, run_id, workers, tmp, *, hold=0, env=None, spool=None) -> subprocess.Popen:
    args = [sys.executable, "-m", "pipeline", "rollout", "--lake", lake_uri, "--env", ENV, "--policy", str(policy),
            "--groups", str(GROUPS), "--group-size", str(G), "--seed", "11", "--workers", str(workers),
            "--run-id", run_id, "--json", "--set", f"tool_log={tmp / 'tool.log'}", "--set", "groups_per_wave=2",
            "--set", "spool_fsync=false"]
    if hold:
        args += ["--set", f"hold_after_executed={hold}", "--set", f"hold_file={tmp / 'hold'}"]
    if spool:
        args += ["--set", f"spool_dir={spool}"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env))


def _wait_markers(tmp: Path, proc: subprocess.Popen, n: int = 1) -> list[int]:
    """The pids of the first ``n`` workers that reached their hold point."""
    for _ in range(6000):
        found = [p for p in tmp.glob("hold.*") if not p.name.endswith(".tmp")]
        if len(found) >= n:
            return [int(p.read_text()) for p in found]
        if proc.poll() is not None:
            pytest.fail(f"the run ended before its hold point: {proc.stderr.read()[-3000:]}")
        time.sleep(0.1)
    pytest.fail("no worker reached its hold point")


def _start_time(pid: int) -> str | None:
    """The start time of a running ``pid`` (None once it exited: gone, or a zombie
    an init that reaps late still lists)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = {}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if (st := _start_time(c)) is not None:
                out[c] = st
                todo.append(c)
    return out


def _check_run(lake, run_id: str, tool_log: Path) -> dict[str, str]:
    import pyarrow.dataset as ds

    executed = Counter(tool_log.read_text().split()) if tool_log.exists() else Counter()
    assert all(n == 1 for n in executed.values()), f"executed twice: {[k for k, n in executed.items() if n > 1]}"
    traj = lake.read("trajectories", columns=["trajectory_id", "status", "num_tool_calls"],
                     filter=ds.field("run_id") == run_id).to_pylist()
    planned = {f"{run_id}-g{k}-{j}" for k in range(GROUPS) for j in range(G)}
    ids = [r["trajectory_id"] for r in traj]
    assert sorted(ids) == sorted(planned), "a trajectory was lost or landed twice"
    events = lake.read("events", columns=["episode_id", "step_id", "action_id", "event_type"],
                       filter=ds.field("run_id") == run_id).to_pylist()
    keys = Counter((e["episode_id"], e["step_id"], e["action_id"], e["event_type"]) for e in events)
    assert all(n == 1 for n in keys.values()), "an event key landed twice"
    terminal = Counter(e["episode_id"] for e in events if e["event_type"] == "TERMINAL")
    assert set(terminal) == planned and set(terminal.values()) == {1}
    # an action has at most one execution on record, and never more real executions than records
    on_record = {f"{e['episode_id']}/{e['action_id']}" for e in events if e["event_type"] == "ACTION_EXECUTED"}
    assert on_record <= set(executed)
    return {r["trajectory_id"]: r["status"] for r in traj}


def _lake_events(lake, run_id):
    import pyarrow.dataset as ds

    if not lake.exists("events"):
        return set()
    return {(e["episode_id"], e["action_id"], e["event_type"]) for e in lake.read(
        "events", columns=["episode_id", "action_id", "event_type"], filter=ds.field("run_id") == run_id).to_pylist()}


@pytest.mark.slow
def test_parent_killed_then_two_reruns_with_other_workers(lake, tool_policy, tmp_path):
    run_id = "owner"
    first = _rollout(lake.uri, tool_policy, run_id, 2, tmp_path, hold=2)
    held = _wait_markers(tmp_path, first, n=2)           # both workers: executed, observation not persisted
    tree = _descendants(first.pid)
    assert set(held) <= set(tree), tree                   # the workers are the parent's processes
    os.kill(first.pid, signal.SIGKILL)                    # the owner dies mid-run
    first.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(_start_time(p) == st for p, st in tree.items()):
        time.sleep(0.1)
    left = [p for p, st in tree.items() if _start_time(p) == st]
    assert not left, f"processes of the killed run are still alive: {left}"
    executed_before = set((tmp_path / "tool.log").read_text().split())
    # both workers' shares (even and odd groups) had tools executed: the rerun's single
    # worker must recover episodes another worker id recorded
    assert {int(k.split("-g")[1].split("-")[0]) % 2 for k in executed_before} == {0, 1}

    # two reruns at once, with another --workers: exactly one owns the run
    b = _rollout(lake.uri, tool_policy, run_id, 1, tmp_path)
    c = _rollout(lake.uri, tool_policy, run_id, 1, tmp_path)
    outs = [p.communicate(timeout=900) for p in (b, c)]
    codes = sorted([b.returncode, c.returncode])
    assert codes[0] == 0 and codes[1] != 0, outs
    winner, loser = (b, c) if b.returncode == 0 else (c, b)
    out, err = outs[[b, c].index(loser)]
    assert "Traceback" not in err, err[-3000:]
    refusal = json.loads(out)            # --json: the one-line error as JSON
    assert refusal["kind"] == "ConflictError"
    assert f"run {run_id} is owned by a live `pipeline rollout`: pid {winner.pid}" in refusal["error"], refusal
    summary = json.loads(outs[[b, c].index(winner)][0])
    assert summary["resumed"] > 0 and summary["workers"] == 1

    _check_run(lake, run_id, tmp_path / "tool.log")
    events = _lake_events(lake, run_id)
    for key in executed_before:                           # executed before the kill: finished from the record
        ep, action = key.rsplit("/", 1)
        if (ep, action, "ACTION_EXECUTED") in events:
            assert (ep, action, "OBSERVATION_PERSISTED") in events
    from pipeline.lake.lease import holder

    assert holder(lake, f"rollout-{run_id}") is None, "the owner releases its lease"


@pytest.mark.slow
@pytest.mark.parametrize("store", ["local", "s3"])
def test_spool_lost_then_rerun_recovers_from_the_lake(store, tmp_path, tool_policy, request):
    from pipeline.lake.delta import Lake

    run_id = f"lost-{store}"
    env: dict[str, str] = {}
    if store == "s3":                                     # the moto server of tests/conftest.py
        _, bucket = request.getfixturevalue("s3_env")
        env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                          "AWS_REGION", "AWS_ALLOW_HTTP")}
        lake = Lake(f"s3://{bucket}/lake", storage_options=env)
    else:
        lake = Lake(tmp_path / "lake")
    spool = tmp_path / "scratch" / run_id                 # the worker's local disk
    first = _rollout(lake.uri, tool_policy, run_id, 1, tmp_path, hold=3, env=env, spool=spool)
    _wait_markers(tmp_path, first)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    executed_before = set((tmp_path / "tool.log").read_text().split())
    on_record = _lake_events(lake, run_id)
    shutil.rmtree(spool)                                  # the node and its scratch disk are gone

    second = _rollout(lake.uri, tool_policy, run_id, 1, tmp_path, env=env, spool=spool)
    out, err = second.communicate(timeout=900)
    assert second.returncode == 0, err[-3000:]
    status = _check_run(lake, run_id, tmp_path / "tool.log")
    # every action that ran was committed in the lake first (shipped before the tools ran);
    # those whose execution never reached the lake have an unknown outcome: never re-run, INFRA_FAILED
    unknown = [k for k in executed_before if (*k.rsplit("/", 1), "ACTION_EXECUTED") not in on_record]
    assert unknown, "the kill left no execution unshipped: the drill would not test that branch"
    for key in executed_before:
        ep, action = key.rsplit("/", 1)
        assert (ep, action, "ACTION_COMMITTED") in on_record
    for key in unknown:
        assert status[key.rsplit("/", 1)[0]] == "INFRA_FAILED"
