"""The front door end to end: producers publish to a real JetStream server,
``pipeline serve`` commits; every acknowledged row lands exactly once through
resends, kill -9 of the committer (mid-pull, after the commit before the ack)
and of the server; a full stream is backpressure; a stale committer is fenced."""

from __future__ import annotations

import subprocess

import pyarrow as pa
import pytest
from serve_helpers import (kill9, landed_ids, make_stream, publish_raw, start_serve, stop_serve, stream_messages,
                      wait_for)

from pipeline.lake.delta import Lake
from pipeline.landing import connect, wire
from pipeline.testing.trajectories import make_trajectories


def _batches(k: int, n: int = 20, prefix: str = "b"):
    return [make_trajectories(n, seed=i, id_prefix=f"{prefix}{i}-", median_len=8, prompt_len=4) for i in range(k)]


def _publish(url: str, stream: str, batches) -> list:
    with connect(url, stream=stream) as door:
        return [door.ingest_table(b) for b in batches]


def _drained(lake, url, stream, n, proc=None):
    wait_for(lambda: len(landed_ids(lake)) >= n and stream_messages(url, stream) == 0, what=f"{n} rows landed",
             proc=proc)


def test_publish_serve_lands_every_row_once_and_resend_is_stored_once(tmp_path, nats_server, stream):
    lake = Lake(tmp_path / "lake")
    proc = start_serve(str(tmp_path / "lake"), nats_server.url, stream)
    try:
        wait_for(lambda: _has_stream(nats_server.url, stream), what="the stream", proc=proc)
        reps = _publish(nats_server.url, stream, _batches(4))
        assert all(r.messages == 1 and r.duplicates == 0 for r in reps)
        # a resend of one message (same Nats-Msg-Id, same bytes) is stored once: the ack says duplicate
        again = publish_raw(nats_server.url, stream, "trajectories", wire.encode(_batches(1)[0]),
                            {wire.HEADER_ID: reps[0].msg_ids[0], wire.HEADER_TABLE: "trajectories"})
        assert again.duplicate is True and again.seq == reps[0].first_seq
        _drained(lake, nats_server.url, stream, 80, proc)
    finally:
        code, err = stop_serve(proc)
    assert code == 0, err
    ids = landed_ids(lake)
    assert len(ids) == 80 and len(set(ids)) == 80
    # the table's transaction is the last stream sequence the committer covered
    assert lake.transaction_version("trajectories", wire.app_id(stream, "trajectories")) == reps[-1].last_seq
    # outcomes per batch: rows landed carry the message id in ingest_id
    ing = lake.read("trajectories", columns=["ingest_id"]).column("ingest_id").to_pylist()
    assert ing.count(f"serve:{reps[1].msg_ids[0]}") == 20


def _has_stream(url, stream):
    try:
        stream_messages(url, stream)
        return True
    except Exception:  # noqa: BLE001 - not created yet
        return False


@pytest.mark.slow
@pytest.mark.parametrize("point", ["serve:trajectories:committed", "serve:trajectories:pulled",
                                   "append:trajectories:staged"])
def test_kill9_committer_then_restart_lands_nothing_twice(tmp_path, nats_server, stream, point):
    """kill -9 after the Delta commit before the ack (the acks are lost: the restart acks those messages
    without landing them), right after a pull, or mid-commit with the files written but not committed
    (nothing committed: the restart lands them)."""
    lake = Lake(tmp_path / "lake")
    make_stream(nats_server.url, stream)
    reps = _publish(nats_server.url, stream, _batches(3))
    marker = tmp_path / "paused"
    proc = start_serve(str(tmp_path / "lake"), nats_server.url, stream, pause_at=f"{point}={marker}")
    wait_for(marker.exists, what=f"the pause at {point}", proc=proc)
    kill9(proc)
    before = len(landed_ids(lake))
    assert before == (60 if point.endswith("committed") else 0)
    assert stream_messages(nats_server.url, stream) == 3      # nothing was acked
    proc = start_serve(str(tmp_path / "lake"), nats_server.url, stream)
    try:
        _drained(lake, nats_server.url, stream, 60, proc)
    finally:
        code, err = stop_serve(proc)
    assert code == 0, err
    ids = landed_ids(lake)
    assert len(ids) == 60 and len(set(ids)) == 60
    assert lake.transaction_version("trajectories", wire.app_id(stream, "trajectories")) == reps[-1].last_seq


