"""Live metrics: a training run's per-step rows are visible in SQL while it runs
(bounded commits, exactly once per step across a kill and rerun), and the
trackers (TensorBoard event files, a local MLflow file store) read back equal
to the metrics table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SETS = ["lr=0.003", "micro_batch_tokens=256", "grad_accum=1", "epochs=1", "seed=5", "max_steps=6",
        "metrics_every_steps=2", "metrics_every_s=0"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _wait_for(marker: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not marker.exists():
        time.sleep(0.05)
    assert marker.exists(), f"the run never reached the marker: {proc.stdout.read().decode()[-3000:]}"


def test_metrics_visible_in_sql_while_training_runs_then_exactly_once(tlake, tmp_path):
    from pipeline.query.duck import query
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    lake, sid = tlake
    marker = tmp_path / "paused"
    cmd = [sys.executable, "-m", "pipeline", "train", "--lake", lake.uri, "--batch-snapshot", sid, "--json",
           "--no-progress"] + [a for s in SETS for a in ("--set", s)]
    proc = subprocess.Popen(cmd, env=_env(PIPELINE_TEST_PAUSE_AT=f"train:step:4={marker}"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for(marker, proc)
        # another process (this one), while the run is paused after its 4th step:
        live = query(lake, "SELECT m.global_step, c.policy_version FROM metrics m "
                           "LEFT JOIN checkpoints c USING (checkpoint_id) ORDER BY 1").to_pylist()
        assert [r["global_step"] for r in live] == [0, 1, 2, 3]          # two commits of two steps each
        assert {r["policy_version"] for r in live} == {None}             # nothing published yet
        hist = [h for h in lake.history("metrics") if "pipeline.app_id" in str(h)]
        assert len(hist) == 2                                            # bounded: one commit per 2 steps
        running = query(lake, open(Path(__file__).parents[2] / "sql" / "training.sql").read(),
                        params={"checkpoint_id": None}).to_pylist()
        assert len(running) == 4 and running[-1]["policy_version"] is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    # the rerun recomputes from step 0 but appends only the steps that had not landed
    cfg = TrainConfig(**{k: type(getattr(TrainConfig(), k))(v) for k, v in (s.split("=") for s in SETS)})
    res = train_snapshot(lake, sid, cfg, progress=False)
    m = query(lake, "SELECT global_step, run_id FROM metrics ORDER BY global_step").to_pylist()
    assert [r["global_step"] for r in m] == list(range(res.global_step)) == list(range(6))
    assert len({r["run_id"] for r in m[:4]}) == 1 and m[4]["run_id"] == m[5]["run_id"] == res.lineage_run_id
    assert m[0]["run_id"] != res.lineage_run_id


def test_trackers_read_back_equal_to_the_metrics_table(tlake, tmp_path, require_module):
    require_module("tensorboard", "mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipeline.train.config import TrainConfig
    from pipeline.train.live import scalars
    from pipeline.train.run import train_snapshot

    lake, sid = tlake
    cfg = TrainConfig(lr=0.003, micro_batch_tokens=256, epochs=1, seed=5, max_steps=4, metrics_every_steps=3,
                      metrics_every_s=0, trackers="tensorboard,mlflow", tracker_dir=str(tmp_path / "trk"))
    res = train_snapshot(lake, sid, cfg, progress=False)
    rows = sorted(lake.read("metrics").to_pylist(), key=lambda r: r["global_step"])
    assert len(rows) == res.global_step == 4
    want = {k: [(r["global_step"], scalars(r)[k]) for r in rows if k in scalars(r)] for k in scalars(rows[0])}

    acc = EventAccumulator(str(tmp_path / "trk" / "tensorboard" / res.checkpoint_id), size_guidance={"scalars": 0})
    acc.Reload()
    for k, series in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(f"train/{k}")]
        assert [s for s, _ in got] == [s for s, _ in series], k
        assert [v for _, v in got] == pytest.approx([v for _, v in series], rel=1e-6, abs=1e-30), k   # float32

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")        # MLflow 3: the file store is opt-in
    client = MlflowClient(tracking_uri=(tmp_path / "trk" / "mlruns").absolute().as_uri())
    exp = client.get_experiment_by_name("trajectory-lakehouse")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == res.checkpoint_id and run.data.params["lr"] == "0.003"
    for k, series in want.items():
        got = sorted((h.step, h.value) for h in client.get_metric_history(run.info.run_id, f"train/{k}"))
        assert got == series, k                                          # MLflow keeps float64: exact


def test_trackers_are_off_by_default_and_validated(tlake):
    from pipeline.errors import ConfigError
    from pipeline.train.config import TrainConfig, identity_hash

    assert TrainConfig().trackers == ""
    with pytest.raises(ConfigError, match="unknown tracker"):
        TrainConfig(trackers="tensorboard,neptune")
    # how a run reports itself is not part of its identity (same checkpoint id, resumable)
    assert identity_hash(TrainConfig()) == identity_hash(TrainConfig(trackers="mlflow", metrics_every_steps=1))
    assert identity_hash(TrainConfig()) != identity_hash(TrainConfig(lr=1.0))


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a wandb transaction log (.wandb): a 7-byte header (":W&B",
    magic, version), then LevelDB-style log records (crc32 4 bytes, length 2
    bytes little-endian, type 1 byte: 1 full, 2 first, 3 middle, 4 last) in
    32 KiB blocks, each a serialized wandb Record protobuf."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, out, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        n, typ = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if typ == 1:
            out.append(chunk)
        elif typ == 2:
            buf = chunk
        elif typ == 3:
            buf += chunk
        elif typ == 4:
            out.append(buf + chunk)
    return out


def test_wandb_offline_run_reads_back_equal_to_the_metrics_table(tlake, tmp_path, monkeypatch, capfd,
                                                                require_module):
    require_module("wandb")
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    from pipeline.train.config import TrainConfig
    from pipeline.train.live import scalars
    from pipeline.train.run import train_snapshot

    monkeypatch.delenv("WANDB_SILENT", raising=False)                    # silent is the default
    monkeypatch.delenv("WANDB_DISABLE_WEAVE", raising=False)
    import types

    # an LLM library in the process (vLLM imports openai) makes wandb suggest Weave: that stays quiet too
    monkeypatch.setitem(sys.modules, "openai", sys.modules.get("openai") or types.ModuleType("openai"))
    monkeypatch.delenv("WANDB_MODE", raising=False)                      # offline is the default
    lake, sid = tlake
    cfg = TrainConfig(lr=0.003, micro_batch_tokens=256, epochs=1, seed=5, max_steps=3, metrics_every_steps=2,
                      metrics_every_s=0, trackers="wandb", tracker_dir=str(tmp_path / "trk"))
    capfd.readouterr()
    res = train_snapshot(lake, sid, cfg, progress=False)
    said = capfd.readouterr()
    assert "wandb" not in said.out + said.err, "wandb's banner and summary stay out of the user's terminal"
    rows = sorted(lake.read("metrics").to_pylist(), key=lambda r: r["global_step"])
    (log,) = (tmp_path / "trk" / "wandb").glob(f"offline-run-*-{res.checkpoint_id}/run-{res.checkpoint_id}.wandb")
    history = []
    for raw in _wandb_records(log):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    assert [h["_step"] for h in history] == [r["global_step"] for r in rows]
    for h, r in zip(history, rows):
        assert {k.removeprefix("train/"): v for k, v in h.items() if k.startswith("train/")} == scalars(r)
