"""The closed loop's invariants on a short demo run (the learning target itself
is measured by the benchmark, not asserted in a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.compute as pc
import pytest

from pipeline.demo import DemoConfig, run_demo
from pipeline.query.duck import query


def _cfg(**kw):
    base = dict(iterations=2, groups=8, group_size=4, eval_n=24, epochs=1, report=False, async_min_groups=4,
                async_timeout_s=240)
    base.update(kw)
    return DemoConfig(**base)


def _check_loop_invariants(lake, summary):
    ckpts = query(lake, "SELECT checkpoint_id, policy_version, snapshot_ids FROM checkpoints ORDER BY policy_version")
    versions = ckpts.column("policy_version").to_pylist()
    assert versions == list(range(len(versions))), "versions increase by one from 0"
    assert summary["final_policy_version"] == versions[-1]
    # every checkpoint's lineage resolves to admitted trajectories only
    bad = query(lake, """
        WITH trained AS (SELECT unnest(snapshot_ids) AS snapshot_id FROM checkpoints)
        SELECT m.trajectory_id FROM snapshot_members m JOIN trained USING (snapshot_id)
        LEFT JOIN (SELECT group_id, decision, unnest(valid_members) AS trajectory_id FROM receipts) r
          ON r.trajectory_id = m.trajectory_id AND r.group_id = m.group_id
        WHERE r.decision IS DISTINCT FROM 'admit'""")
    assert bad.num_rows == 0, bad.to_pylist()[:5]
    trained = query(lake, "SELECT count(*) AS n FROM (SELECT unnest(snapshot_ids) FROM checkpoints)").column(0)[0]
    assert trained.as_py() >= 1, "at least one snapshot was trained on"
    # no trajectory is in two snapshots
    dup = query(lake, "SELECT trajectory_id FROM snapshot_members GROUP BY 1 HAVING count(*) > 1")
    assert dup.num_rows == 0
    for line in summary["iterations"]:
        assert 0.0 <= line["heldout_success"] <= 1.0
    # every held-out evaluation is in the evaluations table (one row per version: same settings = same row)
    evals = {r["policy_version"]: r for r in lake.read("evaluations").to_pylist()}
    for line in summary["iterations"]:
        assert evals[line["policy_version"]]["success"] == line["heldout_success"]
        assert evals[line["policy_version"]]["command"] == "pipeline demo"


@pytest.mark.slow
def test_sync_demo_loop(lake):
    from pipeline.report.build import build_report

    lines = []
    summary = run_demo(lake, _cfg(), out=lines.append)
    _check_loop_invariants(lake, summary)
    _, rep = build_report(lake)
    assert rep["errors"] == [] and rep["alerts"] == [], "the demo's own healthy run raises no alert"
    assert len(summary["iterations"]) == 3 and any("held-out success" in str(x) for x in lines)
    trained = [it for it in summary["iterations"] if it["checkpoint_id"]]
    # an iteration whose groups were all zero-variance admits nothing and publishes nothing
    assert summary["final_policy_version"] == len(trained) >= 1
    for it in summary["iterations"][1:]:
        assert (it["snapshot_id"] is None) == (it["checkpoint_id"] is None)


@pytest.mark.slow
def test_async_demo_respects_max_lag_and_follows_new_versions(lake):
    summary = run_demo(lake, _cfg(mode="async", max_policy_lag=1), out=lambda *a: None)
    _check_loop_invariants(lake, summary)
    lags = query(lake, "SELECT max(policy_lag) AS m FROM snapshot_members").column(0)[0].as_py()
    assert lags is not None and lags <= 1, "no admitted member exceeds the max policy lag"
    seen = query(lake, "SELECT DISTINCT policy_version FROM trajectories WHERE run_id LIKE 'demo-async-%'")
    assert len(seen) >= 2, "the worker picked up a newly published policy version"
    assert 0.0 <= summary["trainer_idle_fraction"] <= 1.0
    # one resident trainer published every version (pipeline train --follow), and stopped cleanly
    import json

    trained = [json.loads(r["train_config_json"]) for r in lake.read("checkpoints").to_pylist() if r["snapshot_ids"]]
    assert trained and all(tc["trainer"] == "follow" for tc in trained)
    assert summary["resident_trainer"]["returncode"] == 0
    assert summary["resident_trainer"]["stopped_by"] in ("stop_after", "signal")


@pytest.mark.slow
def test_demo_cli_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipeline", "demo", "--lake", str(tmp_path / "lk"), "--json",
                          "--iterations", "1", "--groups", "4", "--set", "group_size=4", "--set", "eval_n=8",
                          "--set", "report=false", "--set", "epochs=1"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    # seeded: iteration 1's groups (seed 0) have reward variance, so it admits, trains and publishes version 1
    assert summary["final_policy_version"] == 1 and len(summary["iterations"]) == 2
    trained = summary["iterations"][1]
    assert trained["snapshot_id"] and trained["checkpoint_id"]
    again = subprocess.run([sys.executable, "-m", "pipeline", "demo", "--lake", str(tmp_path / "lk")],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already holds a policy" in again.stderr


def _env_without_pause(**extra):
    import os

    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_TEST_PAUSE_AT"}
    return env | extra


@pytest.mark.slow
def test_async_kill_worker_and_trainer_then_restart_loses_and_duplicates_nothing(lake, tmp_path, kill_at_marker):
    """The async pieces are separate processes meeting in the lake: SIGKILL the
    rollout worker mid-ship (a batch's trajectories committed, its events not) and
    the trainer mid-publish (its checkpoints row committed, the run not finished),
    each at a readiness marker its own code writes there; restart them, and count."""
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.policy_store import latest_policy_version
    from pipeline.rollout.policy import init_policy

    init_policy(lake, seed=0)
    groups, g = 24, 4
    worker_cmd = [sys.executable, "-m", "pipeline", "rollout", "--lake", lake.uri, "--groups", str(groups),
                  "--group-size", str(g), "--seed", "5", "--run-id", "async-kill", "--follow-latest",
                  "--set", "flush_rows=16", "--set", "groups_per_wave=4"]
    shipped = tmp_path / "worker-mid-ship"
    worker = subprocess.Popen(worker_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=_env_without_pause(PIPELINE_TEST_PAUSE_AT=f"append:trajectories:committed={shipped}"))
    kill_at_marker(worker, shipped)
    landed = query(lake, "SELECT trajectory_id FROM trajectories").column(0).to_pylist()
    assert 0 < len(landed) < groups * g, "the worker was killed mid-run"
    ended = set(query(lake, "SELECT episode_id FROM events WHERE event_type = 'TERMINAL'").column(0).to_pylist()
                if lake.exists("events") else [])
    assert not set(landed) <= ended, "killed mid-ship: the batch's trajectories landed, its events not"

    # the worker streams: its first shipment holds finished members of several groups, few complete; the
    # operator decides the groups with what arrived (a member landing later is outside its decided group)
    a = admit(lake, AdmissionConfig(group_timeout_s=0), command="test")
    assert a.snapshot_id, a.as_dict(with_receipts=True)["receipts"]
    train_cmd = [sys.executable, "-m", "pipeline", "train", "--batch-snapshot", a.snapshot_id, "--lake", lake.uri,
                 "--set", "epochs=2", "--no-progress"]
    published = tmp_path / "trainer-mid-publish"
    trainer = subprocess.Popen(train_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=_env_without_pause(PIPELINE_TEST_PAUSE_AT=f"append:checkpoints:committed={published}"))
    kill_at_marker(trainer, published)
    assert latest_policy_version(lake) == 1, "killed right after the publishing commit"
    rerun = subprocess.run(train_cmd + ["--json"], capture_output=True, text=True, timeout=600,
                           env=_env_without_pause())
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads(rerun.stdout.strip().splitlines()[-1])["already_published"], "the rerun is a no-op"

    done = subprocess.run(worker_cmd, capture_output=True, text=True, timeout=900,
                          env=_env_without_pause())  # same run id: resume
    assert done.returncode == 0, done.stderr[-2000:]
    ids = query(lake, "SELECT trajectory_id FROM trajectories WHERE run_id = 'async-kill'").column(0)
    assert len(ids) == groups * g and pc.count_distinct(ids).as_py() == groups * g, "nothing lost or duplicated"
    terminal = query(lake, """SELECT episode_id, count(*) AS n FROM events WHERE event_type = 'TERMINAL'
                              GROUP BY 1""").to_pylist()
    assert len(terminal) == groups * g and {r["n"] for r in terminal} == {1}, "the torn batch's events landed once"
    versions = query(lake, "SELECT policy_version FROM checkpoints ORDER BY 1").column(0).to_pylist()
    assert versions == [0, 1], "the killed trainer published exactly once"
    admit(lake, AdmissionConfig(), command="test")
    dup = query(lake, "SELECT trajectory_id FROM snapshot_members GROUP BY 1 HAVING count(*) > 1")
    assert dup.num_rows == 0
    followed = query(lake, """SELECT count(*) FROM trajectories WHERE run_id = 'async-kill'
                              AND list_max(token_policy_versions) >= 1""").column(0)[0].as_py()
    assert followed > 0, "after the restart the worker followed the newly published version"


@pytest.mark.slow
@pytest.mark.vllm
def test_sync_demo_with_the_vllm_engine(lake):
    summary = run_demo(lake, _cfg(engine="vllm", iterations=1), out=lambda *a: None)
    _check_loop_invariants(lake, summary)
    assert summary["engine"] == "vllm"
