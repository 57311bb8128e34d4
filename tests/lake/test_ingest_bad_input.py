"""The bad-input matrix: every kind of bad row is quarantined with an actionable
reason, good rows beside it land, and a file of only bad rows leaves the
trajectories table version unchanged."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.errors import InputFileError
from pipeline.ingest import ingest_files


def _write(path, table):
    pq.write_table(table, path)
    return path


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, default=_default) + "\n")
    return path


def _default(v):
    if isinstance(v, datetime):
        return v.isoformat()
    raise TypeError(type(v))


def _json_rows(table):
    rows = table.to_pylist()
    for r in rows:
        if r["reward_components"] is not None:
            r["reward_components"] = dict(r["reward_components"])
    return rows


def _quarantine(lake):
    return lake.read("quarantine").sort_by("source_row").to_pylist()


def _set(table, name, values, typ=None):
    i = table.schema.get_field_index(name)
    arr = pa.array(values, typ or table.schema.field(name).type)
    return table.set_column(i, pa.field(name, arr.type), arr)


FILE_LEVEL = ("unknown_column", "missing_column", "duplicate_column", "derived_column")


@pytest.fixture
def good(make_traj):
    return make_traj(4, seed=7, group_size=2)


def _base(lake, tmp_path, good):
    """Land the good rows first, so 'version unchanged' is measured on a real table."""
    r = ingest_files(lake, [_write(tmp_path / "good.parquet", good)])
    assert r.landed == 4
    return lake.version("trajectories")


def _only_bad(lake, tmp_path, good, table, code, fragment=None, name="bad.parquet"):
    v0 = _base(lake, tmp_path, good)
    r = ingest_files(lake, [_write(tmp_path / name, table)])
    assert r.landed == 0
    assert lake.version("trajectories") == v0, "bad rows must not create a table version"
    q = _quarantine(lake)
    assert r.rejected_rows == table.num_rows
    if code in FILE_LEVEL:     # every row fails alike: one entry for the whole file
        assert len(q) == 1 and q[0]["source_row"] == -1 and "a problem of the whole file" in q[0]["reason"]
        assert json.loads(q[0]["raw_row"])["rows"] == table.num_rows and r.file_problems
    else:
        assert len(q) == table.num_rows
    assert {row["reason_code"] for row in q} == {code}, q[0]["reason"]
    if fragment:
        assert fragment in q[0]["reason"], q[0]["reason"]
    assert all(row["source_file"].endswith(name) and row["raw_row"] for row in q)
    return q


def test_extra_column(lake, tmp_path, good, make_traj):
    bad = make_traj(2, seed=8).append_column("surprise", pa.array([1, 2]))
    _only_bad(lake, tmp_path, good, bad, "unknown_column", "surprise")


def test_missing_column(lake, tmp_path, good, make_traj):
    bad = make_traj(2, seed=8).drop_columns(["verifier_version"])
    _only_bad(lake, tmp_path, good, bad, "missing_column", "verifier_version")


def test_a_problem_of_the_whole_file_is_recorded_once_not_once_per_row(lake, tmp_path, good, make_traj, capsys):
    from pipeline.cli import main

    bad = make_traj(300, seed=9).drop_columns(["verifier_version", "env_version"])
    path = _write(tmp_path / "wide.parquet", bad)
    assert main(["ingest", str(path), "--lake", lake.uri]) == 1          # nothing landed
    out = capsys.readouterr().out
    assert "300 quarantined" in out and out.count("whole file, recorded once:") == 2, out
    assert "required column verifier_version is missing" in out and "required column env_version is missing" in out
    q = _quarantine(lake)
    assert [(row["source_row"], row["reason_code"]) for row in q] == [(-1, "missing_column")]   # one per code
    assert "env_version is missing; required column verifier_version is missing" in q[0]["reason"]
    cols = json.loads(q[0]["raw_row"])["columns"]
    assert "verifier_version" not in cols and cols["trajectory_id"] == "string"
    assert main(["ingest", str(path), "--lake", lake.uri]) == 1          # a rerun records nothing twice
    assert len(_quarantine(lake)) == 1


def test_wrong_type(lake, tmp_path, good, make_traj):
    bad = make_traj(2, seed=8)
    bad = _set(bad, "reward", ["1.0", "0.0"], pa.string())
    _only_bad(lake, tmp_path, good, bad, "wrong_type", "reward has type string")


def test_float64_logprobs_are_not_narrowed_silently(lake, tmp_path, good, make_traj):
    bad = make_traj(2, seed=8)
    i = bad.schema.get_field_index("response_logprobs")
    wide = pc.multiply(bad.column(i).combine_chunks().values.cast(pa.float64()), 1.0 + 1e-12)  # not float32-exact
    wide = pa.ListArray.from_arrays(bad.column(i).combine_chunks().offsets, wide)
    bad = bad.set_column(i, "response_logprobs", wide)
    _only_bad(lake, tmp_path, good, bad.drop_columns(["content_hash"]), "wrong_type", "cast explicitly")


def test_float64_logprobs_that_are_exact_float32_land(lake, tmp_path, make_traj):
    t = make_traj(2, seed=8)
    i = t.schema.get_field_index("response_logprobs")
    t = t.set_column(i, "response_logprobs", t.column(i).cast(pa.list_(pa.float64())))
    r = ingest_files(lake, [_write(tmp_path / "wide.parquet", t)])
    assert (r.landed, r.quarantined) == (2, 0)  # the given content_hash (of the float32 values) verifies


def test_int64_columns_that_fit_are_accepted(lake, tmp_path, make_traj):
    t = make_traj(3, seed=9)
    for name in ("group_size", "num_turns", "num_tool_calls"):
        i = t.schema.get_field_index(name)
        t = t.set_column(i, name, t.column(i).cast(pa.int64()))
    i = t.schema.get_field_index("response_ids")
    t = t.set_column(i, "response_ids", t.column(i).cast(pa.list_(pa.int64())))
    r = ingest_files(lake, [_write(tmp_path / "wide.parquet", t)])
    assert (r.landed, r.quarantined) == (3, 0)


def test_null_in_required_field(lake, tmp_path, good, make_traj):
    bad = _set(make_traj(2, seed=8), "task_id", [None, None])
    _only_bad(lake, tmp_path, good, bad, "null_required", "task_id is null")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward(lake, tmp_path, good, make_traj, value):
    bad = _set(make_traj(2, seed=8), "reward", [value, value])
    _only_bad(lake, tmp_path, good, bad, "not_finite", "not finite")


def test_null_reward_is_valid_and_distinct_from_zero(lake, tmp_path, make_traj):
    t = make_traj(2, seed=10)
    t = _set(t, "reward", [None, 0.0])
    t = _set(t, "status", ["INFRA_FAILED", "ACCEPTED"])
    t = _set(t, "verdict", ["ENV_ERROR", "FAIL"])
    t = t.drop_columns(["content_hash"])  # hashes change with the reward
    r = ingest_files(lake, [_write(tmp_path / "n.parquet", t)])
    assert r.landed == 2
    rewards = dict(zip(*lake.read("trajectories", columns=["verdict", "reward"]).to_pydict().values()))
    assert rewards == {"ENV_ERROR": None, "FAIL": 0.0}


def test_a_judged_row_without_a_reward_is_quarantined_not_landed_as_unevaluated(lake, tmp_path, good, make_traj):
    """pandas writes a NaN reward as a missing value: on a row that says ACCEPTED / PASS it would land as
    'no valid evaluation' and silently leave the group's baseline; it is a contradiction, so the row is held."""
    from pipeline.ingest import ingest_table

    _base(lake, tmp_path, good)
    t = make_traj(3, seed=11).drop_columns(["content_hash", "reward_components"])
    df = t.to_pandas()
    df["reward"] = df["reward"].astype("float64")
    df.loc[0, "reward"] = float("nan")                 # verdict PASS or FAIL, reward NaN
    df.loc[1, ["status", "verdict", "reward"]] = ["INFRA_FAILED", "UNKNOWN", float("nan")]   # consistent
    verdict0 = df.loc[0, "verdict"]
    r = ingest_table(lake.uri, df)
    assert r.landed == 2
    q = [row for row in _quarantine(lake) if row["reason_code"] == "reward_missing"]
    assert len(q) == 1 and f"verdict is {verdict0}" in q[0]["reason"] and "set verdict UNKNOWN" in q[0]["reason"]
    landed = {row["trajectory_id"]: row["reward"] for row in lake.read("trajectories").to_pylist()}
    assert df.loc[0, "trajectory_id"] not in landed and landed[df.loc[1, "trajectory_id"]] is None


