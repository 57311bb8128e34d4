"""How the CPU demo's default publish_dtype was chosen (docs/resident-trainer.md, section 3):
generation speed of the demo's policy on the hf engine from fp32 and bf16 published weights
(and bf16 compute, for reference), then a short fixed-seed demo run in each dtype.

    PYTHONPATH=. python scripts/publish_dtype_check.py            # ~5 minutes on 2 CPU cores

Prints one JSON object per measurement. Writes only temporary directories.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline import vocab
from pipeline.demo import DemoConfig, run_demo, warm_start_overrides
from pipeline.lake.delta import Lake
from pipeline.rollout.engine import Request, Sampling
from pipeline.rollout.hf import HFEngine
from pipeline.rollout.policy import init_policy

PROMPTS = ["37*45=", "12+88=", "r:40213=", "91-17=", "8*9=", "100-37=", "55+66=", "r:123="]


def generation_speed(tmp: Path) -> dict:
    torch.set_num_threads(1)
    fp32 = init_policy(Lake(tmp / "lake"), seed=0, **warm_start_overrides("arithmetic-tool")).hf_dir
    bf16 = tmp / "bf16"
    shutil.copytree(fp32, bf16)
    w = load_file(str(bf16 / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps(cfg | {"dtype": "bfloat16"}))
    reqs = [Request(tuple([vocab.BOS_ID] + vocab.encode(p)), n=8, seed=100 + k) for k, p in enumerate(PROMPTS)]
    sampling = Sampling(temperature=1.0, max_new_tokens=24)
    out: dict = {"params": sum(v.numel() for v in w.values()), "tokens_per_s": {}}
    for name, d, compute in (("fp32 published", fp32, None), ("bf16 published", bf16, None),
                             ("bf16 published, bf16 compute", bf16, torch.bfloat16)):
        eng = HFEngine(d, threads=1)
        if compute is not None:
            eng.model.to(compute)
        eng.generate(reqs[:1], sampling)                    # warm-up
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            res = eng.generate(reqs, sampling)
            best = max(best, sum(len(c.token_ids) for cs in res for c in cs) / (time.perf_counter() - t0))
        out["tokens_per_s"][name] = round(best, 1)
        eng.close()
    return out


def learning(tmp: Path, dtype: str) -> dict:
    cfg = DemoConfig(iterations=3, groups=16, group_size=8, eval_n=100, epochs=2, seed=0, infra_fault_p=0.0,
                     report=False, publish_dtype=dtype)
    s = run_demo(Lake(tmp / f"lake-{dtype}"), cfg, out=lambda *a: None)
    return {"publish_dtype": dtype, "heldout": [it["heldout_success"] for it in s["iterations"]],
            "reward": [it["reward_mean"] for it in s["iterations"]]}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(generation_speed(Path(d))), flush=True)
        for dt in ("float32", "bfloat16"):
            print(json.dumps(learning(Path(d), dt)), flush=True)
