"""The resident trainer (pipeline train --follow): follow over S1..Sk == the chain
of --batch-snapshot S1..Sk == a follow killed (SIGKILL, inside the critical
section, at a readiness marker) and restarted, byte for byte, with 1 and 2
processes; cheap publishing; SIGTERM; stale snapshots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.testing.train_fixtures import publish_synthetic_snapshot
from pipeline.train.config import TrainConfig
from pipeline.train.follow import follow, pending_snapshots
from pipeline.train.run import train_snapshot

CFG = TrainConfig(lr=3e-3, micro_batch_tokens=256, grad_accum=2, epochs=1, seed=4, max_steps=3, max_train_lag=None)
SETS = ["lr=0.003", "micro_batch_tokens=256", "grad_accum=2", "epochs=1", "seed=4", "max_steps=3", "max_train_lag=null"]


def _more_snapshots(lake, k: int) -> list[str]:
    """k more snapshots after the template's, the same ids in every lake they are added to."""
    return [publish_synthetic_snapshot(lake, 16, seed=20 + i, median_len=18, prompt_len=6) for i in range(k)]


def _chain(lake, sids, cfg=CFG, nproc=1) -> list[tuple[str, int, str]]:
    out = []
    for sid in sids:
        r = train_snapshot(lake, sid, cfg, nproc=nproc, progress=False)
        out.append((r.checkpoint_id, r.policy_version, r.weight_sha256["hf/model.safetensors"]))
    return out


def _line(lake) -> list[tuple[str, int, str]]:
    """(checkpoint id, version, weights sha256) of every trained version, oldest first."""
    rows = [r for r in lake.read("checkpoints").to_pylist() if r["snapshot_ids"]]
    rows.sort(key=lambda r: r["policy_version"])
    return [(r["checkpoint_id"], r["policy_version"], dict(r["file_sha256"])["hf/model.safetensors"]) for r in rows]


def _env(**extra):
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PIPELINE_TEST_PAUSE_AT"):
        env.pop(k, None)
    return env | extra


def _follow_cli(lake, sets, *extra):
    return [sys.executable, "-m", "pipeline", "train", "--follow", "--lake", lake.uri, "--json", "--no-progress"] + [
        a for s in sets for a in ("--set", s)] + list(extra)


