"""Natural producer output lands, or reports every problem of every row at once.

A pandas DataFrame written with ``to_parquet`` (int64 everywhere, float64
log-probs, dicts as structs, missing ints as float NaN, nanosecond UTC
timestamps, a non-default index) lands after exact conversions; a file with
several problems per row gets all of them in one quarantine pass; odd input
(null list elements, uint64 above 2^63, repeated columns, invalid UTF-8, lone
surrogates) is a reject with a reason, never a traceback.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.ingest import ingest_files
from pipeline.lake.validate import validate_table
from pipeline.schema import table_spec


def _frame(make_traj, n=12, seed=40):
    t = make_traj(n, seed=seed, median_len=10, group_size=3)
    rows = t.drop_columns(["content_hash"]).to_pylist()
    for r in rows:
        r["reward_components"] = dict(r["reward_components"])
    df = pd.DataFrame(rows)
    df.loc[1, "sampling_seed"] = None          # -> float64 with NaN, as pandas does
    df.at[2, "token_policy_versions"] = None
    for c in ("created_at", "finished_at"):
        df[c] = pd.to_datetime(df[c], utc=True).astype("datetime64[ns, UTC]")
    return t, df.set_index(pd.Index([f"r{i}" for i in range(n)]))  # a non-default index


def _quarantine(lake):
    return lake.read("quarantine").sort_by("source_row").to_pylist()


def test_pandas_natural_dtypes_land_exactly(lake, tmp_path, make_traj):
    t, df = _frame(make_traj)
    path = tmp_path / "pandas.parquet"
    df.to_parquet(path)
    schema = pq.read_schema(path)
    assert schema.field("group_size").type == pa.int64()
    assert pa.types.is_struct(schema.field("reward_components").type)
    assert schema.field("sampling_seed").type == pa.float64()
    assert schema.field("response_logprobs").type == pa.list_(pa.float64())
    assert schema.field("created_at").type.unit == "ns"
    r = ingest_files(lake, [path])
    assert (r.landed, r.quarantined) == (12, 0), _quarantine(lake) if r.quarantined else r
    got = lake.read("trajectories").sort_by("trajectory_id")
    changed = {t.column("trajectory_id")[1].as_py(), t.column("trajectory_id")[2].as_py()}
    want = t.sort_by("trajectory_id")
    # the same hashes as the typed originals, except the two rows we changed
    for tid, h, h0 in zip(got.column("trajectory_id").to_pylist(), got.column("content_hash").to_pylist(),
                          want.column("content_hash").to_pylist()):
        assert (h == h0) == (tid not in changed), tid
    assert got.column("sampling_seed").null_count == 1
    assert got.column("token_policy_versions").null_count == 1
    assert dict(got.column("reward_components")[0].as_py()) == dict(want.column("reward_components")[0].as_py())


def test_every_problem_of_a_row_in_one_pass(lake, tmp_path, make_traj):
    _, df = _frame(make_traj)
    df["status"] = "DONE"                                        # bad enum
    df.loc["r0", "temperature"] = -1.0                              # out of range
    df["created_at"] = df["created_at"].dt.tz_localize(None)     # naive timestamps
    df.at["r3", "response_ids"] = df.at["r3", "response_ids"][:-1]     # length mismatch
    df["response_logprobs"] = [[x + 1e-9 if x else 0.0 for x in v] for v in df["response_logprobs"]]  # lossy
    path = tmp_path / "bad.parquet"
    df.to_parquet(path)
    r = ingest_files(lake, [path])
    assert (r.landed, r.quarantined) == (0, 12)
    q = _quarantine(lake)
    for row in q:
        for fragment in ("'DONE' is not one of", "created_at has no time zone", "response_logprobs has double",
                         "cast explicitly"):
            assert fragment in row["reason"], row["reason"]
    assert "temperature=-1.0 is outside" in q[0]["reason"]
    assert "response_ids has" in q[3]["reason"] or "elements, response_ids has" in q[3]["reason"], q[3]["reason"]
    assert q[0]["reason"].startswith("4 problems: ")
    # a failed cell is reported once, not again by the checks that read it
    assert "null but required" not in q[0]["reason"]


def test_null_list_elements_are_quarantined_with_the_index(lake, tmp_path, make_traj):
    t = make_traj(3, seed=41, median_len=10, group_size=3).drop_columns(["content_hash"])
    rows = t.to_pylist()
    rows[0]["response_ids"][2] = None
    rows[1]["prompt_ids"][0] = None
    rows[2]["token_policy_versions"][1] = None
    v = validate_table(pa.Table.from_pylist(rows, schema=t.schema))
    assert [(r.row, r.code) for r in v.rejects] == [(0, "null_element"), (1, "null_element"), (2, "null_element")]
    assert "response_ids[2] is null" in v.rejects[0].message
    assert "prompt_ids[0] is null" in v.rejects[1].message
    assert "token_policy_versions[1] is null; write -1 on observation tokens" in v.rejects[2].message
    assert len(v.rejects[0].problems) == 1  # not also a length/enum consequence


def test_uint64_duplicate_columns_and_invalid_utf8_are_rejects(make_traj):
    t = make_traj(2, seed=42, median_len=10).drop_columns(["content_hash"])
    big = t.set_column(t.schema.get_field_index("queue_wait_ms"), "queue_wait_ms",
                       pa.array([2**63 + 5, 7], pa.uint64()))
    v = validate_table(big)
    assert [(r.row, r.code) for r in v.rejects] == [(0, "out_of_range")]
    assert "queue_wait_ms=9223372036854775813 does not fit int64" in v.rejects[0].message
    dup = pa.Table.from_arrays(t.columns + [t.column("task_id")], names=t.column_names + ["task_id"])
    v = validate_table(dup)
    assert {r.code for r in v.rejects} == {"duplicate_column"} and "['task_id']" in v.rejects[0].message
    ids = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(np.array([0, 2, 4], np.int32).tobytes()),
                                                 pa.py_buffer(b"\xff\xfeok")])
    bad = t.set_column(t.schema.get_field_index("task_id"), "task_id", ids)
    v = validate_table(bad)
    assert [(r.row, r.code) for r in v.rejects] == [(0, "bad_utf8")]
    assert v.valid.num_rows == 1


def test_lone_surrogate_and_invalid_utf8_in_jsonl(lake, tmp_path, make_traj):
    t = make_traj(3, seed=43, median_len=10, group_size=3).drop_columns(["content_hash"])
    rows = t.to_pylist()
    lines = []
    for r in rows:
        r["reward_components"] = dict(r["reward_components"])
        lines.append(json.dumps(r, default=lambda v: v.isoformat()))
    lines[0] = lines[0].replace('"task_id": "', '"task_id": "\\ud800', 1)
    lines[1] = lines[1].replace('"num_turns": ', '"num_turns": 1.5, "x": ', 1)  # two problems
    data = (lines[0] + "\n" + lines[1] + "\n").encode() + lines[2].encode().replace(b"tok-1", b"tok-\xff") + b"\n"
    (tmp_path / "s.jsonl").write_bytes(data)
    r = ingest_files(lake, [tmp_path / "s.jsonl"])
    assert (r.landed, r.quarantined) == (0, 3)
    q = _quarantine(lake)
    assert q[0]["reason_code"] == "bad_utf8" and "lone surrogate" in q[0]["reason"]
    assert q[1]["reason"].startswith("2 problems") and "unknown column(s) ['x']" in q[1]["reason"]
    assert q[2]["reason_code"] == "bad_json" and "not valid UTF-8" in q[2]["reason"]


def test_exact_conversions_structs_units_and_zones(make_traj):
    t = make_traj(2, seed=44, median_len=10)
    want = t.column("content_hash").to_pylist()
    i = t.schema.get_field_index("reward_components")
    comps = [dict(x) for x in t.column(i).to_pylist()]
    conv = t.set_column(i, "reward_components", pa.array(comps))  # struct<format, task_success, tool_cost>
    for name in ("created_at", "finished_at"):
        j = conv.schema.get_field_index(name)
        conv = conv.set_column(j, name, conv.column(j).cast(pa.timestamp("us", tz="Asia/Kolkata")))
    j = conv.schema.get_field_index("prompt_ids")
    conv = conv.set_column(j, "prompt_ids", conv.column(j).cast(pa.large_list(pa.int64())))
    v = validate_table(conv)
    assert v.rejects == [] and v.valid.column("content_hash").to_pylist() == want
    ms = t.set_column(t.schema.get_field_index("created_at"), "created_at",
                      t.column("created_at").cast(pa.timestamp("ms", tz="UTC"), safe=False))
    assert validate_table(ms.drop_columns(["content_hash"])).rejects == []


def test_ingest_schema_marks_optional_columns_nullable():
    s = table_spec("trajectories").ingest_schema()
    assert s.field("content_hash").nullable
    assert not s.field("trajectory_id").nullable and s.field("reward").nullable
    assert "created_day" not in s.names


def test_invalid_utf8_parquet_is_quarantined_by_ingest(lake, tmp_path, make_traj):
    t = make_traj(2, seed=45, median_len=10).drop_columns(["content_hash"])
    ids = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(np.array([0, 2, 4], np.int32).tobytes()),
                                                 pa.py_buffer(b"\xff\xfeok")])
    t = t.set_column(t.schema.get_field_index("task_id"), "task_id", ids)
    pq.write_table(t, tmp_path / "u.parquet")
    r = ingest_files(lake, [tmp_path / "u.parquet"])
    assert (r.landed, r.quarantined) == (1, 1)
    q = _quarantine(lake)
    assert q[0]["reason_code"] == "bad_utf8" and "\\xff" in q[0]["raw_row"]


def test_safe_raw_renders_what_validation_rejects(make_traj):
    from pipeline.lake.validate import safe_raw

    t = make_traj(1, seed=46, median_len=10).drop_columns(["content_hash"])
    ids = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(np.array([0, 2], np.int32).tobytes()),
                                                 pa.py_buffer(b"\xffA")])
    t = t.set_column(t.schema.get_field_index("task_id"), "task_id", ids)
    t = pa.Table.from_arrays(t.columns + [t.column("run_id")], names=t.column_names + ["run_id"])
    row = safe_raw(t).to_pylist()[0]
    assert row["task_id"] == "\\xffA" and row["run_id#2"] == row["run_id"]


def test_repeated_map_keys_and_nan_have_no_hash(make_traj):
    from pipeline.lake.contenthash import content_hash

    t = make_traj(2, seed=47, median_len=10).drop_columns(["content_hash"])
    i = t.schema.get_field_index("reward_components")
    comps = pa.array([[("a", 1.0), ("b", 2.0), ("a", 3.0)], [("a", 1.0)]], pa.map_(pa.string(), pa.float64()))
    v = validate_table(t.set_column(i, "reward_components", comps))
    assert [(r.row, r.code) for r in v.rejects] == [(0, "duplicate_key")] and "'a'" in v.rejects[0].message
    row = t.to_pylist()[0]
    with pytest.raises(ValueError, match="repeats"):
        content_hash(row | {"reward_components": [("a", 1.0), ("a", 2.0)]})
    with pytest.raises(ValueError, match="NaN"):
        content_hash(row | {"reward": float("nan")})


def test_repeated_columns_are_a_clear_error_or_quarantined(lake, tmp_path, make_traj):
    from pipeline.errors import InputFileError

    t = make_traj(2, seed=48, median_len=10).drop_columns(["content_hash"])
    dup = pa.Table.from_arrays(t.columns + [t.column("task_id")], names=t.column_names + ["task_id"])
    pq.write_table(dup, tmp_path / "d.parquet")
    with pytest.raises(InputFileError, match="Multiple matches"):  # the Parquet reader refuses the file
        ingest_files(lake, [tmp_path / "d.parquet"])
    assert not lake.version("trajectories")  # no rows landed (at most the empty table was created)
    with pa.ipc.new_file(tmp_path / "d.arrow", dup.schema) as w:  # Arrow IPC reads: validation rejects
        w.write_table(dup)
    r = ingest_files(lake, [tmp_path / "d.arrow"])
    assert (r.landed, r.quarantined, r.rejected_rows) == (0, 1, 2) and r.reasons == {"duplicate_column": 1}  # the file
