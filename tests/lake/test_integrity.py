"""Integrity under damage (docs/write-protocol.md, "Nothing committed without
its files" and "Cleanup"): no committed version references a missing file,
whatever the clocks say and whatever `lake maintain` runs meanwhile; a commit
whose files vanished refuses with one clear error. Local lake and S3 (moto)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from pipeline.lake.ingest import stamp_derived

SKEW_S = 61 * 60          # the probe: a staged file whose mtime is 61 minutes in the past


@pytest.fixture(params=["local", "s3"])
def any_lake(request, lake):
    return lake if request.param == "local" else request.getfixturevalue("s3_lake")


def _unreferenced(lake, name: str) -> list[str]:
    """Data files under ``name`` no commit references (what orphan cleanup would consider)."""
    from urllib.parse import unquote

    fs, root = lake.filesystem()
    base = f"{root}/{name}"
    dt = lake.table(name)
    referenced = set()
    for v in range(dt.version() + 1):
        for e in lake.log_entries(name, v) or []:
            for kind in ("add", "remove"):
                if kind in e:
                    referenced.add(unquote(e[kind]["path"]))
    return [i.path[len(base) + 1:] for i in fs.get_file_info(pafs.FileSelector(base, recursive=True))
            if i.type == pafs.FileType.File and i.path.endswith(".parquet") and "_delta_log" not in i.path
            and i.path[len(base) + 1:] not in referenced]


def _age(lake, name: str, rels: list[str], seconds: float) -> None:
    """Move the mtimes of ``rels`` by ``seconds`` (a writer/store clock skew); local lakes only."""
    for rel in rels:
        p = Path(lake.uri) / name / rel
        st = p.stat()
        os.utime(p, (st.st_atime + seconds, st.st_mtime + seconds))


def _readable(lake, name: str) -> pa.Table:
    return lake.read(name)           # every file of the latest version: raises if one is missing


def _seed(lake, make_traj, n: int = 12, prefix: str = "a-") -> pa.Table:
    t = make_traj(n, seed=len(prefix), median_len=6, sigma=0.2, id_prefix=prefix)
    lake.append("trajectories", stamp_derived(t, "seed"), command="test")
    return t


# -- library staging: Lake.stage -> lake maintain -> Lake.append(staged=...) --------------------------------

@pytest.mark.parametrize("how", ["skewed-past", "orphan-age-0"])
def test_library_staged_files_survive_maintenance(any_lake, make_traj, how):
    from pipeline.maintain import maintain

    lake = any_lake
    if how == "skewed-past" and not lake.is_local:
        pytest.skip("mtimes cannot be set on S3; orphan age 0 makes every file look old there")
    _seed(lake, make_traj)
    more = make_traj(8, seed=9, median_len=6, sigma=0.2, id_prefix="b-")
    read_version = lake.version("trajectories")
    st = lake.stage("trajectories", stamp_derived(more, "lib"))
    staged = _unreferenced(lake, "trajectories")
    assert staged, "stage wrote no file"
    if how == "skewed-past":
        _age(lake, "trajectories", staged, -SKEW_S)
        maintain(lake, tables=["trajectories"])                      # the default age guard (60 minutes)
    else:
        maintain(lake, tables=["trajectories"], orphan_min_age_s=0)
    assert sorted(_unreferenced(lake, "trajectories")) == sorted(staged), "maintenance deleted a declared file"
    res = lake.append("trajectories", None, command="test", staged=[st], read_version=read_version)
    assert res.landed
    t = _readable(lake, "trajectories")
    assert t.num_rows == 20
    assert _unreferenced(lake, "trajectories") == []
    from pipeline.lake import staging

    assert not staging.declared(lake).paths, "the committed files are still declared"


def test_a_staged_file_that_vanished_is_never_committed(any_lake, make_traj):
    from pipeline.lake.delta import KeyRace
    from pipeline.lake.delta.writes import StagedFilesMissing

    lake = any_lake
    _seed(lake, make_traj)
    v = lake.version("trajectories")
    st = lake.stage("trajectories", stamp_derived(make_traj(8, seed=9, median_len=6, id_prefix="b-"), "lib"))
    fs, root = lake.filesystem()
    for a in st.actions:
        fs.delete_file(f"{root}/trajectories/{a.path}")               # a cleanup that ignores the registry
    with pytest.raises(StagedFilesMissing, match="no longer there as written") as exc:
        lake.append("trajectories", None, command="test", staged=[st], read_version=v)
    assert isinstance(exc.value, KeyRace)                              # ingest restages on it
    assert lake.version("trajectories") == v, "something was committed"
    assert _readable(lake, "trajectories").num_rows == 12


# -- the CLI ingest parked between staging and commit, with maintenance running meanwhile -----------------

def _cli_env(lake, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env.update(lake.storage_options or {})
    return env


@pytest.mark.slow
@pytest.mark.parametrize("skew", [-SKEW_S, +SKEW_S, None])
def test_ingest_staged_file_survives_maintain_whatever_the_clocks(any_lake, tmp_path, make_traj, skew):
    from pipeline.maintain import maintain

    lake = any_lake
    if skew is not None and not lake.is_local:
        pytest.skip("mtimes cannot be set on S3 (orphan age 0 covers it)")
    _seed(lake, make_traj)
    src = make_traj(16, seed=5, median_len=6, sigma=0.2, id_prefix="c-")
    path = tmp_path / "in.parquet"
    pq.write_table(src, path)
    marker = tmp_path / "staged.marker"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "ingest", str(path), "--lake", lake.uri, "--json"],
                            env=_cli_env(lake, {"PIPELINE_TEST_PAUSE_AT": f"append:trajectories:staged={marker}"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.02)
        staged = _unreferenced(lake, "trajectories")
        assert staged
        if skew is not None:
            _age(lake, "trajectories", staged, skew)
            maintain(lake, tables=["trajectories"])
        else:
            maintain(lake, tables=["trajectories"], orphan_min_age_s=0)
        Path(f"{marker}.go").write_text("")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out)["landed"] == 16
    t = _readable(lake, "trajectories")
    assert t.num_rows == 28 and len(set(t.column("trajectory_id").to_pylist())) == 28


# -- the staging registry itself ------------------------------------------------------------------------

def test_a_record_is_live_unless_its_writer_is_dead_or_both_clocks_say_it_is_old(lake):
    from pipeline.lake import staging

    rid = staging.declare(lake, ["trajectories/x.parquet", "_snapshots/.tmp-a/"])
    d = staging.declared(lake)
    assert d.covers("trajectories/x.parquet") and d.covers("_snapshots/.tmp-a/members.parquet")
    assert not d.covers("trajectories/y.parquet")
    rec = Path(lake.uri) / staging.STAGING_DIR / f"{rid}.json"
    old = time.time() - staging.INTENT_MAX_AGE_S - 60
    os.utime(rec, (old, old))                                       # the store's clock says old ...
    assert staging.declared(lake).covers("trajectories/x.parquet")  # ... the writer's does not
    body = json.loads(rec.read_text())
    rec.write_text(json.dumps(dict(body, created=old)))             # the writer's clock says old ...
    assert staging.declared(lake).covers("trajectories/x.parquet")  # ... the store's (fresh mtime) does not
    os.utime(rec, (old, old))
    assert not staging.declared(lake).covers("trajectories/x.parquet")   # both: an expired record
    staging.declared(lake, remove_expired=True)
    assert not rec.exists()

    # a writer on this host that is gone: its record protects nothing, at once
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    rid = staging.declare(lake, ["trajectories/z.parquet"])
    rec = Path(lake.uri) / staging.STAGING_DIR / f"{rid}.json"
    rec.write_text(json.dumps(dict(json.loads(rec.read_text()), pid=int(p.stdout))))
    assert not staging.declared(lake).covers("trajectories/z.parquet")
    rec.write_text("{not json")
    assert not staging.declared(lake).covers("trajectories/z.parquet")   # damaged: protects nothing


# -- snapshot publication ---------------------------------------------------------------------------------

def _admissible_lake(lake, make_traj) -> None:
    for k in range(3):
        t = make_traj(16, seed=200 + k, median_len=6, sigma=0.2, id_prefix=f"g{k}-")
        lake.append("trajectories", stamp_derived(t, f"seed-{k}"), command="test", app_id="seed", txn_version=k)


def _admit_in_thread(lake, barrier: Path, monkeypatch):
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.snapshots.publish import PUBLISH_BARRIER_ENV

    monkeypatch.setenv(PUBLISH_BARRIER_ENV, str(barrier))
    out: dict = {}

    def run():
        try:
            out["result"] = admit(lake, AdmissionConfig(quality=False), current_policy_version=0)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            out["error"] = exc

    th = threading.Thread(target=run)
    th.start()
    deadline = time.time() + 300
    while not list(barrier.glob("ready-*")):
        assert th.is_alive(), out
        assert time.time() < deadline, "admission never reached its commit point"
        time.sleep(0.01)
    return th, out


def test_maintenance_with_orphan_age_0_during_publication_loses_no_group(any_lake, make_traj, tmp_path,
                                                                        monkeypatch):
    from pipeline.maintain import maintain
    from pipeline.snapshots.format import verify_snapshot

    lake = any_lake
    _admissible_lake(lake, make_traj)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    th, out = _admit_in_thread(lake, barrier, monkeypatch)
    maintain(lake, orphan_min_age_s=0)          # the in-flight payload is declared: left alone
    (barrier / "go").write_text("")
    th.join(timeout=300)
    assert "error" not in out, out.get("error")
    a = out["result"]
    assert a.snapshot_id and verify_snapshot(lake, a.snapshot_id)["ok"]
    monkeypatch.delenv("PIPELINE_SNAPSHOT_PUBLISH_BARRIER")
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit

    again = admit(lake, AdmissionConfig(quality=False), current_policy_version=0)
    assert again.snapshot_id is None or again.snapshot_id == a.snapshot_id


def test_publication_refuses_when_its_payload_vanished_and_leaves_the_groups_undecided(any_lake, make_traj,
                                                                                      tmp_path, monkeypatch):
    from pipeline.errors import IntegrityError
    from pipeline.snapshots.format import verify_snapshot

    lake = any_lake
    _admissible_lake(lake, make_traj)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    th, out = _admit_in_thread(lake, barrier, monkeypatch)
    fs, root = lake.filesystem()
    payloads = [i.path for i in fs.get_file_info(pafs.FileSelector(f"{root}/_snapshots", recursive=True))
                if i.type == pafs.FileType.File and i.base_name.startswith("members")]
    assert payloads
    for p in payloads:
        fs.delete_file(p)                      # what an old maintain (no registry) did
    (barrier / "go").write_text("")
    th.join(timeout=300)
    err = out.get("error")
    assert isinstance(err, IntegrityError), err
    assert "no longer there as written" in str(err) and "nothing was committed" in str(err)
    assert not lake.exists("receipts") or lake.read("receipts").num_rows == 0, "groups were decided"
    sid = (barrier / next(barrier.glob("ready-*")).name).read_text()
    assert not _try(lake, sid), "a snapshot was published without its payload"
    monkeypatch.delenv("PIPELINE_SNAPSHOT_PUBLISH_BARRIER")
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit

    a = admit(lake, AdmissionConfig(quality=False), current_policy_version=0)      # the rerun converges
    assert a.snapshot_id == sid and verify_snapshot(lake, sid)["ok"]


def _try(lake, sid: str) -> bool:
    from pipeline.snapshots.format import try_open

    return try_open(lake, sid) is not None


# -- the key index can only cost time ---------------------------------------------------------------------

def _index_file(lake) -> str:
    fs, root = lake.filesystem()
    files = [i.path for i in fs.get_file_info(pafs.FileSelector(f"{root}/_index/trajectories", allow_not_found=True))
             if i.base_name.startswith("keys-")]
    assert len(files) == 1, files
    return files[0]


def _damage(lake, how: str) -> None:
    """Damage the key index in place, in whatever format it is written (the header, if any, left as it was)."""
    import io

    import numpy as np

    fs, _ = lake.filesystem()
    path = _index_file(lake)
    with fs.open_input_stream(path) as f:
        raw = f.read()
    if path.endswith(".npy"):      # the format before index headers
        keys, head = np.load(io.BytesIO(raw)), b""
    else:
        nl = raw.index(b"\n") + 1
        head, keys = raw[:nl], np.frombuffer(raw[nl:], "<i8")
    if how == "half":
        keys = keys[: len(keys) // 2]
    elif how == "unsorted":
        keys = np.random.default_rng(0).permutation(keys)
    if how == "zero-byte":
        data = b""
    elif how == "float64":
        buf = io.BytesIO()
        np.save(buf, keys.astype(np.float64))
        data = buf.getvalue()
    elif head:
        data = head + np.ascontiguousarray(keys, "<i8").tobytes()
    else:
        buf = io.BytesIO()
        np.save(buf, keys)
        data = buf.getvalue()
    with fs.open_output_stream(path) as f:
        f.write(data)


def _ingest(lake, t):
    import pipeline.lake.delta as delta
    from pipeline.ingest import ingest_table

    delta.KEY_CACHE.clear()               # as a fresh process: the keys come from _index/ and the log
    return ingest_table(lake, t)


def _assert_unique(lake, n: int) -> None:
    ids = lake.read("trajectories", columns=["trajectory_id"]).column(0).to_pylist()
    assert len(ids) == len(set(ids)) == n, f"{len(ids)} rows, {len(set(ids))} ids: duplicates landed"


@pytest.mark.parametrize("how", ["half", "unsorted", "zero-byte", "float64"])
def test_a_damaged_key_index_never_lets_a_duplicate_in(any_lake, make_traj, how, caplog):
    from pipeline.maintain import maintain

    lake = any_lake
    a = make_traj(72, seed=1, median_len=6, sigma=0.2, id_prefix="a-")
    assert _ingest(lake, a).landed == 72
    maintain(lake, tables=["trajectories"], orphan_min_age_s=0)
    _damage(lake, how)
    with caplog.at_level("WARNING", logger="pipeline.lake"):
        r = _ingest(lake, pa.concat_tables([a.slice(0, 60), make_traj(6, seed=2, median_len=6, id_prefix="n-")]))
    assert (r.landed, r.duplicates) == (6, 60)
    _assert_unique(lake, 78)
    assert any("ignoring the key index" in m for m in caplog.messages), caplog.messages
    found = lake.load_key_index("trajectories", lake.version("trajectories"))   # rebuilt, and trusted again
    assert found is not None and len(found[1]) == 72


def _copy_tree(fs, src: str, dst: str) -> None:
    for info in fs.get_file_info(pafs.FileSelector(src, recursive=True)):
        if info.type == pafs.FileType.File:
            target = dst + info.path[len(src):]
            fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            fs.copy_file(info.path, target)


def test_a_key_index_from_another_history_of_the_table_is_not_trusted(any_lake, make_traj):
    """The table restored from a backup, `_index/` left as it was: the index of
    the old history names a version the new history reaches with other rows."""
    from pipeline.maintain import maintain

    lake = any_lake
    fs, root = lake.filesystem()
    a = make_traj(24, seed=1, median_len=6, sigma=0.2, id_prefix="a-")
    _ingest(lake, a)
    _copy_tree(fs, f"{root}/trajectories", f"{root}/backup")                     # the backup: A
    _ingest(lake, make_traj(24, seed=2, median_len=6, id_prefix="b-"))
    _ingest(lake, make_traj(24, seed=3, median_len=6, id_prefix="x-"))
    maintain(lake, tables=["trajectories"], orphan_min_age_s=0)                   # index of the old history
    iv = lake.load_key_index("trajectories", 10**9)[0]
    fs.delete_dir(f"{root}/trajectories")
    _copy_tree(fs, f"{root}/backup", f"{root}/trajectories")                     # restored; _index/ kept
    c = make_traj(12, seed=4, median_len=6, id_prefix="c-")
    k = 0
    while lake.version("trajectories") < iv:                                    # the new history catches up
        _ingest(lake, c if k == 0 else make_traj(12, seed=10 + k, median_len=6, id_prefix=f"d{k}-"))
        k += 1
    n = lake.read("trajectories", columns=["trajectory_id"]).num_rows
    z = make_traj(3, seed=99, median_len=6, id_prefix="z-")     # new rows: not the same table, so not skipped whole
    r = _ingest(lake, pa.concat_tables([c, z]))                                  # c landed already
    assert (r.landed, r.duplicates) == (3, 12)
    _assert_unique(lake, n + 3)


# -- pipeline lake verify -----------------------------------------------------------------------------------

def test_lake_verify_lists_every_missing_or_unreadable_file_and_snapshot(any_lake, make_traj, capsys, monkeypatch):
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.cli import main
    from pipeline.snapshots.format import open_snapshot

    lake = any_lake
    for k, v in (lake.storage_options or {}).items():    # the CLI reads the store's options from the environment
        monkeypatch.setenv(k, v)
    _admissible_lake(lake, make_traj)
    a = admit(lake, AdmissionConfig(quality=False), current_policy_version=0)
    assert main(["lake", "verify", "--lake", lake.uri, "--json"]) == 0
    ok = json.loads(capsys.readouterr().out)
    assert ok["ok"] and ok["snapshots"]["checked"] == 1 and ok["tables"]["trajectories"]["files"] == 3
    fs, root = lake.filesystem()
    live = sorted(p for p, _ in lake.live_files(lake.table("trajectories")))
    fs.delete_file(f"{root}/trajectories/{live[0]}")
    with fs.open_output_stream(f"{root}/trajectories/{live[1]}") as f:
        f.write(b"PAR1 not parquet at all")
    snap = open_snapshot(lake, a.snapshot_id)
    fs.delete_file(f"{root}/{snap.path}/{next(iter(snap.manifest['files']))}")
    assert main(["lake", "verify", "--lake", lake.uri]) == 1
    text = capsys.readouterr().out
    assert f"trajectories/{live[0]}: missing" in text
    assert f"trajectories/{live[1]}:" in text and "FAILED" in text
    assert f"snapshot {a.snapshot_id}" in text
    assert main(["lake", "maintain", "--lake", lake.uri, "--json"]) == 0       # maintain runs it too, and says so
    captured = capsys.readouterr()
    rep = json.loads(captured.out)
    assert "lake verify found 3 problem(s)" in captured.err
    assert not rep["verify"]["ok"] and len(rep["verify"]["problems"]) == 3
