"""The streaming harness: verifiers under a deadline and the episode's wall clock,
concurrent verifiers, shipping while other episodes still run, and the seeded
latency model. A verifier that never answers costs its own episodes (ended at
the deadline), never another episode's outcome and never the run."""

from __future__ import annotations

import json
import threading
import time

import pyarrow.dataset as ds
import pytest

from pipeline.rollout.engine import derive_seed
from pipeline.rollout.envs.arithmetic import ArithmeticTool
from pipeline.rollout.run import RolloutConfig, run_rollout

RELEASE = threading.Event()      # set at the end of the module: abandoned verifier threads then exit
SEED, GROUPS, G = 3, 4, 4


def teardown_module():
    RELEASE.set()


def slow_task_id() -> str:
    """The task of group 0 of the test runs (what the slow verifiers below hang on)."""
    return ArithmeticTool().reset(derive_seed(SEED, "task", 0), "train").task_id


class HangingVerifier(ArithmeticTool):
    """The calculator whose verifier never answers for group 0's task; the other
    verifications take 50 ms each and count how many ran at once."""

    name = "test-hanging-verifier"
    lock = threading.Lock()
    inflight = 0
    peak = 0
    hung: list[str] = []

    def verify(self, task, answer, num_tool_calls):
        cls = type(self)
        if task.task_id == slow_task_id():
            with cls.lock:
                cls.hung.append(task.task_id)
            RELEASE.wait()
        with cls.lock:
            cls.inflight += 1
            cls.peak = max(cls.peak, cls.inflight)
        try:
            time.sleep(0.05)
            return super().verify(task, answer, num_tool_calls)
        finally:
            with cls.lock:
                cls.inflight -= 1


def _cfg(policy_dir, run_id, **kw):
    base = dict(env=f"{__name__}:HangingVerifier", policy=str(policy_dir), groups=GROUPS, group_size=G, seed=SEED,
                run_id=run_id, spool_fsync=False, verifier_concurrency=4)
    base.update(kw)
    return RolloutConfig(**base)


