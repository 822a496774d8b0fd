#!/usr/bin/env bash
# The lead's GPU-machine run for CUDA-graph decode and the real-model benchmark (device tool; carry .whl with
# the numba + llvmlite wheels, or .site/site.tar.xz). Results under $OUT.
#   (device) bash benchmarks/device_graphs.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -f .site/site.tar.xz ]; then     # the same wheels unpacked and xz-compressed (fits the 64 MiB carry limit)
  mkdir -p /tmp/site && tar xJf .site/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 FREETOKEN_HOME=/tmp/ft-home
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null
timeout 240 python3 -m pytest -q -p no:cacheprovider --device cuda tests/test_decode_graph.py tests/test_engine_default_tier.py tests/test_kernels_fused.py tests/test_models_parity.py \
  tests/test_engine_generation.py tests/test_engine_experts.py tests/test_hybrid_experts.py > "$OUT/cuda_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/cuda_tests.log"; tail -15 "$OUT/cuda_tests.log"
timeout 150 python3 benchmarks/profile_decode_step.py --layers 4 2>&1 | tee "$OUT/profile_step.txt" | grep -v "^  .*/layer" | head -40
if [ "${1:-}" = quick ]; then
  timeout 300 python3 -m runtime.experts.bench model --budgets 8 0 --routings uniform --tokens 32 --warmup 8 \
    --prefill 8192 16384 --prefill-budgets 8 --ttft-context 20000 --out "$OUT" 2>&1 | tee "$OUT/bench_model.txt"
else
  timeout 540 python3 -m runtime.experts.bench model --budgets 4 8 12 24 0 --routings uniform skewed --tokens 32 \
    --warmup 8 --prefill 1024 8192 16384 --prefill-budgets 8 0 --ttft-context 20000 --out "$OUT" 2>&1 | tee "$OUT/bench_model.txt"
fi
