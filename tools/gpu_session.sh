#!/usr/bin/env bash
# One device call (see /work/.library/device): install the carried wheels, then run the phases named as arguments.
# Results land in $OUT. Prepare on the dev machine (the device copy has no .git otherwise, and the bench JSON records
# the commit):
#   rm -rf .devrun && mkdir .devrun && git clone -q --depth 1 file://$PWD .devrun/src && cp -r .whl .fi .devrun/src/
# and run with carry [".devrun"]:  cd .devrun/src && bash tools/gpu_session.sh tests kernels "bench:--workload w1 ..."
# Lighter (session 21): carry only the .git of a depth-1 clone WITH its checkout (a --no-checkout clone has an empty
# index, so every run reads "-dirty"): `git clone -q --depth 1 file://$PWD /tmp/s && mkdir .devrun && cp -r /tmp/s/.git
# .devrun/dotgit`, carry [".devrun", ".whl"], and begin the command with `rm -rf .git && mv .devrun/dotgit .git` (the
# device's copy may hold a .git of the session's start: moving into it would leave the old commit in the JSON).
# The `tests` phase needs a call of its own now (more than 4 minutes).
# The image sets PYTHONDONTWRITEBYTECODE=1 and ships torch / sympy without .pyc files, so every fresh process there
# compiles their sources again (seconds; a pip-installed user has the .pyc): the script unsets it and keeps the .pyc
# under /tmp/pyc, so cold-start figures (`bench --cold`) count what a user's second process pays (session 22).
# Phases:
#   tests            pytest -m gpu (over 4 min since session 21: give it its own call)
#   kernels          kernel micro-benchmarks: fused elementwise, attention backends, FP8 conv3d, fast VAE, profiles
#   bench:ARGS       one `fastremover bench ARGS` (each mode's JSON is written as soon as that mode finishes)
#   conv:ARGS        the FP8 conv3d kernel bench (`tools/bench_conv3d_fp8.py --bench ARGS`, JSON in $OUT/conv3d.json)
#   vae:ARGS         the fast VAE bench (tools/bench_vae.py; ARGS as for it, JSON in $OUT/vae.json)
#   pytest:ARGS      pytest ARGS (log appended to $OUT/pytest.log)
#   py:SCRIPT ARGS   python3 SCRIPT ARGS (experiments; write JSON to $OUT yourself via --out)
#   precompile       tools/precompile_check.py for the tiny and the real config: every Triton compile of a
#                    fast run, ahead (precompiled) or lazy; none should be lazy
#   flash3-variants  experiments/flash3_variants.py for the stock build (.fa3) and each carried variant build
#                    .fa3-<name> (tools/build_flash3.sh variant <name> <mode>; kept in the checkout's ignored
#                    .fa3variants/<name>: copy them to .devrun/src/.fa3-<name>), each in its own process, two rounds
#   flash3           put FlashAttention-3 (tools/build_flash3.sh's output, carried as .fa3) on PYTHONPATH
#   if-faster:A,B    stop here unless attention backend row A beat row B at S = 32760 in $OUT/attention.json
#   flashinfer       FlashInfer for the fa3 / fp8-fa3 attention backends: unpack .fi/fi.tar.xz (a trimmed
#                    flashinfer-python + apache-tvm-ffi site tree) into /tmp/fisite; modules prebuilt earlier
#                    (.fi/aot/<name>.so) go where FlashInfer loads them without compiling, else nvcc builds them
#                    (~minutes) and they are copied to $OUT for the next call. Make .fi with
#                    tools/build_flashinfer_modules.sh (builds without a GPU; one build on the device failed) and
#                    copy it next to .whl into .devrun/src
# Budget: a W2 bench with two modes takes ~5 min (reference + 2 modes x (warm-up + repeats) + hash runs + the VAE
# FLOP pass + first-call compiles); give it its own call with a 550 s timeout.
set -uo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
# the fast VAE's benchmark: tools/bench_vae.py once it has moved out of the package
vae_bench() { python3 tools/bench_vae.py --bench "$@"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
git log --oneline -1
for phase in "$@"; do
  echo "=== $phase"
  case "$phase" in
    tests)
      python3 -m pytest -m gpu -q -s -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error|cos |PSNR" | tail -30 ;;
    kernels)
      python3 tools/bench_kernels.py 2>&1 | tee "$OUT/kernels.txt" | tail -12
      python3 tools/bench_attention.py --bench --out "$OUT/attention.json" 2>&1 | tail -24
      python3 tools/bench_conv3d_fp8.py --bench --no-variants --out "$OUT/conv3d.json" 2>&1 | tail -12
      vae_bench --pair off --out "$OUT/vae-w2.json" 2>&1 | tail -5
      python3 tools/profile_step.py --workload w2 --modes exact fast --out "$OUT/profile-w2.json" 2>&1 | tail -30
      python3 tools/profile_step.py --vae --out "$OUT/profile-vae-w2.json" 2>&1 | tail -34 ;;
    conv:*)
      # shellcheck disable=SC2086
      python3 tools/bench_conv3d_fp8.py --bench ${phase#conv:} --out "$OUT/conv3d.json" 2>&1 | tail -60 ;;
    vae:*)
      # shellcheck disable=SC2086
      vae_bench ${phase#vae:} --out "$OUT/vae.json" 2>&1 | tail -12 ;;
    flash3)  # FlashAttention-3 built by tools/build_flash3.sh, carried as .fa3 (its out/ folder)
      export PYTHONPATH=$PWD/.fa3:$PYTHONPATH
      python3 -c "import torch, flash_attn_interface; print('flash_attn_interface OK')" 2>&1 | tail -3 ;;
    precompile)
      for preset in tiny minimax-remover; do
        python3 tools/precompile_check.py --preset "$preset" --json "$OUT/precompile-check-$preset.json" 2>&1 \
          | grep -E "^(precompile|compiles|LAZY)" | cut -c1-300 | head -12
      done ;;
    py:*)
      # shellcheck disable=SC2086
      python3 ${phase#py:} 2>&1 | tail -60 ;;
    flash3-variants)  # two rounds, the builds interleaved: the process-to-process spread is ~3 %
      for round in 1 2; do
        for d in .fa3 .fa3-*; do
          [ -d "$d" ] || continue
          label=${d#.fa3-}; [ "$d" = .fa3 ] && label=stock
          PYTHONPATH=$PWD/$d:$PYTHONPATH python3 experiments/flash3_variants.py --label "$label" \
            --out "$OUT/flash3-$label-r$round.json" 2>&1 | grep "kernel only"
        done
      done ;;
    flashinfer)
      mkdir -p /tmp/fisite && tar -xJf .fi/fi.tar.xz -C /tmp/fisite || exit 1
      export PYTHONPATH=/tmp/fisite:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a
      export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
      for so in .fi/aot/*.so; do
        [ -e "$so" ] || continue
        name=$(basename "$so" .so); mkdir -p "/tmp/fisite/flashinfer/data/aot/$name"
        cp "$so" "/tmp/fisite/flashinfer/data/aot/$name/$name.so"
      done
      python3 -m fastremover.ops.attention.flashinfer_fa3 --build --out-dir "$OUT" 2>&1 | tail -20 ;;
    attention:*)
      # shellcheck disable=SC2086
      python3 tools/bench_attention.py --bench ${phase#attention:} --out "$OUT/attention.json" 2>&1 \
        | tail -40 ;;
    if-faster:*)
      spec=${phase#if-faster:}
      python3 - "$OUT/attention.json" "${spec%%,*}" "${spec#*,}" <<'EOF' || break
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
def ms(name):
    return min((r["ms"] for r in rows if r["seq"] == 32760 and r["backend"] == name and "ms" in r), default=float("inf"))
a, b = ms(sys.argv[2]), ms(sys.argv[3])
print(f"{sys.argv[2]}: {a:.3f} ms vs {sys.argv[3]}: {b:.3f} ms")
sys.exit(0 if a < b else 1)
EOF
      ;;
    pytest:*)
      # shellcheck disable=SC2086
      python3 -m pytest -q -s -p no:cacheprovider ${phase#pytest:} 2>&1 | tee -a "$OUT/pytest.log" \
        | grep -E "passed|failed|FAILED|Error|cos |err|config" | tail -40 ;;
    bench:*)
      # exact's auto attention is FlashInfer's fa3 only after the flashinfer phase (else sdpa, ~0.5 s slower at W2)
      [ -d .fi ] && [ -z "${FLASHINFER_WORKSPACE_BASE:-}" ] && echo "NOTE: .fi is here but the flashinfer phase has not run"
      # shellcheck disable=SC2086
      python3 -m fastremover.cli bench ${phase#bench:} --out "$OUT" 2>&1 | grep -v -E '^\s*$' | tail -20 ;;
    *) echo "unknown phase $phase" ;;
  esac
done
