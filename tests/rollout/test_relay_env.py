"""``tool-relay`` (pipeline/rollout/envs/relay.py): every episode makes exactly
``tool_turns`` tool calls whatever the policy writes, so an untrained policy
drives a multi-turn rollout (the rollout benchmark's load), and its trajectories
depend on the seeds alone."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest

from pipeline.errors import ConfigError
from pipeline.rollout.envs import get_env, list_envs
from pipeline.rollout.run import RolloutConfig, run_rollout


def test_registered_deterministic_and_scored_on_the_calls_made():
    assert "tool-relay" in list_envs()
    env = get_env("tool-relay")
    assert env.scripted_tool_turns == 3 and env.multi_turn
    task = env.reset(7)
    assert task == env.reset(7) and task.prompt.startswith("k:") and task.prompt.endswith("=")
    out = env.step(task, "anything<obs>x", key="k")
    assert out == env.step(task, "anything<obs>x", key="other") and len(out) == 4 and out.isdigit()
    assert env.step(task, "b", key="k") != env.step(task, "c", key="k")
    assert (env.verify(task, None, 3).verdict, env.verify(task, None, 3).reward) == ("PASS", 1.0)
    two = env.verify(task, "whatever", 2)
    assert (two.verdict, two.reward, two.components) == ("FAIL", 0.0, {"tool_calls": pytest.approx(2 / 3)})
    with pytest.raises(ConfigError, match="must be >= 1"):
        get_env("tool-relay", tool_turns=0)


def _rows(lake, run_id):
    return lake.read("trajectories", filter=ds.field("run_id") == run_id,
                     columns=["trajectory_id", "response_ids", "loss_mask", "status", "reward",
                              "num_tool_calls"]).to_pylist()


def test_an_untrained_policy_makes_every_call_and_the_seeds_fix_the_tokens(lake, policy_dir):
    """Each episode: 3 tool turns (ended by a stop token or by their token budget alike) and a final turn
    that is verified; the same trajectories in streaming and waves, with and without tool latency."""
    common = dict(env="tool-relay", policy=str(policy_dir), groups=2, group_size=3, seed=5, max_turns=4,
                  max_tokens_per_turn=6, max_total_tokens=64, temperature=1.0, flush_seconds=0.5)
    s = run_rollout(lake, RolloutConfig(run_id="relay-s", schedule="stream", **common))
    run_rollout(lake, RolloutConfig(run_id="relay-w", schedule="waves", tool_latency_ms=20, tool_latency_sigma=1,
                                    slow_tool_p=0.2, **common))
    assert s.trajectories == 6 and s.tool_executions == 18 and s.statuses == {"ACCEPTED": 6}
    a, b = _rows(lake, "relay-s"), _rows(lake, "relay-w")
    assert all(r["num_tool_calls"] == 3 and r["reward"] == 1.0 and r["status"] == "ACCEPTED" for r in a + b)
    for r in a:   # 4 policy turns (runs of mask 1) between 3 observations (runs of mask 0)
        m = r["loss_mask"]
        assert sum(1 for i, x in enumerate(m) if x == 1 and (i == 0 or m[i - 1] == 0)) == 4
    key = lambda rows: {r["trajectory_id"].split("-g", 1)[1]: r["response_ids"] for r in rows}  # noqa: E731
    assert key(a) == key(b)
    ev = lake.read("events", filter=(ds.field("run_id") == "relay-s") & (ds.field("event_type") == "ACTION_COMMITTED"),
                   columns=["payload"]).to_pylist()
    assert len(ev) == 18 and all(json.loads(e["payload"])["tool"] == "tool-relay" for e in ev)
