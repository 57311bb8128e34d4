"""One hand-built case per admission rule and reason (docs/admission-rules.md,
Admission semantics), with the expected receipt written out by hand."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit

from admission_rows import NOW, land, traj

BASE = AdmissionConfig(quality=False)


def run(lake, rows, cfg=BASE, *, current=5, now=NOW, **kw):
    if rows:
        land(lake, rows)
    res = admit(lake, cfg, current_policy_version=current, now=now, **kw)
    out = {}
    for r in res.receipts.to_pylist():
        r["excluded_members"] = dict(r["excluded_members"])
        r["checks"] = dict(r["checks"])
        out[r["group_id"]] = r
    return res, out


def test_member_exclusions_and_null_vs_zero_reward(lake):
    rows = [
        traj("a1", "g", reward=1.0),
        traj("a2", "g", reward=0.0),                       # zero is a real (failing) reward
        traj("a3", "g", reward=0.0),
        traj("a4", "g", reward=None, verdict="FAIL"),       # null: no valid evaluation
        traj("a5", "g", reward=0.0, status="INFRA_FAILED", verdict="ENV_ERROR"),
        traj("a6", "g", reward=0.0, status="EXPIRED", verdict="FAIL"),
        traj("a7", "g", reward=1.0, verdict="UNKNOWN"),
        traj("a8", "g", reward=0.0, verdict="ENV_ERROR"),
    ]
    for r in rows:
        r["group_size"] = 8
    res, rec = run(lake, rows)
    r = rec["g"]
    assert r["decision"] == "admit"
    assert r["valid_members"] == ["a1", "a2", "a3"]
    assert r["excluded_members"] == {"a4": "no_reward", "a5": "infra_failed", "a6": "expired",
                                     "a7": "no_reward", "a8": "no_reward"}
    # valid rewards 1, 0, 0: mean 1/3, population std sqrt(2/9)
    assert r["reward_mean"] == pytest.approx(1 / 3)
    assert r["reward_std"] == pytest.approx(math.sqrt(2 / 9))
    assert r["checks"]["member_exclusions"] == "fail:expired=1,infra_failed=1,no_reward=3"
    assert r["checks"]["min_valid_members"] == "pass"
    # infra failures never enter the baseline: grpo over (1, 0, 0) only
    adv = dict(zip(res.members.column("trajectory_id").to_pylist(), res.members.column("advantage").to_pylist()))
    std = math.sqrt(2 / 9)
    assert adv == pytest.approx({"a1": (2 / 3) / (std + 1e-6), "a2": (-1 / 3) / (std + 1e-6),
                                 "a3": (-1 / 3) / (std + 1e-6)})


def test_reference_config_majority_and_first_differing_field(lake):
    rows = [
        traj("b1", "g", reward=1.0), traj("b2", "g", reward=0.0), traj("b3", "g", reward=1.0),
        traj("b4", "g", env_version="env-2", verifier_version="ver-2"),  # env differs first
        traj("b5", "g", policy_version=4, tpv=[4, 4, 4], env_version="env-2"),  # policy first
        traj("b6", "g", tokenizer_rev="tok-2"),
        traj("b7", "g", prompt_template_rev="tmpl-2"),
        traj("b8", "g", verifier_version="ver-2"),
        traj("b9", "g", temperature=0.7),
    ]
    for r in rows:
        r["group_size"] = 9
    _, rec = run(lake, rows)
    r = rec["g"]
    assert (r["ref_policy_version"], r["ref_tokenizer_rev"], r["ref_prompt_template_rev"], r["ref_env_version"],
            r["ref_verifier_version"], r["ref_temperature"]) == (5, "tok-1", "tmpl-1", "env-1", "ver-1", 1.0)
    assert r["excluded_members"] == {"b4": "env_mismatch", "b5": "policy_mismatch", "b6": "tokenizer_mismatch",
                                     "b7": "template_mismatch", "b8": "verifier_mismatch",
                                     "b9": "temperature_mismatch"}
    assert r["valid_members"] == ["b1", "b2", "b3"]
    assert r["decision"] == "admit"


def test_reference_tie_goes_to_higher_policy_version(lake):
    rows = [traj("c1", "g", policy_version=4, tpv=[4, 4, 4], reward=1.0),
            traj("c2", "g", policy_version=4, tpv=[4, 4, 4], reward=0.0),
            traj("c3", "g", policy_version=5, reward=1.0),
            traj("c4", "g", policy_version=5, reward=0.0)]
    _, rec = run(lake, rows)
    r = rec["g"]
    assert r["ref_policy_version"] == 5
    assert r["excluded_members"] == {"c1": "policy_mismatch", "c2": "policy_mismatch"}
    assert r["valid_members"] == ["c3", "c4"]


def test_reference_tie_then_lexicographically_smaller_tuple(lake):
    rows = [traj("d1", "g", env_version="env-b", reward=1.0), traj("d2", "g", env_version="env-b", reward=0.0),
            traj("d3", "g", env_version="env-a", reward=1.0), traj("d4", "g", env_version="env-a", reward=0.0)]
    _, rec = run(lake, rows)
    r = rec["g"]
    assert r["ref_env_version"] == "env-a"
    assert r["excluded_members"] == {"d1": "env_mismatch", "d2": "env_mismatch"}
    assert r["checks"]["comparability"] == "fail:env_mismatch=2"


def test_reference_ignores_excluded_members(lake):
    # three env-2 members are infra failures: the reference comes from the valid two
    rows = [traj("e1", "g", env_version="env-2", status="INFRA_FAILED", verdict="ENV_ERROR", reward=None),
            traj("e2", "g", env_version="env-2", status="INFRA_FAILED", verdict="ENV_ERROR", reward=None),
            traj("e3", "g", env_version="env-2", status="INFRA_FAILED", verdict="ENV_ERROR", reward=None),
            traj("e4", "g", reward=1.0), traj("e5", "g", reward=0.0)]
    for r in rows:
        r["group_size"] = 5
    _, rec = run(lake, rows)
    assert rec["g"]["ref_env_version"] == "env-1"
    assert rec["g"]["valid_members"] == ["e4", "e5"]


def test_freshness_over_the_oldest_sampled_token(lake):
    # current 5, max lag 1. f1 started at 3 and finished at 4 (partial rollout):
    # oldest sampled token 3 -> lag 2 (stale) even though most tokens are fresh.
    # f2 started at 3 but every sampled token came from 4 (observations are -1): lag 1.
    # f3/f4 have no token versions: fall back to policy_version 3 -> lag 2.
    rows = [traj("f1", "g", policy_version=3, tpv=[3, -1, 4, 4], response_len=4, reward=1.0),
            traj("f2", "g", policy_version=3, tpv=[4, -1, 4, 4], response_len=4, reward=0.0),
            traj("f3", "g", policy_version=3, tpv=None, reward=1.0),
            traj("f5", "g", policy_version=3, tpv=[-1, 4, 4], reward=1.0)]
    for r in rows:
        r["loss_mask"] = [0 if v == -1 else 1 for v in (r["token_policy_versions"] or [1] * 3)]
        r["response_logprobs"] = [0.0 if m == 0 else -0.5 for m in r["loss_mask"]]
    _, rec = run(lake, rows)
    r = rec["g"]
    assert r["excluded_members"] == {"f1": "stale_policy", "f3": "stale_policy"}
    assert r["valid_members"] == ["f2", "f5"]
    assert r["policy_lag"] == 1
    assert r["checks"]["freshness"] == "fail:stale_policy=2"


def test_stale_wait(lake):
    rows = [traj("h1", "g", queue_wait_ms=100, reward=1.0), traj("h2", "g", queue_wait_ms=5000, reward=0.0),
            traj("h3", "g", queue_wait_ms=1000, reward=0.0), traj("h4", "g", queue_wait_ms=1001, reward=1.0)]
    _, rec = run(lake, rows, AdmissionConfig(quality=False, max_queue_wait_ms=1000))
    r = rec["g"]
    assert r["excluded_members"] == {"h2": "stale_wait", "h4": "stale_wait"}
    assert r["max_queue_wait_ms"] == 1000
    assert r["decision"] == "admit"


def test_insufficient_valid(lake):
    rows = [traj("i1", "g", reward=1.0)] + [
        traj(f"i{k}", "g", status="INFRA_FAILED", verdict="ENV_ERROR", reward=None) for k in (2, 3, 4)]
    res, rec = run(lake, rows)
    r = rec["g"]
    assert r["decision"] == "insufficient_valid"
    assert r["checks"]["min_valid_members"] == "fail:1 < 2"
    assert r["snapshot_id"] is None and res.snapshot_id is None
    assert r["reward_mean"] == 1.0 and r["reward_std"] == 0.0


def test_zero_variance_exact_and_threshold(lake):
    rows = ([traj(f"z{k}", "g1", reward=1.0) for k in range(4)]                       # all pass
            + [traj(f"y{k}", "g2", reward=0.3) for k in range(4)]                     # equal non-binary
            + [traj("x0", "g3", reward=0.0), traj("x1", "g3", reward=1e-9),          # spread, std 4.3e-10
               traj("x2", "g3", reward=0.0), traj("x3", "g3", reward=0.0)]
            + [traj("w0", "g4", reward=0.0), traj("w1", "g4", reward=1.0),
               traj("w2", "g4", reward=0.0), traj("w3", "g4", reward=0.0)])
    res, rec = run(lake, rows)
    assert {g: r["decision"] for g, r in rec.items()} == {
        "g1": "zero_variance", "g2": "zero_variance", "g3": "zero_variance", "g4": "admit"}
    assert rec["g2"]["reward_std"] == 0.0
    assert rec["g1"]["checks"]["reward_spread"] == "fail:no reward spread among valid members"
    assert res.admitted_members == 4 and res.counts == {"admit": 1, "zero_variance": 3}


def test_zero_variance_kept_with_advantage_zero_when_not_dropped(lake):
    """drop_zero_variance=false (the ablation in benchmarks/bench_gates.py): groups
    without spread are admitted, each member's advantage exactly 0; the check's
    outcome is still recorded; the default config's hash does not change."""
    from pipeline.admission.config import admission_config_hash

    rows = ([traj(f"z{k}", "g1", reward=1.0) for k in range(4)]
            + [traj("w0", "g4", reward=0.0), traj("w1", "g4", reward=1.0)])
    keep = AdmissionConfig(quality=False, drop_zero_variance=False)
    res, rec = run(lake, rows, keep)
    assert {g: r["decision"] for g, r in rec.items()} == {"g1": "admit", "g4": "admit"}
    assert rec["g1"]["checks"]["reward_spread"] == "fail:no reward spread among valid members"
    adv = dict(zip(res.members.column("trajectory_id").to_pylist(), res.members.column("advantage").to_pylist()))
    assert [adv[f"z{k}"] for k in range(4)] == [0.0] * 4 and adv["w1"] > 0 > adv["w0"]
    assert "drop_zero_variance" not in BASE.decision_dict()
    assert admission_config_hash(keep) != admission_config_hash(BASE)


