"""Carried stragglers (``straggler_policy=carry``, continuous mode with
``group_redundancy``): once a round has its N complete groups, the episodes still
running go on into the next round as partial rollouts. A newer policy does not
wait for them; their later tokens carry its version, the earlier ones keep theirs;
nothing is lost or counted as a policy failure, admission judges them by its
usual rules, and a kill -9 leaves every event exactly once."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from pipeline.admission.rules import member_exclusion
from pipeline.rollout.envs.arithmetic import ArithmeticTool
from pipeline.rollout.run import RolloutConfig, run_rollout

HUNG = threading.Event()         # the straggler's first tool call was reached
RELEASED = threading.Event()     # ... and answered, after the newer policy sampled a turn


class HangOnceTool(ArithmeticTool):
    """The calculator whose first call in the run answers only once the spool shows a
    turn sampled by policy version 1: its episode straggles across the weight switch."""

    name = "test-hang-once-tool"
    spool_dir = ""
    hung: list[str] = []
    lock = threading.Lock()

    def step(self, task, action, *, key):
        cls = type(self)
        with cls.lock:
            first = not cls.hung
            if first:
                cls.hung.append(key.split("/")[0])
        if first:
            HUNG.set()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not _sampled_by(cls.spool_dir, 1):
                time.sleep(0.05)
            RELEASED.set()
        return super().step(task, action, key=key)


def _sampled_by(spool_dir: str, version: int) -> bool:
    for f in Path(spool_dir).glob("*.spool.jsonl"):
        for line in f.read_text().splitlines():
            if '"event_type":"GENERATING"' in line and f'"policy_version":{version},' in line:
                return True
    return False


def test_carry_needs_continuous_mode_and_redundancy_and_follow_redundancy_needs_carry():
    from pipeline.errors import ConfigError
    from pipeline.rollout.config import check_config

    with pytest.raises(ConfigError, match="straggler_policy=carry"):
        check_config(RolloutConfig(follow=True, group_redundancy=0.5))
    for cfg in (RolloutConfig(straggler_policy="carry", group_redundancy=0.5),
                RolloutConfig(straggler_policy="carry", follow=True)):
        with pytest.raises(ConfigError, match="needs follow and group_redundancy"):
            check_config(cfg)
    check_config(RolloutConfig(follow=True, group_redundancy=0.5, straggler_policy="carry"))


def test_a_carried_straggler_goes_on_under_the_newer_policy_and_keeps_its_versions(lake, published, tmp_path):
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit

    published(0)
    stop = tmp_path / "stop"
    HangOnceTool.spool_dir = str(tmp_path / "spool")
    cfg = RolloutConfig(env=f"{__name__}:HangOnceTool", policy="latest", follow_latest=True, follow=True,
                        stop_file=str(stop), groups=2, group_size=2, group_redundancy=0.5, straggler_policy="carry",
                        seed=3, run_id="carry", spool_dir=HangOnceTool.spool_dir, spool_fsync=False,
                        groups_per_wave=3, max_total_tokens=128, tool_timeout_s=600)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(s=run_rollout(lake, cfg)), daemon=True)
    t.start()
    try:
        assert HUNG.wait(120), "no episode called its tool"
        published(1)                                   # a trainer publishes while the straggler waits
        assert RELEASED.wait(120), "the newer policy sampled no turn while the straggler waited"
    finally:
        stop.touch()                                   # no new round; the episodes in flight finish and land
    t.join(timeout=300)
    assert not t.is_alive() and "s" in box
    s = box["s"]
    assert s.carried >= 1 and s.cancelled == 0 and s.policy_versions == [0, 1]
    rows = lake.read("trajectories", filter=ds.field("run_id") == "carry").to_pylist()
    ev = lake.read("events", filter=ds.field("run_id") == "carry").to_pylist()
    created = {e["episode_id"] for e in ev if e["event_type"] == "CREATED"}
    terminals = Counter(e["episode_id"] for e in ev if e["event_type"] == "TERMINAL")
    # nothing lost: every launched episode ended once and landed once
    assert set(terminals) == created and max(terminals.values()) == 1
    assert sorted(r["trajectory_id"] for r in rows) == sorted(created)
    straggler = next(r for r in rows if r["trajectory_id"] == HangOnceTool.hung[0])
    # its tokens from before the switch keep version 0, those after carry 1; observations -1
    tpv = straggler["token_policy_versions"]
    assert len(tpv) == len(straggler["response_ids"]) and straggler["policy_version"] == 0
    sampled = [v for v, m in zip(tpv, straggler["loss_mask"]) if m]
    assert sampled[0] == 0 and sampled[-1] == 1 and sampled == sorted(sampled)
    assert all(v == -1 for v, m in zip(tpv, straggler["loss_mask"]) if not m)
    # an outcome of the policy, never an infrastructure verdict on it, and never cancelled
    assert straggler["stop_reason"] != "cancelled" and straggler["status"] in ("ACCEPTED", "REJECTED")
    assert member_exclusion(straggler["status"], straggler["verdict"], straggler["reward"]) is None

    def reason(max_policy_lag: int):
        r = admit(lake, AdmissionConfig(max_policy_lag=max_policy_lag), current_policy_version=1, dry_run=True,
                  command="test")
        for excluded in r.receipts.column("excluded_members").to_pylist():
            for eid, why in excluded or []:
                if eid == straggler["trajectory_id"]:
                    return why
        return None

    # admission's lag rule reads the oldest sampled token (version 0): within a lag of 1, stale at 0
    assert reason(1) is None and reason(0) == "stale_policy"


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
class HungVerifier(ArithmeticTool):      # groups 4 and 5 (round 1's spares) never get a verdict: they straggle
    name = "test-hung-verifier-carry"
    def verify(self, task, answer, num_tool_calls):
        if task.task_id in {self.reset(derive_seed(5, "task", k), "train").task_id for k in (4, 5)}:
            NEVER.wait()
        return super().verify(task, answer, num_tool_calls)

cfg = RolloutConfig(env="test-hung-verifier-carry", policy=policy, groups=4, group_size=4, seed=5,
                    run_id="carry-crash", tool_log=log, kill_after_executed=kill, group_redundancy=0.5,
                    straggler_policy="carry", follow=True, rounds=2, flush_rows=1, verify_timeout_s=600,
                    groups_per_wave=6)   # one round's groups in flight: round 2 starts as round 1's complete
s = run_rollout(Lake(lake_uri), cfg)
print("SUMMARY", s.trajectories, s.resumed, s.cancelled, s.carried, s.groups_complete, s.rounds)
"""


