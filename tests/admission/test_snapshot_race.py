"""Snapshot publication is atomic per id: two publications of the same id
racing at the commit point (aligned by the barrier hook) on S3 (moto) and on a
local lake: the first complete one wins, the other verifies it and never
overwrites it, and the published snapshot always verifies (also through
`pipeline snapshots verify`, which checks the registered manifest sha)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyarrow.fs import FileSelector

from pipeline.snapshots.format import open_snapshot, verify_snapshot

RACER = Path(__file__).with_name("snapshot_racer.py")
TRIALS = 3


def _race(lake, tmp_path) -> list[list[dict]]:
    sync = tmp_path / "sync"
    for t in range(TRIALS):
        (sync / f"trial-{t}").mkdir(parents=True)
    opts = json.dumps(lake.storage_options or {})
    procs = [subprocess.Popen([sys.executable, str(RACER), lake.uri, opts, str(sync), str(i), str(TRIALS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        for t in range(TRIALS):
            d = sync / f"trial-{t}"
            deadline = time.time() + 300
            while len(list(d.glob("ready-*"))) < 2:  # both wrote their payload; the commit point is next
                assert time.time() < deadline, "publishers did not get ready"
                assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
                time.sleep(0.01)
            (d / "go").write_text("")
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    rows = [json.loads(line) for o in outs for line in o[0].splitlines()]
    return [[r for r in rows if r["trial"] == t] for t in range(TRIALS)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "local"])
def test_racing_publications_of_one_snapshot_id(kind, lake, tmp_path, request):
    lk = lake if kind == "local" else request.getfixturevalue("s3_lake")
    fs, root = lk.filesystem()
    for t, rows in enumerate(_race(lk, tmp_path)):
        assert len(rows) == 2
        sid = rows[0]["snapshot_id"]
        assert rows[1]["snapshot_id"] == sid
        assert rows[0]["manifest_sha256"] == rows[1]["manifest_sha256"], f"trial {t}: both return the winner"
        snap = open_snapshot(lk, sid)
        assert snap.manifest_sha256 == rows[0]["manifest_sha256"], "the published manifest is never replaced"
        assert verify_snapshot(lk, sid)["registered"]
        # the loser left nothing behind: exactly the files the manifest names
        names = sorted(i.base_name for i in fs.get_file_info(FileSelector(f"{root}/{snap.path}")))
        assert names == sorted([*snap.manifest["files"], "manifest.json"]), names
        env = dict(os.environ, **(lk.storage_options or {}))
        cli = subprocess.run([sys.executable, "-m", "pipeline", "snapshots", "verify", sid, "--lake", lk.uri,
                              "--json"], capture_output=True, text=True, env=env, timeout=300)
        assert cli.returncode == 0, cli.stdout + cli.stderr[-2000:]
        assert json.loads(cli.stdout.strip().splitlines()[-1])["ok"]
    if kind == "local":
        assert not [p for p in (Path(lk.uri) / "_snapshots").iterdir() if p.name.startswith(".tmp-")]


def test_a_retried_manifest_put_that_had_landed_is_our_publication(s3_lake, monkeypatch):
    import pyarrow as pa

    from pipeline.snapshots.format import compute_snapshot_id

    from pipeline.snapshots.publish import write_snapshot_files
    from pipeline.lake import objects
    from pipeline.testing.train_fixtures import synthetic_payload

    real = objects.put_if_absent

    def landed_but_refused(lake, rel, data):
        real(lake, rel, data)
        return False

    monkeypatch.setattr(objects, "put_if_absent", landed_but_refused)
    payload = synthetic_payload(8, seed=9)
    sid = compute_snapshot_id(zip(payload.column("trajectory_id").to_pylist(),
                                  payload.column("content_hash").to_pylist()), "retry", "grpo")
    payload = payload.set_column(0, "snapshot_id", pa.array([sid] * payload.num_rows))
    snap = write_snapshot_files(s3_lake, payload, snapshot_id=sid,
                                manifest_extra={"config_hash": "retry", "advantage_estimator": "grpo"})
    assert verify_snapshot(s3_lake, sid)["ok"], "its payload was kept: the manifest that landed names it"
    assert open_snapshot(s3_lake, sid).manifest_sha256 == snap.manifest_sha256


def test_maintain_removes_unpublished_payloads_on_s3(s3_lake, tmp_path):
    """A publisher killed between its payload and its manifest (and a loser that
    died before deleting its payload) leave payloads no manifest names:
    `lake maintain` removes them once old enough, never the published one."""
    import pyarrow as pa

    from pipeline.snapshots.format import compute_snapshot_id, snapshot_dir

    from pipeline.snapshots.publish import write_snapshot_files
    from pipeline.lake import objects
    from pipeline.maintain import maintain
    from pipeline.testing.train_fixtures import synthetic_payload

    def payload(seed):
        p = synthetic_payload(8, seed=seed)
        sid = compute_snapshot_id(zip(p.column("trajectory_id").to_pylist(), p.column("content_hash").to_pylist()),
                                  "m", "grpo")
        return sid, p.set_column(0, "snapshot_id", pa.array([sid] * p.num_rows))

    extra = {"config_hash": "m", "advantage_estimator": "grpo"}
    sid, p = payload(1)
    write_snapshot_files(s3_lake, p, snapshot_id=sid, manifest_extra=extra)
    fs, root = s3_lake.filesystem()
    with fs.open_output_stream(f"{root}/{snapshot_dir(sid)}/members.deadbeefdeadbeef.parquet") as f:
        f.write(b"a loser's payload it did not get to delete")
    # a publisher SIGKILLed at its commit point (the barrier hook's readiness marker): payload, no manifest
    sync = tmp_path / "sync"
    (sync / "trial-0").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, str(RACER), s3_lake.uri, json.dumps(s3_lake.storage_options), str(sync),
                             "0", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list((sync / "trial-0").glob("ready-*")):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    proc.kill()
    proc.wait(timeout=60)
    dead = (sync / "trial-0" / next((sync / "trial-0").glob("ready-*")).name).read_text()
    assert objects.get(s3_lake, f"{snapshot_dir(dead)}/manifest.json") is None  # it never published
    assert maintain(s3_lake, orphan_min_age_s=3600)["snapshot_temp_dirs_removed"] == []  # too young
    removed = maintain(s3_lake, orphan_min_age_s=0)["snapshot_temp_dirs_removed"]
    assert sorted(r.split("/")[0] for r in removed) == sorted([sid, dead]), removed
    assert verify_snapshot(s3_lake, sid)["ok"]
    assert open_snapshot(s3_lake, sid) is not None
