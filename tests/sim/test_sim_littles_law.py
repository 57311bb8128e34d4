"""The simulator's Little's-law figures (issue 19, item 7): lambda, mu,
L = lambda*W, and the backlog / starvation flag."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.sim.config import load_sim_config
from pipeline.sim.engine import simulate
from pipeline.sim.metrics import littles_law, render_text


def test_littles_law_by_hand():
    nan = math.nan
    # finished at 0 and 10; decided at 20 and never (leaves at T=100); one never finished
    f = littles_law(duration_s=100.0, end=np.array([0.0, 10.0, nan]), decided_at=np.array([20.0, nan, nan]),
                    admitted=100, trained=4, trainer_train_s=8.0, trainer_idle_fraction=0.0)
    assert f["lambda_per_s"] == pytest.approx(0.02) and f["queue_w_s"] == pytest.approx(55.0)
    assert f["queue_l"] == pytest.approx(1.1) == f["queue_l_measured"]
    assert f["mu_per_s"] == pytest.approx(0.5) and f["rho"] == pytest.approx(2.0) and f["load_state"] == "backlog"
    kw = dict(duration_s=100.0, end=np.array([0.0]), decided_at=np.array([5.0]), admitted=10, trained=10,
              trainer_train_s=10.0)
    assert littles_law(**kw, trainer_idle_fraction=0.9)["load_state"] == "starvation"   # rho 0.1, idle
    assert littles_law(**kw, trainer_idle_fraction=0.2)["load_state"] == "balanced"
    assert littles_law(**{**kw, "trained": 0}, trainer_idle_fraction=1.0)["mu_per_s"] is None


@pytest.mark.parametrize("overrides,state", [
    ({"duration_h": 2, "workers": 512, "trainer_step_s": 600, "max_policy_lag": 100}, "backlog"),
    ({"duration_h": 2, "workers": 8, "trainer_step_s": 10}, "starvation"),
])
def test_simulator_flags_backlog_and_starvation(overrides, state):
    s = simulate(load_sim_config(None, overrides))
    assert s["load_state"] == state
    assert s["queue_l"] == pytest.approx(s["queue_l_measured"])      # L = lambda * W, measured directly
    assert s["lambda_per_s"] == pytest.approx(s["completions"] / (2 * 3600))
    text = render_text(s)
    assert "L = lambda*W" in text and state.upper() in text
