"""Group commit (pipeline/lake/delta/group.py; docs/write-protocol.md, "Group commit").

Concurrent keyed appends -- threads of one process, separate processes, on a
local lake and on the moto S3 server -- land in shared commits with every
guarantee of the write protocol: each key once, each writer's transaction
once, a writer returns only once its rows are committed (the version it
reports holds them). A leader killed with SIGKILL before or after its commit,
and a follower killed after publishing its intent, leave nothing lost or
doubled: the survivors commit the dead writer's intent once (or find it
committed), a rerun of the dead writer lands nothing new, and `lake maintain`
leaves no unreferenced file and no intent record behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from race_proc import trajectories  # noqa: E402  (tests/lake on sys.path via rootdir)
from test_write_protocol import RACER, _env, _parked, _race, _run, _unreferenced_files  # noqa: E402

POINT_STAGED = "append:trajectories:staged"          # files written, intent published, nothing committed
POINT_COMMITTING = "group:trajectories:committing"   # a leader holding its chosen intents, before its commit
POINT_COMMITTED = "group:trajectories:committed"     # a leader's commit landed, nothing tidied yet


def _ids(lake) -> list[str]:
    return lake.read("trajectories", columns=["trajectory_id"]).column(0).to_pylist()


def _assert_each_once(lake, expected: set[str]) -> None:
    ids = _ids(lake)
    assert len(ids) == len(set(ids)), "a trajectory_id landed twice"
    assert set(ids) == expected


def _group_sizes(lake) -> list[int]:
    return [int(lake.commit_metadata("trajectories", v).get("pipeline.group_commit", 0) or 0)
            for v in range(lake.version("trajectories") + 1)]


def _intent_records(lake) -> list[str]:
    from pipeline.lake import objects

    return objects.list_names(lake, "_staging", prefix="commit.")


def _intent_files_present(lake) -> bool:
    """Every data file the pending intents name is in the store."""
    from pipeline.lake.delta import group

    sizes = {f"trajectories/{a['path']}": int(a["size"]) for i in group.pending(lake, "trajectories")
             for a in i.actions}
    assert sizes
    lake.check_files(sizes, what="the test")
    return True


def _holds(lake, version: int, app_id: str) -> bool:
    return any((e.get("txn") or {}).get("appId") == app_id for e in lake.log_entries("trajectories", version))


def test_threads_share_commits_and_land_each_key_once(lake):
    lake.ensure("trajectories")
    batches = {f"t{w}-{k}": trajectories(w * 10 + k, 20, f"t{w}-{k}-") for w in range(8) for k in range(3)}
    # two writers ship the same trajectories (a retried shipment under another id): they land once
    batches["t7-2"] = batches["t0-0"]
    results: dict[str, object] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def writer(w: int) -> None:
        try:
            barrier.wait()
            for k in range(3):
                results[f"t{w}-{k}"] = lake.append("trajectories", batches[f"t{w}-{k}"], command="test",
                                                    app_id=f"t{w}-{k}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    expected = {i for k, b in batches.items() for i in b.column("trajectory_id").to_pylist()}
    _assert_each_once(lake, expected)
    assert sum(r.rows for r in results.values()) == len(expected)
    assert results["t0-0"].duplicates + results["t7-2"].duplicates == 20
    for app, r in results.items():      # a writer returns once its rows are in the version it reports
        if r.landed:
            assert _holds(lake, r.version, app), app
    assert max(_group_sizes(lake)) > 1, "no two appends shared a commit"
    assert _intent_records(lake) == []


def test_an_intent_with_a_key_that_landed_after_its_check_is_left_out(lake, monkeypatch):
    from pipeline.lake.delta import group
    from pipeline.lake.delta.writes import prepare, write_data_files
    from pipeline.schema import table_spec

    lake.ensure("trajectories")
    spec = table_spec("trajectories")
    a = prepare(lake, spec, trajectories(1, 10, "a-"))
    b = prepare(lake, spec, trajectories(2, 10, "b-"))
    dt = lake.table("trajectories")
    # two intents deduped against the empty table; then a's rows land by another path
    ia = group._publish(lake, "trajectories", app_id="ia", txn_version=0, extra=[], meta={}, checked=dt.version(),
                        actions=write_data_files(lake, spec, a), keys=a.column("row_key").to_numpy(), rows=10)
    ib = group._publish(lake, "trajectories", app_id="ib", txn_version=0, extra=[], meta={}, checked=dt.version(),
                        actions=write_data_files(lake, spec, b), keys=b.column("row_key").to_numpy(), rows=10)
    # a twin of ib (same transaction, other files) and an intent repeating b's keys
    twin = group._publish(lake, "trajectories", app_id="ib", txn_version=0, extra=[], meta={}, checked=dt.version(),
                          actions=write_data_files(lake, spec, b), keys=b.column("row_key").to_numpy(), rows=10)
    again = group._publish(lake, "trajectories", app_id="ic", txn_version=0, extra=[], meta={},
                           checked=dt.version(), actions=write_data_files(lake, spec, b),
                           keys=b.column("row_key").to_numpy(), rows=10)
    with monkeypatch.context() as m:
        m.setenv(group.GROUP_COMMIT_ENV, "0")    # an append committing alone
        lake.append("trajectories", trajectories(1, 10, "a-"), command="other path", app_id="direct")
    dt = lake.table("trajectories")
    take, why = group.choose(group.View.of(lake, "trajectories", dt), group.pending(lake, "trajectories"))
    assert [i.rid for i in take] == [ib.rid]
    assert why == {ia.rid: "keys", twin.rid: "repeat", again.rid: "repeat"}


def _start(uri: str, tmp: Path, command: list[str], *, point: str | None = None,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path | None]:
    marker = tmp / f"at-{time.time_ns()}" if point else None
    extra = dict(env or {})
    if point:
        extra["PIPELINE_TEST_PAUSE_AT"] = f"{point}={marker}"
    p = subprocess.Popen([sys.executable, RACER, uri, "-", *command], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env(extra))
    return p, marker


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL


def _finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _writer(name: str, seed: int) -> list[str]:
    return ["append", name, str(seed), "12", f"{name}-"]


def _expected(*writers: tuple[str, int]) -> set[str]:
    return {i for name, seed in writers for i in trajectories(seed, 12, f"{name}-").column("trajectory_id").to_pylist()}


def _killed_leader(uri: str, tmp: Path, point: str, env: dict[str, str] | None = None) -> tuple[list[dict], dict]:
    """Two followers parked after publishing their intents; a leader that chose all three intents is
    killed at ``point``; the followers are released. -> (the followers' outcomes, the leader's rerun)."""
    followers = [_start(uri, tmp, _writer(f"f{k}", 10 + k), point=POINT_STAGED, env=env) for k in range(2)]
    for p, m in followers:
        _parked(p, m, POINT_STAGED)
    leader, lm = _start(uri, tmp, _writer("lead", 20), point=point, env=env)
    _parked(leader, lm, point)
    _kill(leader)
    for _, m in followers:
        Path(f"{m}.go").write_text("go")
    outs = [_finish(p) for p, _ in followers]
    return outs, _run(uri, _writer("lead", 20), env)


def _maintained_clean(uri: str, lake, env: dict[str, str] | None = None) -> None:
    _run(uri, ["maintain"], env={**(env or {}), "ORPHAN_AGE": "0"})
    assert _unreferenced_files(lake, "trajectories") == []
    assert _intent_records(lake) == []


@pytest.mark.slow
def test_leader_killed_before_its_commit_followers_commit_its_intent_once(lake, tmp_path):
    lake.ensure("trajectories")
    outs, rerun = _killed_leader(lake.uri, tmp_path, POINT_COMMITTING)
    assert all(o["landed"] and o["rows"] == 12 for o in outs)
    # the dead leader's published intent was committed by a follower: its rerun lands nothing new
    assert rerun["landed"] is False and rerun["rows"] == 0
    _assert_each_once(lake, _expected(("f0", 10), ("f1", 11), ("lead", 20)))
    _maintained_clean(lake.uri, lake)
    _assert_each_once(lake, _expected(("f0", 10), ("f1", 11), ("lead", 20)))


@pytest.mark.slow
def test_leader_killed_after_its_commit_followers_find_their_rows_committed(lake, tmp_path):
    lake.ensure("trajectories")
    outs, rerun = _killed_leader(lake.uri, tmp_path, POINT_COMMITTED)
    assert all(o["landed"] and o["rows"] == 12 for o in outs)
    assert len({o["version"] for o in outs}) == 1, "the leader's one commit held both followers"
    assert _holds(lake, outs[0]["version"], "lead")
    assert rerun["landed"] is False and rerun["rows"] == 0
    _assert_each_once(lake, _expected(("f0", 10), ("f1", 11), ("lead", 20)))
    assert _intent_records(lake), "the killed leader left its intent record"
    _maintained_clean(lake.uri, lake)


@pytest.mark.slow
def test_follower_killed_after_staging_is_committed_once_by_the_next_writer(lake, tmp_path):
    lake.ensure("trajectories")
    p, m = _start(lake.uri, tmp_path, _writer("dead", 30), point=POINT_STAGED)
    _parked(p, m, POINT_STAGED)
    _kill(p)
    assert _intent_records(lake) and not any(i.startswith("dead-") for i in _ids(lake))
    # maintenance while the dead writer's intent is pending deletes none of its files
    _run(lake.uri, ["maintain"], env={"ORPHAN_AGE": "0"})
    assert _intent_files_present(lake)
    out = _run(lake.uri, _writer("next", 31))
    assert out["landed"]
    assert _holds(lake, out["version"], "dead")
    assert _run(lake.uri, _writer("dead", 30))["landed"] is False
    _assert_each_once(lake, _expected(("dead", 30), ("next", 31)))
    _maintained_clean(lake.uri, lake)


@pytest.mark.slow
def test_eight_processes_with_overlapping_ids_land_each_id_once(lake, tmp_path):
    lake.ensure("trajectories")
    # writers 0-3 ship one set of trajectories (retries under other ids), 4-7 their own
    cmds = [["append", f"p{w}", "5" if w < 4 else str(w), "12", "shared-" if w < 4 else f"p{w}-"] for w in range(8)]
    outs = _race(lake.uri, tmp_path, cmds)
    expected = {i for c in cmds for i in trajectories(int(c[2]), 12, c[4]).column("trajectory_id").to_pylist()}
    _assert_each_once(lake, expected)
    assert sum(o["rows"] for o in outs) == len(expected)
    assert sum(o["duplicates"] for o in outs[:4]) == 36
    for c, o in zip(cmds, outs):
        if o["landed"]:
            assert _holds(lake, o["version"], c[1])
    assert _intent_records(lake) == []


@pytest.mark.slow
def test_s3_group_commit_races_and_kills(s3_env, tmp_path):
    from pipeline.lake.delta import Lake

    _, bucket = s3_env
    lake = Lake(f"s3://{bucket}/lake")
    lake.ensure("trajectories")
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_REGION", "AWS_ALLOW_HTTP")}
    cmds = [["append", f"s{w}", "5" if w < 2 else str(w), "12", "shared-" if w < 2 else f"s{w}-"] for w in range(4)]
    _race(lake.uri, tmp_path, cmds, env)
    expected = {i for c in cmds for i in trajectories(int(c[2]), 12, c[4]).column("trajectory_id").to_pylist()}
    _assert_each_once(lake, expected)
    outs, rerun = _killed_leader(lake.uri, tmp_path, POINT_COMMITTING, env)
    assert all(o["landed"] for o in outs) and rerun["landed"] is False
    expected |= _expected(("f0", 10), ("f1", 11), ("lead", 20))
    _assert_each_once(lake, expected)
    p, m = _start(lake.uri, tmp_path, _writer("dead", 30), point=POINT_STAGED, env=env)
    _parked(p, m, POINT_STAGED)
    _kill(p)
    assert _run(lake.uri, _writer("next", 31), env)["landed"]
    assert _run(lake.uri, _writer("dead", 30), env)["landed"] is False
    _assert_each_once(lake, expected | _expected(("dead", 30), ("next", 31)))
    _maintained_clean(lake.uri, lake, env)
    assert pc.count_distinct(lake.read("trajectories", columns=["trajectory_id"]).column(0)).as_py() == \
        len(expected) + 24


def test_a_table_created_again_under_a_writer_is_read_afresh(lake):
    import shutil

    first = trajectories(1, 10, "old-")
    for k in range(3):
        lake.append("trajectories", trajectories(k, 10, f"old{k}-"), command="test", app_id=f"old{k}")
    shutil.rmtree(Path(lake.uri) / "trajectories")     # the same path, another table
    lake.ensure("trajectories")
    r = lake.append("trajectories", first, command="test", app_id="new")
    assert r.landed and r.version == 1
    assert sorted(_ids(lake)) == sorted(first.column("trajectory_id").to_pylist())
