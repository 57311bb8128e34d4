"""`pipeline rollout`, `pipeline policy eval` end to end (in-process CLI)."""

from __future__ import annotations

import json

from pipeline.cli import main


def test_rollout_cli_lands_and_summarizes(lake, policy_dir, capsys):
    rc = main(["rollout", "--lake", lake.uri, "--policy", str(policy_dir), "--env", "reverse-digits", "--groups", "3",
               "--group-size", "4", "--seed", "1", "--run-id", "cli", "--json", "--set", "temperature=0.8"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["trajectories"] == out["landed"] == 12 and out["run_id"] == "cli"
    assert sum(out["statuses"].values()) == 12 and out["tokens_per_s"] > 0
    t = lake.read("trajectories", columns=["temperature", "num_tool_calls", "env_version"]).to_pylist()
    assert {r["temperature"] for r in t} == {0.8} and {r["env_version"] for r in t} == {"reverse-digits/1"}
    # same run id again: everything already landed, nothing is sampled twice
    assert main(["rollout", "--lake", lake.uri, "--policy", str(policy_dir), "--env", "reverse-digits", "--groups",
                 "3", "--group-size", "4", "--seed", "1", "--run-id", "cli", "--json"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["trajectories"] == 0 and lake.read("trajectories", columns=["trajectory_id"]).num_rows == 12


def test_rollout_cli_error_is_actionable(lake, capsys):
    rc = main(["rollout", "--lake", lake.uri, "--groups", "1", "--json"])
    assert rc != 0
    err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "policy" in err["error"] and "pipeline policy init" in err["hint"]


def test_policy_eval_is_greedy_on_a_fixed_held_out_set(lake, published, capsys):
    published(0)
    assert main(["policy", "eval", "--lake", lake.uri, "--n", "30", "--json"]) == 0
    a = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["policy", "eval", "--lake", lake.uri, "--n", "30", "--json"]) == 0
    b = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert a == b and a["n"] == 30 and 0.0 <= a["success_rate"] <= 1.0 and a["policy_version"] == 0
    assert sum(a["statuses"].values()) == 30
