#!/usr/bin/env bash
# One device call (see /work/.library/device): install the carried wheels, run the GPU tests, then the benchmarks
# given as arguments (each a `fastremover bench ...` argument list separated by ';'). Results land in $OUT.
# Usage on the device: bash bench/gpu_session.sh "--workload w1 --repeats 2" "--workload w2 --repeats 2"
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
git log --oneline -1
python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu-tests.log"
for args in "$@"; do
  echo "=== fastremover bench $args"
  # shellcheck disable=SC2086
  python3 -m fastremover.cli bench $args --out "$OUT" 2>&1 | grep -v -E '^\s*$' | tail -12
done
