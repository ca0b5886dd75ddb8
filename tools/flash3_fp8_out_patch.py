"""Patch FlashAttention-3's hopper/ sources so the FP8 forward can write e4m3 output codes - an experiment, not
shipped: the e4m3 epilogue saved 5 us of an 11 us quantization pass per W1 call, nothing at W2, and whole steps were
not faster (experiments/flash3_e4m3_out.py, bench/results/flash3-e4m3-out-*.json). Built as
tools/build_flash3.sh's header says (a patched source copy as FA3_SRC, its own FA3_OBJ).

Stock FA3 writes the FP8 kernel's output in bf16. The fast transformer then quantizes that 16-bit tensor to e4m3 for
the FP8 O projection in a separate pass (a static scale: |o - c| <= 1.125 max|v - c|), which at W1 is ~9 us per layer
on the critical path plus the bf16 write and read. With this patch a caller that passes an `out` tensor of dtype
float8_e4m3fn gets the codes straight from the epilogue: the fp32 accumulator, already scaled by 1 / rowsum *
v_descale in `softmax.finalize`, is converted with `cvt.rn.satfinite.e4m3x2.f32` (CUTLASS's NumericArrayConverter),
so v_descale picks the output scale (the experiment passes 448 / 504 to write codes of (o - c) / (1.125 sv)). Without an e4m3 `out`, nothing changes (bf16 output, same kernel as before).

Changes:
  flash.h                      Flash_fwd_params.out_e4m3
  flash_api_stable.cpp         an e4m3 `out` is accepted for e4m3 inputs and sets out_e4m3
  flash_fwd_launch_template.h  FP8 inputs dispatch on out_e4m3 to an epilogue with Element = float_e4m3_t
  epilogue_fwd.hpp, utils.h    the FP8 kernels' column permutation of O (V is transposed in shared memory) also for
                               1-byte outputs, after the conversion, moving pairs of bytes (stock FA3 permutes 16-bit
                               outputs after the conversion and skips 1-byte ones; permuting the fp32 accumulator
                               before it moves twice the data: 5.8 us more per W1 call than the bf16 epilogue,
                               bench/results/flash3-e4m3-out-*.json)

    python tools/flash3_fp8_out_patch.py path/to/hopper
"""


MARK = "fastremover patch (fp8 out)"

