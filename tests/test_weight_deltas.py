"""Sparse weight deltas (pipeline.policy_store.delta): exact reconstruction over a
chain with an anchor in the middle, tampered and missing deltas refused in one
line, retention keeps every version rebuildable, `policy export` writes loadable
HF weights equal to the recorded digest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
import subprocess
import sys
import pytest
import torch

from pipeline.errors import IntegrityError
from pipeline.policy_store import delta as wd


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(32, generator=g),
            "c.half": torch.randn(16, 8, generator=g).to(torch.bfloat16), "d.int": torch.arange(10)}


def _nudge(w: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in w.items():
        t = t.clone()
        if t.is_floating_point():
            mask = torch.rand(t.shape, generator=g) < frac
            t[mask] = (t.float()[mask] + 1e-3).to(t.dtype)
        out[k] = t
    return out


@pytest.mark.parametrize("frac,index_form", [(0.005, "::idx"), (0.05, "::idx")])
def test_make_and_apply_delta_are_bitwise_exact_and_sparse(frac, index_form):
    base = _weights()
    new = _nudge(base, frac, 1)
    new["b.bias"][3] = float("nan")                     # bit patterns, not values: NaN and -0.0 round-trip
    new["a.weight"][0, 0] = -0.0 if base["a.weight"][0, 0] != 0 else 1.0
    new["e.added"] = torch.ones(3)                        # a new tensor is stored whole; a dropped one is dropped
    del new["d.int"]
    delta, names = wd.make_delta(base, new)
    assert "e.added::full" in delta and not any(k.startswith("d.int") for k in delta)
    assert f"a.weight{index_form}" in delta           # indices, sparse or dense (stored as narrow gaps)
    data = wd.encode(delta, names)
    n = int.from_bytes(data[:8], "little")         # content-addressed: the same delta is the same bytes in any
    head = data[8:8 + n].rstrip(b" ")              # process (safetensors orders metadata keys by a random hash)
    assert head == json.dumps(json.loads(head), sort_keys=True, separators=(",", ":")).encode()
    got = wd.apply_delta(base, *wd.decode(data, what="t"))
    assert wd.weights_digest(got) == wd.weights_digest(new) and set(got) == set(new)
    assert len(data) < wd.nbytes(new) / 3                 # <= 5% changed: indices + bits of those only
    assert wd.weights_digest(base) == wd.weights_digest(_weights())   # the base is not modified
    with pytest.raises(IntegrityError, match="not a readable weight delta"):
        wd.decode(data[:-9], what="t")
    with pytest.raises(IntegrityError, match="does not fit its base"):
        wd.apply_delta({k: v[:1] for k, v in base.items()}, delta, names)


def _publish(lake, cid: str, parent: str | None, weights, parent_weights, parent_record, anchor_every: int):
    """A version the way the trainer writes it: hf/ (config, tokenizer, weights), its record, its row."""
    import shutil

    from safetensors.torch import save_file

    from pipeline.policy_store import publish_checkpoint, resolve_policy, run_checkpoint_rel, local_dir

    rel = run_checkpoint_rel(cid, "t")
    root = local_dir(lake, rel)
    src = resolve_policy(lake, "tiny-v0").hf_dir
    shutil.copytree(src, root / "hf", ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(weights, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    rec = wd.write_version_weights(root, weights, parent_id=parent, parent_weights=parent_weights,
                                   parent_record=parent_record, anchor_every=anchor_every)
    wd.keep_exported(lake.uri, cid, root, rec, parent_id=parent)   # delta-only: the full weights leave a delta version
    (root / "ds" / "final").mkdir(parents=True)
    (root / "ds" / "final" / "state.pt").write_bytes(cid.encode() * 64)   # what retention may remove
    publish_checkpoint(lake, checkpoint_id=cid, policy_version=None, parent_checkpoint_id=parent, snapshot_ids=[],
                       train_config={"weights": rec}, train_config_hash="t", seed=0, rel=rel)
    return rec


@pytest.fixture
def chain(lake, tmp_path, monkeypatch):
    """tiny-v0 (init: an anchor without a record) then 6 trained-like versions, anchor_every=3:
    v1 delta, v2 delta, v3 anchor, v4 delta, v5 delta, v6 anchor."""
    from pipeline.testing.train_fixtures import publish_tiny_policy

    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    publish_tiny_policy(lake, checkpoint_id="tiny-v0")
    w = wd.load_hf_weights(wd_hf(lake, "tiny-v0"))
    ws, recs, parent, prec = [w], [], "tiny-v0", None
    for i in range(1, 7):
        nw = _nudge(ws[-1], 0.03, i)
        prec = _publish(lake, f"c{i}", parent, nw, ws[-1], prec, anchor_every=3)
        recs.append(prec)
        ws.append(nw)
        parent = f"c{i}"
    return lake, ws, recs


def wd_hf(lake, cid):
    from pipeline.policy_store import resolve_policy

    return resolve_policy(lake, cid).hf_dir


def test_chain_with_an_anchor_in_the_middle_rebuilds_every_version_exactly(chain):
    lake, ws, recs = chain
    assert [r["kind"] for r in recs] == ["delta", "delta", "anchor", "delta", "delta", "anchor"]
    assert all(r["bytes"] < r["full_bytes"] / 4 for r in recs if r["kind"] == "delta")
    for i in range(1, 7):
        got, row = wd.reconstruct(lake, f"c{i}")
        assert wd.weights_digest(got) == wd.weights_digest(ws[i]) == recs[i - 1]["sha256"]
        assert row["checkpoint_id"] == f"c{i}"
    assert [r["checkpoint_id"] for r in wd.chain_of(lake.read("checkpoints").to_pylist(), "c5")] == ["c3", "c4", "c5"]


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = exc.value.message
    assert "\n" not in msg
    return msg


def test_tampered_or_missing_delta_is_a_one_line_integrity_error(chain):
    from pipeline.policy_store import published_dir

    lake, ws, recs = chain
    f = published_dir(lake, "c2") / recs[1]["file"]
    data = bytearray(f.read_bytes())
    data[len(data) - 5] ^= 0x01                          # one bit of one new value
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as exc:
        wd.reconstruct(lake, "c2")
    assert "sha256 mismatch" in _one_line(exc) and "policy version 2" in exc.value.message
    wd.reconstruct(lake, "c1")                            # versions before it are untouched
    assert wd.weights_digest(wd.reconstruct(lake, "c4")[0]) == recs[3]["sha256"]   # c3 is an anchor
    f.unlink()
    with pytest.raises(IntegrityError) as exc:
        wd.reconstruct(lake, "c2")
    assert "is missing" in _one_line(exc)


def test_the_writer_keeps_one_rebuilt_copy_per_line_not_one_per_version(chain):
    """Each version the writer publishes drops its parent's rebuilt copy from the machine's cache:
    after v1..v6 (v3, v6 anchors) none is left; an older version read again is rebuilt from its anchor."""
    lake, ws, recs = chain
    cache = wd.weights_cache(lake.uri)
    assert not cache.exists() or not [p.name for p in cache.iterdir() if p.name.startswith("c")]
    assert wd.weights_digest(wd.load_hf_weights(wd_hf(lake, "c5"))) == recs[4]["sha256"]   # rebuilt on demand
    assert [p.name.rpartition("-")[0] for p in cache.iterdir()] == ["c5"]
    assert wd.drop_cached(lake.uri, "c5") == 1 and wd.drop_cached(lake.uri, "c5") == 0


def _cached(lake) -> list[str]:
    cache = wd.weights_cache(lake.uri)
    return sorted(p.name.rpartition("-")[0] for p in cache.iterdir() if not p.name.startswith(".")) if cache.exists() else []


def test_copies_readers_rebuild_are_bounded_least_recently_used_first(chain, monkeypatch):
    """A reader's rebuilt copies (eval, a worker's fallback) no longer pile up: past
    $PIPELINE_WEIGHTS_CACHE_KEEP the least recently used go, never one used within the grace
    period, and one removed is rebuilt exactly when read again."""
    import os
    import time

    from pipeline.errors import ConfigError
    from pipeline.policy_store import resolve_policy

    lake, ws, recs = chain
    shutil.rmtree(wd.weights_cache(lake.uri), ignore_errors=True)
    wd._VERIFIED.clear()
    monkeypatch.setenv(wd.CACHE_KEEP_ENV, "2")
    monkeypatch.setattr(wd, "CACHE_GRACE_S", 3600.0)
    for c in ("c1", "c2", "c4", "c5"):                       # the delta versions; c3, c6 are anchors (no copy)
        resolve_policy(lake, c)
    assert _cached(lake) == ["c1", "c2", "c4", "c5"]         # all used within the grace period: kept
    monkeypatch.setattr(wd, "CACHE_GRACE_S", 0.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = wd.weights_cache(lake.uri) / f".c9-0123456789abcdef.tmp{dead.pid}"   # a killed rebuild's temporary
    running = wd.weights_cache(lake.uri) / f".c8-0123456789abcdef.tmp{os.getpid()}"  # a long rebuild, still going
    old = time.time() - 10
    for d in (leftover, running):
        d.mkdir()
        os.utime(d, (old, old))
    time.sleep(0.01)
    resolve_policy(lake, "c2")                               # used again: now the most recent, then c5
    assert sorted(n.rpartition("-")[0] for n in wd.prune_cache(lake.uri)) == ["c1", "c4"]
    assert _cached(lake) == ["c2", "c5"] and not leftover.exists() and running.exists()
    running.rmdir()
    hf = resolve_policy(lake, "c1").hf_dir                   # a removed copy is rebuilt on demand, exactly,
    assert wd.weights_digest(wd.load_hf_weights(hf)) == recs[0]["sha256"]
    assert _cached(lake) == ["c1", "c2"]                     # and its install pruned the least recently used
    monkeypatch.setenv(wd.CACHE_KEEP_ENV, "many")
    with pytest.raises(ConfigError) as exc:
        resolve_policy(lake, "c3")                           # what every command does first: before its work
    assert "PIPELINE_WEIGHTS_CACHE_KEEP='many'" in _one_line(exc)


PRUNER = """
import sys
from pipeline.policy_store import delta as wd
for _ in range(int(sys.argv[2])):
    wd.prune_cache(sys.argv[1], keep=1, grace_s=0)
