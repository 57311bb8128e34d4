"""The content hash as a stranger would implement it: from schemas/README.md alone.

``spec_hash`` below is written from the text of schemas/README.md ("Canonical
content hash") with nothing but hashlib/struct/json/datetime; it does not
import pipeline.lake.contenthash, and it reads the hashed column list from the
README table itself. It must agree with the golden vectors in
schemas/hash_vectors.jsonl, with ``pipeline.lake.content_hashes`` and with
the hashes the lake stores for rows it ingested.

Regenerate the vectors (only when the spec changes, with a new hash version):
``PYTHONPATH=. python tests/lake/test_hash_spec.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "schemas" / "README.md"
VECTORS = ROOT / "schemas" / "hash_vectors.jsonl"
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


# -- the independent implementation (README text only) ------------------------------------
def spec_columns() -> list[tuple[str, str]]:
    """(name, type) of the hashed columns, parsed from the README's table."""
    text = SPEC.read_text()
    block = text[text.index("<!-- hash-columns:begin -->"):text.index("<!-- hash-columns:end -->")]
    rows = re.findall(r"^\| (\d+) \| (\w+) \| ([^|]+?) \|$", block, flags=re.M)
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1))
    return [(name, typ) for _, name, typ in rows]


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _i64(n: int) -> bytes:
    return struct.pack("<q", n)


def _micros(text: str) -> int:
    frac = re.search(r"T[0-9:]+[.,]([0-9]+)", text)
    if frac and frac.group(1)[6:].strip("0"):
        raise ValueError(f"{text}: finer than a microsecond has no hash")
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if t.tzinfo is None:
        raise ValueError(f"{text}: a timestamp without a UTC offset has no hash")
    return (t - EPOCH) // timedelta(microseconds=1)


def _finite(x) -> float:
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{x!r}: a null, NaN or infinite number inside a value has no hash")
    return float(x)


_WIDTH = {"int32": "<i", "int8": "<b", "float32": "<f"}


def trailer_columns() -> list[str]:
    """The README's ``hashed: when_present`` columns (the TRAILER), in order."""
    text = SPEC.read_text()
    block = text[text.index("<!-- hash-trailer:begin -->"):text.index("<!-- hash-trailer:end -->")]
    rows = re.findall(r"^\| (\d+) \| (\w+) \| string \|$", block, flags=re.M)
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1))
    return [name for _, name in rows]


def canonical_form(row: dict) -> bytes:
    """The canonical byte string of one row given in the JSON-lines ingest form."""
    header, strings, maps, lists = [], [], [], []
    for name, typ in spec_columns():
        v = row.get(name)
        entry = name.encode("utf-8") + b"\x00"
        if v is None:
            header.append(entry + b"\x00" + b"\x00" * 8)
            continue
        entry += b"\x01"
        if typ == "string":
            b = v.encode("utf-8")  # a lone surrogate raises: such text has no hash
            entry += _u64(len(b))
            strings.append(b)
        elif typ in ("int32", "int64"):
            entry += _i64(v)
        elif typ == "float64":
            entry += struct.pack("<d", _finite(v))
        elif typ == "timestamp[us, UTC]":
            entry += _i64(_micros(v))
        elif typ.startswith("list<"):
            fmt = _WIDTH[typ[5:-1]]
            entry += _u64(len(v))
            if any(x is None for x in v):
                raise ValueError(f"{name}: a null list element has no hash")
            # a float32 element: the JSON number as the nearest binary64, then the nearest binary32 (struct does it)
            lists.append(b"".join(struct.pack(fmt, _finite(x) if fmt == "<f" else x) for x in v))
        elif typ.startswith("map<"):
            entry += _u64(len(v))
            items = sorted((k.encode("utf-8"), _finite(x)) for k, x in v.items())
            maps.append(b"".join(_u64(len(k)) + k + struct.pack("<d", x) for k, x in items))
        else:
            raise AssertionError(f"type {typ} not in the spec")
        header.append(entry)
    trailer = []
    for name in trailer_columns():
        if row.get(name) is not None:
            b = row[name].encode("utf-8")
            trailer.append(name.encode("utf-8") + b"\x00" + _u64(len(b)) + b)
    return b"".join(header) + b"".join(strings) + b"".join(maps) + b"".join(lists) + b"".join(trailer)


