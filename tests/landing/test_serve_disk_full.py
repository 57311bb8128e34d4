"""A full disk under the lake stops ``pipeline serve`` with one clear error and
acks nothing; with space again, a restart lands every row once (needs root to
mount a small tmpfs; skipped otherwise)."""

from __future__ import annotations

import os
import subprocess

import pytest
from serve_helpers import landed_ids, make_stream, start_serve, stop_serve, stream_messages, wait_for

from pipeline.landing import connect
from pipeline.testing.trajectories import make_trajectories

pytestmark = pytest.mark.slow


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_stops_serve_with_one_error_and_loses_nothing(small_fs, nats_server, stream):
    from pipeline.lake.delta import Lake

    lake_dir = small_fs / "lake"
    Lake(lake_dir).ensure("trajectories")
    make_stream(nats_server.url, stream)
    with connect(nats_server.url, stream=stream) as door:
        for k in range(3):
            door.ingest_table(make_trajectories(50, seed=k, id_prefix=f"d{k}-", median_len=400))
    filler = small_fs / "filler"
    st = os.statvfs(small_fs)
    with open(filler, "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - (64 << 10)))     # room for the lease, not the rows
    proc = start_serve(str(lake_dir), nats_server.url, stream)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "no space left" in errors[0], err[-3000:]
    assert stream_messages(nats_server.url, stream) == 3                   # nothing acked
    filler.unlink()
    proc = start_serve(str(lake_dir), nats_server.url, stream)
    try:
        wait_for(lambda: stream_messages(nats_server.url, stream) == 0, what="the committer", proc=proc)
    finally:
        code, err = stop_serve(proc)
    assert code == 0, err
    ids = landed_ids(Lake(lake_dir))
    assert len(ids) == len(set(ids)) == 150
