#!/usr/bin/env bash
# GPU check, one command from the repository root on a fresh CUDA machine (H200 in mind):
#
#   GPU_CHECK_OUT=DIR scripts/gpu_check.sh      (PYTHON=/path/to/python to choose the interpreter)
#
# Figures first, then the tests, each stage under its own cap and the whole run under 8 minutes
# (bench/gpu_check.py runs them; a stage's cap is cut to what is left of the run):
#   preflight     torch sees CUDA; triton, numpy, pytest import; the engine imports;
#                 a CUDA context comes up (a cold start can take tens of seconds)          60 s
#   kernel_bench  paged decode attention vs copy bandwidth: 8B heads at context 1k, batches
#                 1-64, heuristic and forced splits; 70B heads at 4k; then the decode launch
#                 sweep (BLOCK_N x warps x stages, forced splits) in a 60 s budget          110 s
#   engine_bench  Llama-3-8B-shaped bf16, dummy weights: batch-64 decode step vs its
#                 bandwidth bound, its kernel table (torch.profiler), batch-1 graphs vs
#                 piecewise vs eager, greedy and sampled workloads                          180 s
#   graph_check   CUDA-graph replay vs the same padded step run eagerly (decode graphs and
#                 piecewise graphs), greedy tokens vs the unpadded eager path                90 s
#   kernels       tests/kernels compiled on the GPU, gpu-marked tests included; -v -rfE,
#                 faulthandler_timeout, a per-test report written as each test ends         120 s
# At a cap a stage gets SIGINT (Python and pytest print where they were), SIGKILL 10 s later.
#
# Nothing is downloaded: the repository runs from PYTHONPATH (no pip install), on the machine's own
# torch + triton (+ numpy, pytest). Triton's cache is .triton-cache/ in the tree (ignored by git), so
# a rerun on the same machine compiles nothing. Results go to $GPU_CHECK_OUT (default
# bench-results/gpu-check), each written as its stage ends: gpu_check.log, <stage>.log, stages.tsv,
# stages.json, kernel_bench.json, gpu_engine_bench.json, graph_check.json, pytest-kernels.xml,
# kernel-tests.jsonl, summary.txt (the one-screen summary, each figure next to its target).
# Exit status 0 only if every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${GPU_CHECK_OUT:-bench-results/gpu-check}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

# A .venv built on a CPU-only host holds a CPU torch: use it only if it can see the GPU.
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]] && timeout 60 .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  PY=.venv/bin/python
else
  PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton-cache}"
mkdir -p "$TRITON_CACHE_DIR"

"$PY" -m bench.gpu_check --out "$OUT" --python "$PY" --budget-s "${GPU_CHECK_BUDGET_S:-450}"
