#!/usr/bin/env bash
# Set up .venv (scripts/setup_env.sh) and run the test suite. GPU tests (marker `gpu`) skip
# without CUDA; extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -k layout`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "test,eval,train,hub"
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m pytest -q -ra "$@"
