"""The reward-hacking alarms of the report (pipeline/report/alerts.py): train vs
held-out success gap, KL band, reward-component drift. Each fires on a lake
built with that fault (pipeline.testing.health_lake) and stays silent on the
healthy lake shape (the demo's own run: tests/test_demo.py asserts no alert)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.report.build import ReportOptions, build_report
from pipeline.schema import table_spec

NEW = {"train_heldout_gap", "kl_band", "component_share_drift", "verdict_disagreement"}


def _lake(tmp_path_factory, name: str, **kw):
    from pipeline.lake.delta import Lake
    from pipeline.testing.health_lake import HealthLakeSpec, build_health_lake

    lake = Lake(tmp_path_factory.mktemp(name) / "lake")
    build_health_lake(lake, HealthLakeSpec(trajectories_per_version=200, versions=3, event_episodes=4, **kw))
    return lake


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _lake(tmp_path_factory, "healthy")


@pytest.fixture(scope="module")
def hacked(tmp_path_factory):
    # rollouts pass 95% from version 1 on, held-out stays at version 1's level; a shaping term appears at 2
    return _lake(tmp_path_factory, "hacked", hacked_from=1, shaping_from=2)


def _checks(res) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in res["alert_checks"]:
        out.setdefault(a["check"], []).append(a["message"])
    return out


def _alerts(lake, opts: ReportOptions | None = None) -> dict[str, list[str]]:
    """The alerts section alone (what build_report puts first), by check."""
    from pipeline.report.alerts import alerts
    from pipeline.report.queries import Queries

    notes = [b for b in alerts(Queries(lake, opts or ReportOptions())).blocks if b.kind == "alert"]
    return _checks({"alert_checks": [{"check": b.check, "message": b.text} for b in notes]})


def test_the_alarms_are_silent_on_a_healthy_lake(healthy):
    _, res = build_report(healthy)
    assert res["errors"] == []
    assert not NEW & set(_checks(res)), res["alerts"]


def test_train_success_outrunning_held_out_success_alerts(hacked):
    _, res = build_report(hacked)
    found = _checks(res)
    assert res["errors"] == [] and {"train_heldout_gap", "component_share_drift"} <= set(found)
    text = found["train_heldout_gap"][0]
    assert text.startswith("Train success outruns held-out success: at policy version 3")
    assert "held-out success is 0.320" in text and "since version 1 (bound 0.15," in text
    # a wider bound than the widening silences it
    assert "train_heldout_gap" not in _alerts(hacked, ReportOptions(alert_bounds=(("train_heldout_gap", 0.9),)))


def test_a_shaping_component_gaining_share_alerts(hacked):
    found = _alerts(hacked)["component_share_drift"]
    assert len(found) == 1     # one per run: the gainer, not every share it squeezed
    assert found[0].startswith("Reward component length_bonus (untagged) went from 0% to ")
    assert "between policy versions 0 and 2 (run run-0; bound 30%)" in found[0]


def test_kl_band(healthy, tmp_path):
    from pipeline.lake.delta import Lake

    # the healthy lake's checkpoints move ~0.0014 per step: inside [0, 1]; a lower edge above it fires
    low = _alerts(healthy, ReportOptions(alert_bounds=(("approx_kl_min", 0.01),)))["kl_band"]
    assert len(low) == 3 and all("The policy barely moves: approx_kl averaged 0.00135" in m for m in low)
    clip = _alerts(healthy, ReportOptions(alert_bounds=(("clip_fraction_min", 0.2),)))["kl_band"]
    assert any("Almost nothing was clipped" in m for m in clip)
    # a checkpoint whose steps move far: above the band (a copy of the lake: the fixture stays healthy)
    import shutil

    shutil.copytree(healthy.uri, tmp_path / "lake")
    lake = Lake(tmp_path / "lake")
    m = max(lake.read("metrics").to_pylist(), key=lambda r: (r["checkpoint_id"], r["global_step"]))
    hot = [dict(m, checkpoint_id="ck-hot", global_step=i, approx_kl=1.5) for i in range(4)]
    lake.append("metrics", pa.Table.from_pylist(hot, schema=table_spec("metrics").arrow_schema()), command="t")
    high = _alerts(lake)["kl_band"]
    assert high == [next(t for t in high if "checkpoint ck-hot" in t)]
    assert "approx_kl averaged 1.5 over the steps of checkpoint ck-hot, above the KL band [0, 1]" in high[0]
    # an LLM run's band (approx_kl_max near its target KL): the healthy lake's checkpoints stay inside it too
    assert "kl_band" not in _alerts(healthy, ReportOptions(alert_bounds=(("approx_kl_max", 0.05),)))


def test_alert_bounds_are_checked(healthy, tmp_path, capsys):
    from pipeline.cli import main

    base = ["report", "--lake", healthy.uri, "--out", str(tmp_path / "r.html")]
    assert main([*base, "--alert-bound", "train_heldout_gapp=0.1"]) == 2
    err = capsys.readouterr().err
    assert "unknown alert bound 'train_heldout_gapp'" in err and "train_heldout_gap" in err
    assert main([*base, "--alert-bound", "approx_kl_max"]) == 2
    assert "expected NAME=VALUE with a number (no '=')" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()
    assert main([*base, "--check", "--alert-bound", "approx_kl_min=0.01"]) == 4
