"""Checkpoint directories the trainer writes and reads.

Resumable state of a run in progress (``<lake>/_checkpoints/_runs/<run_key>/``)::

    run.json                    what is being trained (snapshot, parent, config)
    ds/<tag>/...                DeepSpeed: model, optimizer, scheduler (+ client_state: data cursor, metrics)
    rng/<tag>/rank<r>.pt        python, numpy, torch (and CUDA) RNG state of every rank
    manifest-<tag>.json         sha256 of every file of <tag>
    latest                      the tag, written atomically and last

A published checkpoint (``<lake>/_checkpoints/<checkpoint_id>.<run tag>/``, the run's own
directory: the ``checkpoints`` row's ``path``)::

    ds/final/...  rng/final/...  cursor.json  train_config.json
    hf/           config.json, model.safetensors, tokenizer files: the next policy version
    latest        "final", written atomically and last

Both contain pickles (torch.save), so they are loaded only after every file
is rehashed against a manifest this project wrote (for published ones: the
``checkpoints`` row, see pipeline.policy_store).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pipeline.errors import IntegrityError, NotFoundError
from pipeline.policy_store import HF_SUBDIR, hash_dir

if TYPE_CHECKING:  # transformers and deepspeed are imported where a model is loaded
    from transformers import PreTrainedModel

    from pipeline.train.ds_adapter import DeepSpeedStrategy

LATEST = "latest"
FINAL_TAG = "final"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write-then-rename, fsynced: readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# -- resumable state of a run in progress -----------------------------------------


def _tag_files(root: Path, tag: str) -> dict[str, str]:
    out = {}
    for sub in ("ds", "rng"):
        d = root / sub / tag
        if d.is_dir():
            out.update({f"{sub}/{tag}/{k}": v for k, v in hash_dir(d).items()})
    return out


def _save_engine_and_rng(strategy: DeepSpeedStrategy, root: Path, tag: str, client_state: dict[str, Any]) -> None:
    """Every rank: DeepSpeed state under ds/<tag> and its own RNG states under
    rng/<tag>/rank<r>.pt, then a barrier (DeepSpeed saves no RNG state itself)."""
    strategy.save(root / "ds", tag, client_state)
    rng_dir = root / "rng" / tag
    rng_dir.mkdir(parents=True, exist_ok=True)
    torch.save(capture_rng(), rng_dir / f"rank{strategy.rank}.pt")
    strategy.barrier()


def save_state(strategy: DeepSpeedStrategy, root: Path, tag: str, client_state: dict[str, Any]) -> None:
    """Every rank: DeepSpeed state + own RNG; rank 0 then writes the manifest and
    moves ``latest`` (atomically, last) and drops older tags."""
    _save_engine_and_rng(strategy, root, tag, client_state)
    if strategy.is_rank_0():
        atomic_write(root / f"manifest-{tag}.json", json.dumps(_tag_files(root, tag), sort_keys=True, indent=1))
        previous = read_latest(root)
        atomic_write(root / LATEST, tag)
        if previous and previous != tag:
            for sub in ("ds", "rng"):
                shutil.rmtree(root / sub / previous, ignore_errors=True)
            (root / f"manifest-{previous}.json").unlink(missing_ok=True)
    strategy.barrier()


def read_latest(root: Path) -> str | None:
    p = root / LATEST
    return p.read_text().strip() if p.is_file() else None


def load_state(strategy: DeepSpeedStrategy, root: Path) -> dict[str, Any] | None:
    """Restore the newest verified state under ``root``; None when the run never
    saved one. A manifest that does not match the files is an IntegrityError."""
    tag = read_latest(root)
    if tag is None:
        return None
    mpath = root / f"manifest-{tag}.json"
    if not mpath.is_file():
        raise IntegrityError(f"{root}: 'latest' names {tag} but its manifest is missing",
                             hint="the state directory was tampered with; rerun without --resume")
    expected = json.loads(mpath.read_text())
    actual = _tag_files(root, tag)
    bad = sorted(k for k in expected if actual.get(k) != expected[k]) + sorted(set(actual) - set(expected))
    if bad:
        raise IntegrityError(f"{root}: state {tag} does not match its manifest ({bad[:3]})",
                             hint="refusing to unpickle unverified files; rerun without --resume to start over")
    client_state = strategy.load(root / "ds", tag)
    rng_file = root / "rng" / tag / f"rank{strategy.rank}.pt"
    if not rng_file.is_file():
        raise NotFoundError(f"{rng_file} missing: the state was saved by a different number of processes",
                            hint="resume with the same --nproc")
    restore_rng(torch.load(rng_file, weights_only=False))
    return client_state


# -- the published checkpoint ---------------------------------------------------


PUBLISH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _convert(state: dict[str, torch.Tensor], fn) -> dict[str, torch.Tensor]:
    """``fn`` of every tensor, tensors that share memory (tied weights) converted once and still shared:
    a per-tensor ``.to(dtype)`` would give a tied ``lm_head.weight`` its own copy, which
    save_pretrained then writes beside the embeddings (+17% of a 135M model's bytes, and in every delta)."""
    done: dict[tuple, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        key = (v.device.type, v.data_ptr(), v.dtype, tuple(v.shape), v.stride()) if v.numel() else None
        if key is None or key not in done:
            conv = fn(v)
            if key is not None:
                done[key] = conv
        out[k] = conv if key is None else done[key]
    return out


def export_hf(lm: PreTrainedModel, parent_hf: Path, out: Path, state: dict[str, torch.Tensor] | None = None,
              dtype: str = "float32") -> None:
    """HF directory of the trained weights: tokenizer and other files copied
    from the parent policy, then config + safetensors from ``state`` (the
    consolidated state dict; ZeRO-3 keeps only partitions in ``lm``) or else
    from the model itself, in ``dtype`` (``publish_dtype``: what rollout engines
    load; the trainer's own weights are not changed)."""
    out.mkdir(parents=True, exist_ok=True)
    for p in sorted(parent_hf.iterdir()):
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.name not in (
                "config.json", "generation_config.json", "model.safetensors.index.json"):
            shutil.copy2(p, out / p.name)
    if state is None:
        state = _convert(lm.state_dict(), lambda v: v.detach().to("cpu", torch.float32).contiguous())
    to = PUBLISH_DTYPES[dtype]
    state = _convert(state, lambda v: v.detach().to(to).contiguous() if v.is_floating_point() and v.dtype != to else v)
    if getattr(lm.config, "tie_word_embeddings", False):    # a consolidated state may hold tied weights apart
        groups: dict[int, list[str]] = {}
        for n, t in lm.state_dict().items():
            if t.numel():
                groups.setdefault(t.data_ptr(), []).append(n)
        for first, *rest in (g for g in groups.values() if len(g) > 1):
            for n in rest:
                if first in state and n in state and state[n] is not state[first] and torch.equal(state[n], state[first]):
                    state[n] = state[first]      # one tensor: save_pretrained writes a tied weight once
    lm.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("dtype") != dtype:    # save_pretrained records the module's (training) dtype
        cfg["dtype"] = dtype
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_final(strategy: DeepSpeedStrategy, root: Path, *, client_state: dict[str, Any], train_config: dict[str, Any],
                lm: PreTrainedModel, parent_hf: Path, full: bool = True, pause_prefix: str = "",
                delta_base: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Every rank: DeepSpeed state + RNG (``full``; the resident trainer skips
    them between full checkpoints) and its share of the consolidated weights;
    rank 0: cursor, config, hf/ (in ``train_config["publish_dtype"]``), the
    weight delta against the parent's published weights (``delta_base``:
    {parent_id, parent_record, anchor_every}; pipeline.policy_store.delta), then
    ``latest`` last. Returns the version's weights record on rank 0 (None elsewhere
    or without ``delta_base``)."""
    from pipeline.lake.delta import pause_point

    record: dict[str, Any] | None = None
    if strategy.is_rank_0() and root.exists():
        shutil.rmtree(root)           # an unpublished leftover of a crashed publish
    strategy.barrier()
    if full:
        _save_engine_and_rng(strategy, root, FINAL_TAG, client_state)
    state = strategy.consolidated_state_dict(lm)      # collective under ZeRO-3; None off rank 0
    if strategy.is_rank_0():
        cursor = {k: v for k, v in client_state.items() if k != "metrics"}
        atomic_write(root / "cursor.json", json.dumps(cursor, sort_keys=True, indent=1, default=str))
        atomic_write(root / "train_config.json", json.dumps(train_config, sort_keys=True, indent=1, default=str))
        export_hf(lm, parent_hf, root / HF_SUBDIR, state, dtype=train_config.get("publish_dtype") or "float32")
        if delta_base is not None:
            record = _write_weights_record(root, parent_hf, delta_base)
            if delta_base.get("lake_uri"):      # delta-only layout: the full weights leave the version's directory
                from pipeline.policy_store.delta import keep_exported

                keep_exported(delta_base["lake_uri"], str(client_state["checkpoint_id"]), root, record,
                              parent_id=delta_base.get("parent_id"))
        pause_point(f"{pause_prefix}checkpoint:final:hf-written")   # kill tests: every file but `latest`, no row
        atomic_write(root / LATEST, FINAL_TAG)
    strategy.barrier()
    return record


def _write_weights_record(root: Path, parent_hf: Path, base: dict[str, Any]) -> dict[str, Any]:
    """Anchor or delta of the weights just exported to ``root/hf`` (read back: the
    record is of the bytes published) against the parent's published weights."""
    from pipeline.policy_store import delta as wd

    weights = wd.load_hf_weights(root / HF_SUBDIR)
    parent = wd.load_hf_weights(parent_hf) if base.get("parent_id") else None
    files = sorted(p.name for p in (root / HF_SUBDIR).glob("*.safetensors"))
    return wd.write_version_weights(root, weights, parent_id=base.get("parent_id"), parent_weights=parent,
                                    parent_record=base.get("parent_record"), anchor_every=int(base["anchor_every"]),
                                    weight_file=f"{HF_SUBDIR}/{files[0]}" if len(files) == 1 else f"{HF_SUBDIR}/")


def weight_hashes(files: dict[str, str]) -> dict[str, str]:
    """The weight files among a checkpoint's file hashes: hf/ weights (an anchor) or its
    delta (a delta-only version: ``delta/<sha256>.safetensors``)."""
    return {k: v for k, v in files.items() if (k.startswith(f"{HF_SUBDIR}/") and k.endswith(WEIGHT_SUFFIXES))
            or (k.startswith("delta/") and k.endswith(".safetensors"))}


# -- the resident trainer's full state ------------------------------------------
# A version the resident trainer published weights-only gets its DeepSpeed state
# (ds/final, rng/final) later only at shutdown; those files are not in its
# checkpoints row, so a manifest of their sha256, written atomically and last,
# is what makes them loadable (the same rule as a run's resumable state).
STATE_MANIFEST = "state-manifest.json"


def write_full_state(strategy: DeepSpeedStrategy, root: Path, client_state: dict[str, Any]) -> None:
    """Every rank: the DeepSpeed state + RNG of a published weights-only version
    into its directory; rank 0 writes ``state-manifest.json`` last."""
    from pipeline.lake.delta import pause_point

    if strategy.is_rank_0():
        (root / STATE_MANIFEST).unlink(missing_ok=True)
        for sub in ("ds", "rng"):
            shutil.rmtree(root / sub, ignore_errors=True)   # a leftover of a shutdown killed while writing
    strategy.barrier()
    _save_engine_and_rng(strategy, root, FINAL_TAG, client_state)
    if strategy.is_rank_0():
        pause_point("follow:shutdown-state")                # kill tests: state written, manifest not yet
        atomic_write(root / STATE_MANIFEST, json.dumps(_tag_files(root, FINAL_TAG), sort_keys=True, indent=1))
    strategy.barrier()


def has_full_state(root: Path, files: dict[str, str]) -> bool:
    """Whether the checkpoint at ``root`` holds a loadable DeepSpeed state: listed
    in its checkpoints row (``files``, verified by resolve_policy), or written at a
    resident trainer's shutdown and matching its state manifest (verified here)."""
    if (root / LATEST).is_file() and any(k.startswith(f"ds/{FINAL_TAG}/") for k in files):
        return (root / "ds" / FINAL_TAG).is_dir()
    manifest = root / STATE_MANIFEST
    if not manifest.is_file():
        return False
    expected = json.loads(manifest.read_text())
    return bool(expected) and _tag_files(root, FINAL_TAG) == expected
