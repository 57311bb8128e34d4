"""Lineage: OpenLineage START/COMPLETE/FAIL events of training runs, and
`pipeline lineage CHECKPOINT_ID` walking checkpoint -> snapshots -> trajectories -> versions."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest


@pytest.fixture
def trained(lake, tmp_path):
    from pipeline.ingest import ingest_files
    from pipeline.testing.trajectories import make_trajectories
    from pipeline.train.config import TrainConfig
    from pipeline.testing.train_fixtures import publish_synthetic_snapshot, publish_tiny_policy
    from pipeline.train.run import train_snapshot

    # the trajectories table holds the snapshot's members (same generator, same ids)
    path = tmp_path / "t.parquet"
    pq.write_table(make_trajectories(16, seed=4, median_len=12, prompt_len=4), path)
    ingest_files(lake, [path])
    publish_tiny_policy(lake, checkpoint_id="tiny-v0")
    sid = publish_synthetic_snapshot(lake, 16, seed=4, median_len=12, prompt_len=4)
    res = train_snapshot(lake, sid, TrainConfig(lr=1e-3, max_steps=1), progress=False)
    return lake, sid, res


def test_walk_checkpoint_to_versions(trained):
    from pipeline.lineage import walk

    lake, sid, res = trained
    w = walk(lake, res.checkpoint_id)
    assert w["policy_version"] == 1 and w["parent_checkpoint_id"] == "tiny-v0"
    assert [a["checkpoint_id"] for a in w["ancestors"]] == ["tiny-v0"]
    (s,) = w["snapshots"]
    assert s["snapshot_id"] == sid and s["members"] == 16 and s["groups"] == 4
    assert s["trajectories_found"] == 16
    assert s["versions"]["policy_version"] == {"0": 16}
    assert s["versions"]["env_version"] == {"env-1": 16} and s["versions"]["verifier_version"] == {"ver-1": 16}
    assert [e["eventType"] for e in w["events"]] == ["START", "COMPLETE"]
    assert len({e["runId"] for e in w["events"]}) == 1
    assert walk(lake, "1")["checkpoint_id"] == res.checkpoint_id       # by policy version


def test_lineage_cli(trained, capsys):
    from pipeline.cli import main

    lake, sid, res = trained
    assert main(["lineage", "--lake", lake.uri, res.checkpoint_id]) == 0
    text = capsys.readouterr().out
    assert f"checkpoint {res.checkpoint_id}  policy version 1" in text and sid in text and "env-1 x16" in text
    assert main(["lineage", "--lake", lake.uri, "--json", res.checkpoint_id]) == 0
    assert json.loads(capsys.readouterr().out)["snapshots"][0]["snapshot_id"] == sid
    assert main(["lineage", "--lake", lake.uri, "nope"]) == 2


def test_failed_run_emits_fail_with_the_start_run_id(lake):
    from pipeline.lineage import read_events
    from pipeline.train.config import TrainConfig
    from pipeline.train.data import TrainDataError
    from pipeline.testing.train_fixtures import publish_synthetic_snapshot, publish_tiny_policy
    from pipeline.train.run import train_snapshot

    publish_tiny_policy(lake, checkpoint_id="tiny-v0", vocab_size=64)
    sid = publish_synthetic_snapshot(lake, 8, seed=1, vocab_size=256)     # ids beyond the model's 64
    with pytest.raises(TrainDataError, match="outside the model's vocabulary"):
        train_snapshot(lake, sid, TrainConfig(), progress=False)
    ev = read_events(lake)
    assert [e["eventType"] for e in ev] == ["START", "FAIL"]
    assert ev[0]["run"]["runId"] == ev[1]["run"]["runId"]
    assert "TrainDataError" in ev[1]["run"]["facets"]["errorMessage"]["message"]
    assert ev[0]["inputs"][0]["name"] == str(Path(lake.uri).absolute() / "_snapshots" / sid)   # naming spec
    assert lake.read("checkpoints").num_rows == 1                         # nothing published


def test_lineage_file_is_configurable(lake, tmp_path, monkeypatch):
    from pipeline.lineage import emit_run_event, new_run_id

    target = tmp_path / "elsewhere" / "ol.jsonl"
    monkeypatch.setenv("PIPELINE_LINEAGE_FILE", str(target))
    rid = new_run_id()
    emit_run_event(lake, event_type="START", run_id=rid, job_name="j", inputs=[("_snapshots/x", "x")], outputs=[])
    (line,) = target.read_text().splitlines()
    ev = json.loads(line)
    assert ev["run"]["runId"] == rid and ev["inputs"][0]["facets"]["version"]["datasetVersion"] == "x"
    assert ev["inputs"][0]["namespace"] == "file"          # OpenLineage naming spec: local files
    assert ev["inputs"][0]["name"] == str(Path(lake.uri).absolute() / "_snapshots" / "x")
