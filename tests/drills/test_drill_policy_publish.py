"""Drill 2: the trainer dies while publishing a new policy version (weights half written).

docs/drills.md "Drill 2" is the recovery procedure this test walks through.
A real trainer-like process writes a checkpoint directory file by file and is
SIGKILLed in the middle of the weights file. The store-level guarantees:
- a checkpoint directory without its ``checkpoints`` row is never resolved:
  workers keep resolving the last published, hash-verified version;
- the restarted trainer publishes the next version number (the dead attempt
  never took one), re-training the snapshot the dead attempt did not publish
  (it was not consumed), and a retried publish of the same checkpoint lands once;
- a published checkpoint whose files were corrupted afterwards is refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import IntegrityError, NotFoundError
from pipeline.policy_store import (latest_policy_version, local_checkpoint_dir, next_policy_version,
                                   publish_checkpoint, resolve_policy)

# The "trainer": write hf/config.json, then the weights in chunks (fsync each),
# signal after the first chunk, and only then finish + publish (never reached when killed).
TRAINER = r"""
import json, os, sys, time
from pathlib import Path
from pipeline.lake.delta import Lake
from pipeline.policy_store import local_checkpoint_dir, next_policy_version, publish_checkpoint

lake = Lake(sys.argv[1]); ckpt = sys.argv[2]; snapshot = sys.argv[3]; marker = Path(sys.argv[4])
slow = sys.argv[5] == "slow"
parent = sys.argv[6] if len(sys.argv) > 6 else None
version = next_policy_version(lake)
hf = local_checkpoint_dir(lake, ckpt) / "hf"
hf.mkdir(parents=True, exist_ok=True)
(hf / "config.json").write_text(json.dumps({"model_type": "llama", "policy_version": version}))
with open(hf / "model.safetensors", "wb") as f:
    for k in range(8):
        f.write(os.urandom(1 << 16)); f.flush(); os.fsync(f.fileno())
        if k == 0:
            marker.write_text(str(version))
        if slow:
            time.sleep(30)
(hf / "tokenizer.json").write_text("{}")
publish_checkpoint(lake, checkpoint_id=ckpt, policy_version=version, parent_checkpoint_id=parent,
                   snapshot_ids=[snapshot], train_config={"lr": 1e-5}, train_config_hash="cfg", seed=0,
                   global_step=version, samples_seen=64 * version)
print(json.dumps({"published": ckpt, "version": version}))
"""


def write_checkpoint(lake, ckpt: str, seed: int) -> Path:
    hf = local_checkpoint_dir(lake, ckpt) / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(os.urandom(4096 + seed))
    return hf


def trainer(lake, ckpt, snapshot, marker, *, slow, parent=None) -> subprocess.Popen:
    args = [sys.executable, "-c", TRAINER, lake.uri, ckpt, snapshot, str(marker), "slow" if slow else "fast"]
    return subprocess.Popen(args + ([parent] if parent else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def consumed_snapshots(lake) -> list[str]:
    """Snapshots some published checkpoint trained on (the trainer's resume rule)."""
    rows = lake.read("checkpoints", columns=["snapshot_ids"]).column("snapshot_ids").to_pylist()
    return [s for ids in rows for s in ids]


@pytest.mark.slow
def test_trainer_killed_mid_publish(lake, tmp_path):
    write_checkpoint(lake, "ckpt-v0", 0)
    publish_checkpoint(lake, checkpoint_id="ckpt-v0", policy_version=0, parent_checkpoint_id=None, snapshot_ids=[],
                       train_config={}, train_config_hash="cfg", seed=0)
    assert resolve_policy(lake).checkpoint_id == "ckpt-v0"

    # the trainer trains on snap-A and dies writing the weights of version 1
    marker = tmp_path / "first-chunk-written"
    proc = trainer(lake, "ckpt-dead", "snap-A", marker, slow=True, parent="ckpt-v0")
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "trainer never started writing"
        time.sleep(0.05)
    assert marker.read_text() == "1"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    half = local_checkpoint_dir(lake, "ckpt-dead") / "hf"
    assert (half / "config.json").exists() and (half / "model.safetensors").stat().st_size == 1 << 16
    # workers keep resolving the last complete version; the half-written one does not exist for them
    ref = resolve_policy(lake)
    assert (ref.checkpoint_id, ref.policy_version) == ("ckpt-v0", 0)
    with pytest.raises(NotFoundError):
        resolve_policy(lake, 1)
    with pytest.raises(NotFoundError):
        resolve_policy(lake, "ckpt-dead")
    assert latest_policy_version(lake) == 0
    # snap-A was not consumed: no published row lists it
    assert "snap-A" not in consumed_snapshots(lake)

    # restart: a new trainer process re-trains snap-A and publishes version 1 under a new checkpoint id
    assert next_policy_version(lake) == 1
    proc = trainer(lake, "ckpt-v1", "snap-A", tmp_path / "m2", slow=False, parent="ckpt-v0")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"published": "ckpt-v1", "version": 1}
    ref = resolve_policy(lake)
    assert (ref.checkpoint_id, ref.policy_version) == ("ckpt-v1", 1)

    # a publish retried after an ambiguous failure (the process died after the commit) lands once
    publish_checkpoint(lake, checkpoint_id="ckpt-v1", policy_version=1, parent_checkpoint_id="ckpt-v0",
                       snapshot_ids=["snap-A"], train_config={"lr": 1e-5}, train_config_hash="cfg", seed=0)
    rows = lake.read("checkpoints", columns=["checkpoint_id", "policy_version"]).to_pylist()
    versions = sorted(r["policy_version"] for r in rows)
    assert versions == [0, 1], "a policy version number was reused or skipped"
    assert sorted(r["checkpoint_id"] for r in rows) == ["ckpt-v0", "ckpt-v1"]
    consumed = consumed_snapshots(lake)
    assert consumed.count("snap-A") == 1, "a snapshot was consumed twice"
    assert next_policy_version(lake) == 2


def test_corrupted_published_checkpoint_is_refused(lake):
    for v in (0, 1):
        write_checkpoint(lake, f"ckpt-v{v}", v)
        publish_checkpoint(lake, checkpoint_id=f"ckpt-v{v}", policy_version=v,
                           parent_checkpoint_id=None if v == 0 else "ckpt-v0", snapshot_ids=[f"snap-{v}"] if v else [],
                           train_config={}, train_config_hash="cfg", seed=0)
    weights = local_checkpoint_dir(lake, "ckpt-v1") / "hf" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        resolve_policy(lake)
    with pytest.raises(IntegrityError):
        resolve_policy(lake, 1)
    # the previous complete version stays loadable: what a worker falls back to / keeps
    assert resolve_policy(lake, 0).checkpoint_id == "ckpt-v0"
    # a published checkpoint with a file missing is refused too
    weights.unlink()
    with pytest.raises(IntegrityError, match="missing"):
        resolve_policy(lake, 1)


def test_directory_without_row_is_never_resolved_even_if_complete(lake):
    """Files alone never publish: only the row does (the row is written after every file)."""
    write_checkpoint(lake, "ckpt-v0", 0)
    publish_checkpoint(lake, checkpoint_id="ckpt-v0", policy_version=0, parent_checkpoint_id=None, snapshot_ids=[],
                       train_config={}, train_config_hash="cfg", seed=0)
    write_checkpoint(lake, "ckpt-orphan", 7)  # complete files, no row (crash between files and commit)
    assert resolve_policy(lake).checkpoint_id == "ckpt-v0"
    with pytest.raises(NotFoundError):
        resolve_policy(lake, "ckpt-orphan")