"""


def test_two_pruners_at_once_leave_every_visible_copy_whole(tmp_path, monkeypatch):
    """prune_cache in two processes at once (a concurrent twin) while a reader watches: a copy
    under its own name is always complete (removal renames it away first), and what is left is
    the newest copy, no temporary names."""
    import os

    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    uri = str(tmp_path / "lake")
    cache = wd.weights_cache(uri)
    files = ("config.json", "tokenizer.json", "model.safetensors")
    for i in range(60):
        hf = cache / f"v{i:02d}-{i:016x}" / "hf"
        hf.mkdir(parents=True)
        for f in files:
            (hf / f).write_bytes(b"x" * 4096)
        os.utime(hf.parent, (1000 + i, 1000 + i))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    twins = [subprocess.Popen([sys.executable, "-c", PRUNER, uri, "3"], env=env) for _ in range(2)]
    torn = []
    while any(t.poll() is None for t in twins):
        for entry in list(cache.iterdir()):
            if entry.name.startswith("."):
                continue
            missing = [f for f in files if not (entry / "hf" / f).is_file()]
            if missing and entry.exists():
                torn.append((entry.name, missing))
    assert [t.wait() for t in twins] == [0, 0]
    assert not torn, torn
    assert [p.name for p in cache.iterdir()] == [f"v59-{59:016x}"]


def test_a_long_held_parent_copy_removed_from_the_cache_is_rebuilt_when_used(chain):
    """A trainer holds its parent's rebuilt copy for a whole version; if the cache removed it
    meanwhile (prune_cache in another process, a user), ensure_rebuilt rebuilds it exactly."""
    from pipeline.policy_store import resolve_policy

    lake, ws, recs = chain
    ref = resolve_policy(lake, "c5")
    assert wd.ensure_rebuilt(lake, ref) == ref.hf_dir
    shutil.rmtree(ref.hf_dir.parent)
    hf = wd.ensure_rebuilt(lake, ref)
    assert wd.weights_digest(wd.load_hf_weights(hf)) == recs[4]["sha256"] and (hf / "tokenizer.json").is_file()
    anchor = resolve_policy(lake, "c3")                        # an anchor's own published files: used as they are
    assert wd.ensure_rebuilt(lake, anchor) == anchor.hf_dir


def test_retention_keeps_every_version_rebuildable(chain):
    from pipeline.maintain import maintain

    import shutil

    from pipeline.policy_store import resolve_policy

    lake, ws, recs = chain
    report = maintain(lake, keep_checkpoints=1)
    assert report["checkpoints"]["files_removed"] == 5       # the DeepSpeed state of c1..c5, never a delta or anchor
    shutil.rmtree(wd.weights_cache(lake.uri))                # and no rebuilt copy to lean on
    wd._VERIFIED.clear()
    for i in range(1, 7):
        assert wd.weights_digest(wd.reconstruct(lake, f"c{i}")[0]) == recs[i - 1]["sha256"]
        ref = resolve_policy(lake, f"c{i}")                   # every kept file still verifies
        assert wd.weights_digest(wd.load_hf_weights(ref.hf_dir)) == recs[i - 1]["sha256"]


def test_policy_export_writes_loadable_hf_weights_equal_to_the_recorded_digest(chain, tmp_path):
    from transformers import AutoModelForCausalLM

    lake, ws, recs = chain
    out = tmp_path / "exported"
    cp = subprocess.run([sys.executable, "-m", "pipeline", "policy", "export", "--lake", str(lake.uri),
                         "--version", "5", "--out", str(out), "--json"], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    r = json.loads(cp.stdout)
    assert r["weights_sha256"] == r["recorded_sha256"] == recs[4]["sha256"] and r["rebuilt_from"] == ["c3", "c4", "c5"]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert wd.weights_digest({k: v for k, v in model.state_dict().items()}) == recs[4]["sha256"]
    assert (out / "tokenizer.json").is_file() and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    # a tampered chain writes nothing
    from pipeline.policy_store import published_dir

    (published_dir(lake, "c4") / recs[3]["file"]).unlink()
    cp = subprocess.run([sys.executable, "-m", "pipeline", "policy", "export", "--lake", str(lake.uri),
                         "--version", "5", "--out", str(tmp_path / "again")], capture_output=True, text=True)
    assert cp.returncode != 0 and "is missing" in cp.stderr and not (tmp_path / "again").exists()


def test_hf_engine_applies_the_deltas_in_place_and_falls_back_to_a_full_load_when_off_the_chain(chain):
    from pipeline.policy_store import resolve_policy
    from pipeline.rollout.backends import switch_weights
    from pipeline.rollout.hf import HFEngine

    lake, ws, recs = chain

    def served(engine):
        return wd.weights_digest({k: v.detach() for k, v in engine.model.state_dict().items() if k in ws[0]})

    engine = HFEngine(resolve_policy(lake, "c1").hf_dir)
    engine, rec = switch_weights(engine, resolve_policy(lake, "c3").hf_dir)   # c3 (an anchor) by a full load
    assert rec["mode"] == "in_place"        # the served tensors now come from c3's file (memory-mapped)
    deltas = wd.delta_path(lake, "c3", "c5")
    assert deltas is not None and len(deltas) == 2
    engine, rec = switch_weights(engine, resolve_policy(lake, "c5").hf_dir, deltas=deltas)
    assert rec["mode"] == "delta" and served(engine) == recs[4]["sha256"]      # bitwise the published c5
    from pipeline.policy_store.care import verify_checkpoints

    assert verify_checkpoints(lake)["problems"] == []       # writing the served weights never writes c3's file
    # c1 is not on c6's chain (c6 is an anchor): the reader loads the full weights
    assert wd.delta_path(lake, "c1", "c6") is None and wd.delta_path(lake, "c5", "c6") is None
    engine, rec = switch_weights(engine, resolve_policy(lake, "c6").hf_dir, deltas=None)
    assert rec["mode"] == "in_place" and served(engine) == recs[5]["sha256"]
    # a damaged delta on the way is refused before the engine is touched
    from pipeline.policy_store import published_dir

    (published_dir(lake, "c5") / recs[4]["file"]).write_bytes(b"x")
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        wd.delta_path(lake, "c3", "c5")


def test_delta_only_layout_readers_rebuild_from_the_lake_and_refuse_a_damaged_chain(chain):
    """A delta version's directory and row hold its delta, not its weights; resolve_policy (what
    engines, eval and the trainer load) rebuilds them into this machine's cache, checked against
    the recorded digest; a damaged cached copy is rebuilt, a missing delta is a one-line IntegrityError."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.policy_store import published_dir, resolve_policy

    lake, ws, recs = chain
    rows = {r["checkpoint_id"]: r for r in lake.read("checkpoints").to_pylist()}
    for i, rec in enumerate(recs, start=1):
        files = dict(rows[f"c{i}"]["file_sha256"])
        has_full = "hf/model.safetensors" in files and (published_dir(lake, f"c{i}") / "hf/model.safetensors").exists()
        assert has_full == (rec["kind"] == "anchor") and (rec["file"] in files) and "hf/config.json" in files
    shutil.rmtree(wd.weights_cache(lake.uri))             # another machine: nothing rebuilt yet
    wd._VERIFIED.clear()
    for i in range(1, 7):
        hf = resolve_policy(lake, f"c{i}").hf_dir
        assert wd.weights_digest(wd.load_hf_weights(hf)) == recs[i - 1]["sha256"]
        assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    hf5 = resolve_policy(lake, "c5").hf_dir
    w = load_file(str(hf5 / "model.safetensors"))
    w["lm_head.weight"][0, 0] += 1.0                       # a damaged local copy (another process wrote it)
    save_file(w, str(hf5 / "model.safetensors"))
    wd._VERIFIED.clear()
    assert wd.weights_digest(wd.load_hf_weights(resolve_policy(lake, "c5").hf_dir)) == recs[4]["sha256"]
    (hf5 / "config.json").write_text("{}")                # its config too: the copy is the row's files or rebuilt
    wd._VERIFIED.clear()
    assert json.loads((resolve_policy(lake, "c5").hf_dir / "config.json").read_text()) != {}
    shutil.rmtree(wd.weights_cache(lake.uri))
    wd._VERIFIED.clear()
    (published_dir(lake, "c4") / recs[3]["file"]).unlink()
    with pytest.raises(IntegrityError) as exc:
        resolve_policy(lake, "c5")                         # c5's own files are intact: its chain is not
    assert "is missing" in _one_line(exc) and "policy version 4" in exc.value.message
    assert not wd.weights_cache(lake.uri).exists() or not any(wd.weights_cache(lake.uri).glob("c5-*"))