@pytest.mark.slow
def test_carried_stragglers_are_exactly_once_under_a_kill(lake, killed_then_rerun):
    log, out = killed_then_rerun(SCRIPT)
    _, resumed, cancelled, carried, complete, rounds = out.split("SUMMARY")[1].split()
    # round 1 closes at 4 complete groups and carries its hung spares; the last round cancels what is left
    assert int(resumed) >= 1 and int(carried) >= 1 and int(cancelled) >= 1 and int(complete) >= 8
    assert int(rounds) == 2
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
    for r in rows:
        if r["stop_reason"] == "cancelled":                      # recorded, never a policy failure
            assert r["status"] == "EXPIRED" and r["reward"] is None
            assert member_exclusion(r["status"], r["verdict"], r["reward"]) == "expired"
        assert len(r["token_policy_versions"]) == len(r["response_ids"])
    hung = [p for e, p in term.items() if e.rsplit("-", 1)[0] in {f"carry-crash-g{k}" for k in (4, 5)}]
    assert hung and not any(p["status"] == "ACCEPTED" for p in hung)    # their verifier never answered
    assert any(p["stop_reason"] == "cancelled" for p in hung)            # carried to the last round, then cancelled
    observed = {f"{e['episode_id']}/{e['action_id']}" for e in events if e["event_type"] == "OBSERVATION_PERSISTED"}
    assert all(k in observed or term[k.split("/")[0]]["stop_reason"] == "cancelled" for k in executed)
    assert sum(r["num_tool_calls"] for r in rows) == len(observed) <= len(executed)
