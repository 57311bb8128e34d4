"""The GPU path (scripts/gpu-check.sh runs these on a CUDA machine; they skip
elsewhere): the project's vLLM engine generates in bf16 on the GPU from a
real-architecture model built from a config, and the project's DeepSpeed
strategy trains it with bf16 + ZeRO-2 (the loss goes down on a repeated batch).
Small shapes: these check that the path works, scripts/gpu_check.py measures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

# CI has no GPU: there these skip, explicitly, with this reason (scripts/gpu-check.sh runs them on one)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def _gpu_check():
    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    return _gpu_check().build_model_dir(tmp_path_factory.mktemp(request.param), request.param, **SMALL)


@pytest.mark.gpu
@pytest.mark.vllm
@needs_cuda
def test_vllm_gpu_engine_generates_bf16(model_dir):
    r = _gpu_check().check_vllm(model_dir, requests=16, prompt_len=32, new_tokens=32, gpu_memory_utilization=0.3)
    assert r["generated_tokens"] == 16 * 32 and r["tokens_per_s"] > 0


@pytest.mark.gpu
@needs_cuda
def test_deepspeed_bf16_zero2_trains(model_dir):
    from transformers import AutoModelForCausalLM

    from pipeline.train.ds_adapter import DeepSpeedStrategy

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    strat = DeepSpeedStrategy(model, lr=1e-3, weight_decay=0.0, warmup_steps=0, zero_stage=2, precision="bf16",
                              offload=False, max_grad_norm=1.0)
    ids = torch.randint(0, SMALL["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(0)).to(strat.device)
    strat.train()
    losses = []
    for _ in range(8):
        out = strat.forward(input_ids=ids, labels=ids)
        strat.backward(out.loss)
        strat.optimizer_step()
        losses.append(float(out.loss.detach()))
    assert next(strat.module.parameters()).dtype == torch.bfloat16
    assert losses[-1] < losses[0], losses
