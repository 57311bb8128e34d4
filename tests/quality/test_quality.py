"""great-expectations suites generated from schemas/, run on candidate batches and snapshots."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from pipeline.quality.suites import suite_for
from pipeline.schema import table_spec


def test_suite_is_generated_from_the_schema():
    specs = suite_for("trajectories")
    by = {(s.type, s.column): dict(s.kwargs) for s in specs}
    spec = table_spec("trajectories")
    required_scalars = [c.name for c in spec.columns if c.required and not c.is_list
                        and not c.type_text.startswith("map")]
    assert {c for t, c in by if t == "expect_column_values_to_not_be_null"} == set(required_scalars)
    assert by[("expect_column_values_to_be_in_set", "status")]["value_set"] == tuple(spec.column("status").enum)
    assert by[("expect_column_values_to_be_between", "top_p")] == {"min_value": 0, "max_value": 1}
    assert by[("expect_column_values_to_be_between", "group_size")] == {"min_value": 1, "max_value": None}
    assert not any(c in ("response_ids", "reward_components") for _, c in by)  # lists and maps: ingest's job
    assert suite_for("trajectories", ["status"]) == [s for s in specs if s.column == "status"]


@pytest.mark.slow
def test_gx_reports_failing_rows_with_the_first_failed_expectation():
    from pipeline.quality.gx import validate

    t = pa.table({"trajectory_id": ["a", "b", "c", "d"], "status": ["ACCEPTED", "WEIRD", "ACCEPTED", "WEIRD"],
                  "group_size": pa.array([4, 4, 0, 0], pa.int32()), "top_p": [1.0, 0.5, 1.0, 1.0]})
    res = validate(t, "trajectories", key="trajectory_id")
    assert not res.success
    # d fails both; the reason is the first in declared (schema) order: group_size precedes status
    assert res.failing == {"b": "quality:expect_column_values_to_be_in_set(status)",
                           "c": "quality:expect_column_values_to_be_between(group_size)",
                           "d": "quality:expect_column_values_to_be_between(group_size)"}
    failed = {(f["expectation"], f["column"]): f["unexpected_count"] for f in res.summary["failed"]}
    assert failed == {("expect_column_values_to_be_in_set", "status"): 2,
                      ("expect_column_values_to_be_between", "group_size"): 2}
    ok = validate(t.slice(0, 1), "trajectories", key="trajectory_id")
    assert ok.success and ok.failing == {}


@pytest.mark.slow
def test_admission_excludes_failing_rows_and_stores_the_validation(lake):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "admission"))
    from admission_rows import NOW, to_table, traj

    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.lake.ingest import stamp_derived

    rows = [traj(f"q{k}", "g", reward=float(k % 2)) for k in range(4)]
    rows[2]["status"] = "WEIRD"  # written past ingest (e.g. by a buggy writer): GX catches it
    lake.append("trajectories", stamp_derived(to_table(rows), "raw"), command="test")
    res = admit(lake, AdmissionConfig(quality=True), current_policy_version=5, now=NOW)
    rec = res.receipts.to_pylist()[0]
    assert dict(rec["excluded_members"]) == {"q2": "quality:expect_column_values_to_be_in_set(status)"}
    assert dict(rec["checks"])["quality"] == "fail:quality:expect_column_values_to_be_in_set(status)=1"
    assert rec["decision"] == "admit" and rec["valid_members"] == ["q0", "q1", "q3"]
    stored = json.loads(lake.read("snapshots", columns=["quality_json"]).column(0)[0].as_py())
    assert stored["snapshot"]["suite"] == "snapshot_members" and stored["snapshot"]["success"] is True
    assert stored["snapshot"]["rows"] == 3
    assert stored["candidates"]["suite"] == "trajectories" and stored["candidates"]["success"] is False
    assert res.quality["candidates"]["failed"] == [
        {"expectation": "expect_column_values_to_be_in_set", "column": "status", "unexpected_count": 1}]


@pytest.mark.slow
def test_failures_in_several_expectations_match_a_single_complete_pass():
    """The two-pass validation (BOOLEAN_ONLY over the suite, COMPLETE for the failed expectations
    on their columns, int32 columns handed to pandas as int64) reports exactly what one COMPLETE pass
    of the whole suite over the unconverted frame reports: same rows, same reasons, same summary."""
    from pipeline.quality import gx

    bad = {  # id -> overrides; a row failing several expectations gets the first declared one
        "r01": {"group_size": 0},
        "r02": {"group_size": None},
        "r03": {"group_size": 0, "status": "WEIRD"},
        "r04": {"status": "WEIRD"},
        "r05": {"status": None},
        "r06": {"top_p": 2.0, "num_tool_calls": -1},
        "r07": {"num_tool_calls": -1},
        "r08": {"queue_wait_ms": -5, "content_hash": None},
        "r09": {"content_hash": None},
        "r10": {"top_p": None},
    }
    good = {"group_size": 4, "top_p": 1.0, "status": "ACCEPTED", "num_tool_calls": 2, "queue_wait_ms": 10,
            "content_hash": "h"}
    rows = [{"trajectory_id": f"r{i:02d}"} | good | bad.get(f"r{i:02d}", {}) for i in range(30)]
    t = pa.Table.from_pylist(rows, pa.schema([("trajectory_id", pa.string()), ("group_size", pa.int32()),
                                              ("top_p", pa.float64()), ("status", pa.string()),
                                              ("num_tool_calls", pa.int32()), ("queue_wait_ms", pa.int64()),
                                              ("content_hash", pa.string())]))
    res = gx.validate(t, "trajectories", key="trajectory_id")

    q = "quality:expect_column_values_to_"
    assert res.failing == {
        "r01": f"{q}be_between(group_size)", "r02": f"{q}not_be_null(group_size)",
        "r03": f"{q}be_between(group_size)", "r04": f"{q}be_in_set(status)", "r05": f"{q}not_be_null(status)",
        "r06": f"{q}be_between(top_p)", "r07": f"{q}be_between(num_tool_calls)",
        "r08": f"{q}be_between(queue_wait_ms)", "r09": f"{q}not_be_null(content_hash)",
        "r10": f"{q}not_be_null(top_p)"}
    assert [(f["expectation"].removeprefix("expect_column_values_to_"), f["column"], f["unexpected_count"])
            for f in res.summary["failed"]] == [
        ("not_be_null", "group_size", 1), ("be_between", "group_size", 2), ("not_be_null", "top_p", 1),
        ("be_between", "top_p", 1), ("not_be_null", "status", 1), ("be_in_set", "status", 2),
        ("be_between", "num_tool_calls", 2), ("be_between", "queue_wait_ms", 1),
        ("not_be_null", "content_hash", 2)]
    assert res.summary["statistics"] == {"evaluated_expectations": 12.0, "successful_expectations": 3.0,
                                         "unsuccessful_expectations": 9.0, "success_percent": 25.0}
    assert not res.success and res.summary["success"] is False and res.summary["rows"] == 30

    # the reference: one COMPLETE pass of the whole suite over the frame as pyarrow converts it
    specs = suite_for("trajectories", t.column_names)
    ref = gx._run("trajectories", t.to_pandas(), gx._suite("ref", specs),
                  {"result_format": "COMPLETE", "unexpected_index_column_names": ["trajectory_id"]})
    by = {(r.expectation_config.type, r.expectation_config.kwargs["column"]): r for r in ref.results}
    failing: dict[str, str] = {}
    failed = []
    for s in specs:
        r = by[(s.type, s.column)]
        if not r.success:
            ids = [row["trajectory_id"] for row in r.result["unexpected_index_list"]]
            failed.append({"expectation": s.type, "column": s.column, "unexpected_count": len(ids)})
            for i in ids:
                failing.setdefault(i, s.reason)
    assert res.failing == failing and res.summary["failed"] == failed
    assert res.summary["statistics"] == {k: float(v) for k, v in ref.statistics.items()}

    again = gx.validate(t, "trajectories", key="trajectory_id")  # nothing is registered per call
    assert again.failing == res.failing and again.summary == res.summary
    assert gx._context().suites.all() == [] and gx._context().validation_definitions.all() == []