def _run_live(lake, cfg):
    """run_rollout in a thread: a harness that waited for a hung verifier would never return."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(s=run_rollout(lake, cfg)), daemon=True)
    t.start()
    t.join(timeout=300)          # liveness, not speed
    assert not t.is_alive(), "the run is blocked behind a hung verifier"
    return box["s"]


def _rows_and_terminals(lake, run_id):
    rows = lake.read("trajectories", filter=ds.field("run_id") == run_id).to_pylist()
    ev = lake.read("events", filter=ds.field("run_id") == run_id).to_pylist()
    term = {e["episode_id"]: json.loads(e["payload"]) for e in ev if e["event_type"] == "TERMINAL"}
    return rows, ev, term


def _verified(ev):
    return {e["episode_id"] for e in ev if e["event_type"] == "VERIFYING"}


def test_a_verifier_past_its_deadline_is_infra_failed_never_accepted(lake, policy_dir):
    HangingVerifier.hung.clear()
    HangingVerifier.peak = 0
    s = _run_live(lake, _cfg(policy_dir, "vdead", verify_timeout_s=0.5))
    rows, ev, term = _rows_and_terminals(lake, "vdead")
    assert sorted(r["trajectory_id"] for r in rows) == sorted(f"vdead-g{k}-{j}" for k in range(GROUPS)
                                                                for j in range(G))
    slow = [r for r in rows if r["task_id"] == slow_task_id() and r["trajectory_id"] in _verified(ev)]
    assert slow, "some member of the slow group reached its verifier"
    for r in slow:
        assert (r["status"], r["verdict"], r["stop_reason"], r["reward"]) == \
            ("INFRA_FAILED", "UNKNOWN", "verifier_timeout", None)
        assert term[r["trajectory_id"]]["error"].startswith("verifier_timeout")
    assert s.verifiers_abandoned == len(slow) == len(HangingVerifier.hung)
    others = [r for r in rows if r["task_id"] != slow_task_id()]
    # no other episode's outcome depends on the slow verifier: none expired or timed out
    assert others and all(r["status"] in ("ACCEPTED", "REJECTED") for r in others)
    assert 1 < HangingVerifier.peak <= 4               # verifiers run concurrently, within the bound
    assert s.waits_ms["verify"]["n"] == len(_verified(ev)) - len(slow)


def test_a_call_that_outlives_the_wall_clock_ends_expired_at_the_deadline(lake, policy_dir):
    """The property, not a time budget: every EXPIRED episode ended no earlier than its wall clock
    after it started; the hung verifier's episodes all end so; every other episode that ended
    is ACCEPTED/REJECTED unless it too ran past its own wall clock (a loaded box), and those that
    finished did so before any hung one ended."""
    from datetime import datetime

    HangingVerifier.hung.clear()
    wall = 4.0
    # (8 verifier slots: the 4 hung calls hold theirs until the wall clock, the others never queue behind them)
    s = _run_live(lake, _cfg(policy_dir, "vwall", wall_clock_s=wall, verify_timeout_s=600.0, verifier_concurrency=8))
    rows, ev, term = _rows_and_terminals(lake, "vwall")
    ended = {e["episode_id"]: datetime.fromisoformat(str(e["created_at"])) for e in ev if e["event_type"] == "TERMINAL"}
    # a row's created_at is taken when its episode starts, just before the wall clock's start
    lived = {r["trajectory_id"]: (ended[r["trajectory_id"]] - datetime.fromisoformat(str(r["created_at"])))
             .total_seconds() for r in rows}
    slow = [r for r in rows if r["task_id"] == slow_task_id() and r["trajectory_id"] in _verified(ev)]
    assert slow
    for r in slow:                                     # the hung verifier never answered: ended at the wall clock
        assert (r["status"], r["verdict"], r["stop_reason"], r["reward"]) == ("EXPIRED", "UNKNOWN", "wall_clock", None)
        assert "wall clock" in term[r["trajectory_id"]]["error"]
    assert s.verifiers_abandoned == len(slow)
    for r in rows:                                     # nobody expires early
        if r["status"] == "EXPIRED":
            assert lived[r["trajectory_id"]] >= wall, (r["trajectory_id"], lived[r["trajectory_id"]])
    others = [r for r in rows if r["task_id"] != slow_task_id()]
    done = [r for r in others if r["status"] != "EXPIRED"]
    assert done and all(r["status"] in ("ACCEPTED", "REJECTED") for r in done)
    # the innocent members finished (and their TERMINAL was recorded) before the slow ones ended
    t_end = {e["episode_id"]: e["created_at"] for e in ev if e["event_type"] == "TERMINAL"}
    assert max(t_end[r["trajectory_id"]] for r in done) < min(t_end[r["trajectory_id"]] for r in slow)


class WaitsForTheLake(ArithmeticTool):
    """Group 0's verifier answers only once the other groups' rows are in the lake
    (or after 60 s): proof that finished trajectories ship while others run."""

    name = "test-waits-for-the-lake"
    lake_uri = ""
    seen: list[int] = []

    def verify(self, task, answer, num_tool_calls):
        if task.task_id == slow_task_id():
            from pipeline.lake.delta import Lake

            lake = Lake(type(self).lake_uri)
            others = {f"ship-g{k}-{j}" for k in range(1, GROUPS) for j in range(G)}
            for _ in range(600):
                if lake.exists("trajectories"):
                    ids = set(lake.read("trajectories", columns=["trajectory_id"]).column("trajectory_id").to_pylist())
                    if others <= ids:
                        type(self).seen.append(len(ids & others))
                        break
                time.sleep(0.1)
        return super().verify(task, answer, num_tool_calls)


def test_finished_trajectories_ship_while_other_episodes_still_run(lake, policy_dir):
    WaitsForTheLake.lake_uri = lake.uri
    WaitsForTheLake.seen = []
    # (8 verifier slots: group 0's 4 waiting calls hold theirs, the other groups' never queue behind them)
    s = run_rollout(lake, _cfg(policy_dir, "ship", env=f"{__name__}:WaitsForTheLake", flush_seconds=0.2,
                               verify_timeout_s=120.0, verifier_concurrency=8))
    assert s.landed == s.trajectories == GROUPS * G
    assert WaitsForTheLake.seen and WaitsForTheLake.seen[0] == (GROUPS - 1) * G, \
        "the other groups' rows were not in the lake while group 0 was still being verified"
    assert s.waits_ms["ship"]["n"] == GROUPS * G


def test_latency_model_is_seeded_recorded_and_changes_no_outcome(lake, policy_dir):
    from pipeline.rollout.settings import Latency

    lat = Latency(tool_ms=300.0, tool_sigma=1.0, slow_tool_p=0.05, seed=1)
    assert lat.draw("tool", "e/a0") == lat.draw("tool", "e/a0") != lat.draw("tool", "e/a1")
    assert Latency(tool_ms=300.0, tool_sigma=1.0, slow_tool_p=0.05, seed=2).draw("tool", "e/a0") != lat.draw("tool", "e/a0")
    xs = [Latency(tool_ms=300.0, tool_sigma=1.0, seed=1).draw("tool", f"k{i}") for i in range(20000)]
    assert sum(xs) / len(xs) == pytest.approx(0.300, rel=0.05)          # the lognormal's mean is tool_ms
    slow = [lat.draw("tool", f"k{i}") for i in range(20000)]
    assert sum(slow) / len(slow) == pytest.approx(0.300 * (1 + 0.05 * 9), rel=0.06)   # 5% of calls take 10x
    assert Latency().draw("tool", "x") == 0.0 and Latency(verifier_ms=5.0).draw("verify", "x") == 0.005

    base = dict(env="arithmetic-tool", groups=3, group_size=4)
    run_rollout(lake, _cfg(policy_dir, "lat0", **base))
    s = run_rollout(lake, _cfg(policy_dir, "lat1", tool_latency_ms=30.0, tool_latency_sigma=1.0, slow_tool_p=0.2,
                               verifier_latency_ms=10.0, **base))
    ev = lake.read("events", filter=ds.field("run_id") == "lat1").to_pylist()
    created = [json.loads(e["payload"]) for e in ev if e["event_type"] == "CREATED"]
    model = {"tool_ms": 30.0, "tool_sigma": 1.0, "slow_tool_p": 0.2, "verifier_ms": 10.0, "verifier_sigma": 0.0,
             "slow_verifier_p": 0.0, "seed": SEED}
    assert created and all(c["latency"] == model for c in created)
    executed = [e for e in ev if e["event_type"] == "ACTION_EXECUTED"]
    assert executed
    lm = Latency(tool_ms=30.0, tool_sigma=1.0, slow_tool_p=0.2, verifier_ms=10.0, verifier_sigma=0.0,
                 slow_verifier_p=0.0, seed=SEED)
    for e in executed:                                  # every call's injected latency is on record, reproducibly
        key = f"{e['episode_id'].removeprefix('lat1-')}/{e['action_id']}"   # drawn without the run id
        assert json.loads(e["payload"])["injected_ms"] == round(lm.draw("tool", key) * 1000, 3)
    assert s.waits_ms["tool"]["n"] == len(executed) and s.engine_busy_s > 0 and s.engine_steps >= 2
    cols = ["task_id", "response_ids", "loss_mask", "reward", "status", "stop_reason"]

    def outcome(run_id):
        rows = lake.read("trajectories", filter=ds.field("run_id") == run_id).to_pylist()
        return sorted((r["trajectory_id"].split("-", 1)[1], *(str(r[c]) for c in cols)) for r in rows)

    assert outcome("lat0") == outcome("lat1")           # timing changed, the trajectories did not

    # the named query reads the same engine figures back from the events
    import numpy as np

    from pipeline.query.duck import query
    from pipeline.resources import sql_path

    got = query(lake, sql_path("rollout_engine").read_text(), params={"run_id": "lat1"}).to_pylist()
    assert len(got) == 1
    g = got[0]
    assert g["workers"] == 1 and g["episodes"] == 12 and g["engine_calls"] == s.engine_steps
    assert g["engine_busy_s"] == pytest.approx(s.engine_busy_s, abs=1e-3 * s.engine_steps)
    waited = [json.loads(e["payload"])["waited_ms"] for e in executed]
    assert g["tool_p50_ms"] == pytest.approx(float(np.quantile(waited, 0.5)))
    assert g["tool_p95_ms"] == pytest.approx(float(np.quantile(waited, 0.95)))
    assert g["injected_tool_ms"] == pytest.approx(float(np.mean([json.loads(e["payload"])["injected_ms"]
                                                                  for e in executed])))
    assert 0 < g["busy_share"] <= 1
