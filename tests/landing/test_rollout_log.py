"""`pipeline rollout --ingest-url`: the spool ships through the lake's log and
``pipeline serve`` lands it; every trajectory and event lands once, also when
the run is resumed (the recovery publishes again and waits for the lake)."""

from __future__ import annotations

import pytest
from serve_helpers import start_serve, stop_serve, stream_messages, wait_for

from pipeline.lake.delta import Lake


@pytest.mark.slow
def test_rollout_ships_through_the_log(tmp_path, nats_server, stream):
    from pipeline.rollout.policy import init_policy
    from pipeline.rollout.run import run_rollout

    lake = Lake(tmp_path / "lake")
    init_policy(lake, warm_start_steps=20, demonstrations=200, tool_fraction=0.5)
    proc = start_serve(str(tmp_path / "lake"), nats_server.url, stream, extra=["--tables", "trajectories,events"])
    try:
        wait_for(lambda: _stream_exists(nats_server.url, stream), what="the stream", proc=proc)
        s = run_rollout(lake, groups=2, group_size=2, seed=3, run_id="via-log", ingest_url=nats_server.url,
                        ingest_stream=stream)
        assert s.trajectories == 4 and s.landed == 4 and s.events > 0      # published (acknowledged)
        wait_for(lambda: stream_messages(nats_server.url, stream) == 0, what="the committer", proc=proc)
        # resume the run: recovery publishes nothing new twice and waits until the lake has everything
        again = run_rollout(lake, groups=2, group_size=2, seed=3, run_id="via-log", ingest_url=nats_server.url,
                            ingest_stream=stream)
        wait_for(lambda: stream_messages(nats_server.url, stream) == 0, what="the committer", proc=proc)
    finally:
        code, err = stop_serve(proc)
    assert code == 0, err
    ids = lake.read("trajectories", columns=["trajectory_id"]).column("trajectory_id").to_pylist()
    assert len(ids) == len(set(ids)) == 4 + again.landed
    ev = lake.read("events", columns=["row_key"]).column("row_key").to_pylist()
    assert len(ev) == len(set(ev)) == s.events + again.events
    assert not lake.exists("quarantine") or lake.read("quarantine").num_rows == 0


def _stream_exists(url, stream):
    try:
        stream_messages(url, stream)
        return True
    except Exception:  # noqa: BLE001 - not yet
        return False