def spec_hash(row: dict) -> str:
    return hashlib.sha256(canonical_form(row)).hexdigest()


# -- the tests ------------------------------------------------------------------------------
def _vectors() -> list[dict]:
    return [json.loads(line) for line in VECTORS.read_text().splitlines() if line.strip()]


def test_readme_columns_are_the_schema():
    from pipeline.lake.contenthash import hashed_columns

    assert spec_columns() == [(c.name, c.type_text) for c in hashed_columns()]


def _excluded() -> dict[str, str]:
    text = SPEC.read_text()
    block = text[text.index("<!-- hash-excluded:begin -->"):text.index("<!-- hash-excluded:end -->")]
    return dict(re.findall(r"^\| (\w+) \| ([^|]+?) \|$", block, flags=re.M)[1:])


def test_the_column_rule_applied_to_the_yaml_gives_the_readme_table():
    """The README's rule (every column without `ingest: derived`, in YAML order,
    except content_hash and the `hashed: false` ones), applied to the YAML with
    a plain YAML reader, gives the README's hashed table; the README's table of
    excluded columns names every other column, each for its reason."""
    import yaml

    cols = yaml.safe_load((ROOT / "schemas" / "trajectories.yaml").read_text())["columns"]
    by_rule = [(c["name"], c["type"]) for c in cols
               if c.get("ingest") != "derived" and c["name"] != "content_hash" and c.get("hashed", True) is True]
    assert spec_columns() == by_rule
    excluded = _excluded()
    assert set(excluded) == {c["name"] for c in cols} - {n for n, _ in by_rule}
    for c in cols:
        if c["name"] in excluded:
            why = excluded[c["name"]]
            if c.get("ingest") == "derived":
                assert "derived" in why, c["name"]
            elif c.get("hashed") == "when_present":
                assert "hashed: when_present" in why and c["name"] in trailer_columns(), c["name"]
            elif c["name"] != "content_hash":
                assert c.get("hashed") is False and "hashed: false" in why, c["name"]
    assert trailer_columns() == [c["name"] for c in cols if c.get("hashed") == "when_present"]


def test_golden_vectors_independent_implementation():
    vectors = _vectors()
    assert len(vectors) >= 8
    names = {v["name"] for v in vectors}
    assert {"optional_nulls", "empty_map", "unicode", "negative_zero", "positive_zero", "tool_schema_version_not_hashed",
            "float32_from_decimal", "map_keys_utf8_order", "timestamp_offsets"} <= names
    for v in vectors:
        canon = canonical_form(v["row"])
        assert canon.hex() == v["canonical_hex"], v["name"]
        assert hashlib.sha256(canon).hexdigest() == v["content_hash"], v["name"]
    by = {v["name"]: v["content_hash"] for v in vectors}
    assert by["negative_zero"] != by["positive_zero"]  # -0.0 is not normalized
    assert by["tool_schema_version_not_hashed"] == by["basic"]   # hashed: false
    assert by["env_state_hash_null"] == by["basic"] != by["env_state_hash_present"]   # hashed: when_present
    assert by["timestamp_offsets"] == by["basic"]   # the same instants written with other offsets


def test_golden_vectors_match_the_code():
    from pipeline.lake.contenthash import content_hashes
    from pipeline.lake.jsonl import parse_jsonl

    vectors = _vectors()
    data = "\n".join(json.dumps(v["row"]) for v in vectors).encode()
    table, _, rejects = parse_jsonl(data, "vectors.jsonl")
    assert rejects == []
    assert content_hashes(table).to_pylist() == [v["content_hash"] for v in vectors]
    from pipeline.lake.validate import validate_table

    checked = validate_table(table)  # every vector is a valid row of the contract
    assert checked.rejects == []
    assert checked.valid.column("content_hash").to_pylist() == [v["content_hash"] for v in vectors]


NO_HASH = {   # rows the text says have no hash: (row, the reason ingest quarantines it with)
    "null_list_element": (lambda: _base() | {"response_ids": [42, None, 2]}, "null_element"),
    "null_token_version": (lambda: _base() | {"token_policy_versions": [3, None, 3]}, "null_element"),
    "null_logprob": (lambda: _base() | {"response_logprobs": [-0.5, None, -1.25]}, "null_element"),
    "null_map_value": (lambda: _base() | {"reward_components": {"format": None}}, "not_finite"),
    "nan_reward": (lambda: _base() | {"reward": float("nan")}, "not_finite"),
    "sub_microsecond": (lambda: _base() | {"finished_at": "2026-11-01T00:01:30.5000001Z"}, "out_of_range"),
}