def test_mismatched_list_lengths(lake, tmp_path, good, make_traj):
    t = make_traj(1, seed=8, median_len=13, sigma=0.0).drop_columns(["content_hash"])
    row = t.to_pylist()[0]
    assert len(row["response_ids"]) == 13
    row["response_logprobs"] = row["response_logprobs"][:12]
    bad = pa.Table.from_pylist([row], schema=t.schema)
    _only_bad(lake, tmp_path, good, bad, "length_mismatch", "response_logprobs has 12 elements, response_ids has 13")


def test_empty_response(lake, tmp_path, good, make_traj):
    t = make_traj(1, seed=8).drop_columns(["content_hash"])
    row = t.to_pylist()[0]
    row.update(response_ids=[], response_logprobs=[], loss_mask=[], token_policy_versions=[])
    bad = pa.Table.from_pylist([row], schema=t.schema)
    _only_bad(lake, tmp_path, good, bad, "empty_list", "response_ids is empty")


def test_loss_mask_all_zero(lake, tmp_path, good, make_traj):
    t = make_traj(1, seed=8).drop_columns(["content_hash"])
    row = t.to_pylist()[0]
    n = len(row["response_ids"])
    row.update(loss_mask=[0] * n, response_logprobs=[0.0] * n, token_policy_versions=[-1] * n)
    bad = pa.Table.from_pylist([row], schema=t.schema)
    _only_bad(lake, tmp_path, good, bad, "no_policy_tokens", "no policy-sampled token")


