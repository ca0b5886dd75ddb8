#!/bin/bash
# FlashAttention-3 (Dao-AILab flash-attention, hopper/) forward-only build for the fp8-flash3 attention backend, without
# a GPU and without setup.py (which downloads nvcc and git submodules): FP8 e4m3 + bf16, head dim 128, sm_90a, torch's
# stable ABI + Python limited API (one .so for any Python >= 3.9). Prerequisites (paths overridable below): a
# bare mirror of flash-attention, pip's CUDA 13.0 nvcc laid out as CUDA_HOME and CUTLASS headers (as in
# tools/build_flashinfer_modules.sh: FlashInfer 0.7.4 bundles CUTLASS 4.5.0), the torch wheel of the target's version
# (unzipped: headers + libs to link). ~4.5 min on 2 cores. Output: $B/out (flash_attn_interface.py, flash_attn_3/_C.abi3.so)
# to put on PYTHONPATH after `import torch`. FA3_SRC / FA3_OBJ override the source tree and the object folder (a
# patched copy, e.g. tools/flash3_fp8_out_patch.py's, is built with setup's tree copied, patched and passed as
# FA3_SRC, then api, sched, e4m3 and bf16 into their own FA3_OBJ, then linked as `link` does).
# Inputs (environment, defaults in brackets): WORK [/tmp/fibuild] the folder of tools/build_flashinfer_modules.sh,
# whose CUDA 13.0 layout and CUTLASS are used (or FA3_CUDA_HOME, FA3_CUTLASS); FA3_TORCH_WHL [/tmp/tw/torch-2.11.0-
# cp312-cp312-manylinux_2_28_x86_64.whl, from `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 torch==2.11.0`]; FA3_MIRROR [the fetch tool's bare mirror] and FA3_COMMIT [HEAD];
# FA3_PYINC [this python3's headers: any >= 3.9 does, the build is abi3]; FA3_BUILD [/tmp/fa3build];
# FA3_BF16=stub links tools/flash3_bf16_stub.cpp instead of compiling the (unused) bf16 kernel.
# Usage: build.sh [setup|api|sched|e4m3|bf16|bf16stub|link|package|all]
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
set -e
B=${FA3_BUILD:-/tmp/fa3build}
SRC=${FA3_SRC:-$B/src/hopper}
OBJ=${FA3_OBJ:-$B/obj}
LOG=$B/logs
# defaults: the CUDA 13.0 layout and FlashInfer site tree that tools/build_flashinfer_modules.sh leaves in $WORK
FIW=${WORK:-/tmp/fibuild}
export CUDA_HOME=${FA3_CUDA_HOME:-$FIW/cuda/nvidia/cu13}
export PATH=$CUDA_HOME/bin:$CUDA_HOME/nvvm/bin:$PATH
NVCC=$CUDA_HOME/bin/nvcc
CUTLASS=${FA3_CUTLASS:-$FIW/site/flashinfer/data/cutlass}
CUTLASS_INC=$CUTLASS/include
CUTLASS_UTIL_INC=$CUTLASS/tools/util/include
TORCH=${FA3_TORCH:-$B/torch211/torch}  # or an installed torch of the target version (its include/ and lib/)
TORCH_WHL=${FA3_TORCH_WHL:-/tmp/tw/torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl}
FA3_MIRROR=${FA3_MIRROR:-/work/.mirror/Dao-AILab+flash-attention/repo}
FA3_COMMIT=${FA3_COMMIT:-HEAD}  # last built: 0251105a (2026-12-01)
# any Python >= 3.9's headers: the extension uses the limited API (Py_LIMITED_API=0x03090000), so the .so is abi3
PYINC=${FA3_PYINC:-$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')}

FEATURES="-DFLASHATTENTION_DISABLE_BACKWARD -DFLASHATTENTION_DISABLE_PAGEDKV -DFLASHATTENTION_DISABLE_SPLIT \
 -DFLASHATTENTION_DISABLE_APPENDKV -DFLASHATTENTION_DISABLE_LOCAL -DFLASHATTENTION_DISABLE_SOFTCAP \
 -DFLASHATTENTION_DISABLE_PACKGQA -DFLASHATTENTION_DISABLE_FP16 -DFLASHATTENTION_DISABLE_VARLEN \
 -DFLASHATTENTION_DISABLE_CLUSTER -DFLASHATTENTION_DISABLE_HDIM64 -DFLASHATTENTION_DISABLE_HDIM96 \
 -DFLASHATTENTION_DISABLE_HDIM192 -DFLASHATTENTION_DISABLE_HDIM256 -DFLASHATTENTION_DISABLE_SM8x \
 -DFLASHATTENTION_DISABLE_HDIMDIFF64 -DFLASHATTENTION_DISABLE_HDIMDIFF192"

INCS="-I$SRC -I$CUTLASS_INC -I$CUTLASS_UTIL_INC"
TORCH_INCS="-isystem $TORCH/include -isystem $TORCH/include/torch/csrc/api/include -isystem $CUDA_HOME/include -isystem $PYINC"
COMMON_DEFS="-DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -D_GLIBCXX_USE_CXX11_ABI=1"

# same as hopper/setup.py nvcc_flags + cc_flag + torch CUDAExtension defaults
NVCC_FLAGS="--threads 1 -O3 -std=c++17 --ftemplate-backtrace-limit=0 --use_fast_math --resource-usage -lineinfo \
 -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -DCUTLASS_ENABLE_GDC_FOR_SM90 -DCUTLASS_DEBUG_TRACE_LEVEL=0 -DNDEBUG \
 -gencode arch=compute_90a,code=sm_90a \
 -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
 --expt-relaxed-constexpr --expt-extended-lambda --compiler-options -fPIC -ccbin g++ $COMMON_DEFS $FEATURES $INCS"

# same as setup.py "cxx" args (flash_api_stable.cpp chosen because torch >= 2.9)
CXX_FLAGS="-O3 -std=c++17 -fPIC -DPy_LIMITED_API=0x03090000 -DTORCH_TARGET_VERSION=0x0209000000000000 \
 $COMMON_DEFS $FEATURES $INCS $TORCH_INCS"

t() { # name cmd...
  local n=$1; shift
  local s=$(date +%s)
  echo "[$(date +%T)] start $n" | tee -a $LOG/times.txt
  if /usr/bin/time -v "$@" > $LOG/$n.log 2>&1; then st=OK; else st=FAIL; fi
  echo "[$(date +%T)] $st $n $(( $(date +%s) - s ))s maxrss_kb=$(grep 'Maximum resident' $LOG/$n.log | awk '{print $NF}')" | tee -a $LOG/times.txt
  [ $st = OK ]
}

setup() {
  mkdir -p $B/src $OBJ $LOG
  # one tree at a time: a mirror may lack the large blobs elsewhere in the repository (git archive of the whole commit
  # with a pathspec stops at the first missing one)
  if [ ! -d $SRC ]; then
    git --git-dir=$FA3_MIRROR archive --prefix=hopper/ $FA3_COMMIT:hopper | tar -x -C $B/src
    git --git-dir=$FA3_MIRROR archive --prefix=csrc/flash_attn/ $FA3_COMMIT:csrc/flash_attn | tar -x -C $B/src
  fi
  [ -d $TORCH/lib ] || unzip -q $TORCH_WHL 'torch/include/*' 'torch/lib/*' -d $B/torch211
}
api()   { t flash_api_stable g++ $CXX_FLAGS -c $SRC/flash_api_stable.cpp -o $OBJ/flash_api_stable.o; }
sched() { t flash_prepare_scheduler $NVCC $NVCC_FLAGS -c $SRC/flash_prepare_scheduler.cu -o $OBJ/flash_prepare_scheduler.o; }
e4m3()  { t hdim128_e4m3_sm90 $NVCC $NVCC_FLAGS -c $SRC/instantiations/flash_fwd_hdim128_e4m3_sm90.cu -o $OBJ/flash_fwd_hdim128_e4m3_sm90.o; }
bf16()  { t hdim128_bf16_sm90 $NVCC $NVCC_FLAGS -c $SRC/instantiations/flash_fwd_hdim128_bf16_sm90.cu -o $OBJ/flash_fwd_hdim128_bf16_sm90.o; }
bf16stub() { t bf16_stub g++ $CXX_FLAGS -c $(dirname "$0")/flash3_bf16_stub.cpp -o $OBJ/bf16_stub.o; }

link() {
  mkdir -p $B/out/flash_attn_3
  local BF=$OBJ/flash_fwd_hdim128_bf16_sm90.o
  [ -f $BF ] || BF=$OBJ/bf16_stub.o
  t link g++ -shared -o $B/out/flash_attn_3/_C.abi3.so \
    $OBJ/flash_api_stable.o $OBJ/flash_prepare_scheduler.o $OBJ/flash_fwd_hdim128_e4m3_sm90.o $BF \
    -Wl,--as-needed -L$TORCH/lib -lc10 -ltorch -ltorch_cpu -ltorch_cuda -lc10_cuda -L$CUDA_HOME/lib -L$CUDA_HOME/lib64 \
    -lcudart
}

package() {  # python side: top-level flash_attn_interface.py + flash_attn_config.py, flash_attn_3/ package with _C.abi3.so
  mkdir -p $B/out/flash_attn_3
  cp $SRC/flash_attn_interface.py $B/out/
  cp $SRC/flash_attn_3/__init__.py $SRC/flash_attn_3/flash_attn_interface.py $SRC/flash_attn_3/flash_attn_config.py $B/out/flash_attn_3/
  python3 - "$B/out" <<'PY'
import sys
names = ["FLASHATTENTION_DISABLE_BACKWARD","FLASHATTENTION_DISABLE_SPLIT","FLASHATTENTION_DISABLE_PAGEDKV","FLASHATTENTION_DISABLE_APPENDKV","FLASHATTENTION_DISABLE_LOCAL","FLASHATTENTION_DISABLE_SOFTCAP","FLASHATTENTION_DISABLE_PACKGQA","FLASHATTENTION_DISABLE_FP16","FLASHATTENTION_DISABLE_FP8","FLASHATTENTION_DISABLE_VARLEN","FLASHATTENTION_DISABLE_CLUSTER","FLASHATTENTION_DISABLE_HDIM64","FLASHATTENTION_DISABLE_HDIM96","FLASHATTENTION_DISABLE_HDIM128","FLASHATTENTION_DISABLE_HDIM192","FLASHATTENTION_DISABLE_HDIM256","FLASHATTENTION_DISABLE_SM8x","FLASHATTENTION_ENABLE_VCOLMAJOR","FLASH_ATTENTION_DISABLE_HDIMDIFF64","FLASH_ATTENTION_DISABLE_HDIMDIFF192"]
keep = ("FLASHATTENTION_DISABLE_FP8","FLASHATTENTION_DISABLE_HDIM128","FLASHATTENTION_ENABLE_VCOLMAJOR")
CONFIG = {"build_flags": {k: k not in keep for k in names}}
with open(f"{sys.argv[1]}/flash_attn_config.py","w") as f:
    f.write("# Generated for tools/build_flash3.sh's custom FP8-e4m3 hdim128 fwd-only build (same format as hopper/setup.py)\n")
    f.write(f"CONFIG = {CONFIG!r}\n\ndef show():\n    from pprint import pprint\n    pprint(CONFIG)\n")
PY
}

# Variants of the FP8 kernel (tools/flash3_variant_patch.py patches a copy of the sources: exp2 on f16x2 or partly on
# the FMA pipe, another tile shape), each linked with the same api/scheduler/bf16 objects into $B/out_<name>:
#   build.sh variant <name> <patch mode: f16x2 | emu:N | tile:M,N,RS,OVERLAP>
variant() {
  local name=$1 mode=$2
  rm -rf $B/src_$name && mkdir -p $B/src_$name && cp -r $SRC $B/src_$name/
  python3 "$(dirname "$0")/flash3_variant_patch.py" $B/src_$name/hopper "$mode"
  t hdim128_e4m3_sm90_$name $NVCC ${NVCC_FLAGS//-I$SRC/-I$B/src_$name/hopper} \
    -c $B/src_$name/hopper/instantiations/flash_fwd_hdim128_e4m3_sm90.cu -o $OBJ/flash_fwd_hdim128_e4m3_sm90_$name.o
  local BF=$OBJ/flash_fwd_hdim128_bf16_sm90.o
  [ -f $BF ] || BF=$OBJ/bf16_stub.o
  rm -rf $B/out_$name && cp -r $B/out $B/out_$name
  t link_$name g++ -shared -o $B/out_$name/flash_attn_3/_C.abi3.so \
    $OBJ/flash_api_stable.o $OBJ/flash_prepare_scheduler.o $OBJ/flash_fwd_hdim128_e4m3_sm90_$name.o $BF \
    -Wl,--as-needed -L$TORCH/lib -lc10 -ltorch -ltorch_cpu -ltorch_cuda -lc10_cuda -L$CUDA_HOME/lib -lcudart
}

all() {  # the compiles are independent: all at once (one core each; the e4m3 kernel is the long one)
  setup
  api & P0=$!
  sched & P3=$!
  e4m3 & P1=$!
  # FA3_BF16=stub: link the stub instead of compiling the bf16 kernel (the backend runs only e4m3; saves one of the two
  # long nvcc compiles)
  if [ "${FA3_BF16:-build}" = stub ]; then bf16stub & P2=$!; else (bf16 || bf16stub) & P2=$!; fi
  wait $P0; wait $P3; wait $P1; wait $P2 || true
  link
  package
}

"${@:-all}"
