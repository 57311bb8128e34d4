"""The weight-delta format: pure tensor functions (no lake, no files).

A delta turns one version's published weights into the next one's, exactly.
``make_delta`` builds it, ``encode``/``decode`` turn it into the bytes of the
``delta/<sha256>.safetensors`` file and back, ``apply_delta`` (a new copy),
``apply_in_place`` (weights a reader holds) and ``changes`` (for an engine
that writes them itself) apply it. Per tensor whose bits changed: flat indices
(``<name>::idx``, ascending) and how the bit patterns moved (``<name>::dif``:
new minus old, as integers, in the narrowest signed type that holds them: under
AdamW most moves are a few units in the last place, one byte; where more than
half the elements moved, a move for every element and no indices; a few far
moves, such as a sign flip near zero, are stored apart as ``<name>::fix``
indices and ``<name>::fixbits`` new bit patterns, written after the moves); a
tensor whose shape or dtype changed is stored whole as ``<name>::full``. Every
part goes into one zstd frame (``encode``; indices as gaps in the narrowest
type, one byte where changes are dense: as small as a bit mask, and applied in
time proportional to the change), which is what makes a small move cost a few
bits. Deltas of the first format (``pipeline-weights-delta/1``: uncompressed;
``<name>::val``, the new bit patterns; dense changes as a packed bit mask
``<name>::mask``) are still read. The byte-level specification is in
docs/resident-trainer.md, "3. What a version writes" (*The delta file*).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct

import torch

from pipeline.errors import IntegrityError

FORMAT = "pipeline-weights-delta/2"
FORMAT_V1 = "pipeline-weights-delta/1"        # uncompressed, new bit patterns (``::val``): still read
ZSTD_LEVEL = 1      # 135M shape, bf16: level 1 is 5x faster than 9 and as small (benchmarks/bench_loop.py)
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
    inverts it); where more than half the elements moved, no indices and a ``::dif`` for
    every element (zeros included: applied in a pass over the tensor, no scatter, and
    about as small once compressed). Moves outside int8 (a bf16 sign flip near zero is a
    move of ~32768), when they are at most 1/16 of the moves, are set to 0 there and the
    new bit patterns of those elements are stored apart (``::fix``: flat indices,
    ascending; ``::fixbits``), written after the moves; more of them and ``::dif`` is
    wider instead. Nothing when no bit differs. Else the whole tensor.
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
        w = _wide(nb)
        itype = torch.int32 if nb.numel() < 2**31 else torch.int64
        dense = 2 * idx.numel() > nb.numel()     # most elements moved: a move for every element, no indices
        d = nb.to(w) - ob.to(w) if dense else nb[idx].to(w) - ob[idx].to(w)
        if not dense:
            out[f"{name}::idx"] = idx.to(itype)
        big = (d < -128) | (d > 127)
        n_big = int(big.sum())
        if n_big and 16 * n_big <= d.numel():   # a few far moves (a sign flip near zero): their new bits apart
            fix = torch.nonzero(big, as_tuple=True)[0] if dense else idx[big]
            out[f"{name}::fix"] = fix.to(itype)
            out[f"{name}::fixbits"] = nb[fix].clone()
            d = d.masked_fill(big, 0)
        out[f"{name}::dif"] = _narrow(d)
    return out, list(new)


def changed_elements(delta: dict[str, torch.Tensor]) -> int:
    """How many elements a delta changes (a dense ``::dif`` counts its non-zero moves and its fixes)."""
    n = 0
    for key, t in delta.items():
        name, part = key.rsplit("::", 1)
        if part in ("idx", "full") or part == "mask" and f"{name}::val" in delta:
            n += t.numel() if part != "mask" else delta[f"{name}::val"].numel()
        elif part == "dif" and f"{name}::idx" not in delta:
            n += int(t.count_nonzero()) + (delta[f"{name}::fix"].numel() if f"{name}::fix" in delta else 0)
    return n


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


EVERY = slice(None)     # a dense ``::dif``'s "where": every element, in order (``flat[EVERY]`` is ``flat``)


def write(flat: torch.Tensor, idx: torch.Tensor | slice, val: torch.Tensor) -> None:
    """Write ``val`` into the flat tensor ``flat`` where ``idx`` says: ``EVERY`` (a copy),
    a bool mask of ``flat``'s size (``masked_scatter_``) or flat int64 indices (``index_put_``)."""
    if isinstance(idx, slice):
        flat.copy_(val)
    elif idx.dtype == torch.bool:
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
        located = _locate(name, delta, b.numel())
        if located is None:
            out[name] = b
            continue
        where, val, dif = located
        t = b.detach().clone(memory_format=torch.contiguous_format)
        flat = bit_pattern(t)
        if val is not None and val.dtype != flat.dtype:
            raise IntegrityError(f"weight delta of {name} does not fit its base ({tuple(t.shape)}, {t.dtype})",
                                 hint="the delta does not belong to this base")
        write(flat, where, new_bits(flat[where], val, dif))
        fix = _fixes(name, delta, b.numel())
        if fix is not None:
            write(flat, *fix)
        out[name] = t
    return out


