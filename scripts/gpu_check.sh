#!/usr/bin/env bash
# GPU check, one command: the kernel tests compiled for the real device, then the benchmarks.
#
#   scripts/gpu_check.sh            (PYTHON=/path/to/python to choose the interpreter)
#
# Needs torch with CUDA, triton, numpy, pytest and this repository; nothing is installed or
# downloaded. Results go to $GPU_CHECK_OUT (default bench-results/).
set -euo pipefail
cd "$(dirname "$0")/.."

# A .venv built on a CPU-only host holds a CPU torch: use it only if it can see the GPU.
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  PY=.venv/bin/python
else
  PY=python3
fi
OUT="${GPU_CHECK_OUT:-bench-results}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The tests run the interpreter only when this is set or CUDA is missing; here we want compiled kernels.
unset TRITON_INTERPRET

"$PY" - <<'PYEOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
try:
    import numpy
    import pytest
    import triton
except ImportError as exc:
    sys.exit(f"gpu_check: missing {exc.name}; it needs torch, triton, numpy and pytest")
print(f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}, "
      f"pytest {pytest.__version__}, {torch.cuda.get_device_name()}")
PYEOF

echo "== kernel tests (compiled on the GPU, gpu-marked tests included)"
# --confcutdir: only tests/kernels' own conftest loads, so service test fixtures need not import here.
"$PY" -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels tests/kernels

echo "== kernel benchmark: paged decode attention vs copy bandwidth"
"$PY" -m bench.kernel_bench --out "$OUT"

# ==== ENGINE BENCHMARK HOOK ===================================================================
# The end-to-end engine benchmark plugs in here. It runs as soon as bench/gpu_engine_bench.py
# exists; until then this block is skipped.
if "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("bench.gpu_engine_bench") is None)'; then
  echo "== engine benchmark"
  "$PY" -m bench.gpu_engine_bench --out "$OUT"
fi
# ==== END ENGINE BENCHMARK HOOK ===============================================================

echo "gpu_check: all passed; results in $OUT/"
