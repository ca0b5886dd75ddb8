// Stub for the bf16 hdim128 sm90 forward kernel that flash_api_stable.cpp always references
// (bf16 cannot be disabled by a FLASHATTENTION_DISABLE_* macro). This build is FP8-e4m3-only:
// calling with bf16 inputs raises an error instead of running a kernel.
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>
#include "flash.h"
#include <torch/headeronly/util/Exception.h>
template <>
void run_mha_fwd_<90, cutlass::bfloat16_t, 128, 128, false, false, false, false>(Flash_fwd_params &params, cudaStream_t stream) {
    STD_TORCH_CHECK(false, "This FA3 build contains only FP8 e4m3 hdim128 forward kernels (bf16 not compiled).");
}
