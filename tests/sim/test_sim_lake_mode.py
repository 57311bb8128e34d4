"""--land: simulated trajectories land in a real lake; the real admission job decides them."""

from __future__ import annotations

import pytest

from pipeline.sim.config import load_sim_config
from pipeline.sim.engine import simulate
from pipeline.sim.lake_mode import ids_prefix, simulate_in_lake, trajectory_rows

DROP = ("wall_s", "events_per_s", "lake")


def small(**kw):
    # infra faults, a wall-clock limit that expires some slow trajectories, and a queue-wait limit:
    # every member exclusion reason goes through the real job at least once
    return load_sim_config("lake_small", {"duration_h": 0.4, "infra_failure_rate": 0.05,
                                          "max_trajectory_s": 700.0, "max_queue_wait_ms": 240_000, **kw})


@pytest.mark.slow
def test_real_admission_decides_like_the_sim_gate_and_rerun_lands_nothing(lake):
    cfg = small()
    landed = simulate_in_lake(lake, cfg)
    pure = simulate(cfg)
    info = landed["lake"]
    assert info["gate_mismatches"] == 0, info["mismatch_examples"]
    # the real job's decisions drive the same run: identical outcome to the pure simulation
    assert {k: v for k, v in landed.items() if k not in DROP} == {k: v for k, v in pure.items() if k not in DROP}
    reasons = {r for pc in landed["per_class"].values() for r in pc["reasons"]}
    assert {"infra_failed", "expired", "policy_mismatch", "stale_policy", "stale_wait", "zero_variance"} <= reasons
    assert landed["decided"] > 0 and landed["admitted"] > 0

    # the lake holds exactly what was decided: rows, receipts, snapshots
    traj = lake.read("trajectories", columns=["trajectory_id", "group_id", "status", "difficulty"])
    assert traj.num_rows == info["landed"] == landed["decided"]
    receipts = lake.read("receipts", columns=["group_id", "decision", "snapshot_id"]).to_pylist()
    assert len(receipts) == sum(landed["group_decisions"].values())
    assert len({r["group_id"] for r in receipts}) == len(receipts)
    snaps = lake.read("snapshots", columns=["snapshot_id", "num_members"]).to_pylist()
    assert sorted(s["snapshot_id"] for s in snaps) == sorted(info["snapshots"])
    assert sum(s["num_members"] for s in snaps) == landed["admitted"]
    assert {r["snapshot_id"] for r in receipts if r["decision"] == "admit"} == set(info["snapshots"])

    # the harness events of every landed trajectory: one TERMINAL each, carrying its status
    ev = lake.read("events", columns=["episode_id", "event_type", "state"]).to_pylist()
    assert info["events"] == len(ev)
    terminal = {e["episode_id"]: e["state"] for e in ev if e["event_type"] == "TERMINAL"}
    assert terminal == {r["trajectory_id"]: r["status"] for r in traj.to_pylist()}

    # SQL over the simulated lake: the health queries see the bias
    from pipeline.query.duck import query
    from pipeline.resources import sql_path

    lat = query(lake, sql_path("efficiency_latency").read_text(), params={"run_id": cfg.run_id})
    assert set(lat.column("phase").to_pylist()) == {"generation", "tool", "verification"}

    t = query(lake, "SELECT difficulty, count(*) AS n FROM trajectories GROUP BY 1 ORDER BY 1")
    assert dict(zip(t.column("difficulty").to_pylist(), t.column("n").to_pylist())) == {
        name: pc["decided"] for name, pc in landed["per_class"].items() if pc["decided"]}

    # rerunning the same simulation into the same lake lands nothing twice and reads the same decisions back
    versions = {n: lake.version(n) for n in ("trajectories", "receipts", "snapshots")}
    again = simulate_in_lake(lake, cfg)
    assert {n: lake.version(n) for n in versions} == versions
    assert again["lake"]["landed"] == 0 and again["lake"]["gate_mismatches"] == 0
    assert {k: v for k, v in again.items() if k not in DROP} == {k: v for k, v in pure.items() if k not in DROP}


def test_rows_are_valid_contract_rows():
    from pipeline.lake.validate import validate_table
    from pipeline.sim.engine import Simulation

    cfg = small(infra_failure_rate=0.3)
    sim = Simulation(cfg).run()
    idx = [i for i, e in enumerate(sim.end) if e == e]
    t = trajectory_rows(sim, idx, sim.end_time)
    v = validate_table(t)
    assert v.rejects == [] and v.valid.num_rows == len(idx)
    rows = t.select(["trajectory_id", "status", "verdict", "reward", "policy_version",
                     "token_policy_versions", "loss_mask", "queue_wait_ms"]).to_pylist()
    for i, r in zip(idx, rows):
        assert r["trajectory_id"] == f"{ids_prefix(cfg)}-t{i}"
        assert r["status"] == sim.status[i]
        assert (r["reward"] is None) == (r["status"] != "ACCEPTED")
        assert {x for x, m in zip(r["token_policy_versions"], r["loss_mask"]) if m} == {sim.version[i]}
        assert r["queue_wait_ms"] == int((sim.end_time - sim.end[i]) * 1000)
