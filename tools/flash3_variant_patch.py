"""Patch a copy of FlashAttention-3's hopper/ sources for tools/build_flash3.sh's variant builds of the FP8 kernel.

exp2 variants (hopper/softmax.h): in the FP8 kernels (Max_offset != 0) the online softmax's exp2 no longer runs
only on the special-function unit (MUFU).

Why: at head dim 128 in FP8 the MUFU's exp2 (16 per clock per SM) needs as many cycles per score as the FP8 tensor
cores' QK^T + PV (8192 FLOP per clock per SM over 4 * 128 FLOP per score), and FA3's FP8 forward sits near half of
the FP8 matrix peak (940 TFLOP/s at S = 32760 on the H200). Two variants:

  f16x2    exp2 on packed f16x2 (`ex2.approx.f16x2`). The SASS shows ptxas lowers it to one MUFU.EX2.F16 per
           element (not one per pair), so it only helps if the f16 MUFU op is faster than the f32 one.
  emu:N    every N-th column of the score fragment takes exp2 on the FMA pipe instead (FA4's "ex2 emulation" on
           Blackwell): x = max(x, -126); t = x + 1.5 * 2^23 (round to nearest: t's low mantissa bits hold j =
           rint(x)); f = x - (t - 1.5 * 2^23) in [-0.5, 0.5]; p = 1 + f (c1 + f (c2 + f c3)) ~ 2^f (Taylor, relative
           error <= 6e-4); exp2(x) = bits(p) + (bits(t) << 23), i.e. p * 2^j. Nine ALU instructions for one MUFU op.

Why either is harmless: P is rounded to e4m3 next (3 mantissa bits, relative rounding up to 2^-4); the f16 input
rounding of x in [-16, 8] is <= 2^-8 in the exponent and the polynomial's error is 6e-4; the row sum is taken from
the same values (fp32 accumulation as before).

Tile variants (hopper/tile_size.h): `tile:M,N,RS,OVERLAP` replaces the FP8 head-dim-128 tile {128, 224, true, true}
(kBlockM, kBlockN, P @ V with P from registers, intra-warpgroup overlap) with the given one; M = 192 means three
consumer warpgroups. A tile that does not fit shared memory fails to compile.

    python tools/flash3_variant_patch.py path/to/hopper f16x2 | emu:N | tile:M,N,RS,OVERLAP
"""


ORIGINAL = """        #pragma unroll
        for (int ni = 0; ni < size<1>(tensor); ++ni)  {
            // Instead of computing exp(x - max), we compute exp2(x * log_2(e) -
            // max * log_2(e)). This allows the compiler to use the ffma
            // instruction instead of fadd and fmul separately.
            tensor(mi, ni) = exp2f(tensor(mi, ni) * scale - max_scaled);
        }
"""

F16X2 = """        if constexpr (Max_offset != 0) {  // fastremover patch (f16x2): FP8 kernels, exp2 on packed f16x2
            static_assert(size<1>(Layout0{}) % 2 == 0);
            #pragma unroll
            for (int ni = 0; ni < size<1>(tensor); ni += 2) {
                float const x0 = tensor(mi, ni) * scale - max_scaled;
                float const x1 = tensor(mi, ni + 1) * scale - max_scaled;
                uint32_t h2;
                asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h2) : "f"(x1), "f"(x0));  // hi = x1, lo = x0
                asm("ex2.approx.f16x2 %0, %1;" : "=r"(h2) : "r"(h2));
                float lo, hi;
                asm("{.reg .f16 l, h;\\n mov.b32 {l, h}, %2;\\n cvt.f32.f16 %0, l;\\n cvt.f32.f16 %1, h;}"
                    : "=f"(lo), "=f"(hi) : "r"(h2));
                tensor(mi, ni) = lo;
                tensor(mi, ni + 1) = hi;
            }
        } else {
""" + ORIGINAL + """        }
"""

EMU = """        if constexpr (Max_offset != 0) {  // fastremover patch (emu:EVERY): every EVERY-th column's exp2 on the FMA pipe
            #pragma unroll
            for (int ni = 0; ni < size<1>(tensor); ++ni) {
                float const x = tensor(mi, ni) * scale - max_scaled;
                if (ni % EVERY == EVERY - 1) {
                    float const xc = fmaxf(x, -126.f);
                    float const t = __fadd_rn(xc, 12582912.f);       // 1.5 * 2^23: rint(xc) in t's low bits
                    float const f = __fsub_rn(xc, __fsub_rn(t, 12582912.f));  // in [-0.5, 0.5]
                    float p = __fmaf_rn(f, 0.0555041086648216f, 0.240226506959101f);
                    p = __fmaf_rn(f, p, 0.693147180559945f);
                    p = __fmaf_rn(f, p, 1.f);
                    tensor(mi, ni) = __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
                } else {
                    tensor(mi, ni) = exp2f(x);
                }
            }
        } else {
""" + ORIGINAL + """        }
"""


TILE_ORIGINAL = "return {128, paged_kv_non_TMA ? 160 : (v_colmajor || (softcap && is_local) ? 192 : 224), true, true};"


def _patch(path: str, original: str, new: str) -> None:
    src = open(path).read()
    if "fastremover patch" in src:
        raise SystemExit(f"{path} is already patched")
    if src.count(original) != 1:
        raise SystemExit(f"{path}: the code to patch was not found exactly once (FA3 source changed?)")
    open(path, "w").write(src.replace(original, new))


def main(hopper: str, mode: str) -> None:
    if mode == "f16x2":
        _patch(f"{hopper}/softmax.h", ORIGINAL, F16X2)
    elif mode.startswith("emu:") and mode[4:].isdigit() and int(mode[4:]) >= 2:
        _patch(f"{hopper}/softmax.h", ORIGINAL, EMU.replace("EVERY", mode[4:]))
    elif mode.startswith("tile:") and len(parts := mode[5:].split(",")) == 4:
        m, n, rs, overlap = parts
        if not (m.isdigit() and n.isdigit() and rs in ("true", "false") and overlap in ("true", "false")):
            raise SystemExit(f"bad tile {mode!r}: tile:M,N,true|false,true|false")
        _patch(f"{hopper}/tile_size.h", TILE_ORIGINAL,
               f"return {{{m}, {n}, {rs}, {overlap}}};  // fastremover patch (tile variant)")
    else:
        raise SystemExit(f"unknown mode {mode!r}: f16x2, emu:N (N >= 2) or tile:M,N,RS,OVERLAP")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hopper", help="a copy of FlashAttention-3's hopper/ folder (patched in place)")
    parser.add_argument("mode", help="f16x2 | emu:N | tile:M,N,RS,OVERLAP")
    args = parser.parse_args()
    main(args.hopper, args.mode)
