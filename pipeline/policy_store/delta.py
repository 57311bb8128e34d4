"""Sparse weight deltas: a published version costs its change, not its size.

Every version a trainer publishes records how its weights are rebuilt, in its
``checkpoints`` row (``train_config_json["weights"]``):

- ``{"kind": "anchor", "file": "hf/model.safetensors", "sha256": D, "chain": 0}``: the full
  weights (every ``anchor_every``-th version of a line, the first version after an
  init/import, and any version whose delta would not be smaller than its weights);
- ``{"kind": "delta", "file": "delta/<sha256>.safetensors", "base": PARENT_ID, "sha256": D,
  "chain": k, "bytes": n, "full_bytes": m, "changed": c, "elements": e}``: what
  changed against the parent's published weights, in the format of
  ``pipeline.policy_store.delta_codec`` (whose public names this module re-exports).
  The file is content-addressed (its name is its sha256) and listed in the row's
  ``file_sha256``.

``D`` is ``weights_digest`` of the version's weights (names, dtypes, shapes, raw
bytes): any version rebuilt from its anchor and the deltas after it
(``reconstruct``) must hash to it, else IntegrityError; so does a missing delta or
one whose bytes are not the ones published. Rows without a record (init, import,
rows older than this record) are anchors of their own ``hf/`` weights.

Delta-only layout: a delta version's directory holds its delta and ``hf/``'s
config and tokenizer files, not its full weights (those are written only at
anchors). Readers (``resolve_policy``: engines, eval, the trainer's parent)
get a local HF directory with the weights rebuilt (``materialize``: anchor +
deltas, or the newest rebuilt ancestor on this machine + the deltas after it,
every step checked against its digest), kept in a machine-local cache
(``weights_cache``); the writer seeds that cache with the weights it exported
(docs/resident-trainer.md, section 3).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.errors import ConfigError, IntegrityError, NotFoundError
from pipeline.policy_store.delta_codec import (  # noqa: F401 - re-exported: the public names of the format
    EVERY,
    FORMAT,
    FORMAT_V1,
    ZSTD_LEVEL,
    apply_delta,
    apply_in_place,
    bit_pattern,
    changed_elements,
    changes,
    decode,
    encode,
    has_full,
    make_delta,
    nbytes,
    new_bits,
    weights_digest,
    write,
)
from pipeline.resources import machine_cache

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake

DELTA_DIR = "delta"

# -- versions on the lake ----------------------------------------------------------------------------


def load_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of an HF directory."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for p in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(p)))
    if not out:
        raise NotFoundError(f"{hf_dir}: no *.safetensors weights")
    return out


def weights_record(row_or_cfg: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``weights`` record of a checkpoints row (or of its parsed train config); None when it has none."""
    if not row_or_cfg:
        return None
    cfg = row_or_cfg
    if "train_config_json" in row_or_cfg:
        try:
            cfg = json.loads(row_or_cfg.get("train_config_json") or "{}")
        except ValueError:
            return None
    rec = cfg.get("weights")
    return rec if isinstance(rec, dict) else None


def write_version_weights(root: Path, weights: dict[str, torch.Tensor], *, parent_id: str | None,
                          parent_weights: dict[str, torch.Tensor] | None, parent_record: dict[str, Any] | None,
                          anchor_every: int, weight_file: str = "hf/model.safetensors") -> dict[str, Any]:
    """Decide anchor or delta for the version whose published ``weights`` are in
    ``root`` (its checkpoint directory); a delta is written to ``root/delta/<sha>.safetensors``.
    Returns the record for its row."""
    digest = weights_digest(weights)
    full = nbytes(weights)
    chain = int((parent_record or {}).get("chain", 0)) + 1
    anchor = {"kind": "anchor", "file": weight_file, "sha256": digest, "chain": 0, "full_bytes": full}
    if parent_id is None or parent_weights is None or chain >= anchor_every:
        return anchor
    delta, names = make_delta(parent_weights, weights)
    if delta and all(k.endswith("::full") for k in delta):
        return anchor | {"why": "every tensor new, reshaped or retyped"}      # e.g. bf16 after an fp32 parent
    data = encode(delta, names)
    if len(data) >= full:
        return anchor | {"why": "delta not smaller"}
    sha = hashlib.sha256(data).hexdigest()
    rel = f"{DELTA_DIR}/{sha}.safetensors"
    (root / DELTA_DIR).mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)
    changed = changed_elements(delta)
    return {"kind": "delta", "file": rel, "base": parent_id, "sha256": digest, "chain": chain, "bytes": len(data),
            "full_bytes": full, "changed": int(changed), "elements": int(sum(t.numel() for t in weights.values()))}


