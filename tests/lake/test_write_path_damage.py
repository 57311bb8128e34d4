"""Damage and races in the write path (issue 38, item 6): a keyed append committing
alone that loses its race after a conflict, damaged group-commit intents, two
migrations at once, in-memory frames under the file rules, future-dated orphans
and a forged key index. Each test failed before its fix."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from race_proc import trajectories  # noqa: E402  (tests/lake on sys.path via rootdir)
from test_write_protocol import RACER, _env, _parked, _run, _unreferenced_files  # noqa: E402

NO_GROUP = {"PIPELINE_GROUP_COMMIT": "0"}


def _ids(lake) -> list[str]:
    return lake.read("trajectories", columns=["trajectory_id"]).column(0).to_pylist()


# -- a) a keyed append committing alone retries after a concurrent writer landed one of its rows


def test_a_keyed_append_alone_that_loses_its_race_dedupes_on_retry_and_cleans_up(lake, tmp_path, monkeypatch):
    """Process B (group commit off) appends six rows: one conflicts with a row already landed (its first
    pass reports the conflict), then it parks with its files written. A concurrent append lands another
    of B's rows (same content) and wins the commit B was about to make. B's retry drops that row as a
    duplicate, discards the files of its first pass and lands the other four once."""
    monkeypatch.setenv("PIPELINE_GROUP_COMMIT", "0")
    mine = trajectories(5, 6, "x-")
    other = mine.slice(0, 1)
    other = other.set_column(other.schema.get_field_index("content_hash"), "content_hash", pa.array(["0" * 64]))
    assert lake.append("trajectories", other, command="test: landed first").landed
    marker = tmp_path / "at-staged"
    p = subprocess.Popen([sys.executable, RACER, lake.uri, "-", "append", "B", "5", "6", "x-"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env({**NO_GROUP, "PIPELINE_TEST_PAUSE_AT": f"append:trajectories:staged={marker}"}))
    _parked(p, marker, "append:trajectories:staged")
    won = lake.append("trajectories", mine.slice(1, 1), command="test: concurrent writer")
    assert won.landed
    Path(f"{marker}.go").write_text("go")
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["landed"] and r["rows"] == 4 and r["duplicates"] == 1, r
    ids = _ids(lake)
    assert len(ids) == len(set(ids)) == 6
    assert set(ids) == set(mine.column("trajectory_id").to_pylist())
    assert _unreferenced_files(lake, "trajectories") == [], "the lost pass's files were left behind"
    assert _run(lake.uri, ["append", "B", "5", "6", "x-"], NO_GROUP)["landed"] is False   # exactly once
    assert len(_ids(lake)) == 6


# -- d) in-memory frames follow the file rules


def _codes(lake) -> dict[str, str]:
    q = lake.read("quarantine", columns=["reason_code", "raw_row"]).to_pylist() if lake.exists("quarantine") else []
    return {json.loads(r["raw_row"])["trajectory_id"]: r["reason_code"] for r in q}


@pytest.mark.parametrize("kind", ["pandas", "arrow"])
def test_frames_follow_the_file_rules_for_naive_timestamps_and_numbers_as_strings(tmp_path, make_traj, kind):
    """The same rows as a Parquet file and as an in-memory frame: a naive created_at and a reward given as
    a string are quarantined alike (naive_timestamp, wrong_type), never landed."""
    import pyarrow.parquet as pq

    from pipeline.ingest import ingest_files, ingest_table
    from pipeline.lake.delta import Lake

    t = make_traj(4, seed=21, median_len=4).drop_columns(["content_hash", "reward_components"])
    df = t.to_pandas()
    df["created_at"] = df["created_at"].dt.tz_localize(None)             # naive: which zone is unknown
    bad = t.set_column(t.schema.get_field_index("created_at"), "created_at",
                       t.column("created_at").cast(pa.timestamp("us")))
    if kind == "pandas":
        df2 = t.to_pandas()
        df2["reward"] = [None if r is None else str(r) for r in df2["reward"]]   # numbers as strings
        frames = [df, df2]
    else:
        strs = pa.array([None if r is None else str(r) for r in t.column("reward").to_pylist()], pa.string())
        frames = [bad, t.set_column(t.schema.get_field_index("reward"), "reward", strs)]
    by_file, by_frame = Lake(tmp_path / "files"), Lake(tmp_path / "frames")
    for k, frame in enumerate(frames):
        path = tmp_path / f"in{k}.parquet"
        if kind == "pandas":
            frame.to_parquet(path)
        else:
            pq.write_table(frame, path)
        f = ingest_files(by_file, [path])
        m = ingest_table(by_frame, frame)
        assert m.landed == f.landed == 0 or (k == 1 and m.landed == f.landed), (k, f.as_dict(), m.as_dict())
        assert m.reasons == f.reasons, (k, f.reasons, m.reasons)
    assert _codes(by_frame) == _codes(by_file)
    assert set(_codes(by_frame).values()) >= {"naive_timestamp"}
    assert (by_frame.read("trajectories").num_rows if by_frame.exists("trajectories") else 0) == \
        (by_file.read("trajectories").num_rows if by_file.exists("trajectories") else 0)


# -- c) two migrations at once


def test_a_second_migration_is_refused_with_one_line_while_one_runs(tmp_path, capsys):
    import shutil

    from pipeline.cli import main
    from pipeline.lake import migrate as mig
    from pipeline.lake.delta import Lake

    shutil.copytree(Path(__file__).parent / "fixtures" / "old-layout-lake", tmp_path / "old")
    lake = Lake(tmp_path / "old")
    marker = tmp_path / "at-written"
    code = ("import sys\nfrom pipeline.lake.delta import Lake\nfrom pipeline.lake.migrate import migrate\n"
            "print(migrate(Lake(sys.argv[1]), batch_bytes=1)['current'])\n")
    p = subprocess.Popen([sys.executable, "-c", code, lake.uri], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env({"PIPELINE_TEST_PAUSE_AT": f"rewrite:trajectories:written={marker}"}))
    try:
        _parked(p, marker, "rewrite:trajectories:written")
        rc = main(["lake", "migrate", "--lake", lake.uri])
        out, err = capsys.readouterr()
        assert rc == 2, (out, err)
        first = err.strip().splitlines()[0]
        assert "another migration runs" in first and f"{p.pid}" in first, err
        assert "Traceback" not in err and "internal error" not in err
    finally:
        Path(f"{marker}.go").write_text("go")
        out, err = p.communicate(timeout=600)
    assert p.returncode == 0 and out.strip() == "True", err[-3000:]
    assert mig.status(Lake(lake.uri)) == {}
    ids = Lake(lake.uri).read("trajectories", columns=["trajectory_id"]).column(0).to_pylist()
    assert len(ids) == len(set(ids)) == 16
    assert main(["lake", "migrate", "--lake", lake.uri]) == 0     # the lease was released: a no-op now


# -- b) a damaged intent is set aside after one failed check, reported by verify, removed by maintain


def _intent_records(lake, prefix: str = "commit.") -> list[str]:
    from pipeline.lake import objects

    return sorted(objects.list_names(lake, "_staging", prefix=prefix))


def _problems(lake) -> list[str]:
    from pipeline.maintain import verify

    return verify(lake, ["trajectories"], snapshots=False)["problems"]


@pytest.mark.slow
def test_an_intent_with_a_missing_file_is_set_aside_and_its_live_writer_still_lands(lake, tmp_path):
    """Writer W (another process) published its intent; one of its files is then deleted. An overlapping
    append sees W's intent lead, checks it once, sets it aside and lands; W, released, finds some of its
    keys landed and lands the rest: nothing lost, nothing twice. verify reports the set-aside record,
    maintain removes it."""
    from pipeline.lake.delta import group

    lake.ensure("trajectories")
    marker = tmp_path / "at-staged"
    p = subprocess.Popen([sys.executable, RACER, lake.uri, "-", "append", "W", "3", "12", "w-"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env({"PIPELINE_TEST_PAUSE_AT": f"append:trajectories:staged={marker}"}))
    _parked(p, marker, "append:trajectories:staged")
    [w] = group.pending(lake, "trajectories")
    (Path(lake.uri) / "trajectories" / w.actions[0]["path"]).unlink()      # damage: a file it names is gone
    assert any("is damaged" in x and "absent" in x for x in _problems(lake))
    mine = trajectories(3, 12, "w-").slice(0, 6)
    both = pa.concat_tables([mine, trajectories(4, 6, "x-")])
    r = lake.append("trajectories", both, command="test: overlapping append", app_id="X")
    assert r.landed and r.rows == 12
    assert _intent_records(lake) == [] and _intent_records(lake, "damaged.") == [f"damaged.{w.rid}.json"]
    Path(f"{marker}.go").write_text("go")
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["landed"] and res["rows"] == 6 and res["duplicates"] == 6, res
    ids = _ids(lake)
    assert len(ids) == len(set(ids)) == 18
    [line] = _problems(lake)
    assert f"commit intent {w.rid} was set aside as damaged" in line and "absent" in line
    _run(lake.uri, ["maintain"], env={"ORPHAN_AGE": "0"})
    assert _intent_records(lake, "damaged.") == [] and _problems(lake) == []
    assert _unreferenced_files(lake, "trajectories") == []


@pytest.fixture(params=["local", "s3"])
def any_lake(request, lake):
    return lake if request.param == "local" else request.getfixturevalue("s3_lake")


def test_an_intent_record_without_a_size_never_blocks_appends(any_lake):
    """A record whose add action lacks ``size`` (its writer gone) is set aside by the first append that
    reads it; every append lands; verify reports it; maintain removes it. Local and S3."""
    from pipeline.lake import objects
    from pipeline.lake.delta import group
    from pipeline.lake.delta.writes import prepare, write_data_files
    from pipeline.schema import table_spec

    lake = any_lake
    lake.ensure("trajectories")
    spec = table_spec("trajectories")
    a = prepare(lake, spec, trajectories(1, 10, "a-"))
    ia = group._publish(lake, "trajectories", app_id="ia", txn_version=0, extra=[], meta={},
                        checked=lake.version("trajectories"), actions=write_data_files(lake, spec, a),
                        keys=a.column("row_key").to_numpy(), rows=10)
    rel = f"_staging/{ia.rid}.json"
    body = json.loads(objects.get(lake, rel))
    del body["commit"]["actions"][0]["size"]
    body["pid"], body["pid_start"] = 2 ** 22 + 17, 1      # its writer is gone
    objects.delete(lake, rel)
    objects.put_if_absent(lake, rel, json.dumps(body).encode())
    group._CACHE.clear()                                   # another process: it reads the damaged record
    assert any(ia.rid in x and "is damaged" in x for x in _problems(lake))
    for k in range(2):
        assert lake.append("trajectories", trajectories(10 + k, 5, f"n{k}-"), command="test").landed
    assert _intent_records(lake) == []
    [line] = _problems(lake)
    assert f"{ia.rid} was set aside as damaged" in line and "size" in line
    report = lake.tidy_damaged_intents("trajectories")
    assert report == ([], [f"damaged.{ia.rid}"])
    assert _problems(lake) == [] and len(_ids(lake)) == 10


# -- f) a forged key index with a recomputed checksum is refused


def test_a_forged_key_index_with_a_recomputed_checksum_is_refused(lake, make_traj, caplog):
    """Keys removed from the index and its header's checksum recomputed: an append does not trust it (a
    duplicate never lands), and `lake verify` refuses it with one line."""
    import hashlib

    import numpy as np
    import pyarrow.fs as pafs

    import pipeline.lake.delta as delta
    from pipeline.ingest import ingest_table
    from pipeline.maintain import maintain

    a = make_traj(40, seed=1, median_len=6, sigma=0.2, id_prefix="a-")
    assert ingest_table(lake, a).landed == 40
    iv = maintain(lake, tables=["trajectories"], orphan_min_age_s=0)["tables"]["trajectories"]["key_index_version"]
    assert iv == lake.version("trajectories") and _problems(lake) == []
    fs, root = lake.filesystem()
    [path] = [i.path for i in fs.get_file_info(pafs.FileSelector(f"{root}/_index/trajectories"))]
    raw = Path(path).read_bytes()
    nl = raw.index(b"\n")
    head, keys = json.loads(raw[:nl]), np.frombuffer(raw[nl + 1:], "<i8")
    landed = delta.row_keys(__import__("pipeline.schema", fromlist=["table_spec"]).table_spec("trajectories"),
                            a.slice(0, 10)).to_numpy()
    forged = np.ascontiguousarray(keys[~np.isin(keys, landed)], "<i8").tobytes()     # forget 10 landed keys
    head.update(rows=len(forged) // 8, sha256=hashlib.sha256(forged).hexdigest())
    line = json.dumps(head, sort_keys=True).encode()
    Path(path).write_bytes(line + b" " * (-(len(line) + 1) % 8) + b"\n" + forged)
    problems = _problems(lake)
    assert len(problems) == 1 and "key index" in problems[0] and "forged" in problems[0], problems
    delta.KEY_CACHE.clear()                                  # a fresh process reads _index/
    with caplog.at_level("WARNING", logger="pipeline.lake"):
        r = ingest_table(lake, pa.concat_tables([a.slice(0, 10), make_traj(3, seed=2, median_len=6, id_prefix="n-")]))
    assert (r.landed, r.duplicates) == (3, 10)
    ids = _ids(lake)
    assert len(ids) == len(set(ids)) == 43
    assert any("ignoring the key index" in m for m in caplog.messages)


# -- e) an orphan dated in the future is removed, its age counted from its first sighting


def test_an_orphan_with_a_future_mtime_is_removed_after_the_age_guard_from_its_first_sighting(lake, make_traj):
    import os

    from pipeline.maintain import maintain

    assert lake.append("trajectories", trajectories(1, 4, "a-"), command="test").landed
    live = {p for p, _ in lake.live_files(lake.table("trajectories"))}
    src = Path(lake.uri) / "trajectories" / sorted(live)[0]
    orphan = src.with_name("part-00000-orphan-from-the-future-c000.zstd.parquet")
    orphan.write_bytes(src.read_bytes())                     # no commit references it, no writer declared it
    future = time.time() + 10 * 86400
    os.utime(orphan, (future, future))                       # a writer whose clock is ten days ahead
    temp = Path(lake.uri) / "_snapshots" / ".tmp-from-the-future"
    temp.mkdir(parents=True)
    (temp / "payload.parquet").write_bytes(b"x")
    os.utime(temp / "payload.parquet", (future, future))     # an admission killed on that host
    os.utime(temp, (future, future))
    out = maintain(lake, tables=["trajectories"], orphan_min_age_s=1.0)
    r = out["tables"]["trajectories"]
    assert orphan.exists() and r["orphans_removed"] == 0 and r["future_dated_orphans_waiting"] == 1
    assert temp.exists() and out["snapshot_temp_dirs_removed"] == []
    time.sleep(1.2)
    out = maintain(lake, tables=["trajectories"], orphan_min_age_s=1.0)
    r = out["tables"]["trajectories"]
    assert not orphan.exists() and r["orphans_removed"] == 1 and r["future_dated_orphans_waiting"] == 0
    assert not temp.exists() and out["snapshot_temp_dirs_removed"] == [temp.name]
    maintain(lake, tables=["trajectories"], orphan_min_age_s=1.0)
    assert not any(p.is_file() for p in (Path(lake.uri) / "_maintain").rglob("*"))   # markers tidied
    assert len(_ids(lake)) == 4
