#!/usr/bin/env bash
# The one prepared script a session with a lent GPU runs: exactrl against TRL (benchmarks/gpu_bench.py) within
# its time budget (--budget-s, default 360 s; ~7 min with the install and the matmul peak), after
# scripts/gpu_paths.py (the new kernels against their references, at most 3 min), the results page and
# the log left under $OUT. First, on your own machine: ../shared/tools/gpu_wheels.sh (wheels into .gpu/whl); then
# the device run, carrying [".gpu"]:  bash scripts/gpu_bench.sh [gpu_bench.py flags, e.g. --exactrl-set k=v]
# The GPU machine has torch (CUDA) and reaches no registry: the wheels go into /tmp/site, exactrl runs from the
# checkout (PYTHONPATH, no pip install -e), and TRL's side runs in the same interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# Issue 38's new paths against their references first (~1-2 min): packed kernels, chunked head, captured decode.
timeout 180 python3 scripts/gpu_paths.py --out "$out" 2>&1 | tee "$out/gpu-paths.log" || true
python3 benchmarks/gpu_bench.py --results-dir "$out" "$@" 2>&1 | tee "$out/gpu-bench.log"
