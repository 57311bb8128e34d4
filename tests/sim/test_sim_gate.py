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
