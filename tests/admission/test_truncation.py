"""Truncation policies, each with its advantages computed by hand (both engines)."""

from __future__ import annotations

import math

import pytest

from pipeline.admission.config import AdmissionConfig, admission_config_hash
from pipeline.admission.run import admit
from pipeline.admission.truncation import overlong_penalty
from pipeline.errors import ConfigError
from pipeline.lake.delta import Lake

from admission_rows import NOW, land, traj

# L_max = 64, L_cache = 16: the penalty ramps from 0 at length 48 to -1 at 64
SOFT = dict(truncation="soft_penalty", overlong_max_len=64, overlong_interval=16)


def _rows():
    rows = [
        traj("t1", "g", reward=1.0, response_len=10),        # short, right
        traj("t2", "g", reward=1.0, response_len=56),        # right, inside the interval: penalty -0.5
        traj("t3", "g", reward=0.0, response_len=64, status="REJECTED", verdict="FAIL"),   # cut at the limit
        traj("t4", "g", reward=0.0, response_len=20),        # short, wrong
    ]
    rows[2]["stop_reason"] = "max_length"
    return rows


def _admit(tmp_path, name, cfg, engine):
    lake = Lake(tmp_path / name)
    land(lake, _rows())
    res = admit(lake, cfg, current_policy_version=5, now=NOW, engine=engine)
    rec = res.receipts.to_pylist()[0]
    adv = dict(zip(res.members.column("trajectory_id").to_pylist(), res.members.column("advantage").to_pylist()))
    return rec, adv


@pytest.mark.parametrize("engine", ["duckdb", "dask"])
def test_each_truncation_policy_by_hand(tmp_path, engine):
    base = dict(quality=False, eps=0.0)
    # score_zero: rewards 1, 1, 0, 0 -> mean .5, std .5 -> +-1; the truncated member is in the baseline
    rec, adv = _admit(tmp_path, "zero", AdmissionConfig(**base), engine)
    assert adv == pytest.approx({"t1": 1.0, "t2": 1.0, "t3": -1.0, "t4": -1.0})
    assert rec["reward_mean"] == pytest.approx(0.5)
    # filter: t3 excluded (reason truncated), baseline over 1, 1, 0: mean 2/3, std sqrt(2/9)
    rec, adv = _admit(tmp_path, "filter", AdmissionConfig(**base, truncation="filter"), engine)
    s = math.sqrt(2 / 9)
    assert adv == pytest.approx({"t1": (1 / 3) / s, "t2": (1 / 3) / s, "t4": (-2 / 3) / s})
    assert dict(rec["excluded_members"]) == {"t3": "truncated"}
    assert rec["reward_mean"] == pytest.approx(2 / 3) and rec["valid_members"] == ["t1", "t2", "t4"]
    assert dict(rec["checks"])["member_exclusions"] == "fail:truncated=1"
    # soft_penalty: rewards 1 + 0, 1 - 0.5, 0 - 1, 0 + 0 = 1, .5, -1, 0 -> mean .125
    rec, adv = _admit(tmp_path, "soft", AdmissionConfig(**base, **SOFT), engine)
    r = [1.0, 0.5, -1.0, 0.0]
    m = sum(r) / 4
    sd = math.sqrt(sum((x - m) ** 2 for x in r) / 4)        # sqrt(0.546875)
    assert adv == pytest.approx({f"t{i + 1}": (x - m) / sd for i, x in enumerate(r)})
    assert rec["reward_mean"] == pytest.approx(0.125)


def test_penalty_formula_and_config():
    assert overlong_penalty([0, 48, 52, 56, 64, 65, 200], 64, 16).tolist() == [0, 0, -0.25, -0.5, -1, -1, -1]
    # the policy is part of the config hash (snapshot ids differ); the default keeps the old hash
    h = {p: admission_config_hash(AdmissionConfig(**({"truncation": p} | (SOFT if p == "soft_penalty" else {}))))
         for p in ("score_zero", "filter", "soft_penalty")}
    assert len(set(h.values())) == 3
    assert "truncation" not in AdmissionConfig().decision_dict()
    assert admission_config_hash(AdmissionConfig(**SOFT)) != admission_config_hash(
        AdmissionConfig(**(SOFT | {"overlong_interval": 8})))
    with pytest.raises(ConfigError, match="overlong_interval"):
        AdmissionConfig(truncation="soft_penalty")