@pytest.mark.slow
def test_kill9_of_the_server_loses_no_acked_row(tmp_path, stream):
    from pipeline.testing.nats_server import NatsServer

    srv = NatsServer(tmp_path / "js").start()
    try:
        make_stream(srv.url, stream)
        _publish(srv.url, stream, _batches(3))          # acked: stored on disk
        srv.restart()                                   # kill -9, then the same port and store
        lake = Lake(tmp_path / "lake")
        proc = start_serve(str(tmp_path / "lake"), srv.url, stream)
        try:
            _drained(lake, srv.url, stream, 60, proc)
        finally:
            code, err = stop_serve(proc)
        assert code == 0, err
        assert sorted(landed_ids(lake)) == sorted(set(landed_ids(lake))) and len(landed_ids(lake)) == 60
    finally:
        srv.stop()


def test_full_stream_is_retriable_backpressure(nats_server, stream):
    from pipeline.landing.producer import BackpressureError

    make_stream(nats_server.url, stream, max_bytes=64 * 1024)
    batch = _batches(1, n=40)[0]
    with connect(nats_server.url, stream=stream) as door:
        with pytest.raises(BackpressureError) as err:
            for _ in range(200):
                door.ingest_table(batch)
    assert err.value.transient and "the log is full" in str(err.value)
    assert stream_messages(nats_server.url, stream) >= 1      # what was acked stays stored


def test_a_stream_the_server_cannot_reserve_is_one_error_with_a_hint(tmp_path, stream):
    """JetStream reserves max_bytes up front: a server with less file store than --max-bytes
    refuses the stream, and serve says so in one error, no traceback, and lands nothing."""
    from pipeline.testing.nats_server import NatsServer

    srv = NatsServer(tmp_path / "js", max_file_store=32 << 20).start()
    try:
        proc = start_serve(str(tmp_path / "lake"), srv.url, stream)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and "Traceback" not in err, err
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "cannot reserve max_bytes=1073741824" in errors[0], err
        assert "--max-bytes" in err.split("hint:")[1], err
        smaller = start_serve(str(tmp_path / "lake"), srv.url, stream, extra=["--max-bytes", str(8 << 20)])
        try:
            wait_for(lambda: _has_stream(srv.url, stream), what="the stream", proc=smaller)
        finally:
            code, err = stop_serve(smaller)
        assert code == 0, err
    finally:
        srv.stop()


def test_second_serve_refuses_with_one_line(tmp_path, nats_server, stream):
    lake_uri = str(tmp_path / "lake")
    first = start_serve(lake_uri, nats_server.url, stream)
    try:
        wait_for(lambda: _has_stream(nats_server.url, stream), what="the first committer", proc=first)
        second = start_serve(lake_uri, nats_server.url, stream)
        try:
            _, err = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            code, err = stop_serve(second)
            raise AssertionError(f"the second pipeline serve did not refuse: {err}") from None
        code = second.returncode
        assert code != 0
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert lines and "serve-" in lines[0] and "Traceback" not in err, err
    finally:
        code, err = stop_serve(first)
    assert code == 0, err


def test_large_batch_is_split_and_each_part_has_its_own_id(tmp_path, stream):
    from pipeline.testing.nats_server import NatsServer

    srv = NatsServer(tmp_path / "js", max_payload=64 * 1024).start()
    try:
        make_stream(srv.url, stream)
        big = make_trajectories(200, seed=3, id_prefix="big-", median_len=64, prompt_len=8)
        assert len(wire.encode(big)) > 64 * 1024
        rep = _publish(srv.url, stream, [big])[0]
        assert rep.messages > 1 and len(set(rep.msg_ids)) == rep.messages
        lake = Lake(tmp_path / "lake")
        proc = start_serve(str(tmp_path / "lake"), srv.url, stream)
        try:
            _drained(lake, srv.url, stream, 200, proc)
        finally:
            stop_serve(proc)
        assert len(set(landed_ids(lake))) == len(landed_ids(lake)) == 200
    finally:
        srv.stop()


