"""The in-simulator gate against docs/admission-rules.md, values by hand."""

from __future__ import annotations

from pipeline.sim.gate import ACCEPTED, EXPIRED, INFRA_FAILED, GateRules, decide_group

OK = ACCEPTED


def test_admits_a_fresh_group_with_spread():
    d = decide_group([3, 3, 3, 3], [OK] * 4, [1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0], 4, GateRules(max_policy_lag=1))
    assert d.decision == "admit"
    assert d.reasons == ("", "", "", "")


def test_failures_are_excluded_before_anything_else():
    # an infra failure with reward 0 must not drag the baseline: it is excluded, not a policy failure
    d = decide_group([1, 1, 1, 1], [INFRA_FAILED, EXPIRED, OK, OK], [None, None, 1.0, 0.0], [0] * 4, 1, GateRules())
    assert d.reasons == ("infra_failed", "expired", "", "")
    assert d.decision == "admit"
    d = decide_group([1, 1], [OK, OK], [None, 1.0], [0, 0], 1, GateRules())
    assert d.reasons == ("no_reward", "")
    assert d.decision == "insufficient_valid"


def test_reference_is_the_most_common_version_ties_to_the_higher():
    # counts: v2 x2, v3 x2 -> tie -> reference 3; the v2 members are policy_mismatch
    d = decide_group([2, 3, 2, 3], [OK] * 4, [1.0, 0.0, 1.0, 0.0], [0] * 4, 3, GateRules(max_policy_lag=5))
    assert d.reasons == ("policy_mismatch", "", "policy_mismatch", "")
    # v2 x3, v3 x1 -> reference 2
    d = decide_group([2, 2, 2, 3], [OK] * 4, [1.0, 0.0, 1.0, 0.0], [0] * 4, 3, GateRules(max_policy_lag=5))
    assert d.reasons == ("", "", "", "policy_mismatch")


def test_policy_lag_boundary_is_inclusive():
    # current 5, version 3: lag 2; max 2 admits, max 1 excludes every member -> insufficient_valid
    assert decide_group([3, 3], [OK] * 2, [1.0, 0.0], [0, 0], 5, GateRules(max_policy_lag=2)).decision == "admit"
    d = decide_group([3, 3], [OK] * 2, [1.0, 0.0], [0, 0], 5, GateRules(max_policy_lag=1))
    assert d.reasons == ("stale_policy", "stale_policy")
    assert d.decision == "insufficient_valid"


def test_queue_wait_limit():
    rules = GateRules(max_policy_lag=9, max_queue_wait_ms=1000)
    d = decide_group([0, 0, 0], [OK] * 3, [1.0, 0.0, 0.0], [1000, 1001, 10], 0, rules)
    assert d.reasons == ("", "stale_wait", "")
    assert d.decision == "admit"


def test_zero_variance_is_exact_spread_then_std():
    assert decide_group([0] * 3, [OK] * 3, [1.0] * 3, [0] * 3, 0, GateRules()).decision == "zero_variance"
    # spread exists but population std (0.5e-6) is below min_reward_std 1e-6
    d = decide_group([0, 0], [OK] * 2, [0.0, 1e-6], [0, 0], 0, GateRules(min_reward_std=1e-6))
    assert d.decision == "zero_variance"
    assert decide_group([0, 0], [OK] * 2, [0.0, 3e-6], [0, 0], 0, GateRules()).decision == "admit"


def test_min_valid_members():
    rules = GateRules(min_valid_members=3)
    d = decide_group([0, 0, 0], [OK, OK, INFRA_FAILED], [1.0, 0.0, None], [0] * 3, 0, rules)
    assert d.decision == "insufficient_valid"