def test_a_following_rollout_worker_switches_by_delta(lake, tmp_path, monkeypatch):
    """The worker's policy holder applies a newly published version's delta to the engine it serves."""
    from pipeline.rollout.run import RolloutConfig
    from pipeline.rollout.worker import PolicyHolder
    from pipeline.testing.train_fixtures import publish_tiny_policy

    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    publish_tiny_policy(lake, checkpoint_id="tiny-v0")
    w0 = wd.load_hf_weights(wd_hf(lake, "tiny-v0"))
    w1 = _nudge(w0, 0.01, 1)
    rec1 = _publish(lake, "c1", "tiny-v0", w1, w0, None, anchor_every=8)
    holder = PolicyHolder(lake, RolloutConfig(follow_latest=True))
    engine, v = holder()
    assert v == 1 and holder.checkpoint_id == "c1"
    w2 = _nudge(w1, 0.01, 2)
    rec = _publish(lake, "c2", "c1", w2, w1, rec1, anchor_every=8)
    assert rec["kind"] == "delta"
    shutil.rmtree(wd.weights_cache(lake.uri))       # a worker on another machine: no rebuilt copy of c2 there
    engine2, v2 = holder()
    assert v2 == 2 and engine2 is engine and [s["mode"] for s in holder.switches] == ["delta"]
    sd = engine.model.state_dict()
    assert wd.weights_digest({k: sd[k] for k in w2}) == rec["sha256"]
    # the delta was applied to the served weights: c2's full weights were never rebuilt on this machine
    assert not wd.weights_cache(lake.uri).exists() or not any(wd.weights_cache(lake.uri).glob("c2-*"))
    assert not holder.newer()

    # an engine that cannot apply a delta falls back to the full weights, rebuilt only then
    w3 = _nudge(w2, 0.01, 3)
    rec3 = _publish(lake, "c3", "c2", w3, w2, rec, anchor_every=8)
    shutil.rmtree(wd.weights_cache(lake.uri))
    assert holder.newer()
    monkeypatch.setattr(engine, "apply_weight_deltas", lambda hf_dir, deltas: False)
    engine3, v3 = holder()
    assert v3 == 3 and engine3 is engine and holder.switches[-1]["mode"] == "in_place"
    sd = engine.model.state_dict()
    assert wd.weights_digest({k: sd[k] for k in w3}) == rec3["sha256"]
    assert any(wd.weights_cache(lake.uri).glob("c3-*"))
    holder.close()


