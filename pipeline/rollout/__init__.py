"""Rollout workers: verifiable environments, policy engines (transformers, vLLM),
the harness state machine and the writer that lands trajectories and events.

Light at import: torch/transformers live in ``hf.py``, vLLM in ``vllm_engine.py``.
``RolloutConfig`` (config.py, light) is importable from here.
"""

from pipeline.rollout.config import RolloutConfig

__all__ = ["RolloutConfig"]
