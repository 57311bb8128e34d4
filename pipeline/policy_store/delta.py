"""Sparse weight deltas: a published version costs its change, not its size.

Every version a trainer publishes records how its weights are rebuilt, in its
``checkpoints`` row (``train_config_json["weights"]``):

- ``{"kind": "anchor", "file": "hf/model.safetensors", "sha256": D, "chain": 0}``: the full
  weights (every ``anchor_every``-th version of a line, the first version after an
  init/import, and any version whose delta would not be smaller than its weights);
- ``{"kind": "delta", "file": "delta/<sha256>.safetensors", "base": PARENT_ID, "sha256": D,
  "chain": k, "bytes": n, "full_bytes": m, "changed": c, "elements": e}``: the elements
  that differ from the parent's published weights, as flat indices (``<name>::idx``,
  ascending) and how their bit patterns moved (``<name>::dif``: new minus old, as
  integers, in the narrowest signed type that holds them: under AdamW most moves are a
  few units in the last place, one byte); a tensor whose shape or dtype changed is
  stored whole as ``<name>::full``. Every part is stored zstd-compressed (``encode``;
  indices as gaps in the narrowest type, one byte where changes are dense: as small as
  a bit mask, and applied in time proportional to the change), which is what makes a
  small move cost a few bits. The file is content-addressed (its name is its sha256)
  and listed in the row's ``file_sha256``. Deltas of the first format
  (``pipeline-weights-delta/1``: uncompressed; ``<name>::val``, the new bit patterns;
  dense changes as a packed bit mask ``<name>::mask``) are still read.

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
import math
import os
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.errors import IntegrityError, NotFoundError
from pipeline.resources import machine_cache

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake

FORMAT = "pipeline-weights-delta/2"
FORMAT_V1 = "pipeline-weights-delta/1"        # uncompressed, new bit patterns (``::val``): still read
ZSTD_LEVEL = 1      # 135M shape, bf16: level 1 is 5x faster than 9 and as small (benchmarks/bench_loop.py)
DELTA_DIR = "delta"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# -- pure tensor functions ---------------------------------------------------------------------------


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """The flat bit patterns of ``t`` as an integer tensor of the same element size."""
    return t.detach().contiguous().reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor (sorted by name): name, dtype, shape, raw bytes."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode() + b"\x00")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_delta(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(tensors, names): what turns ``base`` into ``new`` exactly. Per tensor of ``new``
    with the same shape and dtype in ``base``: the flat indices of the elements whose
    bits differ (``::idx``, ascending) and the difference
    of their bit patterns as integers, new minus old (``::dif``, narrowed: ``new_bits``
    inverts it); nothing when no bit differs. Else the whole tensor.
    ``names`` lists the tensors of ``new`` (a tensor of ``base`` not in it is dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in new.items():
        b = base.get(name)
        if b is None or b.shape != t.shape or b.dtype != t.dtype:
            out[f"{name}::full"] = t.detach().contiguous()
            continue
        nb, ob = bit_pattern(t), bit_pattern(b)
        changed = ob != nb
        idx = torch.nonzero(changed, as_tuple=True)[0]
        if idx.numel() == 0:
            continue
        out[f"{name}::idx"] = idx.to(torch.int32 if nb.numel() < 2**31 else torch.int64)
        w = _wide(nb)
        out[f"{name}::dif"] = _narrow(nb[idx].to(w) - ob[idx].to(w))
    return out, list(new)


def _wide(bits: torch.Tensor) -> torch.dtype:
    """An integer type that holds any difference of two bit patterns of ``bits``'s width."""
    return torch.int32 if bits.element_size() <= 2 else torch.int64


def _narrow(d: torch.Tensor, *, unsigned: bool = False) -> torch.Tensor:
    """Integers in the narrowest signed type that holds them all (``unsigned``: uint8 first)."""
    lo, hi = int(d.min()), int(d.max())
    for dt in ((torch.uint8,) if unsigned else ()) + (torch.int8, torch.int16, torch.int32):
        if torch.iinfo(dt).min <= lo and hi <= torch.iinfo(dt).max:
            return d.to(dt)
    return d


