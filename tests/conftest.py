"""Shared fixtures. Tests run offline on CPU, on real Delta tables under tmp_path."""

from __future__ import annotations

import os

# Tiny models on a busy 2-core box run fastest single-threaded (shared/VERIFIED.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/pipeline/torch_extensions"))

import pytest  # noqa: E402


@pytest.fixture
def lake(tmp_path):
    """An empty local lake under a temp dir."""
    from pipeline.lake.delta import Lake

    return Lake(tmp_path / "lake")


@pytest.fixture
def make_traj():
    """Factory for synthetic trajectories in the ingest contract (pipeline.synth)."""
    from pipeline.synth import make_trajectories

    return make_trajectories