PATCHES = [
    ("flash.h",
     "    bool is_e4m3;\n",
     "    bool is_e4m3;\n    bool out_e4m3;  // " + MARK + ": e4m3 output codes for e4m3 inputs\n"),
    ("flash_api_stable.cpp",
     "    auto out_type = q_type == torch::headeronly::ScalarType::Float8_e4m3fn ? torch::headeronly::ScalarType::BFloat16 : q_type;\n",
     "    auto out_type = q_type == torch::headeronly::ScalarType::Float8_e4m3fn ? torch::headeronly::ScalarType::BFloat16 : q_type;\n"
     "    // " + MARK + ": an e4m3 `out` for e4m3 inputs asks for e4m3 output codes\n"
     "    bool const out_e4m3 = q_type == torch::headeronly::ScalarType::Float8_e4m3fn && out_.has_value()\n"
     "        && out_.value().scalar_type() == torch::headeronly::ScalarType::Float8_e4m3fn;\n"
     "    if (out_e4m3) { out_type = torch::headeronly::ScalarType::Float8_e4m3fn; }\n"),
    ("flash_api_stable.cpp",
     "                     sm_margin);\n    params.total_q = total_q;\n    params.total_k = total_k;\n    params.b_k = batch_size_k;\n",
     "                     sm_margin);\n    params.out_e4m3 = out_e4m3;  // " + MARK + "\n"
     "    params.total_q = total_q;\n    params.total_k = total_k;\n    params.b_k = batch_size_k;\n"),
    ("flash_fwd_launch_template.h",
     "                            run_flash_fwd<Arch, kHeadDim, kHeadDimV, ClusterM, T, T_out, Is_causal, Is_local, Has_softcap, Varlen, PagedKVNonTMA, AppendKV && Varlen, HasQv, PackGQA, Split, V_colmajor>(params, stream);\n",
     "                            if constexpr (Is_FP8) {  // " + MARK + "\n"
     "                                if (params.out_e4m3) {\n"
     "                                    run_flash_fwd<Arch, kHeadDim, kHeadDimV, ClusterM, T, cutlass::float_e4m3_t, Is_causal, Is_local, Has_softcap, Varlen, PagedKVNonTMA, AppendKV && Varlen, HasQv, PackGQA, Split, V_colmajor>(params, stream);\n"
     "                                    return;\n"
     "                                }\n"
     "                            }\n"
     "                            run_flash_fwd<Arch, kHeadDim, kHeadDimV, ClusterM, T, T_out, Is_causal, Is_local, Has_softcap, Varlen, PagedKVNonTMA, AppendKV && Varlen, HasQv, PackGQA, Split, V_colmajor>(params, stream);\n"),
    ("epilogue_fwd.hpp",
     "        static constexpr bool NeedFP8Permute = FP8PermuteCol && (sizeof(Element) == 2 || sizeof(Element) == 4);\n",
     "        // " + MARK + ": 1-byte output codes are permuted too, after the conversion (pairs of bytes)\n"
     "        static constexpr bool NeedFP8Permute = FP8PermuteCol && (sizeof(Element) == 1 || sizeof(Element) == 2 || sizeof(Element) == 4);\n"),
    ("utils.h",
     "    static_assert(sizeof(typename Fragment::value_type) == 2 || sizeof(typename Fragment::value_type) == 4);\n",
     "    static_assert(sizeof(typename Fragment::value_type) == 1 || sizeof(typename Fragment::value_type) == 2 || sizeof(typename Fragment::value_type) == 4);  // " + MARK + "\n"),
    ("utils.h",
     "    using type2 = std::conditional_t<sizeof(typename Fragment::value_type) == 2, uint32_t, uint64_t>;\n",
     "    using type2 = std::conditional_t<sizeof(typename Fragment::value_type) == 1, uint16_t,  // " + MARK + "\n"
     "        std::conditional_t<sizeof(typename Fragment::value_type) == 2, uint32_t, uint64_t>>;\n"
     "    // shuffles move 32 or 64 bits: a pair of bytes travels in the low half of a 32-bit word\n"
     "    using shfl_t = std::conditional_t<sizeof(type2) == 2, uint32_t, type2>;\n"),
    ("utils.h",
     "                upper0 = __shfl_sync(uint32_t(-1), upper0, upper_map[quad_idx], 4);\n",
     "                upper0 = type2(__shfl_sync(uint32_t(-1), shfl_t(upper0), upper_map[quad_idx], 4));  // " + MARK + "\n"),
    ("utils.h",
     "                lower0 = __shfl_sync(uint32_t(-1), lower0, upper_map[quad_idx] ^ 2, 4);\n",
     "                lower0 = type2(__shfl_sync(uint32_t(-1), shfl_t(lower0), upper_map[quad_idx] ^ 2, 4));  // " + MARK + "\n"),
]


def main(hopper: str) -> None:
    sources = {}  # every change checked before any file is written
    for name, original, new in PATCHES:
        path = f"{hopper}/{name}"
        src = sources.get(path) or open(path).read()
        if MARK in src and path not in sources:
            raise SystemExit(f"{path} is already patched")
        if src.count(original) != 1:
            raise SystemExit(f"{path}: the code to patch was not found exactly once (FA3 source changed?)")
        sources[path] = src.replace(original, new)
    for path, src in sources.items():
        open(path, "w").write(src)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hopper", help="a copy of FlashAttention-3's hopper/ folder (patched in place)")
    main(parser.parse_args().hopper)
