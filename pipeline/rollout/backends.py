"""The generation backends by name: ``hf`` (transformers, pipeline/rollout/hf.py)
or ``vllm`` (the vLLM offline engine, pipeline/rollout/vllm_engine.py).

Apart from pipeline/rollout/engine.py, which holds the interface both
implement: the backends import the interface, and this factory imports the
backends, so no module imports one that imports it back.
"""

from __future__ import annotations

from pathlib import Path

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
