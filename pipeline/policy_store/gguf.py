"""Bring your own model as a GGUF file: convert it to a safetensors Hugging Face
directory and import that (``pipeline policy import --gguf FILE``)."""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from pipeline.policy_store import check_model_dir, import_policy

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


@contextmanager
def _gguf_progress_bar_off() -> Iterator[None]:
    """transformers' GGUF reader draws its own ``tqdm.auto`` bar, which no transformers or hub switch
    turns off (it reached stderr under --json): its module's ``tqdm`` gets ``disable=True`` for the load."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def gguf_to_hf_dir(gguf_file: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write a GGUF model file as a safetensors Hugging Face directory (``out_dir``):
    transformers loads the file (``gguf_file=``, which needs the ``gguf`` and
    ``accelerate`` packages: the ``[gguf]`` extra) and dequantizes every tensor
    to ``dtype``; the GGUF-loaded model refuses ``save_pretrained`` (its config
    says "quantized with GGUF"), so the model is rebuilt from its config without
    the quantization entry and given the loaded state dict (every key must
    match), then saved with its tokenizer and chat template."""
    src = Path(gguf_file)
    from pipeline.errors import InputFileError, MissingExtraError

    if not src.is_file():
        raise InputFileError(f"{src}: no such GGUF file", hint="pass the path of a .gguf model file")
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError as exc:
            raise MissingExtraError(f"{module} (needed to read GGUF files: {exc})", "gguf") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        from pipeline.errors import ConfigError

        raise ConfigError(f"dtype {dtype!r}: use float32 or bfloat16 (the trainer's precisions)")
    try:
        with _gguf_progress_bar_off():
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            gmodel = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch_dtype)
    except Exception as exc:  # noqa: BLE001 - an unreadable / unsupported file is bad input
        raise InputFileError(f"{src}: transformers cannot load this GGUF file: {type(exc).__name__}: "
                             f"{str(exc)[:300]}", hint="transformers reads GGUF files of the architectures its "
                                                       "GGUF integration lists (llama, qwen2, mistral, ...)") from None
    config = gmodel.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    res = model.load_state_dict(gmodel.state_dict(), strict=False)
    missing = [k for k in res.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or res.unexpected_keys:
        raise InputFileError(f"{src}: the dequantized tensors do not fit {type(model).__name__}: missing "
                             f"{missing[:4]}, unexpected {list(res.unexpected_keys)[:4]}")
    model.tie_weights()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # how this process loaded the tokenizer (offline or not) is not part of it: the same GGUF file must give
    # the same files, hence the same import (transformers 5 writes these load kwargs into tokenizer_config.json)
    tc = out / "tokenizer_config.json"
    if tc.is_file():
        cfg = json.loads(tc.read_text())
        for k in _LOAD_KWARGS:
            cfg.pop(k, None)
        tc.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


_LOAD_KWARGS = ("local_files_only", "is_local", "cache_dir", "revision", "token", "trust_remote_code", "gguf_file",
                "_commit_hash", "subfolder")


@contextmanager
def converted_gguf(gguf_file: str | Path, *, dtype: str = "float32") -> Iterator[tuple[Path, dict[str, Any], dict]]:
    """(HF directory, ``check_model_dir`` result, source record) of a GGUF file,
    converted into a scratch directory that is removed on exit."""
    import tempfile

    src = Path(gguf_file)
    with tempfile.TemporaryDirectory(prefix="pipeline-gguf-") as tmp:
        out = gguf_to_hf_dir(src, Path(tmp) / "hf", dtype=dtype)
        checked = check_model_dir(out)
        h = hashlib.sha256()
        with open(src, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        yield out, checked, {"source": str(src.resolve()), "gguf_sha256": h.hexdigest(), "dtype": dtype}


def import_gguf(lake: Lake | str | os.PathLike[str], gguf_file: str | Path, *, dtype: str = "float32") -> dict[str, Any]:
    """``pipeline policy import --gguf FILE``: convert (``gguf_to_hf_dir``) into a
    scratch directory, then import that as ``--hf-dir`` does (same checks, same
    idempotence: the same GGUF file gives the same files, so the same version)."""
    with converted_gguf(gguf_file, dtype=dtype) as (out, checked, source):
        return import_policy(lake, out, checked=checked, source=source)