def _kill_marked(proc, marker: Path, timeout: float = 900) -> int:
    """SIGKILL the process whose pid the marker holds (a training process parked at
    its pause point: the CLI itself, or rank 0 under torchrun); returns that pid."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"ended (rc {proc.returncode}) before the marker {marker.name}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no marker {marker} after {timeout} s"
        time.sleep(0.05)
    pid = int(marker.read_text())
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=300)
    return pid


@pytest.fixture(scope="session")
def reference_chain(template_lake, tmp_path_factory) -> tuple[list[str], list[tuple[str, int, str]]]:
    """(snapshot ids, line) of the chain of ``--batch-snapshot`` runs over the template's snapshot and the next
    three of ``_more_snapshots``, with ``CFG``: trained once per session (per xdist worker), in a lake of its own.
    Every test below that compares a resident trainer with that chain compares with (a prefix of) this one: the
    same snapshots and config give the same ids, versions and bytes in any lake (which these tests check)."""
    from pipeline.lake.delta import Lake

    import shutil

    src, s1 = template_lake
    root = tmp_path_factory.mktemp("reference-chain") / "lake"
    shutil.copytree(src, root)
    lake = Lake(root)
    sids = [s1] + _more_snapshots(lake, 3)
    return sids, _chain(lake, sids)


def test_follow_equals_the_chain_and_publishes_weights_only_between_full_states(tlake, reference_chain, tmp_path):
    import dataclasses

    lake, s1 = tlake
    more = _more_snapshots(lake, 2)
    assert pending_snapshots(lake) == [s1] + more                  # admission order
    # trackers are observability: the same ids and bytes as the chain without them (checked below)
    tracked = dataclasses.replace(CFG, trackers="tensorboard", tracker_dir=str(tmp_path / "trk"))
    res = follow(lake, tracked, stop_after=3, progress=False)
    assert res.stopped_by == "stop_after" and [v["policy_version"] for v in res.versions] == [1, 2, 3]
    assert res.replayed == [] and pending_snapshots(lake) == []
    _one_tracker_run_over_every_version(tmp_path / "trk" / "tensorboard", lake, res)

    ref_sids, ref_line = reference_chain
    assert ref_sids[:3] == [s1] + more
    assert _line(lake) == ref_line[:3]                              # same ids, versions, bytes as the chain

    # cheap publishing: weights, cursor and config per version; the DeepSpeed state only with
    # every full_checkpoint_every-th version (default 16) and the last one
    dirs = [Path(v["path"]) for v in res.versions]
    assert [(d / "ds").exists() for d in dirs] == [False, False, True]
    assert [v["full_state"] for v in res.versions] == [False, False, True]
    weights = (dirs[0] / "hf" / "model.safetensors").stat().st_size
    assert all(weights < v["bytes_written"] < 1.5 * weights for v in res.versions[:2])   # weights (+ small files)
    assert res.versions[2]["bytes_written"] > 3 * weights                                  # + fp32 copy, AdamW
    assert res.full_state == [res.versions[-1]["checkpoint_id"]]
    for d in dirs:
        assert (d / "hf" / "model.safetensors").is_file() and (d / "latest").read_text() == "final"
    rows = {r["checkpoint_id"]: r for r in lake.read("checkpoints").to_pylist()}
    tc = json.loads(rows[res.versions[1]["checkpoint_id"]]["train_config_json"])
    assert tc["optimizer_from"] == res.versions[0]["checkpoint_id"] and tc["full_state"] is False
    assert json.loads(rows[res.versions[0]["checkpoint_id"]]["train_config_json"])["optimizer_from"] is None

    # the chain continues the line exactly from the full state the follower left
    s4 = _more_snapshots(lake, 3)[-1]
    nxt = train_snapshot(lake, s4, CFG, progress=False)
    assert json.loads((Path(nxt.path) / "train_config.json").read_text())["optimizer_from"] == res.versions[-1][
        "checkpoint_id"]
    assert ref_sids[3] == s4                                        # the chain's fourth version, bitwise
    assert ref_line[3][2] == nxt.weight_sha256["hf/model.safetensors"]


def _one_tracker_run_over_every_version(tb_root: Path, lake, res) -> None:
    """One TensorBoard run for the resident trainer (not one per version), its steps monotonic
    across versions, each step's policy version a scalar, each version a tag naming its checkpoint."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = list(tb_root.iterdir())
    start = min(lake.read("checkpoints").to_pylist(), key=lambda r: r["policy_version"])   # the head it started at
    assert run_dir.name.startswith(f"follow-{start['checkpoint_id']}-")
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = [e.step for e in acc.Scalars("train/loss")]
    per_version = {v["checkpoint_id"]: v for v in res.versions}
    n_rows = sum(1 for r in lake.read("metrics").to_pylist() if r["checkpoint_id"] in per_version)
    assert loss == list(range(n_rows)), "one step axis over the versions, no restart at 0"
    versions = [int(e.value) for e in acc.Scalars("train/policy_version")]
    assert versions == sorted(versions) and set(versions) == {1, 2, 3}
    tags = {t.split("/", 1)[1] for t in acc.Tags()["tensors"] if t.startswith("versions/")}
    assert {t.split("/")[0] for t in tags} == {"v1", "v2", "v3"}


