"""Tool calls under the harness's deadline and concurrency bound, and retries of
failed members: a tool that hangs forever costs its episode, not the run."""

from __future__ import annotations

import hashlib
import json
import threading
import time


from pipeline.rollout.envs.arithmetic import ArithmeticTool
from pipeline.rollout.run import RolloutConfig, run_rollout

RELEASE = threading.Event()      # set at the end of the module's tests: abandoned threads then exit


class HangingCalculator(ArithmeticTool):
    """The calculator, except that about half the calls (by key) never return;
    records how many calls were in flight at once."""

    name = "test-hanging-calculator"
    lock = threading.Lock()
    inflight = 0
    peak = 0
    hung: list[str] = []

    def step(self, task, action, *, key):
        cls = type(self)
        if hashlib.sha256(key.encode()).digest()[0] % 2 == 0:
            with cls.lock:
                cls.hung.append(key)
            RELEASE.wait()                       # hangs "forever" (until the test module ends)
            return "late"
        with cls.lock:
            cls.inflight += 1
            cls.peak = max(cls.peak, cls.inflight)
        try:
            time.sleep(0.05)
            return super().step(task, action, key=key)
        finally:
            with cls.lock:
                cls.inflight -= 1


def _cfg(policy_dir, **kw):
    base = dict(env=f"{__name__}:HangingCalculator", policy=str(policy_dir), groups=6, group_size=4, seed=3,
                run_id="hang", spool_fsync=False, tool_timeout_s=0.5, tool_concurrency=3)
    base.update(kw)
    return RolloutConfig(**base)


def test_hanging_tool_costs_its_episode_not_the_run(lake, policy_dir):
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(s=run_rollout(lake, _cfg(policy_dir))), daemon=True)
    t.start()
    t.join(timeout=300)            # liveness, not speed: a blocked worker would never return
    assert not t.is_alive(), "the run is blocked behind a hung tool call"
    s = box["s"]
    rows = lake.read("trajectories").to_pylist()
    ids = [r["trajectory_id"] for r in rows]
    planned = {f"hang-g{k}-{j}" for k in range(6) for j in range(4)}
    assert sorted(ids) == sorted(planned), "a trajectory was lost or landed twice"
    timed_out = [r for r in rows if r["stop_reason"] == "env_timeout"]
    assert timed_out and s.tools_abandoned == len(timed_out) == len(HangingCalculator.hung)
    assert all(r["status"] == "INFRA_FAILED" and r["verdict"] == "ENV_ERROR" and r["reward"] is None
               for r in timed_out)
    assert {f"{r['trajectory_id']}/a{r['num_turns'] - 1}" for r in timed_out} == set(HangingCalculator.hung)
    assert 1 < HangingCalculator.peak <= 3          # concurrent, within the bound
    ev = lake.read("events").to_pylist()
    term = {e["episode_id"]: json.loads(e["payload"]) for e in ev if e["event_type"] == "TERMINAL"}
    assert all("deadline" in term[r["trajectory_id"]]["error"] for r in timed_out)
    assert not any(e["event_type"] == "ACTION_EXECUTED" and json.loads(e["payload"])["output"] == "late" for e in ev)


