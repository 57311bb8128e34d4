"""Tool and verifier pools sized for I/O (bounded by a cap and the environment's
declared limit, with the time calls waited for a slot in the summary), and
over-provisioned groups (``group_redundancy``): the run finishes once N groups
are complete and the stragglers are cancelled: recorded, never a policy
failure, their per-token versions kept, exactly once under a kill."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pyarrow.dataset as ds
import pytest

from pipeline.admission.rules import member_exclusion
from pipeline.rollout.engine import derive_seed
from pipeline.rollout.envs.arithmetic import ArithmeticTool
from pipeline.rollout.run import RolloutConfig, run_rollout
from pipeline.rollout.settings import POOL_CAP, pool_size
from pipeline.rollout.summary import bound_by

RELEASE = threading.Event()      # set at the end of the module: the hung calls' threads then exit
SEED, GROUPS, G, R = 4, 4, 3, 0.5
HUNG = (4, 5)                    # the groups whose tool and verifier calls never answer


def teardown_module():
    RELEASE.set()


def _task_id(k: int) -> str:
    return ArithmeticTool().reset(derive_seed(SEED, "task", k), "train").task_id


class SerialTool(ArithmeticTool):
    """The calculator, declaring one tool call at a time; each call takes 100 ms and
    counts how many ran at once."""

    name = "test-serial-tool"
    max_tool_concurrency = 1
    lock = threading.Lock()
    inflight = peak = 0

    def step(self, task, action, *, key):
        cls = type(self)
        with cls.lock:
            cls.inflight += 1
            cls.peak = max(cls.peak, cls.inflight)
        try:
            time.sleep(0.1)
            return super().step(task, action, key=key)
        finally:
            with cls.lock:
                cls.inflight -= 1


class StragglerTool(ArithmeticTool):
    """The calculator whose tool and verifier never answer for the tasks of the
    ``HUNG`` groups: those groups cannot complete, the others can."""

    name = "test-straggler-tool"
    hung: list[str] = []

    def _hang(self, task):
        if task.task_id in {_task_id(k) for k in HUNG}:
            type(self).hung.append(task.task_id)
            RELEASE.wait()

    def step(self, task, action, *, key):
        self._hang(task)
        return super().step(task, action, key=key)

    def verify(self, task, answer, num_tool_calls):
        self._hang(task)
        return super().verify(task, answer, num_tool_calls)


def test_pool_size_follows_the_episodes_in_flight_within_cap_and_declared_limit():
    assert pool_size(0, 64) == 64                         # auto: one thread per episode in flight
    assert pool_size(0, 0) == POOL_CAP                    # unbounded in-flight: the cap
    assert pool_size(0, 10 * POOL_CAP) == POOL_CAP
    assert pool_size(0, 64, 3) == 3                       # the environment's declared limit bounds it
    assert pool_size(8, 64, 3) == 3                       # ... even an explicit request
    assert pool_size(8, 64, None) == 8 and pool_size(8, 2, 0) == 8
    assert bound_by(2.0, {"tool": 5.0, "verify": 0.1}) == "tool_pool"
    assert bound_by(2.0, {"tool": 1.0, "verify": 0.1}) == "engine"
    assert bound_by(0.0, {}) == "engine"


def test_a_declared_limit_bounds_the_pool_and_the_summary_measures_the_slot_waits(lake, policy_dir):
    s = run_rollout(lake, RolloutConfig(env=f"{__name__}:SerialTool", policy=str(policy_dir), groups=4, group_size=4,
                                        seed=1, run_id="serial", spool_fsync=False, groups_per_wave=4))
    assert s.pool_bounds == {"tool": 1, "verify": 16}     # declared 1; verifiers auto: 4 groups x 4 in flight
    assert SerialTool.peak == 1 and s.tool_executions >= 2
    assert s.pool_wait_s["tool"] > 0                      # calls queued behind the single slot
    assert s.bound_by == bound_by(s.engine_busy_s, s.pool_wait_s)


def _check_no_policy_failure(rows, term):
    cancelled = {e for e, p in term.items() if p["stop_reason"] == "cancelled"}
    for r in rows:
        if r["stop_reason"] != "cancelled":
            continue
        assert r["status"] == "EXPIRED" and r["verdict"] == "UNKNOWN" and r["reward"] is None
        assert member_exclusion(r["status"], r["verdict"], r["reward"]) == "expired"   # never a policy failure
        # per-token versions kept: one per response token, the sampling version on policy tokens
        assert len(r["token_policy_versions"]) == len(r["response_ids"])
        assert all(v == r["policy_version"] for v, m in zip(r["token_policy_versions"], r["loss_mask"]) if m)
    return cancelled


def test_over_provisioned_groups_finish_at_n_complete_and_cancel_the_stragglers(lake, policy_dir):
    cfg = RolloutConfig(env=f"{__name__}:StragglerTool", policy=str(policy_dir), groups=GROUPS, group_size=G,
                        seed=SEED, run_id="spare", spool_fsync=False, tool_timeout_s=600, verify_timeout_s=600,
                        group_redundancy=R, retry_group_budget=1)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(s=run_rollout(lake, cfg)), daemon=True)
    t.start()
    t.join(timeout=300)          # liveness: the run does not wait for its stragglers
    assert not t.is_alive(), "the run waited for its stragglers"
    s = box["s"]
    assert StragglerTool.hung                             # the hung groups did reach a call
    launched = GROUPS + 2
    rows = lake.read("trajectories", filter=ds.field("run_id") == "spare").to_pylist()
    ev = lake.read("events", filter=ds.field("run_id") == "spare").to_pylist()
    created = {e["episode_id"] for e in ev if e["event_type"] == "CREATED"}
    terminals = Counter(e["episode_id"] for e in ev if e["event_type"] == "TERMINAL")
    term = {e["episode_id"]: json.loads(e["payload"]) for e in ev if e["event_type"] == "TERMINAL"}
    # nothing lost: every launched episode ended exactly once, and has a row unless cancelled before a token
    assert len(created) == launched * G and set(terminals) == created and max(terminals.values()) == 1
    assert {r["trajectory_id"] for r in rows} == {e for e, p in term.items() if p.get("row", True)}
    cancelled = _check_no_policy_failure(rows, term)
    assert s.cancelled == len(cancelled) >= 1 and s.groups_complete == GROUPS
    by_group: dict[str, list[str]] = {}
    for e, p in term.items():
        by_group.setdefault(e.rsplit("-", 1)[0], []).append(p["stop_reason"])
    complete = [g for g, stops in by_group.items() if "cancelled" not in stops]
    assert len(complete) == GROUPS                        # N comparable groups, every member ended on its own
    assert {f"spare-g{k}" for k in HUNG} <= {g for g in by_group if g not in complete}
    # a cancelled member is never retried
    assert not any(json.loads(e["payload"]).get("retry_of") in cancelled for e in ev
                   if e["event_type"] == "CREATED" and e["payload"])


def test_no_redundancy_launches_exactly_the_groups():
    from pipeline.rollout.plan import launched_groups

    assert launched_groups(RolloutConfig(groups=8)) == 8
    assert launched_groups(RolloutConfig(groups=8, group_redundancy=0.25)) == 10
    assert launched_groups(RolloutConfig(groups=3, group_redundancy=0.1)) == 4


SCRIPT = """
import sys, threading
from pipeline.lake.delta import Lake
from pipeline.rollout.engine import derive_seed
from pipeline.rollout.envs import register_env
from pipeline.rollout.envs.arithmetic import ArithmeticTool
from pipeline.rollout.run import RolloutConfig, run_rollout
lake_uri, policy, log, kill = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
NEVER = threading.Event()

