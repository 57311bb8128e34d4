"""Rewards that can be doubted: admission re-verifies the top-|advantage| tail of
each admitted group (and a shadow sample of whole groups) and holds a group
whose re-verdict disagrees as UNKNOWN (decision verdict_disagreement, with the
reason in its receipt); the others are decided again without it."""

from __future__ import annotations

import pytest

from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit
from pipeline.errors import ConfigError
from pipeline.lake.delta import Lake

from admission_rows import NOW, land, traj

CALLS: list[list[str]] = []
SEEN: list[dict] = []


def confirming(rows):
    """Confirms every verdict; keeps what it was given."""
    SEEN.extend(rows.select(["trajectory_id", "verifier_confidence", "verifier_evidence"]).to_pylist())
    return rows.column("verdict").to_pylist()


def doubting(rows):
    """A second verifier that disagrees on trajectory b1 (recorded PASS) and confirms the rest."""
    CALLS.append(rows.column("trajectory_id").to_pylist())
    return ["FAIL" if t == "b1" else v for t, v in zip(rows.column("trajectory_id").to_pylist(),
                                                       rows.column("verdict").to_pylist())]


ROWS = [traj("a1", "ga", reward=1.0, group_size=3), traj("a2", "ga", reward=0.0, group_size=3),
        traj("a3", "ga", reward=0.0, group_size=3),
        traj("b1", "gb", reward=1.0, group_size=3), traj("b2", "gb", reward=0.0, group_size=3),
        traj("b3", "gb", reward=0.0, group_size=3)]


def _admit(tmp_path, engine="duckdb", **kw):
    lake = Lake(tmp_path / f"lake-{engine}")
    land(lake, ROWS)
    CALLS.clear()
    cfg = AdmissionConfig(quality=False, reverifier="test_reverify:doubting", **kw)
    return lake, admit(lake, cfg, current_policy_version=5, now=NOW, engine=engine)


@pytest.mark.parametrize("engine", ["duckdb", "dask"])
def test_a_disagreeing_reverification_holds_the_group_as_unknown(tmp_path, engine):
    lake, res = _admit(tmp_path, engine, reverify_top=1)
    # the tail: the member of largest |advantage| per group (1 PASS of 3: +sqrt(2) vs -1/sqrt(2))
    assert CALLS == [["a1", "b1"]]
    rec = {r["group_id"]: r for r in lake.read("receipts").to_pylist()}
    assert rec["gb"]["decision"] == "verdict_disagreement" and rec["gb"]["snapshot_id"] is None
    assert dict(rec["gb"]["checks"])["reverify"] == "fail:b1 PASS -> FAIL"
    assert rec["ga"]["decision"] == "admit" and dict(rec["ga"]["checks"])["reverify"] == "pass:1 re-verified"
    assert sorted(res.members.column("trajectory_id").to_pylist()) == ["a1", "a2", "a3"]
    assert res.counts == {"admit": 1, "verdict_disagreement": 1}
    assert res.quality["reverify"] == {"groups": 2, "shadow_groups": 0, "members": 2, "disagreements": 1,
                                       "held_groups": 1, "disagreement_rate": 0.5}
    members = {r["trajectory_id"] for r in lake.read("snapshot_members").to_pylist()}
    assert members == {"a1", "a2", "a3"}                        # the held group is never trained on


def test_shadow_sample_reverifies_whole_groups_and_off_changes_nothing(tmp_path):
    from pipeline.admission.config import admission_config_hash
    from pipeline.admission.reverify import in_shadow_sample

    _, res = _admit(tmp_path, shadow_sample=1.0)
    assert CALLS == [["a1", "a2", "a3", "b1", "b2", "b3"]] and res.quality["reverify"]["shadow_groups"] == 2
    assert in_shadow_sample(["ga", "gb"], 0.0).tolist() == [False, False]
    # off (the default): no call, no reverify entry, the config hash of configs written before the keys
    lake = Lake(tmp_path / "plain")
    land(lake, ROWS)
    CALLS.clear()
    res = admit(lake, AdmissionConfig(quality=False), current_policy_version=5, now=NOW)
    assert CALLS == [] and "reverify" not in res.quality
    assert all("reverify" not in dict(r["checks"]) for r in lake.read("receipts").to_pylist())
    assert admission_config_hash(AdmissionConfig(quality=False, reverifier="x:y")) == \
        admission_config_hash(AdmissionConfig(quality=False))
    with pytest.raises(ConfigError, match="need a reverifier"):
        AdmissionConfig(reverify_top=1)


def test_the_report_shows_the_sample_and_disagreement_rates(tmp_path):
    from pipeline.report.build import build_report

    lake, _ = _admit(tmp_path, shadow_sample=1.0)
    page, res = build_report(lake)
    assert res["errors"] == []
    assert ("Re-verification: 2 of 2 decided groups re-verified, 2 of them in the shadow verifier sample "
            "(rate 100.0% of decided groups); 1 disagreed (disagreement rate 50.0%)") in page
    (a,) = [a for a in res["alert_checks"] if a["check"] == "verdict_disagreement"]
    assert a["message"].startswith("Re-verification disagreed with the recorded verdict in 1 of 2 re-verified groups")
    rec = {r["group_id"]: dict(r["checks"])["reverify"] for r in lake.read("receipts").to_pylist()}
    assert rec == {"ga": "pass:3 re-verified (shadow sample)", "gb": "fail:b1 PASS -> FAIL (shadow sample)"}


def test_verifier_evidence_and_confidence_land_and_reach_the_reverifier(tmp_path):
    """The contract's verifier_evidence / verifier_confidence (outside the hash): a confidence outside
    [0, 1] is quarantined; the re-verifier receives them with the rows."""
    from pipeline.ingest import ingest_table
    from pipeline.rollout.envs.base import Verification

    from admission_rows import to_table

    assert Verification("PASS", 1.0).confidence is None and Verification("PASS", 1.0).evidence is None
    rows = [dict(r, verifier_confidence=c, verifier_evidence=f"answer 4 == reference 4 ({r['trajectory_id']})")
            for r, c in zip(ROWS, (0.9, 0.2, 1.0, 0.99, 1.5, 0.5))]
    plain = to_table(ROWS).column("content_hash").to_pylist()
    t = to_table(rows)
    assert t.column("content_hash").to_pylist() == plain          # hashed: false
    lake = Lake(tmp_path / "lake")
    rep = ingest_table(lake, t)
    assert (rep.landed, rep.quarantined) == (5, 1)                # b2: confidence 1.5
    got = {r["trajectory_id"]: (r["verifier_confidence"], r["verifier_evidence"])
           for r in lake.read("trajectories").to_pylist()}
    assert got["b1"] == (0.99, "answer 4 == reference 4 (b1)") and "b2" not in got
    SEEN.clear()
    res = admit(lake, AdmissionConfig(quality=False, reverify_top=1, reverifier="test_reverify:confirming"),
                current_policy_version=5, now=NOW)
    assert res.counts == {"admit": 2} and res.quality["reverify"]["disagreements"] == 0
    assert SEEN == [{"trajectory_id": "a1", "verifier_confidence": 0.9,
                     "verifier_evidence": "answer 4 == reference 4 (a1)"},
                    {"trajectory_id": "b1", "verifier_confidence": 0.99,
                     "verifier_evidence": "answer 4 == reference 4 (b1)"}]