def new_bits(old: torch.Tensor, val: torch.Tensor | None, dif: torch.Tensor | None) -> torch.Tensor:
    """The new bit patterns of the changed elements: ``val`` (a first-format delta), or their
    old bit patterns ``old`` moved by ``dif``. A move out of the bit patterns' range is an IntegrityError."""
    if val is not None:
        return val
    assert dif is not None
    w = _wide(old)
    moved = old.to(w) + dif.to(w)
    info = torch.iinfo(old.dtype)
    if moved.numel() and (int(moved.min()) < info.min or int(moved.max()) > info.max):
        raise IntegrityError("weight delta moves a bit pattern out of its range", hint="the delta does not belong "
                                                                                        "to this base")
    return moved.to(old.dtype)


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The flat bool mask of the first ``n`` bits of a first-format ``::mask`` (8 to a byte, most
    significant first: numpy.packbits's order; a dense change written by ``masked_scatter_``)."""
    import numpy as np

    raw = packed.to(torch.uint8).reshape(-1).numpy()
    bits = np.unpackbits(raw)
    if bits.size < n or bits[n:].any():
        raise IntegrityError(f"weight delta mask of {raw.size} bytes does not fit its base ({n} elements)",
                             hint="the delta does not belong to this base")
    return torch.from_numpy(bits[:n].view(np.bool_))


def write(flat: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> None:
    """Write ``val`` into the flat tensor ``flat`` where ``idx`` says: a bool mask of
    ``flat``'s size (``masked_scatter_``) or flat int64 indices (``index_put_``)."""
    if idx.dtype == torch.bool:
        flat.masked_scatter_(idx, val)
    else:
        flat.index_put_((idx,), val)


def apply_delta(base: dict[str, torch.Tensor], delta: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """``make_delta``'s inverse: the new weights from ``base`` (not modified) and the delta.
    A delta that does not fit ``base`` (a tensor missing, an index out of range, a
    value of the wrong width) is an IntegrityError."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        full = delta.get(f"{name}::full")
        if full is not None:
            out[name] = full
            continue
        b = base.get(name)
        if b is None:
            raise IntegrityError(f"weight delta names {name}, which its base weights lack",
                                 hint="the delta does not belong to this base")
        idx, val, dif = delta.get(f"{name}::idx"), delta.get(f"{name}::val"), delta.get(f"{name}::dif")
        mask = delta.get(f"{name}::mask")
        if mask is not None and idx is None:
            idx = mask
        moves = val if val is not None else dif
        if idx is None and moves is None:
            out[name] = b
            continue
        if idx is None or moves is None:
            raise IntegrityError(f"weight delta of {name} has indices or values but not both")
        where = _where(name, idx, moves, b.numel(), packed=mask is not None and idx is mask)
        t = b.detach().clone(memory_format=torch.contiguous_format)
        flat = bit_pattern(t)
        if val is not None and val.dtype != flat.dtype:
            raise IntegrityError(f"weight delta of {name} does not fit its base ({tuple(t.shape)}, {t.dtype})",
                                 hint="the delta does not belong to this base")
        write(flat, where, new_bits(flat[where], val, dif))
        out[name] = t
    return out


def changes(delta: dict[str, torch.Tensor], numel: dict[str, int]):
    """Per tensor a delta touches: (name, where, new bit patterns, None, None), (name,
    where, None, moves, None) or (name, None, None, None, whole tensor), for a reader
    that writes them into weights it holds (``numel``: its tensors' sizes; ``where``: int64
    flat indices, or for a dense change a bool mask of the tensor's size, both for
    ``write``; ``moves``: ``new_bits``'s ``dif``, applied to the bit patterns it holds at
    ``where``). A delta that does not fit is an IntegrityError."""
    for name in sorted({k.rsplit("::", 1)[0] for k in delta}):
        full = delta.get(f"{name}::full")
        if full is not None:
            yield name, None, None, None, full
            continue
        if name not in numel:
            raise IntegrityError(f"weight delta names {name}, which the served weights lack",
                                 hint="the delta does not belong to this base")
        idx, val, mask = delta.get(f"{name}::idx"), delta.get(f"{name}::val"), delta.get(f"{name}::mask")
        dif = delta.get(f"{name}::dif")
        packed = idx is None and mask is not None
        if packed:
            idx = mask
        moves = val if val is not None else dif
        if idx is None or moves is None:
            raise IntegrityError(f"weight delta of {name} does not fit its base ({numel[name]} elements)",
                                 hint="the delta does not belong to this base")
        yield name, _where(name, idx, moves, numel[name], packed=packed), val, (dif if val is None else None), None


def _where(name: str, idx: torch.Tensor, val: torch.Tensor, n: int, *, packed: bool) -> torch.Tensor:
    """Where a tensor's delta writes, checked against a base of ``n`` elements: a bool mask
    (a packed ``::mask``, unpacked; as many bits set as values) or int64 indices in range."""
    if packed:
        mask = _unpack(idx, n)
        if val.dim() != 1 or int(mask.sum()) != val.numel():
            raise IntegrityError(f"weight delta of {name} does not fit its base ({n} elements)",
                                 hint="the delta does not belong to this base")
        return mask
    if idx.dim() != 1 or val.dim() != 1 or idx.numel() != val.numel() or (
            idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n)):
        raise IntegrityError(f"weight delta of {name} does not fit its base ({n} elements)",
                             hint="the delta does not belong to this base")
    return idx.long()


def apply_in_place(weights: dict[str, torch.Tensor], deltas: list[tuple[dict[str, torch.Tensor], list[str]]]) -> set[str]:
    """Write ``deltas`` (oldest first) into ``weights`` (contiguous tensors of the published
    dtype, modified in place: a reader's host copy of the weights it serves); the names of
    the tensors written. Every change is checked first: a delta that does not fit raises
    IntegrityError with ``weights`` untouched. A delta storing a tensor whole (``has_full``)
    is refused the same way: its reader loads the full weights instead."""
    numel = {k: v.numel() for k, v in weights.items()}
    todo = [c for delta, _ in deltas for c in changes(delta, numel)]
    for name, _idx, val, _dif, full in todo:
        if full is not None or (val is not None and val.dtype != bit_pattern(weights[name]).dtype):
            raise IntegrityError(f"weight delta of {name} does not fit the served {weights[name].dtype} tensor",
                                 hint="the delta does not belong to this base")
    for name, where, val, dif, _full in todo:
        t = weights[name]
        flat = t.view(-1).view(_INT_OF_SIZE[t.element_size()])
        write(flat, where, new_bits(flat[where], val, dif))
    return {c[0] for c in todo}


def has_full(deltas: list[tuple[dict[str, torch.Tensor], list[str]]]) -> bool:
    """Whether a delta stores a tensor whole (a new, reshaped or retyped tensor)."""
    return any(k.endswith("::full") for delta, _ in deltas for k in delta)


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def _codec():
    import pyarrow as pa

    return pa.Codec("zstd", compression_level=ZSTD_LEVEL)


def encode(delta: dict[str, torch.Tensor], names: list[str]) -> bytes:
    """The delta as safetensors bytes, the same bytes for the same delta: one uint8 tensor,
    ``zstd``, holding one zstd frame of every part's bytes concatenated (sorted by key,
    each padded with zeros to a multiple of 8 bytes; ``::idx`` as gaps: the first index,
    then each index minus the one before, in the narrowest type that holds them: as small
    as a bit mask of the tensor once compressed, and applied in time proportional to the
    change). The metadata holds ``format``, ``names`` (the tensors of the new weights),
    ``codec``, ``size`` (the uncompressed bytes) and ``parts`` (per part: dtype, shape,
    offset, bytes). One frame, not one per part: a 135M model's delta has ~420 parts,
    and decoding them one by one cost more than the bytes. safetensors writes the
    metadata keys in a per-process hash order, so the header is rewritten with sorted
    keys (a valid safetensors header: JSON, space-padded to 8)."""
    import numpy as np
    from safetensors.torch import save

    parts: dict[str, list] = {}
    chunks: list[bytes] = []
    off = 0
    for key in sorted(delta):
        t = delta[key].detach().contiguous()
        if key.endswith("::idx") and t.numel():       # ascending: numpy's diff is ~6x torch's here
            t = _narrow(torch.from_numpy(np.diff(t.numpy(), prepend=t.numpy().dtype.type(0))), unsigned=True)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        parts[key] = [str(t.dtype).removeprefix("torch."), list(t.shape), off, len(raw)]
        chunks += [raw, bytes(-len(raw) % 8)]
        off += len(raw) + (-len(raw) % 8)
    blob = _codec().compress(b"".join(chunks), asbytes=True)
    data = save({"zstd": torch.frombuffer(bytearray(blob), dtype=torch.uint8)},
                metadata={"format": FORMAT, "names": json.dumps(names), "codec": "zstd", "size": str(off),
                          "parts": json.dumps(parts, sort_keys=True)})
    (n,) = struct.unpack("<Q", data[:8])
    header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data[8 + n:]


def decode(data: bytes, *, what: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``encode``'s inverse; bytes that are not a delta of this format are an IntegrityError."""
    from safetensors.torch import load

    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
        if meta.get("format") not in (FORMAT, FORMAT_V1):
            raise ValueError(f"format {meta.get('format')!r}")
        names = [str(x) for x in json.loads(meta["names"])]
        if meta["format"] == FORMAT_V1:
            return load(data), names
        blobs = load(data)
        if set(blobs) != {"zstd"} or meta.get("codec") != "zstd":
            raise ValueError("not one zstd frame")
        return _inflate(blobs["zstd"], int(meta["size"]), json.loads(meta["parts"])), names
    except Exception as exc:  # noqa: BLE001 - any parse failure is damaged bytes
        raise IntegrityError(f"{what}: not a readable weight delta ({type(exc).__name__}: {str(exc)[:120]})",
                             hint="the file was modified after publication") from None


def _inflate(blob: torch.Tensor, size: int, parts: dict[str, list]) -> dict[str, torch.Tensor]:
    """``encode``'s parts back: the frame decompressed once, each part a view of its bytes
    as its recorded dtype and shape (``::idx``: the gaps summed to int64 indices)."""
    buf = torch.frombuffer(bytearray(_codec().decompress(blob.numpy(), decompressed_size=size, asbytes=True)),
                           dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    if buf.numel() != size:
        raise ValueError(f"{buf.numel()} bytes inflated, {size} recorded")
    out: dict[str, torch.Tensor] = {}
    for key, (dtype, shape, off, nbytes) in parts.items():
        dt = getattr(torch, dtype)
        if not isinstance(dt, torch.dtype) or math.prod(shape) * torch.empty(0, dtype=dt).element_size() != nbytes \
                or off % 8 or off < 0 or off + nbytes > size:
            raise ValueError(f"part {key}: {dtype} {shape} at {off} is not {nbytes} bytes of {size}")
        t = buf[off:off + nbytes].view(dt).reshape(shape)
        if key.endswith("::idx"):
            t = torch.cumsum(t, 0, dtype=torch.int64)       # the gaps summed: the indices, ascending
        out[key] = t
    return out


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
    changed = sum(v.numel() for k, v in delta.items() if k.endswith(("::dif", "::full")))
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
    return hf if st is not None and got == ((weights_record(row) or {}).get("sha256"), st) else None


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
        return hf
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
        if head == checkpoint_id and len(digest) == 16:
            shutil.rmtree(p, ignore_errors=True)
            _VERIFIED.pop(str(p / "hf"), None)
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
            return hf
    shutil.rmtree(entry, ignore_errors=True)          # a damaged or partial copy: rebuilt below
    weights, _ = reconstruct(lake, row["checkpoint_id"], cached=True, rows=rows)
    return _install(entry, published_hf, digest, weights=weights)