def test_incomplete_group_past_timeout(lake):
    young = [traj("j1", "young", reward=1.0, age_s=60), traj("j2", "young", reward=0.0, age_s=30)]
    old = [traj("k1", "old", reward=1.0, age_s=700), traj("k2", "old", reward=0.0, age_s=100),
           traj("k3", "old", reward=0.0, age_s=90)]
    res, rec = run(lake, young + old)
    assert set(rec) == {"old"}  # the young incomplete group waits for its members
    r = rec["old"]
    assert r["decision"] == "admit" and r["arrived_members"] == 3 and r["group_size"] == 4
    assert r["checks"]["complete"] == "fail:3/4 arrived"
    # later (600 s after j1 finished) the young group is decided with what arrived
    res2, rec2 = run(lake, [], now=NOW + timedelta(seconds=541))
    assert set(rec2) == {"young"}
    assert rec2["young"]["arrived_members"] == 2


def test_incomplete_not_admitted_when_configured(lake):
    rows = [traj("k1", "old", reward=1.0, age_s=700), traj("k2", "old", reward=0.0, age_s=650)]
    _, rec = run(lake, rows, AdmissionConfig(quality=False, admit_incomplete=False))
    assert rec["old"]["decision"] == "incomplete"
    assert rec["old"]["checks"]["complete"] == "fail:2/4 arrived"