def test_stale_snapshot_is_skipped_and_recorded_never_silently(tlake, capfd):
    from pipeline.testing.train_fixtures import publish_payload_snapshot, synthetic_payload

    lake, s1 = tlake
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=512, max_steps=1, max_train_lag=0)
    stale = publish_synthetic_snapshot(lake, 16, seed=31, median_len=18, prompt_len=6)   # sampled by v0
    res = follow(lake, cfg, stop_after=1, progress=False)                                # s1 -> v1
    assert [v["snapshot_id"] for v in res.versions] == [s1]
    fresh = publish_payload_snapshot(lake, synthetic_payload(16, seed=32, median_len=18, prompt_len=6,
                                                             policy_version=1))
    res = follow(lake, cfg, stop_after=1, progress=False)
    assert [s["snapshot_id"] for s in res.skipped] == [stale] and res.skipped[0]["reason"] == "stale"
    assert "max_train_lag=0" in res.skipped[0]["message"]
    assert [v["snapshot_id"] for v in res.versions] == [fresh]
    row = [r for r in lake.read("checkpoints").to_pylist() if r["checkpoint_id"] == res.head_checkpoint_id][0]
    assert [s["snapshot_id"] for s in json.loads(row["train_config_json"])["skipped_snapshots"]] == [stale]
    assert pending_snapshots(lake) == [stale]          # never consumed; the line's lineage says why
    again = follow(lake, cfg, idle_timeout_s=0.1, progress=False)     # recorded: not re-decided
    assert again.skipped == [] and again.versions == [] and again.stopped_by == "idle_timeout"
    capfd.readouterr()
    follow(lake, cfg, idle_timeout_s=0.1)   # progress lines by default, whether or not stderr is a terminal
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("resident trainer: ")]
    assert err[0].startswith("resident trainer: starting") and err[1].startswith("resident trainer: ready in ")
    assert "waiting for an admitted snapshot" in err[2] and "stops after 0.1s idle" in err[2]
    assert err[-1] == "resident trainer: stopping (idle_timeout)"


def test_follow_refuses_what_it_cannot_do_exactly(tlake):
    from pipeline.errors import ConfigError

    lake, _ = tlake
    with pytest.raises(ConfigError, match="carry_optimizer"):
        follow(lake, TrainConfig(carry_optimizer=False), stop_after=1)
    with pytest.raises(ConfigError, match="stop-after"):
        follow(lake, CFG, stop_after=0)