def test_nonzero_logprob_on_observation_token(lake, tmp_path, good, make_traj):
    t = make_traj(1, seed=8, median_len=40, sigma=0.0).drop_columns(["content_hash"])
    row = t.to_pylist()[0]
    k = row["loss_mask"].index(0)
    row["response_logprobs"][k] = -0.5
    bad = pa.Table.from_pylist([row], schema=t.schema)
    _only_bad(lake, tmp_path, good, bad, "nonzero_masked_logprob")


def test_unknown_enum_value(lake, tmp_path, good, make_traj):
    bad = _set(make_traj(2, seed=8), "status", ["DONE", "ACCEPTED"])
    v0 = _base(lake, tmp_path, good)
    r = ingest_files(lake, [_write(tmp_path / "enum.parquet", bad.drop_columns(["content_hash"]))])
    assert (r.landed, r.quarantined) == (1, 1)
    assert lake.version("trajectories") == v0 + 1
    q = _quarantine(lake)
    assert q[0]["reason_code"] == "bad_enum" and "'DONE' is not one of ACCEPTED" in q[0]["reason"]


def test_naive_timestamps_parquet(lake, tmp_path, good, make_traj):
    bad = make_traj(2, seed=8)
    for name in ("created_at", "finished_at"):
        i = bad.schema.get_field_index(name)
        bad = bad.set_column(i, name, bad.column(i).cast(pa.timestamp("us")))
    _only_bad(lake, tmp_path, good, bad, "naive_timestamp", "no time zone")


def test_naive_timestamps_jsonl(lake, tmp_path, good, make_traj):
    v0 = _base(lake, tmp_path, good)
    rows = _json_rows(make_traj(2, seed=8))
    for r in rows:
        r["created_at"] = r["created_at"].replace(tzinfo=None).isoformat()
    r = ingest_files(lake, [_jsonl(tmp_path / "naive.jsonl", rows)])
    assert r.landed == 0 and lake.version("trajectories") == v0
    q = _quarantine(lake)
    assert [x["reason_code"] for x in q] == ["naive_timestamp"] * 2
    assert json.loads(q[0]["raw_row"])["trajectory_id"] == rows[0]["trajectory_id"]


def test_reversed_timestamps(lake, tmp_path, good, make_traj):
    t = make_traj(2, seed=8)
    created = t.column("created_at")
    bad = _set(t, "finished_at", [c.as_py() - timedelta(seconds=5) for c in created])
    _only_bad(lake, tmp_path, good, bad.drop_columns(["content_hash"]), "time_order", "is before created_at")


def test_timestamps_in_other_time_zones_are_normalized_to_utc(lake, tmp_path, make_traj):
    t = make_traj(1, seed=11)
    i = t.schema.get_field_index("created_at")
    t = t.set_column(i, "created_at", t.column(i).cast(pa.timestamp("ms", tz="Europe/Berlin")))
    r = ingest_files(lake, [_write(tmp_path / "tz.parquet", t)])
    assert r.landed == 1  # same instant, same canonical hash


