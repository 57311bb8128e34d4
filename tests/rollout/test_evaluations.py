"""The evaluations table: `pipeline policy eval` appends one row per (policy,
settings), exactly once; sql/eval_curve.sql gives the curve per version;
sampled evaluations report unbiased pass@k."""

from __future__ import annotations

import json

from pipeline.cli import main


def _last(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_policy_eval_writes_the_eval_curve(lake, published, capsys):
    from pipeline.lineage import checkpoint, read_events, table

    published(0)
    published(1)
    assert main(["policy", "eval", "--lake", lake.uri, "--policy", "0", "--n", "12", "--json"]) == 0
    v0 = _last(capsys)
    assert main(["policy", "eval", "--lake", lake.uri, "--policy", "0", "--n", "12", "--json"]) == 0
    assert _last(capsys)["eval_id"] == v0["eval_id"]                   # same evaluation: one row
    assert main(["policy", "eval", "--lake", lake.uri, "--n", "12", "--json"]) == 0
    v1 = _last(capsys)
    assert main(["policy", "eval", "--lake", lake.uri, "--n", "6", "--samples", "4", "--json"]) == 0
    sampled = _last(capsys)
    assert sorted(sampled["pass_at_k"]) == ["1", "2", "4"]
    p = [sampled["pass_at_k"][k] for k in ("1", "2", "4")]
    assert p == sorted(p) and abs(p[0] - sampled["success_rate"]) < 1e-9   # pass@k grows with k; pass@1 = success

    rows = lake.read("evaluations").to_pylist()
    assert len(rows) == 3 and len({r["eval_id"] for r in rows}) == 3
    assert {(r["policy_version"], r["samples"]) for r in rows} == {(0, 1), (1, 1), (1, 4)}
    assert all(r["command"] == "pipeline policy eval" and r["split"] == "eval" for r in rows)

    from pipeline.query.duck import query
    from pipeline.resources import resource_dir

    sql = (resource_dir("sql") / "eval_curve.sql").read_text()
    curve = query(lake, sql, params={"env": None, "samples": 1}).to_pylist()
    assert [r["policy_version"] for r in curve] == [0, 1]
    assert [r["success"] for r in curve] == [v0["success_rate"], v1["success_rate"]]
    assert curve[1]["checkpoint_id"] == "test-v1" and curve[1]["published_at"] is not None

    ev = [e for e in read_events(lake) if e["job"]["name"] == "pipeline.eval" and e["eventType"] == "COMPLETE"]
    assert len(ev) == 4
    ins = {(d["namespace"], d["name"]) for d in ev[0]["inputs"]}
    assert checkpoint(lake, "test-v0").key() in ins
    assert ev[0]["outputs"][0]["name"] == table(lake, "evaluations").name


def test_eval_without_record_writes_nothing(lake, published, capsys):
    published(0)
    assert main(["policy", "eval", "--lake", lake.uri, "--n", "3", "--no-record", "--json"]) == 0
    assert "eval_id" not in _last(capsys) and not lake.exists("evaluations")


def test_rollout_emits_lineage_policy_in_trajectories_out(lake, published, capsys):
    """The rollout job's run: the checkpoint it sampled from in, the trajectories
    table (at the version it wrote) out, both named per the OpenLineage naming spec."""
    from pipeline.lineage import checkpoint, read_events, table

    published(0)
    assert main(["rollout", "--lake", lake.uri, "--env", "reverse-digits", "--groups", "2", "--group-size", "2",
                 "--run-id", "ol", "--json"]) == 0
    ev = [e for e in read_events(lake) if e["job"]["name"] == "pipeline.rollout"]
    assert [e["eventType"] for e in ev] == ["START", "COMPLETE"]
    done = ev[1]
    assert checkpoint(lake, "test-v0").key() in {(d["namespace"], d["name"]) for d in done["inputs"]}
    outs = {(d["namespace"], d["name"]): d for d in done["outputs"]}
    traj = outs[table(lake, "trajectories").key()]
    assert traj["facets"]["version"]["datasetVersion"] == str(lake.version("trajectories"))
    assert done["job"]["facets"]["jobType"]["jobType"] == "ROLLOUT"
    assert done["run"]["facets"]["processing_engine"]["name"] == "hf"
    params = {p["key"]: p["value"] for p in done["run"]["facets"]["executionParameters"]["parameters"]}
    assert params["run_id"] == "ol" and params["groups"] == "2"
