"""End to end on a tiny Llama: publication, reproducibility, refusal of consumed
snapshots, resume after SIGKILL, the crash-while-publishing drill, two processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import ConflictError, IntegrityError, NotFoundError
from pipeline.train.config import TrainConfig
from pipeline.train.run import train_snapshot

CFG = TrainConfig(lr=3e-3, micro_batch_tokens=256, grad_accum=2, epochs=2, seed=11)


def _weights(res) -> str:
    """The published weights' file: an anchor's hf/ weights or, for a delta-only version, its delta."""
    (sha,) = res.weight_sha256.values()
    return sha


def test_train_publishes_a_complete_reproducible_checkpoint(tlake, tlake2):
    from pipeline.lineage import read_events
    from pipeline.policy_store import resolve_policy

    lake, sid = tlake
    res = train_snapshot(lake, sid, CFG, progress=False)
    assert res.policy_version == 1 and res.parent_checkpoint_id == "tiny-v0" and res.global_step >= 4
    assert res.samples_seen == 2 * 48

    root = Path(res.path)
    assert (root / "latest").read_text() == "final"
    for rel in ("ds/final", "rng/final/rank0.pt", "cursor.json", "train_config.json", "hf/config.json",
                "hf/model.safetensors", "hf/tokenizer.json", "hf/tokenizer_config.json"):
        assert (root / rel).exists(), rel
    assert json.loads((root / "cursor.json").read_text())["global_step"] == res.global_step
    assert json.loads((root / "train_config.json").read_text())["lr"] == CFG.lr

    # published: the newest policy resolves to it, hash-verified
    ref = resolve_policy(lake, None)
    assert (ref.checkpoint_id, ref.policy_version) == (res.checkpoint_id, 1)
    parent = resolve_policy(lake, "tiny-v0")
    assert ref.file_sha256["hf/model.safetensors"] != parent.file_sha256["hf/model.safetensors"]
    row = [r for r in lake.read("checkpoints").to_pylist() if r["checkpoint_id"] == res.checkpoint_id][0]
    assert row["snapshot_ids"] == [sid] and row["global_step"] == res.global_step
    assert dict(row["file_sha256"])["hf/model.safetensors"] == _weights(res)

    # metrics: one row per step
    m = sorted(lake.read("metrics").to_pylist(), key=lambda r: r["global_step"])   # appended live: several commits
    assert [r["global_step"] for r in m] == list(range(res.global_step))
    assert all(r["checkpoint_id"] == res.checkpoint_id and r["tokens"] > 0 and 0 <= r["padding_ratio"] < 1 for r in m)
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in m)

    # lineage: START and COMPLETE share a run id; snapshot in with its version, checkpoint out
    ev = read_events(lake, res.lineage_run_id)
    assert [e["eventType"] for e in ev] == ["START", "COMPLETE"]
    root = Path(lake.uri).absolute()         # OpenLineage naming spec: namespace "file", absolute paths
    snap_in = [d for d in ev[1]["inputs"] if d["name"] == str(root / "_snapshots" / sid)][0]
    assert snap_in["namespace"] == "file" and snap_in["facets"]["version"]["datasetVersion"] == sid
    # the checkpoint is the directory its row names: this run's own (_checkpoints/<id>.<run tag>)
    from pipeline.policy_store import published_rel

    assert published_rel(lake, res.checkpoint_id).startswith(f"_checkpoints/{res.checkpoint_id}.")
    assert ev[1]["outputs"][0]["name"] == str(root / published_rel(lake, res.checkpoint_id)) == str(Path(res.path))
    assert ev[1]["outputs"][0]["facets"]["version"]["datasetVersion"] == "1"

    # same snapshot + config + seed in another lake: byte-identical weights, same checkpoint id
    lake2, _ = tlake2
    res2 = train_snapshot(lake2, sid, CFG, progress=False)
    assert res2.checkpoint_id == res.checkpoint_id
    assert _weights(res2) == _weights(res)


def test_consumed_snapshot_is_never_trained_twice(tlake):
    from pipeline.policy_store import latest_policy_version

    lake, sid = tlake
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=512, seed=1)
    first = train_snapshot(lake, sid, cfg, progress=False)
    again = train_snapshot(lake, sid, cfg, progress=False)          # the same run: a no-op
    assert again.already_published and again.checkpoint_id == first.checkpoint_id
    assert again.policy_version == first.policy_version == 1
    with pytest.raises(ConflictError, match="already consumed"):
        train_snapshot(lake, sid, TrainConfig(lr=2e-3, micro_batch_tokens=512), progress=False)
    forced = train_snapshot(lake, sid, cfg, force=True, progress=False)
    assert forced.checkpoint_id != first.checkpoint_id and forced.policy_version == 2
    assert latest_policy_version(lake) == 2


def test_exported_policy_loads_in_transformers_and_generates(tlake):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lake, sid = tlake
    res = train_snapshot(lake, sid, TrainConfig(lr=1e-3, micro_batch_tokens=512, max_steps=1), progress=False)
    hf = res.hf_dir                       # a delta-only version: its weights rebuilt in this machine's cache
    model = AutoModelForCausalLM.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok("w5 w6 w7", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 5)
    # the export carries the trained weights, not the parent's
    from safetensors.torch import load_file

    sd = load_file(str(hf / "model.safetensors"))
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items() if k in sd)


def test_resume_without_state_is_an_error(tlake):
    lake, sid = tlake
    with pytest.raises(NotFoundError, match="nothing to resume"):
        train_snapshot(lake, sid, CFG, resume=True, progress=False)


def _env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _cli(lake, sid, sets, *extra):
    cmd = [sys.executable, "-m", "pipeline", "train", "--lake", lake.uri, "--batch-snapshot", sid, "--json",
           "--no-progress"] + [a for s in sets for a in ("--set", s)] + list(extra)
    return cmd


KILL_SETS = ["lr=0.003", "micro_batch_tokens=256", "grad_accum=1", "epochs=4", "seed=5", "save_every=1"]
KILL_CFG = TrainConfig(lr=0.003, micro_batch_tokens=256, grad_accum=1, epochs=4, seed=5, save_every=1)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_equals_uninterrupted(tlake, tlake2):
    lake, sid = tlake
    proc = subprocess.Popen(_cli(lake, sid, KILL_SETS), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    runs = Path(lake.uri) / "_checkpoints" / "_runs"
    killed_at = None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        latest = list(runs.glob("*/latest"))
        if latest:
            tag = latest[0].read_text().strip()
            if int(tag.split("-")[1]) >= 3:
                proc.send_signal(signal.SIGKILL)
                killed_at = tag
                break
        time.sleep(0.005)
    proc.wait()
    assert killed_at is not None, f"the run ended before it could be killed: {proc.stdout.read().decode()[-2000:]}"
    assert proc.returncode == -signal.SIGKILL
    from pipeline.policy_store import latest_policy_version

    assert latest_policy_version(lake) == 0                       # nothing published by the killed run

    out = subprocess.run(_cli(lake, sid, KILL_SETS, "--resume"), env=_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert resumed["resumed_from_step"] >= 3 and resumed["policy_version"] == 1

    lake2, _ = tlake2
    straight = train_snapshot(lake2, sid, KILL_CFG, progress=False)
    assert resumed["checkpoint_id"] == straight.checkpoint_id
    assert resumed["weight_sha256"] == straight.weight_sha256       # bitwise identical
    m = lake.read("metrics").to_pylist()
    # every step once (live metrics land in several commits: file order is not step order)
    assert sorted(r["global_step"] for r in m) == list(range(straight.global_step))
    assert len({r["run_id"] for r in m}) == 2                                   # two attempts


DRILL = """
import sys
from pipeline.lake.delta import Lake
from pipeline.train.config import TrainConfig
from pipeline.train.run import train_snapshot
train_snapshot(Lake(sys.argv[1]), sys.argv[2], TrainConfig(lr=0.003, micro_batch_tokens=256, epochs=2, seed=3,
               save_every=2), progress=False, crash_at="publish")