def test_retries_resample_failed_members_within_budget(lake, policy_dir):
    from pipeline.query.duck import query
    from pipeline.resources import sql_path

    s = run_rollout(lake, RolloutConfig(env="arithmetic-tool", policy=str(policy_dir), groups=6, group_size=4, seed=3,
                                        run_id="rt", spool_fsync=False, verifier_error_p=0.4,
                                        retry_group_budget=2, retry_run_budget=7))
    rows = lake.read("trajectories").to_pylist()
    retries = [r for r in rows if "-r" in r["trajectory_id"].rsplit("-g", 1)[1]]
    assert 0 < len(retries) == s.retries <= 7
    per_group: dict[str, int] = {}
    for r in retries:
        per_group[r["group_id"]] = per_group.get(r["group_id"], 0) + 1
        assert r["trajectory_id"].startswith(r["group_id"] + "-r") and r["group_size"] == 4
    assert max(per_group.values()) <= 2
    assert len(rows) == 24 + len(retries) and len({r["trajectory_id"] for r in rows}) == len(rows)
    ev = lake.read("events").to_pylist()
    created = {e["episode_id"]: json.loads(e["payload"]) for e in ev if e["event_type"] == "CREATED"}
    status = {r["trajectory_id"]: r for r in rows}
    for r in retries:
        src = created[r["trajectory_id"]]["retry_of"]
        assert status[src]["group_id"] == r["group_id"]
        assert status[src]["status"] == "INFRA_FAILED" or status[src]["verdict"] == "UNKNOWN"
    failed = sum(1 for r in rows if r["status"] == "INFRA_FAILED" or r["verdict"] == "UNKNOWN")
    assert s.retries + s.retries_denied == failed
    amp = query(lake, sql_path("retry_amplification").read_text(), params={"run_id": "rt"}).to_pylist()
    assert len(amp) == 1 and amp[0]["planned"] == 24 and amp[0]["retries"] == len(retries)
    assert abs(amp[0]["amplification"] - (24 + len(retries)) / 24) < 1e-12
    assert amp[0]["recovered"] == sum(1 for r in retries if r["reward"] is not None)


def test_deadline_precedence_run_then_environment_then_default():
    from pipeline.rollout.engine import Sampling
    from pipeline.rollout.harness import DEFAULT_TOOL_TIMEOUT_S, Harness
    from pipeline.rollout.settings import Limits

    class Declares(ArithmeticTool):
        tool_timeout_s = 7.0

    def deadline(env, run_value):
        return Harness(env, lambda: None, None, run_id="r", worker_id="w", sampling=Sampling(),
                       limits=Limits(tool_timeout_s=run_value)).tool_timeout()

    assert deadline(ArithmeticTool(), 0.0) == DEFAULT_TOOL_TIMEOUT_S
    assert deadline(Declares(), 0.0) == 7.0                 # the environment's own deadline
    assert deadline(Declares(), 2.5) == 2.5                 # the run's setting wins


def teardown_module():
    RELEASE.set()


def test_retry_only_while_the_groups_policy_is_still_served():
    from pipeline.rollout.envs import Task
    from pipeline.rollout.harness import Episode
    from pipeline.rollout.plan import plan_retries
    from pipeline.rollout.summary import RolloutSummary

    class Recorder:
        def __init__(self):
            self.made = []

        def new_episode(self, **kw):
            self.made.append(kw)
            return kw["episode_id"]

    task = Task("t", "1+1=")
    ok = Episode(episode_id="g-0", group_id="g", group_size=2, task=task, seed=0, prompt_ids=[1], policy_version=2)
    ok.status, ok.verdict = "ACCEPTED", "PASS"
    bad = Episode(episode_id="g-1", group_id="g", group_size=2, task=task, seed=0, prompt_ids=[1], policy_version=2)
    bad.status, bad.verdict = "INFRA_FAILED", "ENV_ERROR"
    cfg = RolloutConfig(retry_group_budget=2, retry_run_budget=10)
    for served, expect in ((3, []), (2, ["g-r0"])):
        rec, summary = Recorder(), RolloutSummary("r", "e", "hf")
        out, left = plan_retries(cfg, rec, lambda v=served: (None, v), {"g": (0, task)}, {}, [ok, bad], [ok, bad], 10,
                                  summary)
        assert out == expect and left == 10 - len(expect)
        assert summary.retries_denied == (1 if served == 3 else 0)   # a newer policy: not comparable, no retry
        if expect:
            assert rec.made[0]["extra"] == {"retry_of": "g-1", "retry": 0} and rec.made[0]["policy_version"] == 2