def _fixes(name: str, delta: dict[str, torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(indices, new bit patterns) of the elements whose move a delta stores apart, checked; None if none."""
    fix, bits = delta.get(f"{name}::fix"), delta.get(f"{name}::fixbits")
    if fix is None and bits is None:
        return None
    if fix is None or bits is None:
        raise IntegrityError(f"weight delta of {name} has fixed indices or values but not both")
    return _where(name, fix, bits, n, packed=False), bits


def changes(delta: dict[str, torch.Tensor], numel: dict[str, int]):
    """Per tensor a delta touches, in the order to write them: (name, where, new bit
    patterns, None, None), (name, where, None, moves, None) or (name, None, None, None,
    whole tensor); a tensor with far moves (``::fix``) gets its moves, then its fixed
    elements' new bit patterns. For a reader
    that writes them into weights it holds (``numel``: its tensors' sizes; ``where``: int64
    flat indices, ``EVERY`` for a dense ``::dif``, or a first format's bool mask of the
    tensor's size, all for ``write`` and for indexing the flat tensor; ``moves``:
    ``new_bits``'s ``dif``, applied to the bit patterns it holds at ``where``). A delta
    that does not fit is an IntegrityError."""
    for name in sorted({k.rsplit("::", 1)[0] for k in delta}):
        full = delta.get(f"{name}::full")
        if full is not None:
            yield name, None, None, None, full
            continue
        if name not in numel:
            raise IntegrityError(f"weight delta names {name}, which the served weights lack",
                                 hint="the delta does not belong to this base")
        located = _locate(name, delta, numel[name])
        if located is not None:
            yield name, *located, None
        fix = _fixes(name, delta, numel[name])
        if fix is not None:             # after the moves: the new bits of the far-moved elements
            yield name, fix[0], fix[1], None, None


def _locate(name: str, delta: dict[str, torch.Tensor], n: int):
    """(where, val, dif) of a tensor of ``n`` elements the delta changes (not stored whole),
    checked; None when the delta leaves it unchanged. ``where``: int64 indices, a bool mask
    (a first-format ``::mask``) or ``EVERY`` (a dense ``::dif``); one of ``val`` (first
    format: new bit patterns) and ``dif`` (moves) is set."""
    idx, val, dif = delta.get(f"{name}::idx"), delta.get(f"{name}::val"), delta.get(f"{name}::dif")
    mask = delta.get(f"{name}::mask")
    if val is not None:
        dif = None
    moves = val if val is not None else dif
    if idx is None and mask is None and moves is None:
        return None
    if idx is None and mask is None:
        if dif is None:
            raise IntegrityError(f"weight delta of {name} has values but no indices")
        if dif.dim() != 1 or dif.numel() != n:      # dense: a move for every element
            raise IntegrityError(f"weight delta of {name} does not fit its base ({n} elements)",
                                 hint="the delta does not belong to this base")
        return EVERY, None, dif
    if moves is None:
        raise IntegrityError(f"weight delta of {name} has indices or values but not both")
    if idx is not None:
        return _where(name, idx, moves, n, packed=False), val, dif
    assert mask is not None
    return _where(name, mask, moves, n, packed=True), val, dif


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
        if key.endswith(("::idx", "::fix")) and t.numel():   # ascending: numpy's diff is ~6x torch's here
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
        if key.endswith(("::idx", "::fix")):
            t = torch.cumsum(t, 0, dtype=torch.int64)       # the gaps summed: the indices, ascending
        out[key] = t
    return out