def test_ingest_table_and_serve_land_the_same_rows(tmp_path, nats_server, stream):
    """The committer lands through the ingest path: the same rows give the same table content."""
    from pipeline.ingest import ingest_table

    rows = _batches(1, n=30)[0]
    a = Lake(tmp_path / "a")
    ingest_table(a, rows)
    b = Lake(tmp_path / "b")
    make_stream(nats_server.url, stream)
    _publish(nats_server.url, stream, [rows])
    proc = start_serve(str(tmp_path / "b"), nats_server.url, stream)
    try:
        _drained(b, nats_server.url, stream, 30, proc)
    finally:
        stop_serve(proc)
    cols = ["trajectory_id", "content_hash", "row_key", "oldest_version", "response_len", "prompt_hash"]
    ta = a.read("trajectories", columns=cols).sort_by("trajectory_id")
    tb = b.read("trajectories", columns=cols).sort_by("trajectory_id")
    assert ta.equals(tb)
    assert isinstance(ta, pa.Table)


@pytest.mark.slow
def test_s3_kill9_after_commit_then_restart_lands_each_row_once(s3_env, nats_server, stream, tmp_path):
    """The same kill on a lake in moto S3 (serve reads the AWS_* environment s3_env sets)."""
    from pipeline.lake.delta import storage_options_from_env

    _, bucket = s3_env
    uri = f"s3://{bucket}/lake"
    make_stream(nats_server.url, stream)
    _publish(nats_server.url, stream, _batches(2, prefix="s3-"))
    marker = tmp_path / "paused"
    proc = start_serve(uri, nats_server.url, stream, pause_at=f"serve:trajectories:committed={marker}")
    wait_for(marker.exists, what="the pause after the commit", proc=proc)
    kill9(proc)
    lake = Lake(uri, storage_options=storage_options_from_env())
    assert len(landed_ids(lake)) == 40 and stream_messages(nats_server.url, stream) == 2
    proc = start_serve(uri, nats_server.url, stream)
    try:
        wait_for(lambda: stream_messages(nats_server.url, stream) == 0, what="the acks", proc=proc)
    finally:
        code, err = stop_serve(proc)
    assert code == 0, err
    ids = landed_ids(lake)
    assert len(ids) == len(set(ids)) == 40


def test_a_standby_takes_over_when_the_committer_stops(tmp_path, nats_server, stream):
    lake_uri = str(tmp_path / "lake")
    first = start_serve(lake_uri, nats_server.url, stream)
    standby = None
    try:
        wait_for(lambda: _has_stream(nats_server.url, stream), what="the first committer", proc=first)
        standby = start_serve(lake_uri, nats_server.url, stream, extra=["--standby"])
        kill9(first)                                   # the lease is pid-bound: free at once
        _publish(nats_server.url, stream, _batches(2, prefix="sb"))
        lake = Lake(lake_uri)
        _drained(lake, nats_server.url, stream, 40, standby)
    finally:
        if first.poll() is None:
            stop_serve(first)
        code, err = stop_serve(standby) if standby is not None else (0, "")
    assert code == 0, err
    assert len(set(landed_ids(lake))) == len(landed_ids(lake)) == 40


def test_credentials_are_required_and_used(tmp_path, stream, monkeypatch):
    from pipeline.errors import ConfigError
    from pipeline.testing.nats_server import NatsServer

    srv = NatsServer(tmp_path / "js", user="lake", password="s3cret").start()
    try:
        with pytest.raises(ConfigError) as err:
            connect(srv.url, stream=stream)
        assert "cannot connect" in str(err.value) and "s3cret" not in str(err.value)
        monkeypatch.setenv("NATS_USER", "lake")
        monkeypatch.setenv("NATS_PASSWORD", "s3cret")
        make_stream_auth(srv.url, stream)
        with connect(srv.url, stream=stream) as door:
            assert door.ingest_table(_batches(1)[0]).messages == 1
    finally:
        srv.stop()