@pytest.mark.slow
@pytest.mark.parametrize("point,every,replayed", [
    ("follow:v2:checkpoint:final:hf-written", 8, 1),   # mid-publish: every file of v2 but `latest`, no row
    ("follow:v3:published", 8, 3),                     # after v3's row, before anything else
    ("follow:v3:published", 2, 1),                     # v2 had the full state: replay v3 only
    ("follow:shutdown-state", 8, 4),                   # idle shutdown: state written, its manifest not yet
], ids=["mid-publish", "after-publish", "after-publish-full-v2", "mid-shutdown-state"])
def test_follow_killed_and_restarted_equals_the_chain(tlake, reference_chain, tmp_path, point, every, replayed):
    lake, s1 = tlake
    sids = [s1] + _more_snapshots(lake, 3)
    marker = tmp_path / "ready"
    sets = SETS + [f"full_checkpoint_every={every}"]
    first = ["--idle-timeout", "0.5"] if point == "follow:shutdown-state" else ["--stop-after", "4"]
    proc = subprocess.Popen(_follow_cli(lake, sets, *first), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(PIPELINE_TEST_PAUSE_AT=f"{point}={marker}"))
    assert _kill_marked(proc, marker) == proc.pid and proc.returncode == -signal.SIGKILL
    published = len(_line(lake))
    again = ["--stop-after", str(4 - published)] if published < 4 else ["--idle-timeout", "0.5"]
    out = subprocess.run(_follow_cli(lake, sets, *again), capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(res["replayed"]) == replayed
    assert res["stopped_by"] == ("stop_after" if published < 4 else "idle_timeout")

    assert reference_chain[0] == sids
    assert _line(lake) == reference_chain[1]                        # bitwise, same ids and versions as the chain
    m = lake.read("metrics").to_pylist()
    assert len({(r["checkpoint_id"], r["global_step"]) for r in m}) == len(m)   # every step's row once


@pytest.mark.slow
def test_sigterm_while_waiting_writes_the_full_state_and_exits_0(tlake, reference_chain):
    lake, s1 = tlake
    proc = subprocess.Popen(_follow_cli(lake, SETS), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    deadline = time.monotonic() + 600
    while not _line(lake):                 # v1 published (weights only): the trainer now waits for snapshots
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    head = Path(res["versions"][0]["path"])
    assert res["stopped_by"] == "signal" and res["full_state"] == [res["head_checkpoint_id"]]
    assert (head / "state-manifest.json").is_file() and (head / "ds").is_dir()

    s2 = _more_snapshots(lake, 1)[0]
    res2 = follow(lake, CFG, stop_after=1, progress=False)
    assert res2.replayed == []                                      # loaded the shutdown state
    assert reference_chain[0][:2] == [s1, s2]
    assert _line(lake) == reference_chain[1][:2]


CFG2 = TrainConfig(lr=3e-3, micro_batch_tokens=256, grad_accum=3, epochs=1, seed=2, max_steps=2, zero_stage=2,
                   max_train_lag=None)
SETS2 = ["lr=0.003", "micro_batch_tokens=256", "grad_accum=3", "epochs=1", "seed=2", "max_steps=2", "zero_stage=2",
         "full_checkpoint_every=8", "max_train_lag=null"]


@pytest.mark.slow
def test_two_processes_follow_equals_chain_and_killed_follow(tlake, tlake2, template_lake, tmp_path):
    import shutil

    from pipeline.lake.delta import Lake

    lake, s1 = tlake
    sids = [s1] + _more_snapshots(lake, 2)
    marker = tmp_path / "ready"
    proc = subprocess.Popen(_follow_cli(lake, SETS2, "--nproc", "2", "--stop-after", "3"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=_env(PIPELINE_TEST_PAUSE_AT=f"follow:v2:published={marker}"))
    assert _kill_marked(proc, marker) != proc.pid                   # rank 0 of the torchrun group
    assert proc.returncode != 0 and len(_line(lake)) == 2
    out = subprocess.run(_follow_cli(lake, SETS2, "--nproc", "2", "--stop-after", "1"), capture_output=True,
                         text=True, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["world_size"] == 2 and len(res["replayed"]) == 2

    lake2, _ = tlake2
    assert _more_snapshots(lake2, 2) == sids[1:]
    chain = _chain(lake2, sids, CFG2, nproc=2)
    shutil.copytree(template_lake[0], tmp_path / "lake3")
    lake3 = Lake(tmp_path / "lake3")
    _more_snapshots(lake3, 2)
    straight = follow(lake3, CFG2, nproc=2, stop_after=3, progress=False)
    assert straight.world_size == 2
    assert _line(lake) == chain == _line(lake3)


def test_a_snapshot_whose_admission_lost_the_receipts_commit_is_not_trained(tlake):
    """Admission writes its snapshot before its receipts; the loser of a receipts race
    leaves a snapshot row whose groups the winner decided into another snapshot."""
    from datetime import datetime, timezone

    import pyarrow as pa

    from pipeline.schema import arrow_schema
    from pipeline.snapshots.format import read_snapshot_table

    lake, s1 = tlake
    winner = publish_synthetic_snapshot(lake, 16, seed=41, median_len=18, prompt_len=6)
    members = {sid: read_snapshot_table(lake, sid, columns=["trajectory_id", "group_id"]).to_pylist()
               for sid in (s1, winner)}
    rows = [{"snapshot_id": sid, "trajectory_id": m["trajectory_id"], "group_id": m["group_id"], "content_hash": "x",
             "advantage": 0.0, "reward": 0.0, "policy_lag": 0} for sid, ms in members.items() for m in ms]
    lake.append("snapshot_members", pa.Table.from_pylist(rows, schema=arrow_schema("snapshot_members")),
                command="test")
    now = datetime.now(timezone.utc)
    groups = sorted({m["group_id"] for m in members[s1]})        # s1's groups, decided into the winner
    rec = [{"group_id": g, "admission_run_id": "winner", "config_hash": "c", "current_policy_version": 0,
            "run_id": "r", "group_size": 4, "arrived_members": 4, "valid_members": [], "excluded_members": [],
            "checks": [], "decision": "admit", "decided_at": now, "snapshot_id": winner} for g in groups]
    lake.append("receipts", pa.Table.from_pylist(rec, schema=arrow_schema("receipts")), command="test")
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=512, max_steps=1, max_train_lag=None)
    res = follow(lake, cfg, stop_after=1, progress=False)
    assert [(s["snapshot_id"], s["reason"]) for s in res.skipped] == [(s1, "superseded")]
    assert [v["snapshot_id"] for v in res.versions] == [winner]
    assert pending_snapshots(lake) == [s1]
