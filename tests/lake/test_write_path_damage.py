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