def test_update_if_gate_and_component_caps(lake):
    # g1: reward spread comes only from the format heuristic: no member solved the task -> gated
    g1 = [traj(f"u{k}", "g1", reward=0.1 * k, components={"task_success": 0.0, "format": 0.1 * k})
          for k in range(4)]
    g2 = [traj(f"v{k}", "g2", reward=float(k % 2) + 0.5, components={"task_success": float(k % 2), "format": 0.5})
          for k in range(4)]
    cfg = AdmissionConfig(quality=False, update_if=("max(task_success) >= 0.5",), component_caps={"format": 0.2})
    res, rec = run(lake, g1 + g2, cfg)
    assert rec["g1"]["decision"] == "gated"
    assert rec["g1"]["checks"]["update_if"] == "fail:max(task_success)=0 not >= 0.5"
    assert rec["g2"]["decision"] == "admit"
    # caps: format 0.5 capped at 0.2 -> rewards 0.5-0.3 = 0.2 and 1.5-0.3 = 1.2
    assert rec["g2"]["reward_mean"] == pytest.approx(0.7)
    assert sorted(res.members.column("reward").to_pylist()) == pytest.approx([0.2, 0.2, 1.2, 1.2])


def test_bucket_labels_and_caps(lake):
    rows = []
    for g, diff, n_tools, length in (("g1", "easy", 0, 3), ("g2", "easy", 5, 300), ("g3", "hard", 20, 5000)):
        rows += [traj(f"{g}-{k}", g, reward=float(k % 2), difficulty=diff, num_tool_calls=n_tools,
                      response_len=length) for k in range(4)]
    cfg = AdmissionConfig(quality=False, bucket_caps={"difficulty:easy": 1})
    res, rec = run(lake, rows, cfg)
    assert [(rec[g]["difficulty"], rec[g]["length_bucket"], rec[g]["tool_call_bucket"], rec[g]["reward_std_bucket"])
            for g in ("g1", "g2", "g3")] == [("easy", "<256", "<1", ">=0.25"), ("easy", "256-1024", "4-16", ">=0.25"),
                                             ("hard", ">=4096", ">=16", ">=0.25")]
    assert rec["g1"]["decision"] == "admit"
    assert rec["g2"]["decision"] == "capped" and rec["g2"]["checks"]["bucket_cap"] == "fail:difficulty:easy cap 1"
    assert rec["g3"]["decision"] == "admit"
    assert set(res.members.column("group_id").to_pylist()) == {"g1", "g3"}


