"""The write protocol under real races (docs/write-protocol.md).

Every read-decide-commit -- ingest dedupe, maintenance compaction, policy
version publishing -- run as several real processes released at the same
moment, on a local lake and on the moto S3 server, must give the result of
running them one after the other: every trajectory_id exactly once, every
policy version taken once. Processes killed with SIGKILL inside each commit
boundary (they write a readiness marker there and block) leave nothing that a
rerun duplicates, and `lake maintain` removes the files they staged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

RACER = str(Path(__file__).with_name("race_proc.py"))
ROOT = str(Path(__file__).resolve().parents[2])


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _race(uri: str, tmp: Path, commands: list[list[str]], env: dict[str, str] | None = None) -> list[dict]:
    """Start every command, release them together once each wrote its readiness marker
    (imports done), check they ran at the same time, return their JSON outputs."""
    start = tmp / f"go-{time.time_ns()}"
    procs = [subprocess.Popen([sys.executable, RACER, uri, str(start), *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(env)) for c in commands]
    try:
        deadline = time.time() + 300
        while {int(m.read_text() or 0) for m in tmp.glob(f"{start.name}.ready-*")} != {p.pid for p in procs}:
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
            assert time.time() < deadline, "the racers did not get ready"
            time.sleep(0.01)
        start.write_text("go")
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    # a race, not a queue: the last racer was released before the first one finished
    assert max(o["raced"][0] for o in outs) < min(o["raced"][1] for o in outs), [o["raced"] for o in outs]
    return outs


def _ids(lake) -> pa.ChunkedArray:
    return lake.read("trajectories", columns=["trajectory_id"]).column(0)


def _assert_each_once(lake, expected: set[str]) -> None:
    ids = _ids(lake)
    assert len(ids) == pc.count_distinct(ids).as_py(), "a trajectory_id landed twice"
    assert set(ids.to_pylist()) == expected


def _overlapping_files(tmp: Path, make_traj, n_files: int, *, tag: str, conflict_file: bool = False) -> tuple[
        list[str], set[str]]:
    """n_files files over 60 trajectories, each holding a window of 30 that overlaps its neighbours
    (an exporter that retried into new files). With ``conflict_file`` the last file carries different
    content for its ids."""
    base = make_traj(60, seed=7, median_len=6, sigma=0.2, id_prefix=f"{tag}-")
    paths = []
    for i in range(n_files):
        lo = (i * 10) % 30
        part = base.slice(lo, 30)
        if conflict_file and i == n_files - 1:
            part = part.drop_columns(["content_hash"])
            part = part.set_column(part.schema.get_field_index("reward"), "reward",
                                   pa.array([9.0] * part.num_rows, pa.float64()))
        p = tmp / f"{tag}-{i}.parquet"
        pq.write_table(part, p)
        paths.append(str(p))
    covered = set()
    for i in range(n_files):
        lo = (i * 10) % 30
        covered |= set(base.column("trajectory_id").to_pylist()[lo:lo + 30])
    return paths, covered


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(3))
def test_four_concurrent_ingests_of_overlapping_ids_land_each_id_once(lake, tmp_path, make_traj, trial):
    paths, expected = _overlapping_files(tmp_path, make_traj, 4, tag=f"t{trial}")
    outs = _race(lake.uri, tmp_path, [["ingest", p] for p in paths])
    _assert_each_once(lake, expected)
    assert sum(o["landed"] for o in outs) == len(expected)
    assert sum(o["landed"] + o["duplicates"] for o in outs) == 4 * 30


@pytest.mark.slow
def test_concurrent_ingests_with_conflicting_content_land_one_version_and_quarantine_the_other(
        lake, tmp_path, make_traj):
    paths, expected = _overlapping_files(tmp_path, make_traj, 4, tag="c", conflict_file=True)
    outs = _race(lake.uri, tmp_path, [["ingest", p] for p in paths])
    _assert_each_once(lake, expected)
    q = lake.read("quarantine", columns=["trajectory_id", "reason_code"])
    conflicts = q.filter(pc.equal(q.column("reason_code"), "conflict"))
    # every id of the conflicting file either landed from it (and the others' copies were refused) or was refused
    assert sum(o["quarantined"] for o in outs) >= 1
    assert conflicts.num_rows == sum(o["reasons"].get("conflict", 0) for o in outs)
    # admission reads this lake without an integrity error
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit

    admit(lake, AdmissionConfig(quality=False), current_policy_version=0)


def _small_files_lake(lake, make_traj, n_appends: int = 12) -> set[str]:
    from pipeline.lake.ingest import stamp_derived

    ids: set[str] = set()
    for k in range(n_appends):
        t = make_traj(12, seed=100 + k, median_len=6, sigma=0.2, id_prefix=f"s{k}-")
        lake.append("trajectories", stamp_derived(t, f"seed-{k}"), command="test", app_id="seed", txn_version=k)
        ids |= set(t.column("trajectory_id").to_pylist())
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(2))
def test_concurrent_maintains_while_ingests_run_never_duplicate_a_row(lake, tmp_path, make_traj, trial):
    expected = _small_files_lake(lake, make_traj)
    paths, more = _overlapping_files(tmp_path, make_traj, 2, tag=f"m{trial}")
    files_before = lake.file_count("trajectories")
    _race(lake.uri, tmp_path, [["maintain"], ["maintain"], ["ingest", paths[0]], ["ingest", paths[1]]])
    _assert_each_once(lake, expected | more)
    assert lake.file_count("trajectories") < files_before


def _make_checkpoint(lake, checkpoint_id: str) -> None:
    from pipeline.policy_store import local_checkpoint_dir

    d = local_checkpoint_dir(lake, checkpoint_id) / "hf"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"id": checkpoint_id}))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(2))
def test_two_publishers_take_distinct_policy_versions(lake, tmp_path, trial):
    for c in ("a", "b", "c"):
        _make_checkpoint(lake, f"ck-{c}")
    from pipeline.policy_store import publish_checkpoint

    publish_checkpoint(lake, checkpoint_id="ck-a", policy_version=None, parent_checkpoint_id=None, snapshot_ids=[],
                       train_config={}, train_config_hash="h", seed=0)
    outs = _race(lake.uri, tmp_path, [["publish", "ck-b"], ["publish", "ck-c"]])
    assert sorted(o["policy_version"] for o in outs) == [1, 2]
    versions = lake.read("checkpoints", columns=["policy_version"]).column(0).to_pylist()
    assert sorted(versions) == [0, 1, 2]
    # publishing an already published checkpoint again is a no-op that reports its version
    again = publish_checkpoint(lake, checkpoint_id="ck-b", policy_version=None, parent_checkpoint_id=None,
                               snapshot_ids=[], train_config={}, train_config_hash="h", seed=0)
    assert again["policy_version"] == outs[0]["policy_version"]
    assert lake.read("checkpoints", columns=["policy_version"]).num_rows == 3


def test_explicit_policy_version_taken_is_a_clear_conflict(lake):
    from pipeline.errors import ConflictError
    from pipeline.policy_store import publish_checkpoint

    for c in ("a", "b"):
        _make_checkpoint(lake, f"ck-{c}")
    kw = dict(policy_version=0, parent_checkpoint_id=None, snapshot_ids=[], train_config={},
              train_config_hash="h", seed=0)
    publish_checkpoint(lake, checkpoint_id="ck-a", **kw)
    with pytest.raises(ConflictError, match="policy version 0 is already published"):
        publish_checkpoint(lake, checkpoint_id="ck-b", **kw)


# -- kill -9 inside every commit boundary -------------------------------------------------


def _parked(p: subprocess.Popen, marker: Path, point: str) -> None:
    """Wait until ``p`` wrote its readiness marker at pause point ``point`` (it blocks there)."""
    deadline = time.time() + 300
    while not marker.exists():
        if p.poll() is not None:
            pytest.fail(f"the process ended before reaching {point}: {p.stderr.read()[-2000:]}")
        assert time.time() < deadline, f"{point} never reached"
        time.sleep(0.01)
    assert int(marker.read_text()) == p.pid      # it is parked at the point: a kill lands there


def _kill_at(uri: str, tmp: Path, point: str, command: list[str], env: dict[str, str] | None = None) -> None:
    marker = tmp / f"at-{point.replace(':', '-')}-{time.time_ns()}"
    p = subprocess.Popen([sys.executable, RACER, uri, "-", *command], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=_env({**(env or {}), "PIPELINE_TEST_PAUSE_AT": f"{point}={marker}"}))
    _parked(p, marker, point)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL


def _run(uri: str, command: list[str], env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, RACER, uri, "-", *command], capture_output=True, text=True,
                         env=_env(env), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _unreferenced_files(lake, name: str) -> list[str]:
    return lake.remove_orphans(name, min_age_s=0, dry_run=True)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["append:quarantine:committed", "append:trajectories:staged",
                                   "append:trajectories:committed"])
def test_ingest_killed_at_each_commit_boundary_converges_on_rerun(lake, tmp_path, make_traj, point):
    t = make_traj(20, seed=3, median_len=6, sigma=0.2, id_prefix="k-")
    bad = t.slice(0, 2).set_column(t.schema.get_field_index("reward"), "reward",
                                   pa.array([float("nan")] * 2, pa.float64()))
    good = t.slice(2)
    path = tmp_path / "in.parquet"
    pq.write_table(pa.concat_tables([bad, good]), path)
    _kill_at(lake.uri, tmp_path, point, ["ingest", str(path)])
    out = _run(lake.uri, ["ingest", str(path)])
    _assert_each_once(lake, set(good.column("trajectory_id").to_pylist()))
    q = lake.read("quarantine", columns=["source_row", "reason_code"])
    assert sorted(q.column("source_row").to_pylist()) == [0, 1], "a rerun quarantined a row twice"
    # a file whose commit landed is skipped whole (every row counts as a duplicate)
    assert out["landed"] + out["duplicates"] == (20 if out["skipped_files"] else 18)
    if point.endswith("staged"):
        assert _unreferenced_files(lake, "trajectories"), "the kill left no staged file: not inside the section"
    from pipeline.maintain import maintain

    maintain(lake, orphan_min_age_s=0)
    assert _unreferenced_files(lake, "trajectories") == []
    _assert_each_once(lake, set(good.column("trajectory_id").to_pylist()))


@pytest.mark.slow
def test_maintain_killed_after_writing_compacted_files_loses_and_duplicates_nothing(lake, tmp_path, make_traj):
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.snapshots.format import verify_snapshot

    expected = _small_files_lake(lake, make_traj, 6)
    a = admit(lake, AdmissionConfig(quality=False), current_policy_version=0)
    _kill_at(lake.uri, tmp_path, "compact:trajectories:written", ["maintain"])
    _assert_each_once(lake, expected)
    assert _unreferenced_files(lake, "trajectories"), "the kill left no compacted file: not inside the section"
    _run(lake.uri, ["maintain"], env={"ORPHAN_AGE": "0"})
    _assert_each_once(lake, expected)
    assert _unreferenced_files(lake, "trajectories") == []
    assert verify_snapshot(lake, a.snapshot_id)["ok"]


@pytest.mark.slow
def test_publisher_killed_before_its_commit_leaves_the_version_free(lake, tmp_path):
    for c in ("a", "b"):
        _make_checkpoint(lake, f"ck-{c}")
    _kill_at(lake.uri, tmp_path, "append:checkpoints:staged", ["publish", "ck-a"])
    assert _run(lake.uri, ["publish", "ck-b"])["policy_version"] == 0
    assert _run(lake.uri, ["publish", "ck-a"])["policy_version"] == 1


def test_snapshot_temp_dirs_of_dead_admissions_are_removed_only_when_old(lake):
    from pipeline.lake.maintain import remove_snapshot_temps

    tmp = Path(lake.uri) / "_snapshots" / ".tmp-dead-1234"
    tmp.mkdir(parents=True)
    (tmp / "members.parquet").write_bytes(b"partial")
    assert remove_snapshot_temps(lake, min_age_s=3600) == []          # could be a live admission
    assert remove_snapshot_temps(lake, min_age_s=0) == [".tmp-dead-1234"]
    assert not tmp.exists()


# -- the same races on S3 (moto) -------------------------------------------------------------


def _s3_env(s3_server: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


@pytest.mark.slow
def test_s3_concurrent_ingests_maintains_and_publishers(s3_env, tmp_path, make_traj):
    from pipeline.lake.delta import Lake

    _, bucket = s3_env
    lake = Lake(f"s3://{bucket}/lake")
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_REGION", "AWS_ALLOW_HTTP")}
    env["PIPELINE_CACHE"] = str(tmp_path / "cache")
    os.environ["PIPELINE_CACHE"] = env["PIPELINE_CACHE"]
    paths, expected = _overlapping_files(tmp_path, make_traj, 4, tag="s3")
    _race(lake.uri, tmp_path, [["ingest", p] for p in paths], env)
    _assert_each_once(lake, expected)
    more = _small_files_lake(lake, make_traj, 6)
    paths2, expected2 = _overlapping_files(tmp_path, make_traj, 2, tag="s3b")
    _race(lake.uri, tmp_path, [["maintain"], ["maintain"], ["ingest", paths2[0]], ["ingest", paths2[1]]], env)
    _assert_each_once(lake, expected | more | expected2)
    paths3, expected3 = _overlapping_files(tmp_path, make_traj, 1, tag="s3k")
    _kill_at(lake.uri, tmp_path, "append:trajectories:staged", ["ingest", paths3[0]], env)
    assert _unreferenced_files(lake, "trajectories")
    _run(lake.uri, ["maintain"], env={**env, "ORPHAN_AGE": "0"})
    assert _unreferenced_files(lake, "trajectories") == []
    _run(lake.uri, ["ingest", paths3[0]], env)
    _assert_each_once(lake, expected | more | expected2 | expected3)
    for c in ("a", "b"):
        _make_checkpoint(lake, f"ck-{c}")
    outs = _race(lake.uri, tmp_path, [["publish", "ck-a"], ["publish", "ck-b"]], env)
    assert sorted(o["policy_version"] for o in outs) == [0, 1]