def test_moves_are_stored_narrow_and_compressed_and_first_format_deltas_are_still_read():
    """A delta stores how the changed bit patterns moved (one byte for a few units in the last
    place, the bf16 case under AdamW), zstd-compressed; a delta of the first format (the new
    bit patterns, uncompressed) still applies; a part whose recorded size is wrong is refused."""
    import numpy as np
    from safetensors.torch import save

    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(4096, generator=g).to(torch.bfloat16), "x": torch.randn(64, generator=g)}
    bits = base["w"].view(torch.int16).clone()
    moved = torch.rand(4096, generator=g) < 0.2
    bits[moved] += torch.randint(-3, 4, (4096,), generator=g, dtype=torch.int16)[moved]
    new = {"w": bits.view(torch.bfloat16), "x": base["x"].clone()}
    new["x"][5] = 1e30                                  # a far move: a wider integer, still exact
    delta, names = wd.make_delta(base, new)
    assert delta["w::dif"].dtype == torch.int8 and delta["x::dif"].dtype == torch.int64
    assert "w::idx" in delta and not any(k.endswith(("::val", "::mask")) for k in delta)
    data = wd.encode(delta, names)
    assert len(data) < wd.nbytes(new) * 0.2                     # ~20% of bf16 elements moved by <= 3 units
    got = wd.apply_delta(base, *wd.decode(data, what="t"))
    assert wd.weights_digest(got) == wd.weights_digest(new)
    # the first format, uncompressed: indices (or, dense, a packed bit mask) and the new bit patterns
    sparse = {"w": base["w"].clone(), "x": new["x"]}
    sparse["w"].view(torch.int16)[7] += 1
    d1, n1 = wd.make_delta(base, sparse)
    v1 = {k: v for k, v in d1.items() if k.endswith("::idx")}
    v1 |= {k[:-5] + "::val": wd.bit_pattern(sparse[k[:-5]])[d1[k[:-5] + "::idx"].long()] for k in d1 if k.endswith("::dif")}
    v1["w::mask"] = torch.from_numpy(np.packbits(wd.bit_pattern(base["w"]) != wd.bit_pattern(new["w"])))
    v1["w::val"] = wd.bit_pattern(new["w"])[delta["w::idx"].long()]
    del v1["w::idx"]
    old = save(v1, metadata={"format": wd.FORMAT_V1, "names": json.dumps(n1)})
    assert wd.weights_digest(wd.apply_delta(base, *wd.decode(old, what="t"))) == wd.weights_digest(new)
    # a part that does not inflate to its recorded size is damaged bytes, one line
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8:8 + n])
    parts = json.loads(head["__metadata__"]["parts"])
    parts["w::dif"][3] += 1
    head["__metadata__"]["parts"] = json.dumps(parts, sort_keys=True)
    h = json.dumps(head).encode()
    h += b" " * (-len(h) % 8)
    with pytest.raises(IntegrityError, match="not a readable weight delta"):
        wd.decode(len(h).to_bytes(8, "little") + h + data[8 + n:], what="t")