def _read_file(lake: Lake, row: dict[str, Any], name: str) -> bytes:
    """One file of a published row, checked against the row's sha256 (and, for a delta, its name)."""
    from pipeline.policy_store import row_rel

    files = dict(row["file_sha256"])
    what = f"policy version {row['policy_version']} ({row['checkpoint_id']}): {name}"
    want = files.get(name)
    if want is None:
        raise IntegrityError(f"{what} is not among the files its row published", hint="the row is damaged")
    fs, root = lake.filesystem()
    try:
        with fs.open_input_stream(f"{root}/{row_rel(row)}/{name}") as f:
            data = f.read()
    except (FileNotFoundError, OSError):
        raise IntegrityError(f"{what} is missing: the version cannot be rebuilt",
                             hint="restore the file from a copy; nothing was loaded") from None
    got = hashlib.sha256(data).hexdigest()
    if got != want or (name.startswith(f"{DELTA_DIR}/") and name != f"{DELTA_DIR}/{got}.safetensors"):
        raise IntegrityError(f"{what}: sha256 mismatch", hint="the file was modified after publication; "
                                                               "refusing to rebuild weights from it")
    return data


def _anchor_weights(lake: Lake, row: dict[str, Any]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    names = sorted(k for k, _ in row["file_sha256"] if k.startswith("hf/") and k.endswith(".safetensors"))
    if not names:
        raise IntegrityError(f"policy version {row['policy_version']} ({row['checkpoint_id']}): no hf/*.safetensors "
                             "weights in its row", hint="it cannot serve as an anchor")
    out: dict[str, torch.Tensor] = {}
    for n in names:
        out.update(load(_read_file(lake, row, n)))
    return out


def chain_of(rows: list[dict[str, Any]], checkpoint_id: str) -> list[dict[str, Any]]:
    """The rows a version's weights are rebuilt from, anchor first, the version last."""
    by_id = {r["checkpoint_id"]: r for r in rows}
    out: list[dict[str, Any]] = []
    cid: str | None = checkpoint_id
    while cid is not None:
        row = by_id.get(cid)
        if row is None:
            raise IntegrityError(f"checkpoint {checkpoint_id}: its weight chain names {cid}, which is not published",
                                 hint="the delta's base was never published or its row is gone")
        out.append(row)
        rec = weights_record(row)
        if rec is None or rec.get("kind") != "delta":
            break
        cid = rec.get("base")
        if len(out) > len(rows):
            raise IntegrityError(f"checkpoint {checkpoint_id}: its weight chain is a cycle")
    return out[::-1]


def reconstruct(lake: Lake, checkpoint_id: str, *, cached: bool = False,
                rows: list[dict[str, Any]] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights, row) of a published version rebuilt from its anchor and the deltas
    after it, each step checked against the digest its row recorded. ``cached``:
    start from the newest ancestor on the chain rebuilt on this machine
    (``materialize``; its digest checked like the anchor's) instead of the anchor."""
    from pipeline.policy_store import checkpoint_rows

    chain = chain_of(rows if rows is not None else checkpoint_rows(lake), checkpoint_id)
    start = None
    if cached:
        start = next((j for j in range(len(chain) - 2, 0, -1) if _cached_hf(lake, chain[j]) is not None), None)
        if start is not None:
            chain = chain[start:]
    weights: dict[str, torch.Tensor] = {}
    for i, row in enumerate(chain):
        rec = weights_record(row) or {}
        what = f"policy version {row['policy_version']} ({row['checkpoint_id']})"
        if i == 0 and start is not None:
            try:
                weights = load_hf_weights(_cache_entry(lake, row) / "hf")
            except (OSError, NotFoundError):
                weights = {}
            if weights_digest(weights) != rec.get("sha256"):        # a damaged local copy: from the anchor
                return reconstruct(lake, checkpoint_id, rows=rows)
            continue
        if i == 0:
            weights = _anchor_weights(lake, row)
        else:
            delta, names = decode(_read_file(lake, row, rec["file"]), what=f"{what}: {rec['file']}")
            weights = apply_delta(weights, delta, names)
        want = rec.get("sha256")
        if want is not None and weights_digest(weights) != want:
            raise IntegrityError(f"{what}: rebuilt weights do not hash to the recorded {want[:12]}",
                                 hint="a delta or anchor of its chain is damaged; refusing to use the weights")
    return weights, chain[-1]


def export_version(lake: Lake, spec: str | int, out: Path) -> dict[str, Any]:
    """Plain HF weights of a published version (``policy export``): its weights rebuilt
    by ``reconstruct`` (checked against the recorded digest) as ``out/model.safetensors``,
    with its config and tokenizer files. Refuses a non-empty ``out``; writes into a
    temporary sibling and renames it, so a failure leaves no half-written directory."""
    import shutil

    from safetensors.torch import save_file

    from pipeline.errors import ConflictError
    from pipeline.policy_store import HF_SUBDIR, checkpoint_rows, fetch_checkpoint, resolve_policy, row_rel, verify_dir

    ref = resolve_policy(lake, spec, verify=False)
    weights, row = reconstruct(lake, ref.checkpoint_id)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConflictError(f"{out} exists and is not empty", hint="pass a new or empty directory to --out")
    keep = {k: v for k, v in row["file_sha256"] if k.startswith(f"{HF_SUBDIR}/") and "/" not in k[len(HF_SUBDIR) + 1:]
            and not k.endswith((".safetensors", ".bin")) and k != f"{HF_SUBDIR}/model.safetensors.index.json"}
    local = fetch_checkpoint(lake, row["checkpoint_id"], keep, rel=row_rel(row))
    verify_dir(local, keep, what=f"checkpoint {row['checkpoint_id']}")
    tmp = out.with_name(f".{out.name}.tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for k in keep:
        shutil.copy2(local / k, tmp / k[len(HF_SUBDIR) + 1:])
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    rec = weights_record(row) or {}
    return {"policy_version": int(row["policy_version"]), "checkpoint_id": row["checkpoint_id"], "out": str(out),
            "weights_sha256": weights_digest(weights), "recorded_sha256": rec.get("sha256"),
            "rebuilt_from": [r["checkpoint_id"] for r in chain_of(checkpoint_rows(lake), row["checkpoint_id"])]}


def delta_path(lake: Lake, from_id: str | None, to_id: str) -> list[tuple[dict[str, torch.Tensor], list[str]]] | None:
    """The deltas (decoded, each file checked against its row) that take the weights of
    published version ``from_id`` to ``to_id``, oldest first; None when ``from_id`` is not
    on ``to_id``'s chain after its anchor (a reader that far behind loads the full weights)."""
    from pipeline.policy_store import checkpoint_rows

    if from_id is None or from_id == to_id:
        return None
    try:
        chain = chain_of(checkpoint_rows(lake), to_id)
    except IntegrityError:
        return None
    ids = [r["checkpoint_id"] for r in chain]
    if from_id not in ids:
        return None
    out = []
    for row in chain[ids.index(from_id) + 1:]:
        rec = weights_record(row) or {}
        what = f"policy version {row['policy_version']} ({row['checkpoint_id']}): {rec.get('file')}"
        out.append(decode(_read_file(lake, row, rec["file"]), what=what))
    return out


# -- the delta-only layout: rebuilt weights in a machine-local cache -------------------------------


def delta_only(row: dict[str, Any]) -> bool:
    """Whether a published row holds a delta and no full weights (readers rebuild them)."""
    rec = weights_record(row)
    return bool(rec and rec.get("kind") == "delta") and not any(
        k.startswith("hf/") and k.endswith((".safetensors", ".bin")) for k, _ in row["file_sha256"])


def weights_cache(lake_uri: str) -> Path:
    """This machine's directory of rebuilt weights of the lake ``lake_uri``
    (``$PIPELINE_CACHE/weights/<lake hash>``; every entry is checked against its row's
    digest before use, so deleting it, whole or in part, only costs a rebuild)."""
    return machine_cache("weights", lake_uri)


def _entry(lake_uri: str, checkpoint_id: str, digest: str) -> Path:
    return weights_cache(lake_uri) / f"{checkpoint_id}-{digest[:16]}"


def rebuilt_hf(lake_uri: str, checkpoint_id: str, record: dict[str, Any]) -> Path:
    """Where this machine keeps the rebuilt ``hf/`` of a delta version (``keep_exported``, ``materialize``)."""
    return _entry(lake_uri, checkpoint_id, str(record.get("sha256"))) / "hf"


def _cache_entry(lake: Lake, row: dict[str, Any]) -> Path:
    return _entry(lake.uri, row["checkpoint_id"], (weights_record(row) or {}).get("sha256") or "none")


_VERIFIED: dict[str, tuple[str, tuple[int, int]]] = {}   # cache entry -> (digest, weight file stats) checked here


def _stat(p: Path) -> tuple[int, int] | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _cached_hf(lake: Lake, row: dict[str, Any]) -> Path | None:
    """The cached rebuilt ``hf/`` of a delta-only row when this process wrote or checked it (files unchanged since)."""
    if not delta_only(row):
        return None
    hf = _cache_entry(lake, row) / "hf"
    st = _stat(hf / "model.safetensors")
    got = _VERIFIED.get(str(hf))
    if st is not None and got == ((weights_record(row) or {}).get("sha256"), st):
        _used(hf.parent)
        return hf
    return None


CACHE_KEEP_ENV = "PIPELINE_WEIGHTS_CACHE_KEEP"
CACHE_KEEP = 3              # rebuilt copies kept per lake on a machine (most recently used first)
CACHE_GRACE_S = 600.0       # a copy used this recently is never removed (a reader between resolve and load)


def _used(entry: Path) -> None:
    """Mark a cache entry used now (its directory's mtime: what ``prune_cache`` orders by)."""
    try:
        os.utime(entry)
    except OSError:
        pass


def cache_keep() -> int:
    """How many rebuilt copies a machine keeps per lake (``$PIPELINE_WEIGHTS_CACHE_KEEP``, default 3)."""
    raw = os.environ.get(CACHE_KEEP_ENV)
    try:
        keep = CACHE_KEEP if raw is None else int(raw)
    except ValueError:
        raise ConfigError(f"{CACHE_KEEP_ENV}={raw!r} is not a whole number",
                          hint=f"set it to how many rebuilt weight copies to keep per lake (default {CACHE_KEEP})") from None
    if keep < 1:
        raise ConfigError(f"{CACHE_KEEP_ENV}={keep}: at least 1 copy is kept", hint=f"default {CACHE_KEEP}")
    return keep


def prune_cache(lake_uri: str, *, keep: int | None = None, grace_s: float | None = None,
                now: float | None = None) -> list[str]:
    """Bound this machine's cache of a lake's rebuilt weights: remove the least recently
    used copies beyond ``keep`` (``cache_keep()``), never one used in the last ``grace_s``
    seconds, and temporary directories a crashed rebuild left (its process gone);
    the names removed. Every copy can be rebuilt from the lake, a process serving from a
    removed copy keeps its weights, and a trainer whose parent's copy was removed rebuilds
    it when it publishes (``ensure_rebuilt``)."""
    keep = cache_keep() if keep is None else keep
    grace_s = CACHE_GRACE_S if grace_s is None else grace_s
    cache = weights_cache(lake_uri)
    now = time.time() if now is None else now
    entries: list[tuple[float, Path]] = []
    try:
        listed = list(cache.iterdir())
    except OSError:
        return []
    for p in listed:
        try:
            mtime = p.stat().st_mtime
        except OSError:
            continue
        if p.name.startswith("."):
            if now - mtime > grace_s and _writer_gone(p.name):
                shutil.rmtree(p, ignore_errors=True)
            continue
        entries.append((mtime, p))
    removed = []
    for mtime, p in sorted(entries, reverse=True)[keep:]:
        if now - mtime > grace_s and _remove_entry(p):
            removed.append(p.name)
    return removed


def _remove_entry(entry: Path) -> bool:
    """Remove a cache entry whole or not at all, as readers see it: renamed away first (one
    atomic step: a reader finds the copy complete or finds none), then deleted; a kill -9
    while deleting leaves a temporary name ``prune_cache`` removes later. False if already gone."""
    _VERIFIED.pop(str(entry / "hf"), None)
    gone = entry.with_name(f".{entry.name}.gone.tmp{os.getpid()}")
    try:
        entry.rename(gone)
    except OSError:
        return False
    shutil.rmtree(gone, ignore_errors=True)
    return True


def _writer_gone(name: str) -> bool:
    """Whether the process that named a temporary cache directory ``.<entry>.tmp<pid>``
    (``_install``) is gone: a rebuild still running (longer than the grace period: a large
    model) is never removed under its writer. The cache is this machine's, so is the pid."""
    _, sep, pid = name.rpartition(".tmp")
    if not sep or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:          # alive, another user's
        return False
    return False


def ensure_rebuilt(lake: Lake, ref: Any) -> Path:
    """``ref.hf_dir``, rebuilt again (``resolve_policy``) if this machine's cache removed it
    since ``ref`` was resolved: a long-held path (a trainer's parent) survives ``prune_cache``."""
    hf = Path(ref.hf_dir)
    if ref.policy_version < 0:
        return hf
    if (hf / "config.json").is_file():     # copies are installed and removed by one rename: present is whole
        if hf.parent.parent == weights_cache(lake.uri):     # a rebuilt copy: used now (prune_cache spares it)
            _used(hf.parent)
        return hf
    from pipeline.policy_store import resolve_policy

    return resolve_policy(lake, ref.checkpoint_id).hf_dir


def _install(entry: Path, published_hf: Path, digest: str, weights: dict[str, torch.Tensor] | None = None,
             weight_files: list[Path] | None = None) -> Path:
    """Write ``entry/hf``: the published hf/ files but the weights (config, tokenizer), and the
    weights (``weights`` saved, or ``weight_files`` moved); atomically (a temporary sibling renamed)."""
    from safetensors.torch import save_file

    tmp = entry.with_name(f".{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "hf").mkdir(parents=True)
    for p in sorted(published_hf.iterdir()):
        if p.is_file() and not p.name.endswith((".safetensors", ".bin")) and p.name != "model.safetensors.index.json":
            shutil.copy2(p, tmp / "hf" / p.name)
    if weights is not None:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "hf" / "model.safetensors"),
                  metadata={"format": "pt"})
    for f in weight_files or []:
        shutil.move(str(f), str(tmp / "hf" / f.name))
    hf = entry / "hf"
    try:
        tmp.rename(entry)
    except OSError:       # another process installed it first (its own rebuild, checked): never replaced under a reader
        shutil.rmtree(tmp, ignore_errors=True)
        _used(entry)
        return hf
    _used(entry)
    st = _stat(hf / "model.safetensors")
    if st is not None:
        _VERIFIED[str(hf)] = (digest, st)
    return hf


def keep_exported(lake_uri: str, checkpoint_id: str, root: Path, record: dict[str, Any], *,
                  parent_id: str | None = None) -> Path | None:
    """The writer's side of the delta-only layout: a version whose record is a delta keeps
    only its delta in ``root``; its exported full weights (``root/hf/*.safetensors``) move to
    this machine's cache as its rebuilt weights (the next version's parent, a local reader).
    The parent's rebuilt copy (``parent_id``), which the writer needed only as this
    version's base, is dropped (``drop_cached``): a writer leaves one copy per line, not
    one per version (269 MB a version at 135M bf16). Returns the cached ``hf/`` (None for
    an anchor: its weights stay)."""
    hf = None
    if record.get("kind") == "delta":
        src = root / "hf"
        files = sorted(p for p in src.iterdir() if p.name.endswith((".safetensors", ".bin"))
                       or p.name == "model.safetensors.index.json")
        hf = _install(_entry(lake_uri, checkpoint_id, record["sha256"]), src, record["sha256"], weight_files=files)
    if parent_id and parent_id != checkpoint_id:
        drop_cached(lake_uri, parent_id)
    prune_cache(lake_uri)
    return hf


def drop_cached(lake_uri: str, checkpoint_id: str) -> int:
    """Remove this machine's rebuilt copies of a version (it is rebuilt from its anchor if
    read again); how many were removed. A process serving from a removed copy keeps its
    mapped weights (POSIX keeps an open file's data until it is closed); an engine reads
    only its kept config afterwards, and a later reader rebuilds."""
    cache = weights_cache(lake_uri)
    if not cache.is_dir():
        return 0
    n = 0
    for p in cache.iterdir():
        head, _, digest = p.name.rpartition("-")
        if head == checkpoint_id and len(digest) == 16 and _remove_entry(p):
            n += 1
    return n


def _meta_ok(hf: Path, row: dict[str, Any]) -> bool:
    """Whether a cached copy's config and tokenizer files are the row's ``hf/`` files."""
    want = {k[3:]: v for k, v in row["file_sha256"] if k.startswith("hf/") and "/" not in k[3:]}
    return all((hf / n).is_file() and hashlib.sha256((hf / n).read_bytes()).hexdigest() == v for n, v in want.items())


def materialize(lake: Lake, row: dict[str, Any], published_hf: Path, rows: list[dict[str, Any]] | None = None) -> Path:
    """A local HF directory with a delta-only version's full weights: the cached copy
    when it hashes to the recorded digest, else rebuilt (``reconstruct`` from the
    newest cached ancestor or the anchor) and cached. ``published_hf``: the version's
    own (verified) hf/ directory, whose config and tokenizer files the copy gets."""
    hit = _cached_hf(lake, row)
    if hit is not None:
        return hit
    digest = str((weights_record(row) or {}).get("sha256"))
    entry = _cache_entry(lake, row)
    hf = entry / "hf"
    st = _stat(hf / "model.safetensors")
    if st is not None:                 # written by another process: trusted only once it hashes to the row
        try:
            ok = _meta_ok(hf, row) and weights_digest(load_hf_weights(hf)) == digest
        except Exception:  # noqa: BLE001 - an unreadable copy is rebuilt
            ok = False
        if ok:
            _VERIFIED[str(hf)] = (digest, st)
            _used(entry)
            return hf
    _remove_entry(entry)                              # a damaged or partial copy: rebuilt below
    weights, _ = reconstruct(lake, row["checkpoint_id"], cached=True, rows=rows)
    hf = _install(entry, published_hf, digest, weights=weights)
    prune_cache(lake.uri)
    return hf