def test_gate_decides_like_the_real_admission_engine():
    """Random groups through the sim gate and through the real engine (decide_candidates:
    the DuckDB SQL + decide.finalize, the core `pipeline admit` runs): the same reasons and decisions."""
    import random
    from datetime import datetime, timedelta, timezone

    import pyarrow as pa

    from pipeline.admission.candidates import candidate_schema
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.engine_duckdb import decide_candidates
    from pipeline.admission.rules import COMPARABILITY, reference_config
    from pipeline.sim.gate import CONFIG_FIELDS, batch_config

    rnd = random.Random(7)
    now = datetime(2026, 11, 30, tzinfo=timezone.utc)
    current, rules = 5, GateRules(max_policy_lag=1, max_queue_wait_ms=900, min_valid_members=2)
    cfg = AdmissionConfig(quality=False, max_policy_lag=rules.max_policy_lag,
                          max_queue_wait_ms=rules.max_queue_wait_ms, min_valid_members=rules.min_valid_members,
                          min_reward_std=rules.min_reward_std, length_edges=(), tool_call_edges=(), reward_std_edges=())
    base = {"tokenizer_rev": "tok-1", "prompt_template_rev": "tmpl-1", "env_version": "env-1",
            "verifier_version": "ver-1", "temperature": 1.0, "top_p": 1.0, "task_version": "v1",
            "harness_version": "h-1", "tool_schema_version": "", "prompt_hash": "p", "env_state_hash": ""}
    rows, groups = [], []
    for g in range(80):
        n = rnd.randint(1, 6)
        gbase = dict(base, verifier_version=rnd.choice(["ver-1", "ver-1", "ver-2"]))   # batch_config
        gversion = rnd.choice([current, current, current - 1, current - 2])
        members = []
        for k in range(n):
            conf = dict(gbase)
            if rnd.random() < 0.15:   # one member differs in one comparability field
                f = rnd.choice([f for f, _ in CONFIG_FIELDS])
                conf[f] = 0.5 if isinstance(conf[f], float) else conf[f] + "x"
            status = rnd.choice(["ACCEPTED"] * 14 + [INFRA_FAILED, EXPIRED])
            reward = None if status != "ACCEPTED" or rnd.random() < 0.05 else float(rnd.choice([0.0, 1.0, 1.0]))
            row = {"trajectory_id": f"g{g:02d}-{k}", "group_id": f"g{g:02d}", "group_size": n, "task_id": "t",
                   "run_id": "r", "policy_version": gversion if rnd.random() < 0.9 else gversion - 1,
                   "status": status, "verdict": "PASS" if reward else "FAIL", "reward": reward,
                   "difficulty": "easy", "num_tool_calls": 0, "finished_at": now - timedelta(seconds=1),
                   "queue_wait_ms": rnd.choice([10] * 8 + [500, 1000]), "content_hash": "c", "stop_reason": "eos",
                   "response_len": 3, **conf}
            row["oldest_version"] = row["policy_version"]
            members.append(row)
        rows += members
        groups.append(members)
    cands = pa.Table.from_pylist(rows, schema=candidate_schema(cfg))
    real = {r["group_id"]: r for r in decide_candidates(cands, cfg, current_policy_version=current, now=now,
                                                          config_hash="h").receipts.to_pylist()}

    decisions, group_configs = [], []
    conf_fields = [f for f, _ in COMPARABILITY[1:]]
    for members in groups:
        decisions.append(decide_group([r["policy_version"] for r in members], [r["status"] for r in members],
                                      [r["reward"] for r in members], [r["queue_wait_ms"] for r in members],
                                      current, rules, configs=[tuple(r[f] for f in conf_fields) for r in members]))
        ref = reference_config((r["policy_version"], *(r[f] for f in conf_fields)) for r in members
                               if r["status"] == "ACCEPTED" and r["reward"] is not None) or (None,) * 11
        group_configs.append(dict(zip([f for f, _ in COMPARABILITY], ref)))
    decisions = batch_config(decisions, group_configs)
    seen = set()
    for members, d in zip(groups, decisions):
        r = real[members[0]["group_id"]]
        assert d.decision == r["decision"], (members, d, r)
        assert {m["trajectory_id"]: why for m, why in zip(members, d.reasons) if why} == dict(r["excluded_members"])
        seen.add(d.decision)
        seen.update(d.reasons)
    # the example exercises every rule the gate models
    assert {"admit", "insufficient_valid", "zero_variance", "batch_config_mismatch", "infra_failed", "expired",
            "no_reward", "policy_mismatch", "stale_policy", "stale_wait"} <= seen
    assert any(r.endswith("_mismatch") and r != "policy_mismatch" for r in seen)