def test_a_dense_change_is_a_move_for_every_element_applied_in_one_pass():
    """Where more than half the elements moved, the delta holds a move for every element (no indices);
    it rebuilds the weights exactly through every reader: apply_delta (the chain), apply_in_place (vLLM's
    host copy) and the hf engine's fp32 add (the published bf16 bits are the upper half of its fp32 bits)."""
    from pipeline.rollout.hf import add_moves

    g = torch.Generator().manual_seed(5)
    base = {"w": torch.randn(5000, generator=g).to(torch.bfloat16)}
    bits = base["w"].view(torch.int16).clone()
    bits += torch.randint(-5, 6, (5000,), generator=g, dtype=torch.int16)
    bits[:3] = torch.tensor([-1, 0x7F7F, -32768], dtype=torch.int16)    # sign flips and extremes: exact too
    new = {"w": bits.view(torch.bfloat16)}
    delta, names = wd.make_delta(base, new)
    assert set(delta) == {"w::dif", "w::fix", "w::fixbits"} and delta["w::dif"].numel() == 5000
    assert delta["w::dif"].dtype == torch.int8 and delta["w::fix"].tolist() == [0, 1, 2]   # far moves: new bits apart
    assert wd.changed_elements(delta) == int((wd.bit_pattern(base["w"]) != bits).sum())
    got = wd.apply_delta(base, *wd.decode(wd.encode(delta, names), what="t"))
    assert torch.equal(wd.bit_pattern(got["w"]), bits)
    held = {"w": base["w"].clone()}
    assert wd.apply_in_place(held, [(delta, names)]) == {"w"} and torch.equal(wd.bit_pattern(held["w"]), bits)
    served = base["w"].float()
    todo = list(wd.changes(delta, {"w": 5000}))
    assert [(c[2] is None, c[3] is None) for c in todo] == [(True, False), (False, True)]   # moves, then fixed bits
    (_, where, _, dif, _), (_, fix, fixbits, _, _) = todo
    add_moves(served.view(torch.int32), where, dif, shift=16)
    wd.write(served, fix, fixbits.view(torch.bfloat16).float())
    assert torch.equal(served.view(torch.int32), new["w"].float().view(torch.int32))     # bits: a NaN is among them


