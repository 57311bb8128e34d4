"""The async demo loop once through the front door: the rollout worker publishes
to the log, ``pipeline serve`` lands, admission and the resident trainer read
the lake as always."""

from __future__ import annotations

import pytest
from serve_helpers import start_serve, stop_serve, stream_messages, wait_for

from pipeline.lake.delta import Lake


@pytest.mark.slow
def test_async_demo_runs_once_through_the_log(tmp_path, nats_server, stream):
    from pipeline.demo import DemoConfig, run_demo

    lake = Lake(tmp_path / "lake")
    proc = start_serve(str(tmp_path / "lake"), nats_server.url, stream, extra=["--tables", "trajectories,events"])
    try:
        cfg = DemoConfig(mode="async", iterations=1, groups=8, group_size=4, eval_n=24, epochs=1, report=False,
                         async_min_groups=4, async_timeout_s=240, ingest_url=nats_server.url, ingest_stream=stream)
        summary = run_demo(lake, cfg, out=lambda *a: None)
        wait_for(lambda: stream_messages(nats_server.url, stream) == 0, what="the committer", proc=proc)
    finally:
        code, err = stop_serve(proc)
    assert code == 0, err
    assert len(summary["iterations"]) == 2 and summary["iterations"][1]["snapshot_id"]
    rows = lake.read("trajectories", columns=["trajectory_id", "ingest_id"]).to_pylist()
    assert rows and all(r["ingest_id"].startswith("serve:") for r in rows), "every trajectory came through the log"
    ids = [r["trajectory_id"] for r in rows]
    assert len(ids) == len(set(ids))