@pytest.mark.parametrize("case", sorted(NO_HASH))
def test_rows_without_a_hash_are_refused_by_both_and_quarantined(case):
    from pipeline.lake.contenthash import content_hashes
    from pipeline.lake.jsonl import parse_jsonl
    from pipeline.lake.validate import validate_table

    make, reason = NO_HASH[case]
    row = make()
    with pytest.raises(ValueError):
        spec_hash(row)
    table, _, rejects = parse_jsonl(json.dumps(row).encode(), "bad.jsonl")
    if reason == "out_of_range":   # refused while parsing, before any hash
        assert [r.code for r in rejects] == [reason]
        return
    assert rejects == []
    with pytest.raises(ValueError):
        content_hashes(table)
    assert [r.code for r in validate_table(table).rejects] == [reason]


def test_a_json_object_with_a_repeated_key_is_rejected_not_last_one_wins():
    from pipeline.lake.jsonl import parse_jsonl

    line = json.dumps(_base()).replace('"reward_components": {', '"reward_components": {"format": 9.0, ')
    _, _, rejects = parse_jsonl(line.encode(), "dup.jsonl")
    assert [r.code for r in rejects] == ["bad_json"] and "format" in rejects[0].message


def test_readme_example_bytes():
    text = SPEC.read_text()
    row = _vectors()[0]["row"] | {"group_size": 4, "reward": None, "reward_components": {"b": 1.0, "a": -0.0}}
    canon = canonical_form(row).hex()
    for quoted in re.findall(r"`((?:[0-9a-f]{2} )+[0-9a-f]{2})`", text[text.index("### Example"):]):
        assert quoted.replace(" ", "") in canon, quoted


def test_real_rows_independent_vs_code_vs_lake(lake, tmp_path, make_traj):
    """Rows the project generates, landed through ingest: the lake's stored
    hash, content_hashes and the independent implementation agree."""
    import pyarrow.parquet as pq

    from pipeline.lake.contenthash import content_hashes
    from pipeline.ingest import ingest_files

    t = make_traj(12, seed=5, median_len=20, group_size=3)
    path = tmp_path / "rows.parquet"
    pq.write_table(t.drop_columns(["content_hash"]), path)
    assert ingest_files(lake, [path]).landed == 12
    stored = lake.read("trajectories").sort_by("trajectory_id")
    code = content_hashes(stored.select([c for c in stored.column_names if c not in ("created_day", "ingest_id")]))
    for row, h_code, h_stored in zip(stored.to_pylist(), code.to_pylist(), stored.column("content_hash").to_pylist()):
        jrow = {k: (v.isoformat() if isinstance(v, datetime) else dict(v) if k == "reward_components" and v is not None
                    else v) for k, v in row.items()}
        assert spec_hash(jrow) == h_code == h_stored


# -- regeneration ----------------------------------------------------------------------------
def _base() -> dict:
    return {
        "trajectory_id": "vec-basic", "group_id": "g-1", "group_size": 4, "task_id": "task-7", "task_version": "v1",
        "run_id": "run-0", "policy_version": 3, "token_policy_versions": [3, -1, 3],
        "tokenizer_rev": "tok-1", "prompt_template_rev": "tmpl-1", "harness_version": "h-1", "env_version": "env-1",
        "verifier_version": "ver-1", "temperature": 1.0, "top_p": 0.95, "sampling_seed": 1234,
        "status": "ACCEPTED", "verdict": "PASS", "stop_reason": "eos", "reward": 1.0,
        "reward_components": {"task_success": 1.0, "format": 0.5, "tool_cost": -0.01},
        "difficulty": "easy", "num_turns": 2, "num_tool_calls": 1,
        "created_at": "2026-11-01T00:00:00.000001Z", "finished_at": "2026-11-01T00:01:30.5Z",
        "queue_wait_ms": 250, "prompt_ids": [1, 17, 29999], "response_ids": [42, 7, 2],
        "response_logprobs": [-0.5, 0.0, -1.25], "loss_mask": [1, 0, 1],
    }