def test_reinforce_batch_norm_one_sample_per_prompt(lake):
    rows = [traj(f"r{k}", f"p{k}", group_size=1, reward=float(k == 0)) for k in range(4)]
    cfg = AdmissionConfig(quality=False, advantage="reinforce_batch_norm", min_valid_members=1)
    res, rec = run(lake, rows, cfg)
    assert {r["decision"] for r in rec.values()} == {"admit"}
    assert rec["p1"]["checks"]["reward_spread"] == "skip"
    adv = dict(zip(res.members.column("trajectory_id").to_pylist(), res.members.column("advantage").to_pylist()))
    std = math.sqrt(0.1875)  # rewards 1,0,0,0: mean .25, var .1875
    assert adv["r0"] == pytest.approx(0.75 / (std + 1e-6))
    assert adv["r1"] == pytest.approx(-0.25 / (std + 1e-6))


def test_groups_are_decided_once_even_when_stragglers_arrive(lake):
    rows = [traj(f"s{k}", "g", reward=float(k % 2)) for k in range(4)]
    res, rec = run(lake, rows)
    assert rec["g"]["decision"] == "admit"
    late = traj("s9", "g", reward=1.0)  # a fifth member after the decision
    res2, rec2 = run(lake, [late])
    assert rec2 == {} and res2.snapshot_id is None
    assert lake.read("receipts", columns=["group_id"]).num_rows == 1


