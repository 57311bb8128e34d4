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

from pipeline.admission.snapshot import open_snapshot, verify_snapshot

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

    from pipeline.admission.snapshot import compute_snapshot_id, write_snapshot_files
    from pipeline.lake import objects
    from pipeline.train.fixtures import synthetic_payload

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
