#!/usr/bin/env bash
# One device call (see /work/.library/device): install the carried wheels, run the GPU tests and the kernel
# micro-benchmark, then the benchmarks given as arguments (each one `fastremover bench` argument list).
# Results land in $OUT. Usage on the device:
#   bash bench/gpu_session.sh "--workload w1 --modes exact,fast --repeats 2" "--workload w2 --modes exact --repeats 2"
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
git log --oneline -1
python3 -m pytest -m gpu -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|error|FAILED|cos|Error" | tail -30
python3 -m fastremover.fast.kernels.bench_kernels 2>&1 | tee "$OUT/kernels.txt" | tail -12
for args in "$@"; do
  echo "=== fastremover bench $args"
  # shellcheck disable=SC2086
  python3 -m fastremover.cli bench $args --out "$OUT" 2>&1 | grep -v -E '^\s*$' | tail -14
done
