"""Drill: a retry storm. The tool fails on every call; retries are budgeted per
group and per run, so the run degrades (failed members stay failed, null
rewards) and ends: nothing loops, nothing is lost, the budget is the bound."""

from __future__ import annotations

import json

import pyarrow.dataset as ds

from pipeline.rollout.envs import ToolError
from pipeline.rollout.envs.arithmetic import ArithmeticTool
from pipeline.rollout.run import RolloutConfig, run_rollout


class BrokenCalculator(ArithmeticTool):
    """Every tool call fails (a dead backend)."""

    name = "drill-broken-calculator"
    calls = 0

    def step(self, task, action, *, key):
        type(self).calls += 1
        raise ToolError("backend down")


def test_retry_storm_budget_holds(policy_lake):
    lake = policy_lake
    run_id = "storm"
    cfg = RolloutConfig(env=f"{__name__}:BrokenCalculator", policy="0", groups=6, group_size=4, seed=3,
                        run_id=run_id, spool_fsync=False, retry_group_budget=3, retry_run_budget=10)
    s = run_rollout(lake, cfg)
    rows = lake.read("trajectories", filter=ds.field("run_id") == run_id).to_pylist()
    ids = [r["trajectory_id"] for r in rows]
    assert len(ids) == len(set(ids))
    planned = {f"{run_id}-g{k}-{j}" for k in range(6) for j in range(4)}
    assert planned <= set(ids)
    retries = set(ids) - planned
    failed = [r for r in rows if r["status"] == "INFRA_FAILED"]
    assert len(failed) > 10, "the storm needs more failures than the run budget"
    assert len(retries) == s.retries == 10                  # the run budget, spent exactly
    per_group: dict[str, int] = {}
    for t in retries:
        g = t.rsplit("-r", 1)[0]
        per_group[g] = per_group.get(g, 0) + 1
    assert max(per_group.values()) <= 3                     # the group budget
    assert s.retries_denied == len(failed) - s.retries      # every other failure stays failed
    assert BrokenCalculator.calls == len(failed) and s.tool_executions == 0   # each failure: one real call
    assert all(r["reward"] is None for r in failed)          # degraded: no valid evaluation, never a 0
    ev = lake.read("events", filter=ds.field("run_id") == run_id).to_pylist()
    created = [json.loads(e["payload"]) for e in ev if e["event_type"] == "CREATED"]
    assert sum("retry_of" in p for p in created) == 10
    terminal = [e["episode_id"] for e in ev if e["event_type"] == "TERMINAL"]
    assert sorted(terminal) == sorted(ids)                   # every episode ended exactly once
