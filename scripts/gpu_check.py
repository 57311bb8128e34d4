"""GPU readiness check (run by scripts/gpu-check.sh on a CUDA machine).

Builds a model of a real architecture from a config with random weights
(default: the Qwen2.5-0.5B shape, ``qwen2``; ``--arch llama`` for a Llama
shape), then

1. generates with this project's vLLM engine (``pipeline.rollout.vllm_engine``,
   bf16, on the GPU): prints generated tokens/s;
2. trains with this project's DeepSpeed strategy (``pipeline.train.ds_adapter``,
   bf16, ZeRO-2): prints the optimizer step time and trained tokens/s;
3. runs the resident trainer (``pipeline.train.follow``, bf16) over K
   synthetic snapshots on a temporary lake, the model imported as policy
   version 0: per-version wall time, its training steps, bytes written, the
   start-up paid once; then the chain of ``train_snapshot`` calls over the same
   snapshots on a second lake, and whether both published the same weight
   bytes (on a GPU that needs deterministic kernels: reported, not asserted).
   Rollout engines still rebuild per version here (the in-place switch of the
   streaming-rollout issue is not part of this check yet).

    python scripts/gpu_check.py                    # both, default sizes
    python scripts/gpu_check.py --arch llama --json out.json
    python scripts/gpu_check.py --skip-vllm --skip-deepspeed --loop-versions 4   # the resident loop only

The tokenizer is the project's char tokenizer (saved next to the weights so
vLLM can load the directory); the model's vocabulary is larger, as real
models' padded vocabularies are, and generation never detokenizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARCHS: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's shape (494M parameters)
    "qwen2": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1000000.0),
    # a small Llama-3 shape (~0.5B)
    "llama": dict(model_type="llama", vocab_size=128256, hidden_size=1024, intermediate_size=4096,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=500000.0),
}


def build_model_dir(out: Path, arch: str = "qwen2", *, seed: int = 0, **overrides: Any) -> Path:
    """A HF directory (config, bf16 random weights, the char tokenizer) for ``arch``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.rollout.hf import build_tokenizer

    spec = dict(ARCHS[arch]) | overrides
    cfg = AutoConfig.for_model(**spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def check_vllm(model_dir: Path, *, requests: int = 256, prompt_len: int = 128, new_tokens: int = 256,
               gpu_memory_utilization: float = 0.5) -> dict[str, Any]:
    """Generated tokens/s of the project's vLLM engine (bf16) on the GPU."""
    import random

    from pipeline.rollout.engine import Request, Sampling
    from pipeline.rollout.vllm_engine import VLLMEngine

    t0 = time.perf_counter()
    eng = VLLMEngine(model_dir, max_model_len=prompt_len + new_tokens + 8,
                     gpu_memory_utilization=gpu_memory_utilization, dtype="bfloat16")
    startup = time.perf_counter() - t0
    rng = random.Random(0)
    reqs = [Request(tuple(rng.randrange(10, 40) for _ in range(prompt_len)), 1, i) for i in range(requests)]
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, stop_ids=())
    try:
        t1 = time.perf_counter()
        outs = eng.generate(reqs, sampling)
        secs = time.perf_counter() - t1
    finally:
        eng.close()
    generated = sum(len(c.token_ids) for o in outs for c in o)
    return {"engine": "vllm", "dtype": "bfloat16", "requests": requests, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "generated_tokens": generated, "seconds": round(secs, 3),
            "tokens_per_s": round(generated / secs, 1), "startup_s": round(startup, 1)}


