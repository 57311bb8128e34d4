"""The event loop: hand-computed timelines, conservation, determinism, the bias."""

from __future__ import annotations

import math

import pytest

from pipeline.errors import ConfigError
from pipeline.sim.config import load_sim_config
from pipeline.sim.engine import Simulation, simulate
from pipeline.sim.metrics import summarize

ONE_CLASS = {"only": {"weight": 1.0, "median_s": 10.0, "sigma": 0.0, "pass_rate": 0.5, "n_tasks": 1}}


def tiny(**kw):
    """2 workers, groups of 2, every trajectory exactly 10 s, step 5 s, sync 1 s, 60 s simulated."""
    base = dict(workers=2, group_size=2, batch_groups=1, trainer_step_s=5.0, weight_sync_s=1.0,
                duration_h=60 / 3600, admission_interval_s=0.0, max_outstanding_groups=1,
                infra_failure_rate=0.0, task_mix=ONE_CLASS, min_valid_members=1)
    base.update(kw)
    return load_sim_config(None, base)


def run_tiny(**kw):
    sim = Simulation(tiny(**kw))
    # rewards are drawn per group; make every group 0, 1 so none is zero_variance (these tests are about time)
    orig = sim._new_group

    def new_group():
        g = orig()
        for k, i in enumerate(sim.members(g)):
            sim.reward[i] = float(k % 2)
        return g

    sim._new_group = new_group
    return sim.run()


