#!/usr/bin/env bash
# Build FlashInfer's two FA3 modules that the fa3 / fp8-fa3 attention backends use, on a machine WITHOUT a GPU, with
# pip's CUDA 13.0 compiler, and pack what one device call needs (tools/gpu_session.sh `flashinfer` phase):
#   .fi/fi.tar.xz               the flashinfer modules an FA3 call imports + the single_prefill sources (~2 MB)
#   .fi/aot/*.so                the prebuilt modules (~1 MB each), loaded without a compiler
#   .whl/apache_tvm_ffi-*.whl   FlashInfer's FFI for the device's python 3.12
# Why here: one build on the device failed (ninja "subcommand failed", the compiler's message was cut off in the
# output) and cost 5 minutes of device time; this build took 4-5 min per module on 2 cores.
# Usage (repo root, venv active): bash tools/build_flashinfer_modules.sh   (.fi and .whl are git-ignored;
# the device call carries them: `carry: [".fi", ".whl"]`).
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
set -euo pipefail
W=${WORK:-/tmp/fibuild}
mkdir -p "$W"
pip download -q --no-deps -d "$W" flashinfer-python==0.7.4
pip install -q --no-deps --target "$W/site" "$W"/flashinfer_python-0.7.4-py3-none-any.whl apache-tvm-ffi==0.1.15.post2
pip install -q --target "$W/deps" nvidia-ml-py einops tabulate click ninja tqdm requests
pip install -q --no-deps --target "$W/cuda" nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
  nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 "nvidia-nvvm==13.0.*" nvidia-curand
C=$W/cuda/nvidia/cu13
(cd "$C" && ln -sfn lib lib64 && cd lib && ln -sf libcudart.so.13 libcudart.so && mkdir -p stubs \
  && echo "" | gcc -shared -Wl,-soname,libcuda.so.1 -o stubs/libcuda.so -x c -)  # link-time stub; the driver's at run time
export CUDA_HOME=$C PATH=$C/bin:$W/deps/bin:$PATH FLASHINFER_WORKSPACE_BASE=$W/ws FLASHINFER_CUDA_ARCH_LIST=9.0a
export MAX_JOBS=${MAX_JOBS:-2} PYTHONPATH=$W/site:$W/deps:$PWD
mkdir -p .fi/aot
python -m fastremover.ops.attention.flashinfer_fa3 --build --out-dir .fi/aot  # copies <name>.so of each module
# the modules an FA3 call imports (traced), plus the jinja/cu sources its spec generation reads
python - "$W/site" > "$W/files" <<'PY'
import os, sys, torch
site = sys.argv[1]
import flashinfer.prefill  # noqa: F401
from fastremover.ops.attention.flashinfer_fa3 import jit_specs
[s.aot_path for s in jit_specs()]
files = {os.path.relpath(m.__file__, site) for m in list(sys.modules.values())
         if getattr(m, "__file__", None) and m.__file__.startswith(site + "/flashinfer")}
for d in {os.path.dirname(f) for f in files}:
    files |= {f"{d}/{x}" for x in os.listdir(f"{site}/{d}") if x.endswith((".json", ".txt"))}
files |= {f"flashinfer/data/csrc/{x}" for x in os.listdir(f"{site}/flashinfer/data/csrc") if x.startswith("single_prefill")}
print("\n".join(sorted(files)))
PY
tar -cJf .fi/fi.tar.xz -C "$W/site" -T "$W/files"
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl apache-tvm-ffi==0.1.15.post2
ls -la .fi .fi/aot