"""
DRILL_CFG = TrainConfig(lr=0.003, micro_batch_tokens=256, epochs=2, seed=3, save_every=2)


@pytest.mark.slow
def test_drill_crash_while_publishing(tlake, tlake2):
    """Trainer dies with the weights half written: readers keep the last complete
    version, the rerun resumes and publishes the next unused version, and the
    snapshot is consumed once."""
    from pipeline.lineage import read_events
    from pipeline.policy_store import latest_policy_version, resolve_policy

    lake, sid = tlake
    p = subprocess.run([sys.executable, "-c", DRILL, lake.uri, sid], env=_env(), capture_output=True, text=True)
    assert p.returncode == 137, p.stderr[-3000:]
    half = list((Path(lake.uri) / "_checkpoints").glob("ck-*/hf/model.safetensors"))
    assert len(half) == 1 and not (half[0].parent.parent / "latest").exists()
    ref = resolve_policy(lake, None)                                # workers still get version 0, verified
    assert (ref.checkpoint_id, ref.policy_version) == ("tiny-v0", 0)

    # a corrupted resumable state is refused, never silently replaced by a fresh start
    runs = list((Path(lake.uri) / "_checkpoints" / "_runs").iterdir())
    assert len(runs) == 1
    victim = sorted(p for p in (runs[0] / "ds").rglob("*.pt"))[0]
    good = victim.read_bytes()
    victim.write_bytes(good[:-10] + b"0123456789")
    with pytest.raises(IntegrityError, match="does not match its manifest"):
        train_snapshot(lake, sid, DRILL_CFG, resume=True, progress=False)
    victim.write_bytes(good)

    res = train_snapshot(lake, sid, DRILL_CFG, resume=True, progress=False)
    assert res.policy_version == 1 and res.resumed_from_step and res.resumed_from_step > 0
    assert latest_policy_version(lake) == 1
    assert resolve_policy(lake, None).checkpoint_id == res.checkpoint_id       # hash-verified complete now
    again = train_snapshot(lake, sid, DRILL_CFG, progress=False)
    assert again.already_published and latest_policy_version(lake) == 1        # consumed once, no version reused
    rows = [r for r in lake.read("checkpoints").to_pylist() if sid in r["snapshot_ids"]]
    assert len(rows) == 1
    assert {e["eventType"] for e in read_events(lake)} >= {"START", "COMPLETE"}

    lake2, _ = tlake2
    straight = train_snapshot(lake2, sid, DRILL_CFG, progress=False)
    assert straight.weight_sha256 == res.weight_sha256


@pytest.mark.slow
def test_two_processes_match_one_up_to_reduction_order(tlake, tlake2):
    import torch
    from safetensors.torch import load_file

    cfg = TrainConfig(lr=3e-3, micro_batch_tokens=256, grad_accum=3, epochs=1, seed=2, zero_stage=2)
    lake, sid = tlake
    two = train_snapshot(lake, sid, cfg, nproc=2, progress=False)
    assert two.world_size == 2 and two.policy_version == 1
    lake2, _ = tlake2
    one = train_snapshot(lake2, sid, cfg, progress=False)
    assert one.global_step == two.global_step
    a = load_file(str(one.hf_dir / "model.safetensors"))
    b = load_file(str(two.hf_dir / "model.safetensors"))
    parent = load_file(str(Path(lake.uri) / "_checkpoints" / "tiny-v0" / "hf" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    assert any(not torch.equal(a[k], parent[k]) for k in a)
    m = sorted(lake.read("metrics").to_pylist(), key=lambda r: r["global_step"])
    m1 = sorted(lake2.read("metrics").to_pylist(), key=lambda r: r["global_step"])
    for r, s in zip(m, m1):
        assert r["loss"] == pytest.approx(s["loss"], rel=1e-4, abs=1e-6)
        assert r["tokens"] == s["tokens"]


@pytest.mark.parametrize("sets", [
    {"precision": "bf16", "zero_stage": 1, "activation_checkpointing": True},
    {"ratio_level": "sequence", "clip_low": 3e-4, "clip_high": 4e-4, "agg": "seq-mean-token-mean", "kl_coef": 0.1,
     "kl_kind": "k3", "entropy_coef": 0.01},
    {"old_logprobs": "rollout", "policy_loss": "reinforce", "agg": "seq-mean-token-sum-norm", "vocab_chunk": 100,
     "logprob_chunk": 7},
    {"zero_stage": 2, "offload": True, "kl_coef": 0.05, "kl_reference": "tiny-v0", "old_logprobs": "rollout",
     "clip_high": 0.28, "warmup_steps": 2},
    {"zero_stage": 3, "precision": "bf16", "activation_checkpointing": True, "kl_coef": 0.05,
     "kl_reference": "tiny-v0", "vocab_chunk": 100, "logprob_chunk": 7},
], ids=["bf16-zero1-actckpt", "gspo-kl-entropy", "reinforce-rollout-vocabchunk", "zero2-offload-ref",
        "bf16-zero3-actckpt-ref"])
def test_config_variants_train_and_publish(tlake, sets):
    import math

    lake, sid = tlake
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=256, grad_accum=2, max_steps=2, **sets)
    res = train_snapshot(lake, sid, cfg, progress=False)
    assert res.policy_version == 1 and res.global_step == 2
    m = sorted(lake.read("metrics").to_pylist(), key=lambda r: r["global_step"])
    assert len(m) == 2 and all(math.isfinite(r["loss"]) and r["tokens"] > 0 for r in m)
    if cfg.kl_coef > 0:
        assert all(r["kl"] is not None and r["kl"] >= 0 for r in m)
    if cfg.warmup_steps:
        assert m[0]["lr"] < m[1]["lr"]


def test_tampered_snapshot_is_refused(tlake):
    lake, sid = tlake
    f = Path(lake.uri) / "_snapshots" / sid / "members.parquet"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="members.parquet"):
        train_snapshot(lake, sid, CFG, progress=False)
    assert lake.read("checkpoints").num_rows == 1


def test_cli_errors_say_what_to_do(tlake, capsys):
    from pipeline.cli import main

    lake, sid = tlake
    assert main(["train", "--lake", lake.uri, "--batch-snapshot", "0" * 64]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "hint" in err
    assert main(["train", "--lake", lake.uri, "--batch-snapshot", sid, "--set", "zero_stage=4"]) == 2
    assert "ZeRO stages are 0, 1, 2 and 3" in capsys.readouterr().err
    assert main(["train", "--lake", lake.uri, "--batch-snapshot", sid, "--set", "nope=1"]) == 2
    assert main(["train", "--lake", lake.uri, "--batch-snapshot", sid, "--resume", "--json"]) == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kind"] == "NotFoundError"


def test_next_snapshot_continues_the_parents_optimizer(tlake, tlake2):
    from pipeline.testing.train_fixtures import publish_synthetic_snapshot

    results = {}
    for name, (lake, sid), carry in (("carry", tlake, True), ("fresh", tlake2, False)):
        cfg = TrainConfig(lr=3e-3, micro_batch_tokens=256, max_steps=3, carry_optimizer=carry)
        first = train_snapshot(lake, sid, cfg, progress=False)
        sid2 = publish_synthetic_snapshot(lake, 24, seed=8, median_len=20, prompt_len=6)
        second = train_snapshot(lake, sid2, cfg, progress=False)        # parent: the newest = first
        assert second.parent_checkpoint_id == first.checkpoint_id and second.policy_version == 2
        tc = json.loads((Path(second.path) / "train_config.json").read_text())
        assert tc["optimizer_from"] == (first.checkpoint_id if carry else None)
        m = sorted((r for r in lake.read("metrics").to_pylist() if r["checkpoint_id"] == second.checkpoint_id),
                   key=lambda r: r["global_step"])
        assert m[0]["lr"] == pytest.approx(3e-3)                         # this run's LR, not the parent's state
        results[name] = (first, second)
    assert _weights(results["carry"][0]) == _weights(results["fresh"][0])   # config differs only in the flag
    assert _weights(results["carry"][1]) != _weights(results["fresh"][1])   # AdamW moments carried over

    # a different layout cannot reuse the state: fresh optimizer, said so
    lake, _ = tlake
    sid3 = publish_synthetic_snapshot(lake, 16, seed=9, median_len=20, prompt_len=6)
    third = train_snapshot(lake, sid3, TrainConfig(lr=3e-3, micro_batch_tokens=256, max_steps=1, zero_stage=1),
                           progress=False)
    assert json.loads((Path(third.path) / "train_config.json").read_text())["optimizer_from"] is None