def test_wrong_content_hash(lake, tmp_path, good, make_traj):
    bad = _set(make_traj(2, seed=8), "content_hash", ["0" * 64, "f" * 64])
    _only_bad(lake, tmp_path, good, bad, "hash_mismatch", "does not match the canonical hash")


def test_duplicate_id_inside_one_file(lake, tmp_path, make_traj):
    t = make_traj(3, seed=12)
    same = pa.concat_tables([t, t.slice(0, 1)])              # exact repeat -> one lands, one duplicate
    r = ingest_files(lake, [_write(tmp_path / "dup.parquet", same)])
    assert (r.landed, r.duplicates, r.quarantined) == (3, 1, 0)
    other = make_traj(2, seed=13)
    clash = _set(other, "trajectory_id", ["x-1", "x-1"]).drop_columns(["content_hash"])
    v = lake.version("trajectories")
    r = ingest_files(lake, [_write(tmp_path / "clash.parquet", clash)])
    assert (r.landed, r.quarantined) == (0, 2)  # which one is right is unknowable: both quarantined
    assert lake.version("trajectories") == v
    assert {q["reason_code"] for q in _quarantine(lake)} == {"conflict"}


def test_duplicate_id_across_files(lake, tmp_path, make_traj):
    t = make_traj(4, seed=14)
    a = _write(tmp_path / "a.parquet", t.slice(0, 3))
    b = _write(tmp_path / "b.parquet", t.slice(1, 3))  # rows 1,2 repeat, row 3 is new
    r = ingest_files(lake, [a, b])
    assert (r.landed, r.duplicates, r.quarantined) == (4, 2, 0)
    r = ingest_files(lake, [b])  # the same file again: a no-op
    assert (r.landed, r.quarantined) == (0, 0) and r.skipped_files
    assert lake.read("trajectories", columns=["trajectory_id"]).num_rows == 4


def test_same_id_different_content_is_a_conflict(lake, tmp_path, good, make_traj):
    v0 = _base(lake, tmp_path, good)
    changed = _set(good.slice(0, 1), "reward", [7.0]).drop_columns(["content_hash"])
    r = ingest_files(lake, [_write(tmp_path / "changed.parquet", changed)])
    assert (r.landed, r.quarantined) == (0, 1)
    assert lake.version("trajectories") == v0
    q = _quarantine(lake)[0]
    assert q["reason_code"] == "conflict" and "already exists" in q["reason"]
    stored = lake.read("trajectories", columns=["trajectory_id", "reward"]).to_pylist()
    assert {r["trajectory_id"]: r["reward"] for r in stored}[good.column("trajectory_id")[0].as_py()] != 7.0


def test_reingest_is_a_noop(lake, tmp_path, good):
    p = _write(tmp_path / "good.parquet", good)
    ingest_files(lake, [p])
    versions = (lake.version("trajectories"), lake.version("quarantine"))
    r = ingest_files(lake, [p])
    assert (r.landed, r.duplicates, r.quarantined) == (0, 4, 0)
    assert (lake.version("trajectories"), lake.version("quarantine")) == versions


def test_reingest_of_a_file_with_bad_rows_does_not_quarantine_twice(lake, tmp_path, good, make_traj):
    bad = pa.concat_tables([make_traj(1, seed=20), _set(make_traj(1, seed=21), "status", ["NOPE"])],
                           promote_options="permissive")
    p = _write(tmp_path / "mixed.parquet", bad)
    ingest_files(lake, [p])
    ingest_files(lake, [p])
    assert lake.read("quarantine").num_rows == 1
    assert lake.read("trajectories").num_rows == 1


def test_empty_file_is_a_clear_error_and_writes_nothing(lake, tmp_path, good):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(InputFileError, match="empty"):
        ingest_files(lake, [_write(tmp_path / "good.parquet", good), tmp_path / "empty.jsonl"])
    assert lake.version("trajectories") is None


