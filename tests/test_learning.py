"""CI fails if learning breaks: a short fixed-seed closed loop on the built-in
task must raise held-out (greedy, never-trained-on split) success by at least
20 points. An assertion on what the policy learned, never on wall time.

Measured margin: version 0 solves ~2% of the held-out split (it copies digits
but cannot multiply); one GRPO update teaches it to call the calculator
(~99%). A wiring bug anywhere in rollout -> admit -> snapshot -> train ->
publish (advantages of the wrong sign, a loss mask that trains on tool
output, a trainer that publishes its parent's weights, admission that drops
every group) leaves the gain near zero.
"""

from __future__ import annotations

import pytest

from pipeline.demo import DemoConfig, run_demo


@pytest.mark.slow
def test_short_fixed_seed_run_raises_heldout_success_by_20_points(lake):
    cfg = DemoConfig(iterations=1, groups=16, group_size=8, eval_n=60, epochs=2, seed=0, infra_fault_p=0.0,
                     report=False)
    summary = run_demo(lake, cfg, out=lambda *a: None)
    first, last = summary["heldout_first"], summary["heldout_last"]
    assert summary["final_policy_version"] == 1, "one update was trained and published"
    assert last - first >= 0.20, f"held-out success {first:.3f} -> {last:.3f}: the loop did not learn"
