"""A worker SIGKILLed between a tool's execution and the observation's
persistence is restarted and completes every trajectory without running any
tool call twice (counted through the calculator's side-effect log)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = """
import sys
from pipeline.lake.delta import Lake
from pipeline.rollout.run import RolloutConfig, run_rollout
lake_uri, policy, log, kill = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = RolloutConfig(env="arithmetic-tool", policy=policy, groups=8, group_size=4, seed=5, run_id="crash",
                    tool_log=log, kill_after_executed=kill, groups_per_wave=2, flush_rows=1)
s = run_rollout(Lake(lake_uri), cfg)
print("SUMMARY", s.trajectories, s.resumed, s.tool_executions)
"""


def _run(lake, policy_dir, log, kill):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", SCRIPT, lake.uri, str(policy_dir), str(log), str(kill)],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).resolve().parents[2])


@pytest.mark.slow
def test_sigkill_between_execution_and_observation(lake, policy_dir, tmp_path):
    log = tmp_path / "tool-executions.log"
    crashed = _run(lake, policy_dir, log, kill=5)
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    executed_before = log.read_text().split()
    assert len(executed_before) == 5
    # the killed worker's spool: the 5th action has ACTION_EXECUTED and no OBSERVATION_PERSISTED
    spool = next((Path(lake.uri) / "_spool" / "crash").glob("*.spool.jsonl"))
    recs = [json.loads(x) for x in spool.read_text().splitlines()]
    ev = Counter((r["episode_id"], r["action_id"], r["event_type"]) for r in recs if r["kind"] == "event")
    dangling = [k for k in ev if k[2] == "ACTION_EXECUTED" and (k[0], k[1], "OBSERVATION_PERSISTED") not in ev]
    # (the harness group-commits: every action of the wave executed so far is in this state)
    assert dangling
    dangling_keys = {f"{e}/{a}" for e, a, _ in dangling}
    assert executed_before[-1] in dangling_keys

    restarted = _run(lake, policy_dir, log, kill=0)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    executed = log.read_text().split()
    assert len(executed) == len(set(executed))                   # no tool call ran twice
    assert all(executed.count(k) == 1 for k in dangling_keys)

    rows = lake.read("trajectories", columns=["trajectory_id", "num_tool_calls", "status", "response_ids"]).to_pylist()
    assert len(rows) == 32 and len({r["trajectory_id"] for r in rows}) == 32
    assert sum(r["num_tool_calls"] for r in rows) == len(executed)  # every execution observed exactly once
    events = lake.read("events", columns=["episode_id", "step_id", "action_id", "event_type"]).to_pylist()
    keys = Counter((e["episode_id"], e["step_id"], e["action_id"], e["event_type"]) for e in events)
    assert max(keys.values()) == 1                               # each event landed once
    for eid, aid, _ in dangling:                                 # finished from the recorded output
        assert keys[(eid, int(aid[1:]), aid, "OBSERVATION_PERSISTED")] == 1
        assert keys[(eid, int(aid[1:]), aid, "ACTION_EXECUTED")] == 1
    total, resumed, _ = restarted.stdout.split("SUMMARY")[1].split()
    assert int(resumed) >= len(dangling)


@pytest.mark.slow
def test_two_worker_processes_share_one_lake(lake, policy_dir):
    from pipeline.rollout.run import RolloutConfig, run_rollout

    s = run_rollout(lake, RolloutConfig(policy=str(policy_dir), groups=5, group_size=3, seed=2, run_id="multi",
                                        workers=2, spool_fsync=False))
    assert s.workers == 2 and s.trajectories == s.landed == 15
    rows = lake.read("trajectories", columns=["trajectory_id", "group_id", "ingest_id"]).to_pylist()
    assert len({r["trajectory_id"] for r in rows}) == 15 and len({r["group_id"] for r in rows}) == 5
    # one app id per worker, each with its own batch sequence
    assert lake.transaction_version("trajectories", "multi/w0") == 0
    assert lake.transaction_version("trajectories", "multi/w1") == 0
    workers = {r["ingest_id"].split(":")[1] for r in rows}
    assert workers == {"multi/w0", "multi/w1"}
