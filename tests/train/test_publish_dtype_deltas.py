"""publish_dtype=bfloat16 and sparse deltas through the resident trainer: the
published weights are bf16 (what engines load), each version records an anchor
or a delta that rebuilds it exactly, and the trainer's fp32 master weights stay
exact: --follow publishes the same ids and bytes as the chain of --batch-snapshot runs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from pipeline.policy_store import delta as wd
from pipeline.policy_store import published_dir, resolve_policy
from pipeline.testing.train_fixtures import publish_synthetic_snapshot
from pipeline.train.config import TrainConfig, identity_hash
from pipeline.train.follow import follow
from pipeline.train.run import train_snapshot

CFG = TrainConfig(lr=1e-5, micro_batch_tokens=256, grad_accum=2, epochs=1, seed=4, max_steps=3, max_train_lag=None,
                  publish_dtype="bfloat16", anchor_every=3)


def _more(lake, k: int) -> list[str]:
    return [publish_synthetic_snapshot(lake, 16, seed=20 + i, median_len=18, prompt_len=6) for i in range(k)]


def _line(lake) -> list[tuple[str, int, dict[str, str], str]]:
    """(id, version, weight files (an anchor's hf/ weights or a delta-only version's delta), weights digest)."""
    from pipeline.train.checkpoint import weight_hashes

    rows = sorted((r for r in lake.read("checkpoints").to_pylist() if r["snapshot_ids"]),
                  key=lambda r: r["policy_version"])
    return [(r["checkpoint_id"], r["policy_version"], weight_hashes(dict(r["file_sha256"])),
             wd.weights_record(r)["sha256"]) for r in rows]


def test_identity_counts_publish_dtype_only_when_not_float32():
    base = TrainConfig()
    assert identity_hash(dataclasses.replace(base, anchor_every=2)) == identity_hash(base)
    assert identity_hash(dataclasses.replace(base, publish_dtype="bfloat16")) != identity_hash(base)


def test_bf16_follow_equals_the_chain_and_every_version_rebuilds_from_its_deltas(tlake, tlake2):
    lake, s1 = tlake
    sids = [s1] + _more(lake, 2)
    res = follow(lake, CFG, stop_after=3, progress=False)
    assert [v["policy_version"] for v in res.versions] == [1, 2, 3]

    rows = {r["checkpoint_id"]: r for r in lake.read("checkpoints").to_pylist()}
    recs = [wd.weights_record(rows[v["checkpoint_id"]]) for v in res.versions]
    # v1 against the fp32 initial policy: every tensor changed dtype, so no delta is smaller: an anchor
    assert [r["kind"] for r in recs] == ["anchor", "delta", "delta"] and recs[0]["why"] == "every tensor new, reshaped or retyped"
    assert [r["chain"] for r in recs] == [0, 1, 2]
    for v, rec in zip(res.versions, recs):
        own = published_dir(lake, v["checkpoint_id"]) / "hf"      # delta-only: full weights only at the anchor
        assert (own / "model.safetensors").exists() == (rec["kind"] == "anchor")
        assert (published_dir(lake, v["checkpoint_id"]) / rec["file"]).is_file()
        hf = resolve_policy(lake, v["checkpoint_id"]).hf_dir        # rebuilt where it is a delta
        with safe_open(str(hf / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
        got, _ = wd.reconstruct(lake, v["checkpoint_id"])
        assert wd.weights_digest(got) == rec["sha256"] == wd.weights_digest(wd.load_hf_weights(hf))
    assert all(0 < r["changed"] < r["elements"] and r["bytes"] < r["full_bytes"] for r in recs[1:])

    # a rollout engine following the line: from v1, by the two deltas in place, or by loading v3's file; both
    # serve v3's bf16 weights upcast to the engine's fp32, as a fresh engine does
    from pipeline.rollout.backends import switch_weights
    from pipeline.rollout.hf import HFEngine

    v1, v3 = (resolve_policy(lake, res.versions[i]["checkpoint_id"]).hf_dir for i in (0, 2))
    want = {k: t.float() for k, t in wd.load_hf_weights(v3).items()}
    for deltas, mode in ((wd.delta_path(lake, res.versions[0]["checkpoint_id"], res.versions[2]["checkpoint_id"]),
                          "delta"), (None, "in_place")):
        engine, rec = switch_weights(HFEngine(v1), v3, deltas=deltas)
        sd = engine.model.state_dict()
        assert rec["mode"] == mode and all(sd[k].dtype == torch.float32 for k in want)
        assert wd.weights_digest({k: sd[k] for k in want}) == wd.weights_digest(want)

    lake2, _ = tlake2
    assert _more(lake2, 2) == sids[1:]
    chain = [train_snapshot(lake2, sid, CFG, progress=False) for sid in sids]
    assert [(r.checkpoint_id, r.policy_version, r.weight_sha256) for r in chain] == [x[:3] for x in _line(lake)]
    assert _line(lake2) == _line(lake)                              # and the same rebuilt weights


def test_follow_rebuilds_a_parent_copy_the_cache_removed_while_it_trained(tlake, tmp_path, monkeypatch):
    """The resident trainer holds its last version's rebuilt copy as the next version's parent;
    another process's prune_cache (or a user) may remove it while a version trains. The trainer
    rebuilds it when it publishes, and every version still rebuilds to its recorded digest."""
    import shutil

    from pipeline.train import steps

    lake, _ = tlake
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    _more(lake, 2)
    real, wiped = steps.prepare_data, []

    def prune_then_prepare(run, lm=None):
        cache = wd.weights_cache(lake.uri)
        if cache.exists() and any(cache.iterdir()):
            wiped.append(sorted(p.name for p in cache.iterdir()))
            shutil.rmtree(cache)
            wd._VERIFIED.clear()
        return real(run, lm=lm)

    monkeypatch.setattr(steps, "prepare_data", prune_then_prepare)
    res = follow(lake, CFG, stop_after=3, progress=False)
    assert [v["policy_version"] for v in res.versions] == [1, 2, 3] and wiped    # v3's parent copy was removed
    rows = {r["checkpoint_id"]: r for r in lake.read("checkpoints").to_pylist()}
    recs = [wd.weights_record(rows[v["checkpoint_id"]]) for v in res.versions]
    assert [r["kind"] for r in recs] == ["anchor", "delta", "delta"]
    for v, rec in zip(res.versions, recs):
        assert wd.weights_digest(wd.reconstruct(lake, v["checkpoint_id"])[0]) == rec["sha256"]


@pytest.mark.slow
def test_bf16_restart_replays_delta_only_versions_on_a_machine_without_their_weights(tlake, tmp_path, monkeypatch):
    """A restart that must replay delta-only versions (their DeepSpeed state lost) on a machine with
    no rebuilt copy: each replayed version's weights are checked against its recorded digest
    (rebuilt from the anchor and its deltas), and the line continues."""
    import shutil

    from pipeline.policy_store.care import repair_checkpoints

    lake, _ = tlake
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "this-machine"))
    _more(lake, 2)
    res = follow(lake, CFG, stop_after=3, progress=False)
    ids = [v["checkpoint_id"] for v in res.versions]
    rows = {r["checkpoint_id"]: r for r in lake.read("checkpoints").to_pylist()}
    assert [wd.weights_record(rows[c])["kind"] for c in ids] == ["anchor", "delta", "delta"]
    _two_machines_rebuild_at_once(lake, ids[2], wd.weights_record(rows[ids[2]])["sha256"], tmp_path / "twins")
    ds = sorted(p for p in (published_dir(lake, ids[2]) / "ds").rglob("*") if p.is_file())
    ds[0].write_bytes(b"damaged")                              # v3's full state lost: repair retires it
    assert repair_checkpoints(lake)["repaired"]
    shutil.rmtree(wd.weights_cache(lake.uri))                    # another machine
    wd._VERIFIED.clear()
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "other-machine"))
    _more(lake, 3)
    res2 = follow(lake, CFG, stop_after=1, progress=False)
    assert res2.replayed == ids and [v["policy_version"] for v in res2.versions] == [4]


TWIN = """
import sys
from pipeline.policy_store import delta as wd, resolve_policy
hf = resolve_policy(sys.argv[1], sys.argv[2]).hf_dir
print("DIGEST", wd.weights_digest(wd.load_hf_weights(hf)), hf)
"""


def _two_machines_rebuild_at_once(lake, checkpoint_id: str, digest: str, cache) -> None:
    """Two processes sharing one empty cache rebuild the same delta-only version at once: each gets the
    recorded weights, one copy is installed (the other's renamed away), no temporary folder is left."""
    import os
    import subprocess
    import sys
    from unittest import mock

    env = dict(os.environ, PIPELINE_CACHE=str(cache), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", TWIN, lake.uri, checkpoint_id], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    got = [o.split("DIGEST")[1].split() for o, _ in outs]
    assert [g[0] for g in got] == [digest, digest] and got[0][1] == got[1][1]
    with mock.patch.dict(os.environ, {"PIPELINE_CACHE": str(cache)}):
        entries = [p.name for p in wd.weights_cache(lake.uri).iterdir()]
    assert len([e for e in entries if e.startswith(checkpoint_id)]) == 1 and not [e for e in entries if ".tmp" in e]
    assert str(cache) in got[0][1]                                   # rebuilt in the shared cache, not found elsewhere


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_writes_a_tied_weight_once_in_every_publish_dtype(tmp_path, dtype):
    """A tied lm_head is the embeddings' tensor: export_hf writes it once (as save_pretrained does
    for fp32), not as a separate converted copy (+17% of a 135M model's bytes, in every delta); the
    exported model loads with the head tied to the embeddings, from the model or a passed state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.testing.train_fixtures import TINY
    from pipeline.train.checkpoint import export_hf

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    (tmp_path / "parent").mkdir()
    for i, state in enumerate((None, {k: v.detach().clone() for k, v in lm.state_dict().items()})):
        out = tmp_path / f"out{i}"
        export_hf(lm, tmp_path / "parent", out, state=state, dtype=dtype)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            emb = f.get_tensor("model.embed_tokens.weight")
        assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
        assert emb.dtype == getattr(torch, dtype)
        assert torch.equal(emb, lm.model.embed_tokens.weight.detach().to(emb.dtype))
        back = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
        assert torch.equal(back.lm_head.weight, emb.float())
