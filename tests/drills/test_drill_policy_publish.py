"""Drill 2: the trainer dies while publishing a new policy version.

docs/drills.md "Drill 2" is the recovery procedure this test walks through.
The real trainer, ``pipeline train --batch-snapshot S`` (a tiny Llama and a
tiny snapshot: pipeline.testing.train_fixtures), is SIGKILLed inside its
publish, at a readiness marker its own code writes when it gets there
(``PIPELINE_TEST_PAUSE_AT``, pipeline.lake.delta.pause_point), so the kill
provably lands in the section under test:
- ``checkpoint:final:hf-written``: the checkpoint directory is partly written
  (DeepSpeed state and hf/ weights written, ``latest`` not, no row);
- ``append:checkpoints:staged``: every file written and hashed, the row's data
  file staged, the ``checkpoints`` commit not made.
The store-level guarantees:
- a checkpoint directory without its ``checkpoints`` row is never resolved:
  workers keep resolving the last published, hash-verified version;
- the restarted trainer (the same command, ``--resume``) publishes the next
  version number (the dead attempt never took one), re-training the snapshot
  the dead attempt did not publish (it was not consumed), and a retried
  publish of the same checkpoint lands once;
- the row file the killed publish staged is never read, and ``maintain``
  removes it;
- a published checkpoint whose files were corrupted afterwards is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import IntegrityError, NotFoundError
from pipeline.policy_store import (latest_policy_version, local_checkpoint_dir, next_policy_version, published_rel,
                                   publish_checkpoint, resolve_policy)

SETS = ["lr=0.003", "micro_batch_tokens=256", "epochs=2", "seed=3", "save_every=2"]
FILES_PARTLY_WRITTEN = "checkpoint:final:hf-written"
ROW_STAGED = "append:checkpoints:staged"


def write_checkpoint(lake, ckpt: str, seed: int) -> Path:
    hf = local_checkpoint_dir(lake, ckpt) / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(os.urandom(4096 + seed))
    return hf


def train_cmd(lake, sid: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "train", "--lake", lake.uri, "--batch-snapshot", sid, "--json",
            "--no-progress"] + [a for s in SETS for a in ("--set", s)] + list(extra)


def train_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PIPELINE_TEST_PAUSE_AT"):
        if k not in extra:
            env.pop(k, None)
    return env


def consumed_snapshots(lake) -> list[str]:
    """Snapshots some published checkpoint trained on (the trainer's resume rule)."""
    rows = lake.read("checkpoints", columns=["snapshot_ids"]).column("snapshot_ids").to_pylist()
    return [s for ids in rows for s in ids]


@pytest.mark.slow
@pytest.mark.parametrize("point", [FILES_PARTLY_WRITTEN, ROW_STAGED])
def test_pipeline_train_killed_mid_publish(tlake, tmp_path, point, kill_at_marker):
    from pipeline.maintain import maintain

    lake, sid = tlake                       # policy version 0 (tiny-v0) and an unconsumed snapshot
    assert resolve_policy(lake).checkpoint_id == "tiny-v0"

    # the trainer trains on the snapshot and is killed inside the publish of version 1
    marker = tmp_path / "in-publish"
    proc = subprocess.Popen(train_cmd(lake, sid), env=train_env(PIPELINE_TEST_PAUSE_AT=f"{point}={marker}"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_at_marker(proc, marker)

    (dead,) = [p for p in (Path(lake.uri) / "_checkpoints").glob("ck-*")]
    ckpt, _, tag = dead.name.partition(".")      # the run's own directory: <checkpoint id>.<run tag>
    assert tag, dead.name
    assert (dead / "hf" / "config.json").exists() and (dead / "hf" / "model.safetensors").exists()
    # `latest` is written after every other file: the first kill left the directory partly written
    assert (dead / "latest").exists() == (point == ROW_STAGED)
    staged = lake.remove_orphans("checkpoints", min_age_s=0, dry_run=True)
    assert len(staged) == (1 if point == ROW_STAGED else 0), staged   # the killed publish's row file
    # workers keep resolving the last complete version; the dead one does not exist for them
    ref = resolve_policy(lake)
    assert (ref.checkpoint_id, ref.policy_version) == ("tiny-v0", 0)
    with pytest.raises(NotFoundError):
        resolve_policy(lake, 1)
    with pytest.raises(NotFoundError):
        resolve_policy(lake, ckpt)
    assert latest_policy_version(lake) == 0 and lake.read("checkpoints").num_rows == 1
    # the snapshot was not consumed: no published row lists it
    assert sid not in consumed_snapshots(lake)

    # restart: the same command (+ --resume) re-trains the snapshot and publishes version 1
    assert next_policy_version(lake) == 1
    rerun = subprocess.run(train_cmd(lake, sid, "--resume"), env=train_env(), capture_output=True, text=True,
                           timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    out = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert (out["checkpoint_id"], out["policy_version"]) == (ckpt, 1)   # the run's id: same directory
    assert out["resumed_from_step"], "the rerun continued from the killed run's saved state"
    ref = resolve_policy(lake)
    assert (ref.checkpoint_id, ref.policy_version) == (ckpt, 1)

    # a publish retried after an ambiguous failure (the process died after the commit) lands once
    again = publish_checkpoint(lake, checkpoint_id=ckpt, policy_version=None, parent_checkpoint_id="tiny-v0",
                               snapshot_ids=[sid], train_config={}, train_config_hash="cfg", seed=0,
                               rel=published_rel(lake, ckpt))
    assert again["policy_version"] == 1
    rows = lake.read("checkpoints", columns=["checkpoint_id", "policy_version"]).to_pylist()
    assert sorted(r["policy_version"] for r in rows) == [0, 1], "a policy version number was reused or skipped"
    assert sorted(r["checkpoint_id"] for r in rows) == sorted(["tiny-v0", ckpt])
    assert consumed_snapshots(lake).count(sid) == 1, "a snapshot was consumed twice"
    assert next_policy_version(lake) == 2

    # what the killed publish staged is cleaned up by maintain; the published rows stay
    report = maintain(lake, tables=["checkpoints"], orphan_min_age_s=0)
    assert report["tables"]["checkpoints"]["orphans_removed"] == len(staged)
    assert report["checkpoint_dirs_removed"] == [f"_checkpoints/{dead.name}"] and not dead.exists()
    assert lake.remove_orphans("checkpoints", min_age_s=0, dry_run=True) == []
    assert resolve_policy(lake).checkpoint_id == ckpt and lake.read("checkpoints").num_rows == 2


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