def test_dry_run_writes_nothing(lake):
    rows = [traj(f"q{k}", "g", reward=float(k % 2)) for k in range(4)]
    res, rec = run(lake, rows, dry_run=True)
    assert rec["g"]["decision"] == "admit" and res.snapshot_id is not None
    assert not lake.exists("receipts") and not lake.exists("snapshots")
    res2, _ = run(lake, [])
    assert res2.snapshot_id == res.snapshot_id  # the dry run named the snapshot the real run made


def test_current_policy_version_defaults_to_newest_seen(lake):
    rows = [traj("n1", "g", policy_version=7, reward=1.0), traj("n2", "g", policy_version=7, reward=0.0),
            traj("n3", "g", policy_version=7, reward=0.0), traj("n4", "g", policy_version=7, reward=1.0)]
    land(lake, rows)
    res = admit(lake, BASE, now=NOW)
    assert res.current_policy_version == 7
    assert res.receipts.column("current_policy_version").to_pylist() == [7]


def test_target_groups_report(lake):
    rows = ([traj(f"t{k}", "g1", reward=float(k % 2)) for k in range(4)]
            + [traj(f"o{k}", "g2", reward=1.0) for k in range(4)])
    res, _ = run(lake, rows, target_groups=5)
    # 1 of 2 decided groups admitted: 4 missing at rate 0.5 -> sample 8 more groups
    assert res.target == {"target_groups": 5, "admitted_groups": 1, "missing_groups": 4,
                          "observed_admit_rate": 0.5, "groups_to_sample": 8}


def test_running_mean_baseline_is_carried_between_snapshots(lake):
    cfg = AdmissionConfig(quality=False, advantage="reinforce_batch_norm", min_valid_members=1,
                          baseline_momentum=0.5)
    first = [traj(f"m{k}", f"p{k}", group_size=1, reward=float(k < 3)) for k in range(4)]   # mean .75
    res1, _ = run(lake, first, cfg)
    second = [traj(f"n{k}", f"q{k}", group_size=1, reward=float(k < 1)) for k in range(4)]  # mean .25
    res2, _ = run(lake, second, cfg)
    # baseline b2 = .5 * .75 + .5 * .25 = .5; batch std of (1,0,0,0) = sqrt(.1875)
    adv = dict(zip(res2.members.column("trajectory_id").to_pylist(), res2.members.column("advantage").to_pylist()))
    s = math.sqrt(0.1875)
    assert adv["n0"] == pytest.approx(0.5 / (s + 1e-6)) and adv["n1"] == pytest.approx(-0.5 / (s + 1e-6))


def test_every_copy_of_the_rules_follows_rules_py():
    """pipeline/admission/rules.py holds the reason names and their order; the SQL
    spells them out and the reference oracle keeps its own table: both must agree."""
    import re

    from pipeline.admission import reference, rules
    from pipeline.resources import sql_path

    sql = sql_path("admission_members").read_text()
    body = sql[sql.index("WITH arrived"):]
    assert re.findall(r"WHEN m\.(\w+) <> r\.\1 THEN '(\w+)'", body) == list(rules.COMPARABILITY)
    order = re.search(r"ORDER BY n DESC, policy_version DESC, ([\w,\s]+?)\) AS rk", body).group(1)
    assert [f.strip() for f in order.split(",")] == list(rules.REF_FIELDS[1:])
    steps = re.findall(r"THEN '(\w+)'", body)
    assert steps == ([r for _, r in rules.STATUS_REASONS] + [rules.NO_REWARD, rules.OUT_OF_VOCABULARY]
                     + list(rules.MISMATCH_REASONS)
                     + list(rules.FRESHNESS_REASONS))
    for status, reason in rules.STATUS_REASONS:
        assert f"c.status = '{status}' THEN '{reason}'" in body
    assert "IN (" + ", ".join(f"'{v}'" for v in rules.NO_REWARD_VERDICTS) + ")" in body
    assert reference.MISMATCH == rules.COMPARABILITY
