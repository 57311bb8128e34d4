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