def check_deepspeed(model_dir: Path, *, batch: int = 8, seq_len: int = 1024, steps: int = 10,
                    zero_stage: int = 2) -> dict[str, Any]:
    """Optimizer step time of the project's DeepSpeed strategy, bf16 + ZeRO-2, on the GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.train.ds_adapter import DeepSpeedStrategy

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    strat = DeepSpeedStrategy(model, lr=1e-5, weight_decay=0.0, warmup_steps=0, zero_stage=zero_stage,
                              precision="bf16", offload=False, max_grad_norm=1.0)
    dev = strat.device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    times, losses = [], []
    strat.train()
    for step in range(steps + 2):                       # 2 warm-up steps, not timed
        ids = torch.randint(0, vocab, (batch, seq_len), generator=g).to(dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = strat.forward(input_ids=ids, labels=ids)
        strat.backward(out.loss)
        strat.optimizer_step()
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - t0)
            losses.append(float(out.loss.detach()))
    step_s = sorted(times)[len(times) // 2]
    return {"trainer": "deepspeed", "precision": "bf16", "zero_stage": zero_stage, "batch": batch,
            "seq_len": seq_len, "steps": steps, "median_step_s": round(step_s, 4),
            "tokens_per_s": round(batch * seq_len / step_s, 1), "loss_first": losses[0], "loss_last": losses[-1],
            "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def check_resident_loop(model_dir: Path, *, versions: int = 4, rows: int = 64, zero_stage: int = 0) -> dict[str, Any]:
    """The resident trainer on the GPU (bf16): K versions, per-version split, bytes, follow == chain."""
    import shutil
    import tempfile

    from pipeline.lake.delta import Lake
    from pipeline.policy_store import import_policy, local_checkpoint_dir
    from pipeline.testing.train_fixtures import publish_payload_snapshot, synthetic_payload
    from pipeline.train.config import TrainConfig
    from pipeline.train.follow import follow
    from pipeline.train.run import train_snapshot

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    cfg = TrainConfig(precision="bf16", zero_stage=zero_stage, lr=1e-5, max_train_lag=None, micro_batch_tokens=8192)
    with tempfile.TemporaryDirectory(prefix="gpu-loop-") as tmp:
        a = Lake(Path(tmp) / "follow")
        import_policy(a, model_dir)
        sids = [publish_payload_snapshot(a, synthetic_payload(rows, seed=100 + k, vocab_size=vocab, median_len=256,
                                                              prompt_len=64, max_len=1024)) for k in range(versions)]
        shutil.copytree(Path(tmp) / "follow", Path(tmp) / "chain")
        b = Lake(Path(tmp) / "chain")
        t0 = time.perf_counter()
        res = follow(a, cfg, stop_after=versions, progress=False)
        follow_s = time.perf_counter() - t0
        per = []
        for v in res.versions:
            m = [r for r in a.read("metrics").to_pylist() if r["checkpoint_id"] == v["checkpoint_id"]]
            root = local_checkpoint_dir(a, v["checkpoint_id"])
            per.append({"policy_version": v["policy_version"], "wall_s": round(v["seconds"], 3),
                        "steps_s": round(sum(r["step_seconds"] for r in m), 3),
                        "bytes": sum(p.stat().st_size for p in root.rglob("*") if p.is_file()),
                        "full_state": v["full_state"]})
        t1 = time.perf_counter()
        chain = [train_snapshot(b, sid, cfg, progress=False) for sid in sids]
        chain_s = time.perf_counter() - t1
        same = [v["weight_sha256"] == c.weight_sha256 for v, c in zip(res.versions, chain)]
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return {"versions": per, "startup_s": round(res.startup_seconds, 2), "follow_s": round(follow_s, 2),
            "chain_s": round(chain_s, 2), "weights_bytes_bf16_source": weights,
            "follow_equals_chain": all(same), "equal_per_version": same, "zero_stage": zero_stage}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2", choices=sorted(ARCHS))
    ap.add_argument("--dir", default="", help="model directory (default: a temp dir)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--loop-versions", type=int, default=4, help="resident-loop versions (0 = skip that check)")
    args = ap.parse_args(argv)
    import tempfile

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device visible to torch: nothing to check", file=sys.stderr)
        return 2
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "arch": args.arch}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        d = Path(args.dir) if args.dir else Path(tmp) / args.arch
        t0 = time.perf_counter()
        build_model_dir(d, args.arch)
        info["build_s"] = round(time.perf_counter() - t0, 1)
        if not args.skip_vllm:
            info["vllm"] = check_vllm(d)
            print(f"vLLM {args.arch} bf16: {info['vllm']['tokens_per_s']:.0f} generated tokens/s "
                  f"({info['vllm']['generated_tokens']} tokens in {info['vllm']['seconds']:.1f}s)", flush=True)
        if not args.skip_deepspeed:
            info["deepspeed"] = check_deepspeed(d)
            ds = info["deepspeed"]
            print(f"DeepSpeed {args.arch} bf16 ZeRO-2: step {ds['median_step_s'] * 1000:.0f} ms, "
                  f"{ds['tokens_per_s']:.0f} trained tokens/s, loss {ds['loss_first']:.3f} -> {ds['loss_last']:.3f}, "
                  f"peak {ds['max_memory_gib']} GiB", flush=True)
        if args.loop_versions > 0:
            info["resident_loop"] = loop = check_resident_loop(d, versions=args.loop_versions)
            steady = loop["versions"][1:] or loop["versions"]
            wall = sum(v["wall_s"] for v in steady) / len(steady)
            steps = sum(v["steps_s"] for v in steady) / len(steady)
            print(f"resident trainer {args.arch} bf16, {args.loop_versions} versions: {wall:.2f} s/version, "
                  f"{steps:.2f} s in steps ({1 - steps / wall:.0%} overhead), start-up {loop['startup_s']:.1f} s once; "
                  f"chain of train_snapshot {loop['chain_s']:.1f} s vs follow {loop['follow_s']:.1f} s; "
                  f"follow == chain bytes: {loop['follow_equals_chain']}", flush=True)
    print(json.dumps(info))
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