def test_the_hf_engine_serving_bf16_applies_dense_moves_and_far_fixes_bitwise(lake, tmp_path, monkeypatch):
    """The hf engine serves bf16-published weights in fp32 and applies a bf16 delta by int32 adds to
    the fp32 bits: a dense delta (every element moved) with far moves (sign flips) stored apart lands
    bit for bit (a NaN among them)."""
    import shutil

    from safetensors.torch import save_file

    from pipeline.rollout.hf import HFEngine
    from pipeline.testing.train_fixtures import publish_tiny_policy

    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    publish_tiny_policy(lake, checkpoint_id="tiny-v0")
    src = wd_hf(lake, "tiny-v0")
    dirs = []
    w = {k: v.to(torch.bfloat16) for k, v in wd.load_hf_weights(src).items()}
    g = torch.Generator().manual_seed(9)
    versions = [w]
    nxt = {}
    for k, t in w.items():
        bits = t.view(torch.int16).clone().reshape(-1)
        bits += torch.randint(-4, 5, bits.shape, generator=g, dtype=torch.int16)
        bits[:2] = torch.tensor([-1, -32767], dtype=torch.int16)        # a NaN, a sign flip near zero
        nxt[k] = bits.view(torch.bfloat16).reshape(t.shape)
    versions.append(nxt)
    for i, ws in enumerate(versions):
        d = tmp_path / f"v{i}"
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(cfg | {"dtype": "bfloat16"}))
        save_file(ws, str(d / "model.safetensors"))
        dirs.append(d)
    delta = wd.make_delta(versions[0], versions[1])
    assert any(k.endswith("::fix") for k in delta[0]) and not any(k.endswith("::idx") for k in delta[0])
    engine = HFEngine(dirs[0])
    assert engine.apply_weight_deltas(dirs[1], [wd.decode(wd.encode(*delta), what="t")])
    sd = engine.model.state_dict()
    for k, t in versions[1].items():
        assert torch.equal(sd[k].view(torch.int32), t.float().view(torch.int32)), k