def test_corrupt_file_is_a_clear_error_and_writes_nothing(lake, tmp_path, good):
    p = _write(tmp_path / "c.parquet", good)
    data = p.read_bytes()
    (tmp_path / "corrupt.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputFileError, match="corrupt or truncated"):
        ingest_files(lake, [p, tmp_path / "corrupt.parquet"])
    assert lake.version("trajectories") is None and lake.version("quarantine") is None


def test_zero_row_parquet_lands_nothing(lake, tmp_path, good):
    r = ingest_files(lake, [_write(tmp_path / "zero.parquet", good.slice(0, 0))])
    assert (r.rows_read, r.landed, r.quarantined) == (0, 0, 0)


def test_jsonl_matrix(lake, tmp_path, make_traj):
    rows = _json_rows(make_traj(6, seed=30))
    rows[1]["num_turns"] = 1.5                 # float for an int field
    rows[2]["reward"] = True                   # bool is not a number here
    rows[3]["response_ids"] = "1 2 3"          # not a list
    del rows[4]["env_version"]                 # missing field
    lines = [json.dumps(r, default=_default) for r in rows] + ["{not json"]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    r = ingest_files(lake, [tmp_path / "m.jsonl"])
    assert (r.landed, r.quarantined) == (2, 5)
    codes = [q["reason_code"] for q in _quarantine(lake)]
    assert codes == ["wrong_type", "wrong_type", "wrong_type", "missing_column", "bad_json"]
    assert _quarantine(lake)[4]["raw_row"] == "{not json"


def test_arrow_ipc_and_jsonl_land_the_same_rows_as_parquet(tmp_path, make_traj):
    from pipeline.lake.delta import Lake

    t = make_traj(5, seed=31)
    ipc = tmp_path / "t.arrow"
    with pa.ipc.new_file(ipc, t.schema) as w:
        w.write_table(t)
    hashes = {}
    for name, path in (("pq", _write(tmp_path / "t.parquet", t)), ("ipc", ipc),
                       ("jsonl", _jsonl(tmp_path / "t.jsonl", _json_rows(t)))):
        lk = Lake(tmp_path / f"lake-{name}")
        assert ingest_files(lk, [path]).landed == 5
        hashes[name] = sorted(lk.read("trajectories", columns=["content_hash"]).column(0).to_pylist())
    assert hashes["pq"] == hashes["ipc"] == hashes["jsonl"] == sorted(t.column("content_hash").to_pylist())


def test_stored_rows_carry_derived_columns(lake, tmp_path, good):
    r = ingest_files(lake, [_write(tmp_path / "good.parquet", good)])
    t = lake.read("trajectories", columns=["created_at", "created_day", "ingest_id"])
    assert set(t.column("ingest_id").to_pylist()) == {r.ingest_id}
    days = pc.cast(t.column("created_at"), pa.date32())
    assert t.column("created_day").equals(days)


def test_jsonl_lines_split_on_newline_only_and_bad_utf8_is_quarantined(lake, tmp_path, make_traj):
    rows = _json_rows(make_traj(2, seed=40))
    rows[0]["difficulty"] = "a\u2028b"  # a raw line separator inside a JSON string is valid JSON
    for row in rows:
        del row["content_hash"]  # recomputed on ingest
    text = "\n".join(json.dumps(r, default=_default, ensure_ascii=False) for r in rows).encode()
    text += b'\n{"trajectory_id": "bad-\xff"}\n'
    (tmp_path / "u.jsonl").write_bytes(text)
    r = ingest_files(lake, [tmp_path / "u.jsonl"])
    assert (r.rows_read, r.landed, r.quarantined) == (3, 2, 1)
    q = _quarantine(lake)[0]
    assert q["source_row"] == 2 and "not valid UTF-8" in q["reason"]
    assert "a\u2028b" in lake.read("trajectories", columns=["difficulty"]).column(0).to_pylist()


@pytest.mark.parametrize("column", ["response_ids", "prompt_ids"])
def test_negative_token_id_is_quarantined(lake, tmp_path, good, make_traj, column):
    """-100 (the ignore index) landed before: admitted, then refused by the trainer."""
    t = make_traj(1, seed=8, median_len=8, sigma=0.0).drop_columns(["content_hash"])
    row = t.to_pylist()[0]
    row[column] = row[column][:2] + [-100] + row[column][3:]
    bad = pa.Table.from_pylist([row], schema=t.schema)
    _only_bad(lake, tmp_path, good, bad, "out_of_range", f"{column}[2]=-100 is outside [0, inf]")


# -- odd in-memory frames through ingest_table: a quarantine reason or one clear error, never a raw exception


def test_odd_frames_land_or_get_one_clear_error(lake, make_traj):
    import numpy as np
    import polars as pl

    from pipeline.ingest import ingest_table

    t = make_traj(4, seed=1, median_len=4)
    c = t.column("response_ids").combine_chunks()
    off = np.asarray(c.offsets)
    lv = pa.ListViewArray.from_arrays(pa.array(off[:-1], pa.int32()), pa.array(np.diff(off), pa.int32()), c.values)
    as_view = t.set_column(t.schema.get_field_index("response_ids"), "response_ids", lv)
    assert ingest_table(lake, as_view).landed == 4                              # list_view: decoded
    u = make_traj(4, seed=2, median_len=4, id_prefix="p-")
    assert ingest_table(lake, u.to_pandas()).landed == 4                         # a map column as (k, v) tuples
    w = make_traj(4, seed=3, median_len=4, id_prefix="l-")
    assert ingest_table(lake, pl.from_arrow(w).lazy()).landed == 4               # a polars LazyFrame: collected
    dup = pa.Table.from_arrays(list(w.columns) + [w.column("reward")], names=w.column_names + ["reward"])
    r = ingest_table(lake, dup)
    assert r.landed == 0 and r.reasons == {"duplicate_column": 1} and r.rejected_rows == 4   # one entry: the file's
    mixed = make_traj(4, seed=4, median_len=4, id_prefix="m-").to_pandas()
    mixed["task_id"] = ["a", 1, 2.5, None]
    with pytest.raises(InputFileError, match=r"column 'task_id' \(pandas dtype object\) cannot be converted .*"
                                             r"float, int, str"):
        ingest_table(lake, mixed)
    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0).to_pylist()
    assert len(ids) == len(set(ids)) == 12