def _make_vectors() -> list[dict]:
    b = _base
    rows = {
        "basic": b(),
        "optional_nulls": b() | {"token_policy_versions": None, "sampling_seed": None, "reward": None,
                                 "reward_components": None, "difficulty": None, "status": "INFRA_FAILED",
                                 "verdict": "ENV_ERROR"},
        "empty_map": b() | {"reward_components": {}, "difficulty": ""},
        "unicode": b() | {"trajectory_id": "vec-ünïcödé-😀", "task_id": "任务-7", "difficulty": "e\u0301",
                          "run_id": "é", "reward_components": {"z": 1.0, "é": 2.0, "a": 3.0, "Z": 4.0, "😀": 5.0,
                                                              "ä": 6.0}},
        "negative_zero": b() | {"trajectory_id": "vec-zero", "reward": -0.0, "reward_components": {"x": -0.0},
                                "response_logprobs": [-0.5, -0.0, -1.25], "verdict": "FAIL"},
        "positive_zero": b() | {"trajectory_id": "vec-zero", "reward": 0.0, "reward_components": {"x": 0.0},
                                "response_logprobs": [-0.5, 0.0, -1.25], "verdict": "FAIL"},
        "extremes": b() | {"trajectory_id": "vec-extremes", "policy_version": 2**63 - 1, "sampling_seed": -2**63,
                           "queue_wait_ms": 0, "group_size": 2**31 - 1,
                           "created_at": "1969-12-31T23:59:59.999999Z", "finished_at": "2262-04-11T23:47:16.854775Z",
                           "prompt_ids": [0, 1, 2**31 - 1], "token_policy_versions": [2**31 - 1, -1, 0],
                           "temperature": 0.0, "top_p": 1.0},
        "float32_values": b() | {"trajectory_id": "vec-f32", "response_logprobs":
                                 [-0.10000000149011612, 0.0, -3.4028234663852886e38],
                                 "reward": 0.1, "temperature": 0.7},
        "subnormal": b() | {"trajectory_id": "vec-subnormal", "response_logprobs": [-1.401298464324817e-45, 0.0, -1.0],
                            "reward": 5e-324, "created_at": "2026-11-01T05:30:00+05:30",
                            "finished_at": "2026-11-01T00:00:01Z"},
        "long_tokens": b() | {"trajectory_id": "vec-long", "response_ids": list(range(300)),
                              "response_logprobs": [-1.0] * 300, "loss_mask": [1] * 300,
                              "token_policy_versions": [3] * 300},
        # added with the complete text (same hash version: every earlier vector is unchanged)
        "tool_schema_version_not_hashed": b() | {"tool_schema_version": "tools-2"},
        "float32_from_decimal": b() | {"trajectory_id": "vec-f32-decimal", "response_logprobs": [-0.1, 0.0, -2.3],
                                       "reward": 0.3},
        "map_keys_utf8_order": b() | {"trajectory_id": "vec-keys", "reward_components":
                                      {"\uffff": 1.0, "\U0001f600": 2.0, "\u00e9": 3.0, "e": 4.0, "E": 5.0}},
        "timestamp_offsets": b() | {"created_at": "2026-10-31T19:00:00.000001-05:00",
                                    "finished_at": "2026-11-01T09:31:30.500000+09:30"},
        # hashed: when_present (issue 41): null hashes as before the column existed; a value joins the trailer
        "env_state_hash_null": b() | {"env_state_hash": None},
        "env_state_hash_present": b() | {"env_state_hash": "5e" * 32},
    }
    from pipeline.lake.contenthash import content_hashes
    from pipeline.lake.jsonl import parse_jsonl

    data = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows.values()).encode()
    table, _, rejects = parse_jsonl(data, "vectors.jsonl")
    assert not rejects, rejects
    hashes = content_hashes(table).to_pylist()
    return [{"name": k, "row": r, "canonical_hex": canonical_form(r).hex(), "content_hash": h}
            for (k, r), h in zip(rows.items(), hashes)]


if __name__ == "__main__" and "--write" in sys.argv:
    out = "".join(json.dumps(v, ensure_ascii=False) + "\n" for v in _make_vectors())
    VECTORS.write_text(out)
    print(f"wrote {VECTORS}")
