"""The trainer: ``pipeline train --batch-snapshot ID``.

Pure tensor cores (``losses``, ``logprobs``, ``packing``) and thin wrappers:
``data`` (snapshot -> sequences + pre-training assertions), ``ds_adapter`` (the
only module importing DeepSpeed), ``checkpoint`` (resumable state, HF export,
publication), ``run`` (the driver loop: ``train_snapshot``). torch is imported
inside these modules only, never at ``import pipeline``.
"""
