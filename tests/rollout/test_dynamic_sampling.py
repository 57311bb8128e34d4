"""Dynamic sampling as a loop (issue 19, item 6): admission's --target-groups
shortfall sizes the next rollout, in the demo's sync loop and in the jobs."""

from __future__ import annotations

import math

import pytest

from pipeline.admission.run import admit, last_target, plan_next_rollout


def test_plan_next_rollout_by_hand():
    t = {"target_groups": 10, "admitted_groups": 4, "missing_groups": 6, "observed_admit_rate": 0.5,
         "groups_to_sample": 12}
    assert plan_next_rollout(t, default=8, max_groups=64) == 12              # the shortfall over the rate
    assert plan_next_rollout(t, default=8, max_groups=10) == 10              # clamped
    assert plan_next_rollout(t, default=8, max_groups=64, fresh=True) == 20  # a whole batch: ceil(10 / 0.5)
    met = t | {"admitted_groups": 10, "missing_groups": 0, "groups_to_sample": 0, "observed_admit_rate": 0.4}
    assert plan_next_rollout(met, default=8, max_groups=64) == math.ceil(10 / 0.4)
    none = t | {"admitted_groups": 0, "missing_groups": 10, "observed_admit_rate": 0.0, "groups_to_sample": None}
    assert plan_next_rollout(none, default=8, max_groups=64) == 64           # nothing admitted: the cap
    assert plan_next_rollout(None, default=8, max_groups=64) == 8


def test_jobs_dynamic_groups_token_follows_the_last_admission(lake, make_traj):
    from pipeline.jobs import JobSpec, resolve_args
    from pipeline.lake.ingest import stamp_derived

    spec = JobSpec(name="rollout", schedule="* * * * *", args=("rollout", "--groups", "{dynamic_groups:16:64}"))
    assert resolve_args(lake, spec) == ["rollout", "--groups", "16"]  # no admission yet: the default
    lake.append("trajectories", stamp_derived(make_traj(40, seed=1, group_size=4), "i1"), command="test")
    from datetime import datetime, timezone

    a = admit(lake, target_groups=50, now=datetime(2026, 12, 1, tzinfo=timezone.utc))
    assert a.target["missing_groups"] > 0 and last_target(lake) == a.target
    want = plan_next_rollout(a.target, default=16, max_groups=64)
    assert resolve_args(lake, spec) == ["rollout", "--groups", str(want)]
    from pipeline.jobs import load_jobs

    jobs = load_jobs()
    assert "--target-groups" in jobs["admission"].args and "{dynamic_groups:16:64}" in jobs["rollout"].args
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError):
        resolve_args(lake, JobSpec(name="x", schedule="* * * * *", args=("--groups", "{dynamic_groups:16}")))


@pytest.mark.slow
def test_demo_shortfall_drives_the_next_round(lake, published):
    from pipeline.demo import DemoConfig, sample_to_target
    from pipeline.query.duck import query

    published(0)
    cfg = DemoConfig(groups=2, group_size=4, target_groups=6, max_groups=4, max_rounds=3, infra_fault_p=0.0,
                     report=False)
    s = sample_to_target(lake, cfg, 1, cfg.groups, 0)
    assert s.rounds[0] == 2 and len(s.rounds) >= 2      # 2 groups can never admit 6: a second round follows
    for probe, n in zip(s.probes, s.rounds[1:]):        # each later round is the previous shortfall's plan
        assert probe["missing_groups"] > 0
        assert n == plan_next_rollout(probe, default=cfg.groups, max_groups=cfg.max_groups)
    assert s.admission.target["target_groups"] == 6
    assert s.admission.target["missing_groups"] == 0 or len(s.rounds) == cfg.max_rounds
    n = query(lake, "SELECT count(DISTINCT group_id) AS n FROM trajectories").column(0)[0].as_py()
    assert n == sum(s.rounds) == s.offset
    assert s.admission.receipts.num_rows == n        # one admission decided every sampled group
