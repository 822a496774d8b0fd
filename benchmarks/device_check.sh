#!/usr/bin/env bash
# What the lead runs on the GPU machine in one call (device tool), results under $OUT:
# the CUDA test pass of the engine suites, fla-core vs the torch GDN path, the NVML probe,
# conversion throughput, and engine throughput on CUDA.
#   (device) bash benchmarks/device_check.sh          # carry: .whl (platformdirs, fla-core wheels)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 FREETOKEN_HOME=/tmp/ft-home
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch,sys;print(sys.version, torch.__version__, torch.cuda.get_device_name())'; } > "$OUT/machine.txt" 2>&1
python3 benchmarks/probe_report.py > "$OUT/probe.json" 2> "$OUT/probe.err"
timeout 200 python3 -m pytest -q -p no:cacheprovider --device cuda tests/test_models_parity.py tests/test_models_gdn.py \
  tests/test_gated_deltanet.py tests/test_engine_generation.py tests/test_engine_experts.py tests/test_sampling.py \
  > "$OUT/cuda_tests.log" 2>&1; echo "pytest rc=$?" >> "$OUT/cuda_tests.log"
timeout 60 python3 benchmarks/gdn_cuda_check.py > "$OUT/gdn_cuda.txt" 2>&1; echo "rc=$?" >> "$OUT/gdn_cuda.txt"
timeout 110 python3 benchmarks/bench_convert.py --work /tmp/bc --json-dir "$OUT" --kinds mxfp4,bf16 --layers 4 \
  > "$OUT/convert.txt" 2>&1; echo "rc=$?" >> "$OUT/convert.txt"
timeout 60 python3 benchmarks/bench_engine.py --device cuda --size a3b --codec bf16 --experts grouped \
  > "$OUT/engine_cuda.txt" 2>&1; echo "rc=$?" >> "$OUT/engine_cuda.txt"
tail -3 "$OUT/cuda_tests.log"; tail -5 "$OUT"/*.txt
