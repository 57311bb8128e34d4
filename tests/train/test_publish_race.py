"""One publisher per version (issue 38, items 1 and 2): however many runs publish
one checkpoint at once, the files its row names are the winner's and are never
overwritten; `lake verify` checks them as rollout does; `policy repair` makes a
version damaged by an older pipeline load again.

- two real `pipeline train --batch-snapshot S` started together, local and S3;
- eight publishers at the publication function (real processes, released by a
  barrier file), local and S3: six of one checkpoint id, two of another id for
  the same snapshot;
- kill -9 at every boundary of the publication, local and S3;
- the line's lease: a `--batch-snapshot` run is refused while the resident trainer runs;
- `lake verify` and `policy repair` on the damage the race used to leave.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from publish_racer import write_run_dir  # tests/train/, on the path as the test's own directory

from pipeline.policy_store import (checkpoint_rows, local_dir, publish_checkpoint, resolve_policy, row_rel,
                                   run_checkpoint_rel)

RACER = Path(__file__).with_name("publish_racer.py")
SETS = ["lr=0.003", "micro_batch_tokens=256", "grad_accum=2", "epochs=1", "seed=4", "max_steps=3",
        "max_train_lag=null"]


@pytest.fixture(params=["local", "s3"])
def any_lake(request, lake, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))     # object-store lakes' local copies
    return lake if request.param == "local" else request.getfixturevalue("s3_lake")


def _lake_files(lake, rel: str) -> list[str]:
    import pyarrow.fs as pafs

    fs, root = lake.filesystem()
    infos = fs.get_file_info(pafs.FileSelector(f"{root}/{rel}", allow_not_found=True, recursive=True))
    return sorted(i.path.split(f"{rel}/", 1)[1] for i in infos if i.type == pafs.FileType.File)


def _run_dirs(lake) -> list[str]:
    import pyarrow.fs as pafs

    fs, root = lake.filesystem()
    infos = fs.get_file_info(pafs.FileSelector(f"{root}/_checkpoints", allow_not_found=True))
    return sorted(i.path.rsplit("/", 1)[1] for i in infos if i.type == pafs.FileType.Directory)


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PIPELINE_TEST_PAUSE_AT", "PIPELINE_RUN_TAG")}
    return env | {"OMP_NUM_THREADS": "1"} | extra


# -- eight publishers at once ---------------------------------------------------------------------------------------

def test_eight_publishers_at_once_one_row_one_directory_the_losers_told_who(any_lake, tmp_path):
    from pipeline.maintain import verify

    lake = any_lake
    sync = tmp_path / "sync"
    sync.mkdir()
    ids = ["ck-race"] * 6 + ["ck-other"] * 2          # two checkpoint ids for one snapshot
    opts = json.dumps(lake.storage_options or {})
    procs = [subprocess.Popen([sys.executable, str(RACER), lake.uri, opts, str(sync), str(i), ids[i], "snap-1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for i in range(len(ids))]
    deadline = time.monotonic() + 300
    while len(list(sync.glob("ready-*"))) < len(ids):
        for p in procs:
            assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "racers not ready"
        time.sleep(0.05)
    (sync / "go").write_text("")
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))

    (row,) = checkpoint_rows(lake)                    # one version, one snapshot consumed once
    winner = [o for o in outs if "error" not in o and not o["already_published"]]
    assert len(winner) == 1, outs
    (w,) = winner
    assert row_rel(row) == w["rel"] and row["checkpoint_id"] == ids[int(w["racer"])] and row["policy_version"] == 0
    for o in outs:
        if o is w:
            continue
        if ids[int(o["racer"])] == row["checkpoint_id"]:   # the same checkpoint: "already published", by whom
            assert o["already_published"] and o["path"] == w["rel"] and o["policy_version"] == 0, o
            assert f"racer {w['racer']} on " in o["published_by"] and w["rel"].rsplit("/", 1)[1] in o["published_by"]
        else:                                              # another checkpoint of the snapshot: refused, told whom
            assert "was consumed by checkpoint" in o["error"] and f"racer {w['racer']} on " in o["error"], o
    # the winner's files are on the lake as published; every loser deleted its own directory
    assert _run_dirs(lake) == [w["rel"].rsplit("/", 1)[1]]
    assert _lake_files(lake, w["rel"]) == sorted(k for k, _ in row["file_sha256"])
    ref = resolve_policy(lake)                         # what rollout does: every file rehashed
    assert ref.checkpoint_id == row["checkpoint_id"] and ref.rel == w["rel"]
    assert (ref.path / "ds" / "final" / "mp_rank_00_model_states.pt").read_bytes().startswith(
        f"state of racer {w['racer']} ".encode())
    v = verify(lake)
    assert v["ok"] and v["checkpoints"]["checked"] == 1, v["problems"]


# -- kill -9 at every boundary of the publication -------------------------------------------------------------------

BOUNDARIES = ["publish:files-written", "append:checkpoints:staged", "append:checkpoints:committed",
              "publish:committed"]


@pytest.mark.slow
@pytest.mark.parametrize("point", BOUNDARIES)
def test_publisher_killed_at_every_boundary_then_a_second_publisher(any_lake, tmp_path, point, kill_at_marker):
    from pipeline.maintain import maintain, verify

    lake = any_lake
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, str(RACER), lake.uri, json.dumps(lake.storage_options or {}), "-",
                             "killed", "ck-k", "snap-k"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(PIPELINE_TEST_PAUSE_AT=f"{point}={marker}"))
    kill_at_marker(proc, marker)
    (killed_dir,) = _run_dirs(lake)
    committed = point in ("append:checkpoints:committed", "publish:committed")
    assert len(checkpoint_rows(lake)) == (1 if committed else 0)

    # a second run of the same checkpoint publishes after the kill
    rel = run_checkpoint_rel("ck-k")
    src = local_dir(lake, rel)
    write_run_dir(src, "second")
    row = publish_checkpoint(lake, checkpoint_id="ck-k", policy_version=None, parent_checkpoint_id=None,
                             snapshot_ids=["snap-k"], train_config={}, train_config_hash="race", seed=0,
                             command="racer second", rel=rel, once_per_snapshot=True)
    (only,) = checkpoint_rows(lake)
    assert row["already_published"] == committed and row_rel(only) == (f"_checkpoints/{killed_dir}" if committed
                                                                        else rel)
    if committed:
        assert "racer killed on " in row["published_by"] and not src.exists()   # the loser's files are gone
    assert resolve_policy(lake).checkpoint_id == "ck-k"         # rollout loads it: every file as hashed
    v = verify(lake)
    assert v["ok"], v["problems"]
    # the killed run's unpublished directory (when it lost) is removed by maintenance, the published one stays
    report = maintain(lake, tables=["checkpoints"], orphan_min_age_s=0)
    assert report["checkpoint_dirs_removed"] == ([] if committed else [f"_checkpoints/{killed_dir}"])
    assert _run_dirs(lake) == [row_rel(only).rsplit("/", 1)[1]]
    assert report["verify"]["ok"] and resolve_policy(lake).checkpoint_id == "ck-k"


# -- the line's lease -----------------------------------------------------------------------------------------------

def test_batch_snapshot_is_refused_while_the_resident_trainer_holds_the_line(tlake):
    from pipeline.lake.lease import try_acquire
    from pipeline.train.hold import LINE_LEASE, LineHeldError
    from pipeline.train.run import train_snapshot

    lake, sid = tlake
    lease, _ = try_acquire(lake, LINE_LEASE, owner="pipeline train --follow (host-a pid 1)", ttl=600,
                           info={"role": "follow"})
    assert lease is not None
    with pytest.raises(LineHeldError, match=r"the resident trainer holds the line .*host-a pid 1"):
        train_snapshot(lake, sid)
    r = subprocess.run([sys.executable, "-m", "pipeline", "train", "--batch-snapshot", sid, "--lake", lake.uri],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode != 0 and "the resident trainer holds the line" in r.stderr, r.stderr
    lease.release()
    assert not [d for d in _run_dirs(lake) if "." in d], "a refused run wrote nothing"


# -- two real trainers at once ----------------------------------------------------------------------------------------

def _train_cmd(uri: str, sid: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "train", "--batch-snapshot", sid, "--lake", uri, "--json",
            "--no-progress"] + [a for s in SETS for a in ("--set", s)]


def _two_trainers(lake, sid, env) -> list[dict]:
    procs = [subprocess.Popen(_train_cmd(lake.uri, sid), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _check_two(lake, outs) -> None:
    from pipeline.maintain import verify

    assert outs[0]["checkpoint_id"] == outs[1]["checkpoint_id"] and outs[0]["policy_version"] == 1 == \
        outs[1]["policy_version"]
    assert sorted(o["already_published"] for o in outs) == [False, True]     # one published, one was told so
    late = next(o for o in outs if o["already_published"])
    assert late["published_by"] and "pipeline train on " in late["published_by"]
    trained = [r for r in checkpoint_rows(lake) if r["snapshot_ids"]]
    assert len(trained) == 1
    v = verify(lake)
    assert v["ok"], v["problems"]                      # every published checkpoint's files as hashed
    resolve_policy(lake)                               # rollout's check


@pytest.mark.slow
def test_two_trainers_on_one_snapshot_local(tlake):
    lake, sid = tlake
    _check_two(lake, _two_trainers(lake, sid, _env()))


@pytest.mark.slow
def test_two_trainers_on_one_snapshot_s3(s3_env, tmp_path, monkeypatch):
    from pipeline.lake.delta import Lake
    from pipeline.testing.train_fixtures import publish_synthetic_snapshot, publish_tiny_policy

    _, bucket = s3_env
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    lake = Lake(f"s3://{bucket}/lake")
    publish_tiny_policy(lake, checkpoint_id="tiny-v0")
    sid = publish_synthetic_snapshot(lake, 48, seed=7, median_len=20, prompt_len=6)
    _check_two(lake, _two_trainers(lake, sid, _env()))


# -- `lake verify` checks what rollout checks; `policy repair` lets the loop go on ------------------------------------

@pytest.mark.slow
def test_verify_reports_a_damaged_version_and_repair_lets_rollout_and_follow_go_on(tlake):
    import shutil

    from pipeline.errors import IntegrityError
    from pipeline.maintain import verify
    from pipeline.train.config import TrainConfig
    from pipeline.train.follow import follow

    lake, sid = tlake
    # version 1 with a DeepSpeed state, as a trainer publishes it (its model: tiny-v0's)
    rel = run_checkpoint_rel("ck-damaged")
    root = local_dir(lake, rel)
    shutil.copytree(resolve_policy(lake, 0).hf_dir, root / "hf")
    (root / "ds" / "final").mkdir(parents=True)
    state = root / "ds" / "final" / "mp_rank_00_model_states.pt"
    state.write_bytes(b"the winner's state " * 64)
    (root / "rng" / "final").mkdir(parents=True)
    (root / "rng" / "final" / "rank0.pt").write_bytes(b"rng " * 16)
    publish_checkpoint(lake, checkpoint_id="ck-damaged", policy_version=None, parent_checkpoint_id="tiny-v0",
                       snapshot_ids=[], train_config={"kind": "test"}, train_config_hash="t", seed=0, rel=rel)
    assert verify(lake)["ok"]
    state.write_bytes(b"a racing loser's state " * 64)       # what two trainers on one directory used to leave

    v = verify(lake)
    assert not v["ok"] and v["checkpoints"]["checked"] == 2
    (line,) = v["problems"]
    assert line.startswith("checkpoint ck-damaged (policy version 1, ") and \
        "sha256 mismatch for ['ds/final/mp_rank_00_model_states.pt']" in line
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        resolve_policy(lake)                                  # rollout refuses it, as lake verify said
    cli = [sys.executable, "-m", "pipeline"]
    r = subprocess.run(cli + ["lake", "verify", "--lake", lake.uri], capture_output=True, text=True, env=_env())
    assert r.returncode == 1 and "checkpoints: 2 published version(s) rehashed, 1 problem(s)" in r.stdout, r.stdout
    assert "pipeline policy repair" in r.stdout

    r = subprocess.run(cli + ["policy", "repair", "--lake", lake.uri], capture_output=True, text=True, env=_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("policy version 1 (ck-damaged): retired its DeepSpeed state (2 files"), r.stdout
    assert verify(lake)["ok"] and not (root / "ds").exists()
    assert resolve_policy(lake).checkpoint_id == "ck-damaged"   # rollout loads it again
    again = subprocess.run(cli + ["policy", "repair", "--lake", lake.uri, "--json"], capture_output=True, text=True,
                           env=_env())
    assert again.returncode == 0 and json.loads(again.stdout)["repaired"] == []

    # the resident trainer goes on from the repaired version (a fresh optimizer: its state was retired)
    cfg = TrainConfig(lr=3e-3, micro_batch_tokens=256, grad_accum=2, epochs=1, seed=4, max_steps=3, max_train_lag=None)
    res = follow(lake, cfg, stop_after=1, progress=False)
    (ver,) = res.versions
    assert ver["policy_version"] == 2 and ver["parent_checkpoint_id"] == "ck-damaged" and ver["snapshot_id"] == sid
    assert verify(lake)["ok"]

    # a damaged model cannot be repaired here: one line, exit 1, nothing changed
    weights = Path(ver["path"]) / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    r = subprocess.run(cli + ["policy", "repair", "--lake", lake.uri], capture_output=True, text=True, env=_env())
    assert r.returncode == 1 and r.stdout.startswith("policy version 2: cannot repair: checkpoint "), r.stdout
    assert "['hf/model.safetensors']" in r.stdout and weights.is_file()
