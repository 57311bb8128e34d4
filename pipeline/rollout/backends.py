"""The generation backends by name: ``hf`` (transformers, pipeline/rollout/hf.py)
or ``vllm`` (the vLLM offline engine, pipeline/rollout/vllm_engine.py).

Apart from pipeline/rollout/engine.py, which holds the interface both
implement: the backends import the interface, and this factory imports the
backends, so no module imports one that imports it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal

from pipeline.rollout.engine import Engine


def make_engine(name: str, hf_dir: str | Path, *, threads: int | None = None, **kwargs) -> Engine:
    """``hf`` (transformers) or ``vllm`` (vLLM offline engine)."""
    if name == "hf":
        from pipeline.rollout.hf import HFEngine

        return HFEngine(Path(hf_dir), threads=threads, **kwargs)
    if name == "vllm":
        from pipeline.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(Path(hf_dir), threads=threads, **kwargs)
    from pipeline.errors import ConfigError

    raise ConfigError(f"unknown engine {name!r}", hint="use --engine hf or --engine vllm")


def switch_weights(engine: Engine, hf_dir: str | Path, *, mode: Literal["in_place", "rebuild"] = "in_place",
                   threads: int | None = None, deltas: list | None = None,
                   full_dir: Callable[[], str | Path] | None = None) -> tuple[Engine, dict]:
    """Serve the policy in ``hf_dir`` from now on: apply its sparse weight
    ``deltas`` to the weights the engine holds (``engine.apply_weight_deltas``,
    when given and the engine has it: mode ``delta``), else load its weights
    into the running engine (``engine.load_weights``, which returns False when
    the architecture differs) or, failing that or with ``mode="rebuild"``, close
    the engine and build a new one. Returns the engine and ``{mode, seconds}``.

    ``full_dir``: where the version's full weights are, asked only when the deltas
    do not apply (a following worker passes the version's own ``hf/`` as ``hf_dir``:
    config and tokenizer, no weights in the delta-only layout, so the rebuild of its
    full weights is paid only on the fallback)."""
    import time

    t0 = time.perf_counter()
    apply = getattr(engine, "apply_weight_deltas", None)
    if mode == "in_place" and deltas and apply is not None and apply(Path(hf_dir), deltas):
        return engine, {"mode": "delta", "deltas": len(deltas), "seconds": time.perf_counter() - t0}
    if full_dir is not None:
        hf_dir = full_dir()
    load = getattr(engine, "load_weights", None)
    if mode == "in_place" and load is not None and load(Path(hf_dir)):
        return engine, {"mode": "in_place", "seconds": time.perf_counter() - t0}
    name = engine.name
    engine.close()
    new = make_engine(name, hf_dir, threads=threads)
    return new, {"mode": "rebuild", "seconds": time.perf_counter() - t0}
