"""Drill 1: a rollout worker dies after a tool executed, before the observation was persisted.

docs/drills.md "Drill 1". The real worker (pipeline.rollout.run) runs in a
subprocess and is SIGKILLed by its own fault hook right after its 2nd tool
execution is durable in the spool (``kill_after_executed``), i.e. with
ACTION_EXECUTED recorded and OBSERVATION_PERSISTED not. The same run is then
restarted. Every real tool execution appends its idempotency key to a tool log,
so "executed twice" is observable. After the restart:
- no action key was executed twice (for an idempotent and a non-idempotent tool);
- the interrupted actions whose output was recorded finish from the recorded
  output (OBSERVATION_PERSISTED appears, the tool is not called again);
- actions committed but not executed before the crash are run once (idempotent
  tool) or their episode ends INFRA_FAILED (non-idempotent tool: outcome unknown);
- every planned episode has exactly one trajectory row; event keys are unique.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

WORKER = r"""
import json, sys
from pipeline.lake.delta import Lake
from pipeline.rollout.run import RolloutConfig, run_rollout
cfg = RolloutConfig(**json.loads(sys.argv[2]))
print(json.dumps(run_rollout(Lake(sys.argv[1]), cfg).as_dict()))
"""


# policy_lake (conftest.py): a policy that mostly calls the calculator, shared with the other drills


def worker(lake, cfg: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", WORKER, lake.uri, json.dumps(cfg)], capture_output=True,
                          text=True, timeout=600, env=env)


def spool_events(lake, run_id: str) -> list[dict]:
    files = list((Path(lake.uri) / "_spool" / run_id).glob("*.spool.jsonl"))
    assert len(files) == 1
    out = []
    for line in files[0].read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a torn last line
    return [r for r in out if r["kind"] == "event"]


@pytest.mark.slow
@pytest.mark.parametrize("env", ["arithmetic-tool", "drill_envs:SideEffectCalculator"])
def test_worker_killed_between_tool_and_observation(policy_lake, tmp_path, env):
    lake = policy_lake
    run_id = "drill1-" + ("idem" if env == "arithmetic-tool" else "side-effect")
    tool_log = tmp_path / "tool.log"
    cfg = dict(env=env, groups=8, group_size=4, seed=3, run_id=run_id, policy="0", tool_log=str(tool_log),
               kill_after_executed=2)
    first = worker(lake, cfg)
    assert first.returncode == -signal.SIGKILL, (first.stdout, first.stderr[-2000:])

    # the crash point: actions executed (durable) whose observation was never persisted
    ev = spool_events(lake, run_id)
    kinds: dict[tuple[str, str], set[str]] = {}
    for r in ev:
        kinds.setdefault((r["episode_id"], r["action_id"]), set()).add(r["event_type"])
    executed_only = {k for k, s in kinds.items() if "ACTION_EXECUTED" in s and "OBSERVATION_PERSISTED" not in s}
    committed_only = {k for k, s in kinds.items() if "ACTION_COMMITTED" in s and "ACTION_EXECUTED" not in s}
    assert len(executed_only) == 2
    assert committed_only, "no action was left committed-but-unexecuted: the drill would not test that branch"
    logged_before = tool_log.read_text().splitlines()
    assert sorted(logged_before) == sorted(f"{e}/{a}" for e, a in executed_only)

    # restart: same run id, no fault
    second = worker(lake, dict(cfg, kill_after_executed=0))
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["resumed"] > 0

    keys = Counter(tool_log.read_text().splitlines())
    assert all(n == 1 for n in keys.values()), f"executed twice: {[k for k, n in keys.items() if n > 1]}"

    import pyarrow.dataset as ds

    traj = lake.read("trajectories", columns=["trajectory_id", "status", "num_tool_calls"],
                     filter=ds.field("run_id") == run_id).to_pylist()
    planned = {f"{run_id}-g{k}-{j}" for k in range(8) for j in range(4)}
    ids = [r["trajectory_id"] for r in traj]
    assert sorted(ids) == sorted(planned), "a trajectory was lost or landed twice"
    status = {r["trajectory_id"]: r["status"] for r in traj}
    events = lake.read("events", columns=["episode_id", "step_id", "action_id", "event_type"],
                       filter=ds.field("run_id") == run_id).to_pylist()
    ekeys = Counter((e["episode_id"], e["step_id"], e["action_id"], e["event_type"]) for e in events)
    assert all(n == 1 for n in ekeys.values()), "an event key landed twice"
    persisted = {(e["episode_id"], e["action_id"]) for e in events if e["event_type"] == "OBSERVATION_PERSISTED"}
    for ep, action in executed_only:
        # finished from the recorded output: observation persisted, not executed again, not failed
        assert (ep, action) in persisted
        assert keys[f"{ep}/{action}"] == 1
        assert status[ep] != "INFRA_FAILED"
    for ep, action in committed_only:
        if env == "arithmetic-tool":   # idempotent: re-run once after the restart
            assert keys[f"{ep}/{action}"] == 1 and (ep, action) in persisted
        else:                          # outcome unknown and not idempotent: never re-run, the episode fails
            assert f"{ep}/{action}" not in keys and status[ep] == "INFRA_FAILED"
    terminal = Counter(e["episode_id"] for e in events if e["event_type"] == "TERMINAL")
    assert set(terminal) == planned and set(terminal.values()) == {1}