@register_env
class HungVerifier(ArithmeticTool):      # groups 4 and 5 never get a verdict: they straggle
    name = "test-hung-verifier"
    def verify(self, task, answer, num_tool_calls):
        if task.task_id in {self.reset(derive_seed(5, "task", k), "train").task_id for k in (4, 5)}:
            NEVER.wait()
        return super().verify(task, answer, num_tool_calls)

cfg = RolloutConfig(env="test-hung-verifier", policy=policy, groups=4, group_size=4, seed=5, run_id="spare-crash",
                    tool_log=log, kill_after_executed=kill, group_redundancy=0.5, flush_rows=1,
                    verify_timeout_s=600)
s = run_rollout(Lake(lake_uri), cfg)
print("SUMMARY", s.trajectories, s.resumed, s.cancelled, s.groups_complete)
"""


@pytest.mark.slow
def test_over_provisioned_run_is_exactly_once_under_a_kill(lake, killed_then_rerun):
    log, out = killed_then_rerun(SCRIPT)
    _, resumed, cancelled, complete = out.split("SUMMARY")[1].split()
    assert int(resumed) >= 1 and int(cancelled) >= 1 and int(complete) == 4
    executed = log.read_text().split()
    assert len(executed) == len(set(executed))                   # no tool call ran twice
    events = lake.read("events", columns=["episode_id", "step_id", "action_id", "event_type", "payload"]).to_pylist()
    keys = Counter((e["episode_id"], e["step_id"], e["action_id"], e["event_type"]) for e in events)
    assert max(keys.values()) == 1                               # each event landed once
    created = {e["episode_id"] for e in events if e["event_type"] == "CREATED"}
    term = {e["episode_id"]: json.loads(e["payload"]) for e in events if e["event_type"] == "TERMINAL"}
    assert set(term) == created                                  # every launched episode ended, once
    rows = lake.read("trajectories").to_pylist()
    assert len({r["trajectory_id"] for r in rows}) == len(rows)
    assert {r["trajectory_id"] for r in rows} == {e for e, p in term.items() if p.get("row", True)}
    _check_no_policy_failure(rows, term)
    by_group: dict[str, list[str]] = {}
    for e, p in term.items():
        by_group.setdefault(e.rsplit("-", 1)[0], []).append(p["stop_reason"])
    assert sum("cancelled" not in stops for stops in by_group.values()) >= 4   # N complete groups
    # every executed call is observed, except one a cancellation abandoned while it ran (its episode cancelled)
    observed = {f"{e['episode_id']}/{e['action_id']}" for e in events if e["event_type"] == "OBSERVATION_PERSISTED"}
    assert all(k in observed or term[k.split("/")[0]]["stop_reason"] == "cancelled" for k in executed)
    assert sum(r["num_tool_calls"] for r in rows) == len(observed) <= len(executed)


def test_over_provisioning_changes_no_sample_of_the_groups_it_keeps(lake, policy_dir):
    """The complete groups among the first N are the very trajectories an r = 0 run samples."""
    def rows(run_id, r):
        run_rollout(lake, RolloutConfig(policy=str(policy_dir), groups=3, group_size=3, seed=6, run_id=run_id,
                                        spool_fsync=False, group_redundancy=r))
        return lake.read("trajectories", filter=ds.field("run_id") == run_id).to_pylist()

    plain = {r["trajectory_id"].split("-g", 1)[1]: r for r in rows("plain", 0.0)}
    spare = rows("spare2", 0.67)
    assert len(plain) == 9 and {r["group_id"] for r in spare} >= {f"spare2-g{k}" for k in range(3)}
    spoiled = {r["group_id"] for r in spare if r["stop_reason"] == "cancelled"}
    kept = [r for r in spare if r["group_id"] not in spoiled and int(r["group_id"].rsplit("-g", 1)[1]) < 3]
    assert kept
    for r in kept:
        p = plain[r["trajectory_id"].split("-g", 1)[1]]
        assert (r["response_ids"], r["reward"], r["token_policy_versions"]) == \
               (p["response_ids"], p["reward"], p["token_policy_versions"])