def make_stream_auth(url, stream):
    import asyncio

    from pipeline.landing.committer import ServeSettings
    from pipeline.landing.log import ensure_stream, nats_connect

    async def go():
        nc = await nats_connect(url)
        try:
            await ensure_stream(nc.jetstream(), ServeSettings(stream=stream))
        finally:
            await nc.close()
    asyncio.run(go())


def test_serve_with_an_unreachable_log_is_one_line_and_creates_no_lake(tmp_path):
    from pipeline.testing.nats_server import free_port

    proc = start_serve(str(tmp_path / "lake"), f"nats://127.0.0.1:{free_port()}", "lake")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.startswith("error: cannot connect to the log") and "Traceback" not in err
    assert not (tmp_path / "lake").exists()


@pytest.mark.slow
def test_kill9_of_a_producer_mid_publish_loses_no_acked_row_and_doubles_none(tmp_path, nats_server, stream):
    import sys
    import time
    from pathlib import Path

    make_stream(nats_server.url, stream)
    acked = tmp_path / "acked"
    acked.touch()
    here = Path(__file__).resolve().parent
    env = dict(__import__("os").environ, PYTHONPATH=str(here.parents[1]))
    prod = subprocess.Popen([sys.executable, str(here / "producer_proc.py"), nats_server.url, stream, str(acked),
                             "100000"], env=env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(acked.read_text().split()) >= 20, what="20 acked batches")
    prod.kill()                                          # mid-publish: some batch is in flight
    prod.communicate(timeout=30)
    time.sleep(0.2)
    done = {int(x) for x in acked.read_text().split()}
    lake = Lake(tmp_path / "lake")
    proc = start_serve(str(tmp_path / "lake"), nats_server.url, stream)
    try:
        wait_for(lambda: stream_messages(nats_server.url, stream) == 0, what="the committer", proc=proc)
    finally:
        code, err = stop_serve(proc)
    assert code == 0, err
    ids = landed_ids(lake)
    assert len(ids) == len(set(ids))
    landed_batches = {int(t.split("-")[0][1:]) for t in ids}
    assert done <= landed_batches                       # every acknowledged batch landed
    assert len(landed_batches - done) <= 1              # at most the one in flight (stored, ack not seen)
    assert all(sum(1 for t in ids if t.startswith(f"k{k}-")) == 10 for k in landed_batches)


def test_sigterm_stops_a_waiting_standby_cleanly(tmp_path, nats_server, stream):
    import signal
    import time

    lake_uri = str(tmp_path / "lake")
    first = start_serve(lake_uri, nats_server.url, stream)
    try:
        wait_for(lambda: _has_stream(nats_server.url, stream), what="the first committer", proc=first)
        standby = start_serve(lake_uri, nats_server.url, stream, extra=["--standby"])
        time.sleep(3)                                   # waiting for the lease
        assert standby.poll() is None
        standby.send_signal(signal.SIGTERM)
        _, err = standby.communicate(timeout=60)
        assert standby.returncode == 0, err
    finally:
        code, err = stop_serve(first)
    assert code == 0, err


def test_a_reused_message_id_with_other_bytes_is_refused(nats_server, stream):
    from pipeline.landing.producer import IdReusedError

    make_stream(nats_server.url, stream)
    a, b = _batches(2, n=5, prefix="reuse")
    with connect(nats_server.url, stream=stream) as door:
        first = door.append("trajectories", a, seq=7, producer_id="fixed")
        again = door.append("trajectories", a, seq=7, producer_id="fixed")      # a resend: stored once
        assert again.duplicates == 1 and again.first_seq == first.first_seq
        with pytest.raises(IdReusedError) as err:
            door.append("trajectories", b, seq=7, producer_id="fixed")       # the same id, other rows
    assert "fixed:7" in str(err.value) and "NOT stored" in str(err.value)
    assert stream_messages(nats_server.url, stream) == 1
