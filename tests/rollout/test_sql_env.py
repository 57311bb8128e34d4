"""Issue 41: the observation budget and a stateful environment (sql-agent): a
verbose tool is cut with a marker and never the policy's failure; each episode
starts from a content-addressed snapshot recorded in its trajectory, writes only
its own copy, and a crashed episode resumes from the snapshot to the same
trajectory; admission refuses a group whose members started from different states."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline import vocab
from pipeline.rollout.engine import Sampling
from pipeline.rollout.envs.sql import SqlAgent
from pipeline.rollout.harness import Harness
from pipeline.rollout.settings import Faults, Limits
from pipeline.rollout.spool import Spool
from pipeline.testing.scripted import Scripted


def _harness(env, engine, spool_dir, limits=Limits(max_turns=4, max_tokens_per_turn=64, max_total_tokens=256),
             faults=Faults()):
    spool = Spool(spool_dir, "w", fsync=False)
    return Harness(env, lambda: (engine, 0), spool, run_id="sql", worker_id="w",
                   sampling=Sampling(1.0, 1.0, 64), limits=limits, faults=faults), spool


def _episode(h, task, eid="sql-g0-0"):
    return h.new_episode(episode_id=eid, group_id="g0", group_size=1, task=task, seed=3, policy_version=0)


def test_verbose_tool_is_truncated_with_a_marker_and_never_the_policys_failure(tmp_path):
    env = SqlAgent(store=tmp_path / "store")
    task = env.reset(1)
    verbose = Scripted(["<call>select * from orders</call>", f"<ans>{task.answer}<eos>"])
    # no observation budget (the default): 60 rows take the episode past max_total_tokens through the tool
    # alone: an environment outcome with a null reward (it was REJECTED / max_length / 0.0 before issue 41)
    h, _ = _harness(env, verbose, tmp_path / "a")
    ep = _episode(h, task)
    h.run([ep])
    assert (ep.status, ep.verdict, ep.stop_reason, ep.reward) == ("INFRA_FAILED", "ENV_ERROR", "obs_budget", None)
    # a per-turn cap: the output is cut to 40 observation tokens, the marker says so, the policy answers
    lim = Limits(max_turns=4, max_tokens_per_turn=64, max_total_tokens=64, max_obs_tokens_per_turn=40)
    h, spool = _harness(env, verbose, tmp_path / "b", lim)
    ep = _episode(h, task)
    h.run([ep])
    assert (ep.status, ep.verdict, ep.reward) == ("ACCEPTED", "PASS", 1.0)
    obs = [t for t, m in zip(ep.response_ids, ep.mask) if m == 0]
    assert len(obs) == 40 and vocab.decode(obs).startswith("<obs>1,")
    full = len(vocab.encode(env._run(env.snapshot_path(task.meta["snapshot"]), "select * from orders"))) + 2
    executed = [json.loads(r["payload"]) for r in spool.records() if r.get("event_type") == "ACTION_EXECUTED"]
    cut = executed[0]["truncated"]
    assert cut["keep"] == "head" and cut["of"] == full and cut["tokens"] > full - 40
    assert vocab.decode(obs).endswith(f"...(truncated {cut['tokens']} tokens)</obs>")
    assert executed[0]["output"] == vocab.decode(obs[1:-1])
    # keep the tail instead; and an episode budget spent: an environment outcome again
    h, _ = _harness(env, verbose, tmp_path / "c", Limits(max_turns=4, max_tokens_per_turn=64, max_total_tokens=64,
                                                       max_obs_tokens_per_turn=40, obs_keep="tail"))
    ep = _episode(h, task)
    h.run([ep])
    assert vocab.decode([t for t, m in zip(ep.response_ids, ep.mask) if m == 0]).startswith("<obs>...(truncated")
    h, _ = _harness(env, verbose, tmp_path / "d", Limits(max_turns=4, max_tokens_per_turn=64, max_total_tokens=64,
                                                       max_obs_tokens=10))
    ep = _episode(h, task)
    h.run([ep])
    assert (ep.status, ep.verdict, ep.stop_reason, ep.reward) == ("INFRA_FAILED", "ENV_ERROR", "obs_budget", None)


def test_episodes_start_from_the_snapshot_and_write_only_their_own_copy(tmp_path):
    env = SqlAgent(store=tmp_path / "store")
    task = env.reset(2)
    state = task.meta["snapshot"]
    snap = env.snapshot_path(state)
    assert snap.name == f"{state}.sqlite" and len(state) == 64
    assert env.open("e1", task) == env.open("e2", task) == state
    n = env.step(task, "select count(*) from orders", key="e2/a0")
    assert env.step(task, "delete from orders", key="e1/a0") == ""
    assert env.step(task, "select count(*) from orders", key="e1/a0") == "0"
    assert env.step(task, "select count(*) from orders", key="e2/a1") == n == "60"   # not visible to e2
    from pipeline.rollout.envs.sql import file_hash

    assert file_hash(snap) == state                      # the snapshot itself is untouched
    env.close("e1")
    assert not (tmp_path / "store" / "episodes" / "e1.sqlite").exists()
    # the harness records the state in the trajectory and closes the episode's copy when it ends
    h, spool = _harness(env, Scripted(["<call>delete from orders</call>", f"<ans>{task.answer}<eos>"]),
                        tmp_path / "s")
    ep = _episode(h, task, "e3")
    h.run([ep])
    row = next(r for r in spool.records() if r["kind"] == "trajectory")
    assert row["env_state_hash"] == state and row["reward"] == 1.0
    assert not (tmp_path / "store" / "episodes" / "e3.sqlite").exists()


CRASH = """
import sys
sys.path.insert(0, sys.argv[3])
from test_sql_env import SqlAgent, Scripted, _harness, _episode, TURNS, Faults
env = SqlAgent(store=sys.argv[1])
task = env.reset(4)
h, spool = _harness(env, Scripted(TURNS(task)), sys.argv[2], faults=Faults(kill_after_executed=2))
h.run([_episode(h, task)])
"""


def TURNS(task):
    # two writes, then a read whose result depends on both having been applied exactly once
    return ["<call>insert into orders values (100, 1, 1, 1)</call>", "<call>insert into orders values (101, 1, 1, 1)"
            "</call>", "<call>select count(*) from orders</call>", f"<ans>{task.answer}<eos>"]


def test_a_crashed_sql_episode_resumes_from_its_snapshot_to_the_same_trajectory(tmp_path):
    from pipeline.rollout.recovery import rebuild

    store = tmp_path / "store"
    env = SqlAgent(store=store)
    task = env.reset(4)
    h, spool = _harness(env, Scripted(TURNS(task)), tmp_path / "ref")
    h.run([_episode(h, task)])
    ref = next(r for r in spool.records() if r["kind"] == "trajectory")
    assert "62" in vocab.decode(ref["response_ids"])
    crashed = subprocess.run([sys.executable, "-c", CRASH, str(store), str(tmp_path / "crash"),
                              str(Path(__file__).resolve().parent)], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    copy = store / "episodes" / "sql-g0-0.sqlite"
    assert copy.exists()            # the crashed episode's copy holds both writes
    import shutil

    # resume here (the crashed copy, both writes applied, left behind), then elsewhere (no copy at all)
    for keep_copy in (True, False):
        spool_dir = tmp_path / f"resume-{keep_copy}"
        shutil.copytree(tmp_path / "crash", spool_dir)
        h, spool = _harness(SqlAgent(store=store), Scripted(TURNS(task)), spool_dir)
        state = rebuild(spool.records(), {"sql-g0-0": (task, "g0", 1)})
        ep = state["sql-g0-0"]
        assert ep is not None and ep.env_state_hash == task.meta["snapshot"] and ep.replay
        h.run([ep])
        row = next(r for r in spool.records() if r["kind"] == "trajectory")
        same = ("response_ids", "loss_mask", "status", "verdict", "reward", "env_state_hash", "num_tool_calls")
        assert {k: row[k] for k in same} == {k: ref[k] for k in same}
        assert not copy.exists()    # closed once the episode ended
    # a snapshot whose bytes changed cannot be the recorded state: the episode ends an environment outcome
    snap = store / "snapshots" / f"{task.meta['snapshot']}.sqlite"
    snap.write_bytes(snap.read_bytes() + b"\0")
    shutil.copytree(tmp_path / "crash", tmp_path / "resume-tampered")
    h, spool = _harness(SqlAgent(store=store), Scripted(TURNS(task)), tmp_path / "resume-tampered")
    ep = rebuild(spool.records(), {"sql-g0-0": (task, "g0", 1)})["sql-g0-0"]
    h.run([ep])
    assert (ep.status, ep.verdict, ep.reward) == ("INFRA_FAILED", "ENV_ERROR", None)