def test_jsonl_unknown_column_of_every_line_is_one_file_entry_with_did_you_mean(lake, tmp_path, make_traj):
    """As for Parquet: a key every line carries is a column of the file, quarantined once for the
    file (not once per row), and a close contract name is suggested; a key only some lines carry
    rejects those lines."""
    rows = _json_rows(make_traj(4, seed=31))
    for r in rows:
        r["rewrd"] = r["reward"]
    r = ingest_files(lake, [_jsonl(tmp_path / "typo.jsonl", rows)])
    assert (r.landed, r.quarantined) == (0, 1) and r.rejected_rows == 4
    (q,) = _quarantine(lake)
    assert q["source_row"] == -1 and q["reason_code"] == "unknown_column"
    assert "['rewrd']" in q["reason"] and "did you mean 'reward' for 'rewrd'?" in q["reason"]
    rows = _json_rows(make_traj(3, seed=32))
    rows[1]["rewrd"] = 1.0
    r = ingest_files(lake, [_jsonl(tmp_path / "one.jsonl", rows)])
    assert (r.landed, r.quarantined) == (2, 1)
    row = [q for q in _quarantine(lake) if q["source_file"].endswith("one.jsonl")]
    assert [(q["source_row"], q["reason_code"]) for q in row] == [(1, "unknown_column")]
    assert "did you mean 'reward'" in row[0]["reason"]


def test_jsonl_reason_reads_as_a_sentence(lake, tmp_path):
    """json's "Unterminated string starting at" + " at column N" read "at at column"."""
    (tmp_path / "u.jsonl").write_text('{"trajectory_id": "abc\n{"a": 1,}\n')
    ingest_files(lake, [tmp_path / "u.jsonl"])
    reasons = [q["reason"] for q in _quarantine(lake)]
    assert reasons[0] == "line 1 is not valid JSON: Unterminated string starting at column 19"
    assert reasons[1].endswith("enclosed in double quotes at column 9")
    assert not any("at at" in x for x in reasons)


@pytest.mark.parametrize("kind", ["parquet", "ipc", "binary"])
def test_binary_bytes_named_jsonl_are_one_clear_reason(lake, tmp_path, good, kind):
    path = tmp_path / "rows.jsonl"
    if kind == "parquet":
        _write(path, good)
    elif kind == "ipc":
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, good.schema) as w:
            w.write_table(good)
    else:
        path.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00" + bytes(range(256)) * 4)
    with pytest.raises(InputFileError) as e:
        ingest_files(lake, [path])
    assert "named .jsonl but holds" in str(e.value)
    assert ("rename it *.parquet" in e.value.hint) if kind == "parquet" else True
    assert not lake.exists("quarantine") or lake.read("quarantine").num_rows == 0