def test_async_timeline_by_hand_max_lag_1():
    # g0 [0,10] v0 -> admitted at 10, trained 10-15, v1 published at 16
    # g1 [10,20] v0 -> lag 1 at 20, admitted, trained 20-25, v2 at 26; g2 [20,30] v1 ... every 10 s
    # g5 [50,60] completes at 60 = end: admitted and handed to the trainer at 60
    sim = run_tiny(max_policy_lag=1)
    # g6 starts at 60 (when g5 went to the trainer) and is still running at the end
    assert sim.g_decision == ["admit"] * 6 + [None]
    assert sim.version == [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert sim.steps == 5 and sim.policy_version == 5
    # idle: [0,10] + 4 s in each of [16,20] [26,30] [36,40] [46,50] [56,60]
    assert sim.trainer_idle_s == pytest.approx(30.0)
    assert sim.trainer_train_s == pytest.approx(25.0)
    assert sim.trainer_sync_s == pytest.approx(5.0)


def test_async_timeline_by_hand_max_lag_0():
    # g1 starts at 10 with v0 (v1 is published at 16), so at 20 its lag is 1 > 0: rejected;
    # g2 starts at 20 with v1, lag 0 at 30: admitted; the pattern alternates
    sim = run_tiny(max_policy_lag=0)
    assert sim.g_decision[:6] == ["admit", "insufficient_valid"] * 3
    assert sim.reason[2:4] == ["stale_policy", "stale_policy"]
    # idle [0,10] [16,30] [36,50] [56,60]
    assert sim.trainer_idle_s == pytest.approx(42.0)
    s = summarize(sim)
    assert s["trainer_idle_fraction"] == pytest.approx(42 / 60)
    assert s["rejection_rate"] == pytest.approx(0.5)  # 3 of 6 decided groups
    assert s["policy_lag_hist"] == {0: 6, 1: 6}


def test_sync_timeline_by_hand():
    # g0 [0,10] train 10-15 v1@16; g1 [16,26] train 26-31 v2@32; g2 [32,42] v3@48; g3 [48,58] trained at 58
    sim = run_tiny(mode="sync")
    assert [sim.start[i] for i in range(0, 8, 2)] == [0.0, 16.0, 32.0, 48.0]
    assert sim.g_decision == ["admit"] * 4
    assert sim.steps == 3
    assert sim.trainer_idle_s == pytest.approx(40.0)
    assert sim.trainer_train_s + sim.trainer_idle_s + sim.trainer_sync_s == pytest.approx(60.0)


def small_slow(**kw):
    return load_sim_config("slow_tasks", {"duration_h": 4.0, "workers": 128, "batch_groups": 16, **kw})


def test_same_seed_same_run_other_seed_other_run():
    a = simulate(small_slow(seed=3))
    b = simulate(small_slow(seed=3))
    c = simulate(small_slow(seed=4))
    drop = ("wall_s", "events_per_s")
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    assert a["completions"] != c["completions"] or a["admitted"] != c["admitted"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_conservation_and_gate_invariants(mode):
    cfg = small_slow(mode=mode, max_policy_lag=2, infra_failure_rate=0.05, worker_crash_per_h=0.5,
                     max_trajectory_s=1500.0, max_queue_wait_ms=1_200_000)
    sim = Simulation(cfg).run()
    s = simulate(cfg)
    G = cfg.group_size
    n = len(sim.version)
    assert n == G * len(sim.g_class)
    for g, dec in enumerate(sim.g_decision):
        idx = list(sim.members(g))
        if dec is None:
            assert all(sim.reason[i] is None for i in idx)
            continue
        assert sim.g_left[g] == 0 and sim.g_decided_at[g] >= sim.g_complete[g]
        for i in idx:
            assert sim.end[i] <= sim.g_decided_at[g]
            lag = sim.decided_version[i] - sim.version[i]
            if sim.reason[i] == "":
                assert sim.status[i] == "ACCEPTED" and sim.reward[i] is not None
                assert lag <= cfg.max_policy_lag
                assert (sim.g_decided_at[g] - sim.end[i]) * 1000 <= cfg.max_queue_wait_ms
            if sim.status[i] == "INFRA_FAILED":
                assert sim.reason[i] == "infra_failed"
            if sim.status[i] == "EXPIRED":
                assert sim.reason[i] == "expired"
                assert sim.end[i] - sim.start[i] == pytest.approx(cfg.max_trajectory_s)
        if dec == "admit":
            valid = [sim.reward[i] for i in idx if sim.reason[i] == ""]
            assert len(valid) >= cfg.min_valid_members and max(valid) > min(valid)
    # metrics = a plain loop over the records
    admitted = sum(1 for g, d in enumerate(sim.g_decision) if d == "admit"
                   for i in sim.members(g) if sim.reason[i] == "")
    assert s["admitted"] == admitted
    decided = sum(G for d in sim.g_decision if d is not None)
    assert s["decided"] == decided
    assert s["completions"] == sum(1 for e in sim.end if not math.isnan(e))
    assert s["infra_failed"] > 0 and s["expired"] > 0
    slow = cfg.slow_class
    k = [c.name for c in sim.classes].index(slow)
    slow_dec = [i for g, d in enumerate(sim.g_decision) if d is not None and sim.g_class[g] == k
                for i in sim.members(g)]
    slow_adm = [i for i in slow_dec if sim.g_decision[i // G] == "admit" and sim.reason[i] == ""]
    assert s["rejection_rate_slow"] == pytest.approx(1 - len(slow_adm) / len(slow_dec))
    assert s["trainer_idle_fraction"] + s["trainer_busy_fraction"] + s["trainer_sync_fraction"] == pytest.approx(1.0)
    assert s["trained"] <= s["admitted"] <= s["decided"] <= s["completions"] <= s["started"]
    if mode == "sync":
        assert set(s["policy_lag_hist"]) == {0}
        assert "stale_policy" not in s["per_class"][slow]["reasons"]  # stale_wait can happen: stragglers


def test_strict_freshness_gate_drops_slow_tasks_async_not_sync():
    strict = simulate(small_slow(mode="async", max_policy_lag=1))
    loose = simulate(small_slow(mode="async", max_policy_lag=16))
    sync = simulate(small_slow(mode="sync", max_policy_lag=1))
    # the bias: a strict gate rejects (slow, harder) tasks far more often than the rest
    assert strict["rejection_rate_slow"] > 0.9
    assert strict["rejection_rate_rest"] < 0.3
    assert strict["slow_share_admitted"] < 0.05 < strict["slow_share_created"]
    # relaxing the gate brings them back
    assert loose["rejection_rate_slow"] < strict["rejection_rate_slow"] - 0.5
    assert loose["admitted"] > strict["admitted"]
    # sync never goes stale but wastes the fleet on stragglers
    assert sync["stale_rate_slow"] == 0.0
    assert abs(sync["rejection_rate_slow"] - sync["rejection_rate_rest"]) < 0.1
    assert sync["completions"] < strict["completions"] / 3
    assert sync["trainer_idle_fraction"] > strict["trainer_idle_fraction"]


def test_a_day_of_fleet_time_runs():
    # the benchmark measures speed; here only that a full day at default size completes sanely
    s = simulate(load_sim_config("slow_tasks", {"duration_h": 24.0}))
    assert s["completions"] > 100_000
    assert s["events"] >= s["completions"]


def test_config_errors_say_what_to_fix():
    with pytest.raises(ConfigError, match="min_valid_members"):
        load_sim_config(None, {"group_size": 2, "min_valid_members": 3})
    with pytest.raises(ConfigError, match="unknown config key"):
        load_sim_config(None, {"max_lag": 1})
    with pytest.raises(ConfigError, match="task_mix.slow: unknown key"):
        load_sim_config(None, {"task_mix.slow.speed": 3})
    cfg = load_sim_config("slow_tasks", {"task_mix.slow.median_s": 300})
    assert cfg.task_mix["slow"]["median_s"] == 300 and cfg.task_mix["fast"]["median_s"] == 60
    assert load_sim_config("failures").max_trajectory_s == 1800


def test_packaged_configs_load():
    from pipeline.sim.config import CONFIG_DIR

    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert {"slow_tasks", "failures", "lake_small"} <= set(names)
    for name in names:
        load_sim_config(name)
