"""Continuous mode (``follow``): rounds of groups with no barrier between them (the
engine works on the next round while a round's tail runs), and a SIGTERM that
stops new groups while every episode in flight finishes and lands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from pipeline.rollout.engine import derive_seed
from pipeline.rollout.envs.arithmetic import ArithmeticTool
from pipeline.rollout.run import RolloutConfig, run_rollout

SEED, G = 2, 2
LATER = threading.Event()        # a verification of round 2 or 3 happened


def _task_ids(ks) -> set[str]:
    return {ArithmeticTool().reset(derive_seed(SEED, "task", k), "train").task_id for k in ks}


class TailTool(ArithmeticTool):
    """Group 0's verifications wait (up to 60 s) until a later round's verification ran:
    round 1's tail lasts until the engine has worked on round 2."""

    name = "test-tail-tool"
    tail: list[str] = []

    def verify(self, task, answer, num_tool_calls):
        if task.task_id in _task_ids([0]):
            type(self).tail.append(task.task_id)
            LATER.wait(60)
        elif task.task_id in _task_ids(range(2, 6)):
            LATER.set()
        return super().verify(task, answer, num_tool_calls)


def test_continuous_mode_runs_the_next_round_during_a_rounds_tail(lake, policy_dir):
    cfg = RolloutConfig(env=f"{__name__}:TailTool", policy=str(policy_dir), groups=2, group_size=G, seed=SEED,
                        run_id="cont", spool_fsync=False, follow=True, rounds=3, groups_per_wave=3,
                        verify_timeout_s=600)
    s = run_rollout(lake, cfg)
    assert TailTool.tail                                  # group 0 did reach its verifier
    assert s.rounds == 3 and s.trajectories == s.landed == 3 * 2 * G
    rows = lake.read("trajectories", filter=ds.field("run_id") == "cont").to_pylist()
    assert {r["group_id"] for r in rows} == {f"cont-g{k}" for k in range(6)}   # the next indices each round
    ev = lake.read("events", filter=ds.field("run_id") == "cont").to_pylist()
    term = {e["episode_id"]: e["created_at"] for e in ev if e["event_type"] == "TERMINAL"}
    g0_end = max(t for e, t in term.items() if e.startswith("cont-g0-"))
    later = [t for e, t in term.items() if e.rsplit("-", 1)[0] in {f"cont-g{k}" for k in range(2, 6)}]
    assert min(later) < g0_end                            # no barrier: round 2 ended episodes during round 1's tail
    assert all(r["status"] in ("ACCEPTED", "REJECTED") for r in rows)


def test_follow_refuses_redundancy_and_an_unbounded_multi_worker_run():
    from pipeline.errors import ConfigError
    from pipeline.rollout.config import check_config

    with pytest.raises(ConfigError, match="group_redundancy"):
        check_config(RolloutConfig(follow=True, group_redundancy=0.5))
    with pytest.raises(ConfigError, match="rounds or stop_file"):
        check_config(RolloutConfig(follow=True, workers=2))
    with pytest.raises(ConfigError, match="group_redundancy must be >= 0"):
        check_config(RolloutConfig(group_redundancy=-1))


@pytest.mark.slow
def test_sigterm_stops_new_groups_and_lands_every_episode_in_flight(lake, policy_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.Popen([sys.executable, "-m", "pipeline", "rollout", "--lake", lake.uri, "--policy", str(policy_dir),
                          "--follow", "--groups", "2", "--group-size", "2", "--run-id", "term", "--json",
                          "--set", "flush_seconds=0.2", "--set", "spool_fsync=false"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (Path(lake.uri) / "trajectories" / "_delta_log").exists():
            assert p.poll() is None, p.stderr.read()[-2000:]
            time.sleep(0.2)
        time.sleep(1.0)                                   # a few rounds in
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-2000:]
    s = json.loads(out.strip().splitlines()[-1])
    assert s["rounds"] >= 2
    ev = lake.read("events", filter=ds.field("run_id") == "term").to_pylist()
    created = {e["episode_id"] for e in ev if e["event_type"] == "CREATED"}
    terminals = Counter(e["episode_id"] for e in ev if e["event_type"] == "TERMINAL")
    assert set(terminals) == created and max(terminals.values()) == 1     # nothing left half-done
    rows = lake.read("trajectories", filter=ds.field("run_id") == "term").to_pylist()
    assert {r["trajectory_id"] for r in rows} == created
    assert s["trajectories"] == s["landed"] == len(rows)
