"""NVFP4 Triton kernels for Hopper: quantize, dequantize and the W4A16 GEMM (packed FP4 weights, 16-bit MMA).

Format, rounding points (1)-(10) and the swizzled scale layout: fastremover/fast/nvfp4.py, whose torch functions are
the eager references of these kernels (bit-equal under TRITON_INTERPRET=1, tests/kernels/test_nvfp4.py).

    quantize_nvfp4(x, global_sf, reciprocal)   [M, K] fp16/bf16/fp32 -> Nvfp4Tensor. One program per 32 x 64 tile of
                                     the PADDED scale grid (Mpad rows x 16 Cpad columns): lanes outside x load 0, so
                                     their block amax is 0, their scale e4m3(0) = 0 - every padding scale is written,
                                     as zero, by the same code that writes the real ones. reciprocal="exact" uses IEEE
                                     divisions (div_rn); reciprocal="approx" uses rcp.approx.ftz.f32 at points (2),
                                     (6), (8) exactly where FlashInfer does (GPU only: the interpreter has no PTX).
    dequantize_nvfp4(t, dtype)      fl(e2m1 * sf * alpha) cast to dtype, alpha = fl(1 / global_sf).
    unit_weight_nvfp4(t, dtype)     W_unit * 2^-7 in fp16 or W_unit in bf16 (exact) for a cuBLAS GEMM with
                                     alpha = unit_multiplier(...): at the DiT's large M this beats the fused kernel
                                     below on H200 (docs/nvfp4.md), so Nvfp4Linear uses it by default.
    w4a16_gemm(x, t, bias, gelu)    y = (x @ W_unit^T) * alpha + bias [-> tanh-GELU], x fp16/bf16 [M, K], W [N, K].
                                     The load path unpacks two codes per byte, decodes e2m1 straight to 16-bit bit
                                     patterns, multiplies by the block scale in the MMA dtype (exact: W_unit = e2m1 * sf
                                     has at most 6 significant bits) and feeds tl.dot (wgmma on sm_90), fp32
                                     accumulation; alpha and the bias are applied to the fp32 accumulator.
    unit_gemm(a, b, alpha)          out(fl(acc * alpha)) of two bf16 matrices already holding exact units (the H3 blocks:
                                     both operands dequantized by unit_weight_nvfp4): the W4A16 GEMM's K loop with the
                                     weight tile read instead of decoded, so the same bits on the same units, faster
                                     where M is large enough that decoding in the loop is the bottleneck. On sm_90 a
                                     persistent kernel whose operand tiles arrive by TMA (unit_gemm_config).

No W4A8 kernel: an FP8 MMA needs the block scale applied after the product, but NVFP4's scale changes every 16
elements of K while an e4m3 wgmma consumes 32 per instruction, and W_unit = e2m1 * sf does not fit e4m3 (up to 6
significant bits against 4). Either the accumulator is rescaled per 16-wide K slice (which halves the MMA width and
adds an fp32 multiply-add per accumulator element per 16 K) or the weight is requantized to a coarser e4m3 scale
(then it is no longer NVFP4). docs/nvfp4.md has the argument.

Under the interpreter the e4m3 and bf16 conversions go through the bit-exact helpers of `_common` (the interpreter's
own fp32 -> e4m3 cast is wrong, and its e4m3 -> fp32 cast turns the NaN code 0x7F into 480).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastremover.fast import nvfp4 as ref
from fastremover.fast.kernels._common import (
    autotune,
    bf16_to_f32,
    check_device,
    f32_to_fp8e4m3_rne,
    interpreting,
    launch_options,
    load_f32,
    mul_rn,
    round_to,
    tma_available,
)
from fastremover.fast.kernels.quant import gelu_tanh_f32_device

RECIPROCALS = ("exact", "approx")
R6_EXACT = tl.constexpr(float(torch.reciprocal(torch.tensor(6.0, dtype=torch.float32))))
QUANT_BLOCK = (32, 64)  # rows x columns per quantize / dequantize program (4 scale columns: one swizzle column tile)
# W4A16 GEMM launch configs (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps, swap); the first is the untuned
# default. swap: the kernel computes C^T = W X^T, so the dequantized weight tile is the MMA's register operand.
GEMM_CONFIGS = [
    (128, 128, 64, 8, 4, 8, False),
    (256, 128, 64, 8, 3, 8, False),
    (128, 256, 64, 8, 3, 8, False),
    (128, 128, 128, 8, 3, 8, False),
    (128, 128, 64, 8, 4, 8, True),
    (256, 128, 64, 8, 3, 8, True),
    (128, 64, 64, 8, 4, 4, True),
]
GEMM_CONFIG_INTERPRETER = (16, 32, 32, 2, 1, 4, False)
_GEMM_TUNED: dict = {}


# ----------------------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def rcp_f32(v, APPROX: tl.constexpr):
    """1/v: rcp.approx.ftz.f32 (FlashInfer's reciprocal_approximate_ftz) or the IEEE quotient."""
    if APPROX:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        r = tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), v)
    return r


@triton.jit
def e4m3_bits_to_f32(bits, INTERPRET: tl.constexpr):
    """uint8 e4m3 bit patterns -> fp32 (exact; 0x7F / 0xFF -> NaN)."""
    v = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if INTERPRET:
        v = tl.where((bits & 0x7F) == 0x7F, float("nan"), v)
    return v


@triton.jit
def e2m1_values_f32(codes):
    """e2m1 codes (int32 0..15) -> fp32 values, exact: for a magnitude index i >= 2 the value
    2^(i//2 - 1) * (1 + (i%2)/2) has i's bits as the exponent field's low bits and the top mantissa bit once i is
    shifted to bit 22 and the exponent bias minus one is added, (i << 22) + (126 << 23); i == 1 is 0.5 (e2m1's
    subnormal), i == 0 zero; the sign goes to bit 31."""
    mag = codes & 7
    body = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 126 << 23, 0))
    return (body | ((codes & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_rn_satfinite(y):
    """fp32 -> e2m1 codes (int32), rounding point (10): ties to the even magnitude index, saturating, NaN -> 7."""
    a = tl.abs(y)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    sign = (y.to(tl.int32, bitcast=True) >> 28) & 8
    return tl.where(y != y, 7, mag | sign)


@triton.jit
def swizzled_offsets(rows, cols16, CPAD):
    """Swizzled storage offsets of scales (rows [R, 1], scale columns [1, C]) - nvfp4.swizzled_offset."""
    return ((rows // 128) * (CPAD * 128) + (cols16 // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4
            + cols16 % 4)


@triton.jit
def unpack_tile(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS/2] bytes -> [ROWS, COLS] int32 codes (low nibble = even column)."""
    b = packed.to(tl.int32)
    return tl.reshape(tl.join(b & 0xF, (b >> 4) & 0xF), (ROWS, COLS))


@triton.jit
def scales_tile(SF, rows, cols16, mask, CPAD, ROWS: tl.constexpr, COLS: tl.constexpr, INTERPRET: tl.constexpr):
    """The fp32 block scales of a [ROWS, COLS] tile, each repeated over its 16 columns (masked lanes 0)."""
    bits = tl.load(SF + swizzled_offsets(rows, cols16, CPAD), mask=mask, other=0)
    s = e4m3_bits_to_f32(bits, INTERPRET)
    return tl.reshape(tl.broadcast_to(s[:, :, None], (ROWS, COLS // 16, 16)), (ROWS, COLS))


@triton.jit
def nvfp4_tile(x, g, R: tl.constexpr, N: tl.constexpr, APPROX: tl.constexpr, INTERPRET: tl.constexpr):
    """NVFP4 of an fp32 [R, N] tile (N % 16 == 0) with global scale g: (packed uint8 [R, N/2], scale bits uint8
    [R, N/16]); the rounding points (1)-(10) of fast/nvfp4.py: (1) amax skipping NaNs (NaN only when all 16 are),
    (2)-(8) the e4m3 block scale and the output scale, (9)-(10) the scaled elements to e2m1, two per byte."""
    xb = tl.reshape(x, (R, N // 16, 16))
    a = tl.abs(xb)
    isnan = a != a
    amax = tl.max(tl.where(isnan, 0.0, a), axis=2)
    amax = tl.where(tl.sum(isnan.to(tl.int32), axis=2) == 16, float("nan"), amax)
    if APPROX:
        r6 = rcp_f32(tl.full(amax.shape, 6.0, tl.float32), APPROX)
    else:
        r6 = tl.full(amax.shape, R6_EXACT, tl.float32)
    s = mul_rn(tl.broadcast_to(g, amax.shape), mul_rn(amax, r6, INTERPRET), INTERPRET)
    sf_bits = f32_to_fp8e4m3_rne(s, INTERPRET).to(tl.uint8, bitcast=True)
    rg = rcp_f32(tl.broadcast_to(g, amax.shape), APPROX)
    p = mul_rn(e4m3_bits_to_f32(sf_bits, INTERPRET), rg, INTERPRET)
    out_scale = tl.where(amax != 0, rcp_f32(p, APPROX), 0.0)
    y = mul_rn(xb, tl.broadcast_to(out_scale[:, :, None], xb.shape), INTERPRET)
    codes = tl.reshape(e2m1_rn_satfinite(y), (R, N // 2, 2))
    lo, hi = tl.split(codes)
    return (lo | (hi << 4)).to(tl.uint8), sf_bits



# ----------------------------------------------------------------------------------------------------------------------
# Quantize


@triton.jit
def _quantize_kernel(
    X, PACKED, SF, GSF, M, K, CPAD, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, APPROX: tl.constexpr, INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    x = load_f32(X + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], inside, INTERPRET)
    packed, sf_bits = nvfp4_tile(x, tl.load(GSF), BLOCK_M, BLOCK_K, APPROX, INTERPRET)
    pcols = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(PACKED + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :], packed,
             mask=(rows[:, None] < M) & (pcols[None, :] < K // 2))
    # scales over the whole padded grid (the launch covers exactly Mpad rows x CPAD scale columns)
    c16 = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    tl.store(SF + swizzled_offsets(rows[:, None], c16[None, :], CPAD), sf_bits, mask=c16[None, :] < CPAD)


def _check_matrix(name: str, x: torch.Tensor) -> None:
    ref.check_matrix(name, x)
    if x.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride 1 along K), got strides {x.stride()}")


def quantize_nvfp4(x: torch.Tensor, global_sf: torch.Tensor | None = None, *, reciprocal: str = "exact"
                   ) -> ref.Nvfp4Tensor:
    """[M, K] fp16/bf16/fp32 (K % 16 == 0, rows contiguous) -> Nvfp4Tensor, bit-equal to nvfp4.quantize_reference
    for reciprocal="exact". global_sf: [1] fp32 on x's device (default nvfp4.global_scale_of(x), computed with torch).
    reciprocal="approx": FlashInfer's rcp.approx.ftz.f32 (GPU only)."""
    if reciprocal not in RECIPROCALS:
        raise ValueError(f"reciprocal must be one of {RECIPROCALS}, got {reciprocal!r}")
    _check_matrix("x", x)
    if global_sf is None:
        global_sf = ref.global_scale_of(x)
    if not isinstance(global_sf, torch.Tensor) or global_sf.numel() != 1 or global_sf.dtype != torch.float32:
        raise ValueError("global_sf must be a one-element fp32 tensor")
    global_sf = global_sf.reshape(1)
    check_device(_quantize_kernel, x=x, global_sf=global_sf)
    interp = interpreting(_quantize_kernel)
    if reciprocal == "approx" and interp:
        raise ValueError("reciprocal='approx' needs the GPU (rcp.approx.ftz.f32 is PTX; the interpreter cannot run it)")
    m, k = x.shape
    mpad, cpad = ref.padded_scale_shape(m, k)
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((mpad, cpad), dtype=torch.uint8, device=x.device)
    bm, bk = QUANT_BLOCK
    grid = (triton.cdiv(mpad, bm), triton.cdiv(cpad * 16, bk))
    _quantize_kernel[grid](
        x, packed, scales, global_sf, m, k, cpad, x.stride(0),
        BLOCK_M=bm, BLOCK_K=bk, APPROX=reciprocal == "approx", INTERPRET=interp, num_warps=4,
        **launch_options(_quantize_kernel),
    )
    return ref.Nvfp4Tensor(packed, scales.view(ref.FP8), global_sf.clone())


# ----------------------------------------------------------------------------------------------------------------------
# Dequantize


@triton.jit
def _dequantize_kernel(
    PACKED, SF, ALPHA, OUT, M, K, CPAD,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pcols = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    pmask = (rows[:, None] < M) & (pcols[None, :] < K // 2)
    packed = tl.load(PACKED + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :], mask=pmask, other=0)
    vals = e2m1_values_f32(unpack_tile(packed, BLOCK_M, BLOCK_K))
    c16 = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    smask = (rows[:, None] < M) & (c16[None, :] < K // 16)
    unit = vals * scales_tile(SF, rows[:, None], c16[None, :], smask, CPAD, BLOCK_M, BLOCK_K, INTERPRET)
    w = mul_rn(unit, tl.broadcast_to(tl.load(ALPHA), unit.shape), INTERPRET)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(OUT + rows[:, None].to(tl.int64) * K + cols[None, :], round_to(w, OUT_DTYPE, INTERPRET),
             mask=(rows[:, None] < M) & (cols[None, :] < K))


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _check_nvfp4(t: ref.Nvfp4Tensor) -> tuple[int, int, int]:
    if t.packed.dtype != torch.uint8 or t.packed.dim() != 2 or not t.packed.is_contiguous():
        raise ValueError("packed codes must be a contiguous 2-D uint8 tensor")
    m, k = t.shape
    if k % ref.BLOCK:
        raise ValueError(f"packed codes describe {k} columns, not a multiple of {ref.BLOCK}")
    mpad, cpad = ref.padded_scale_shape(m, k)
    if tuple(t.scales.shape) != (mpad, cpad) or t.scales.dtype != ref.FP8 or not t.scales.is_contiguous():
        raise ValueError(f"scales must be contiguous float8_e4m3fn [{mpad}, {cpad}], got {t.scales.dtype} "
                         f"{list(t.scales.shape)}")
    return m, k, cpad


def dequantize_nvfp4(t: ref.Nvfp4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Nvfp4Tensor -> [M, K] in dtype, bit-equal to nvfp4.dequantize_reference."""
    return _dequantize(t, ref.alpha_of(t.global_scale), dtype)


def _dequantize(t: ref.Nvfp4Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantize kernel: e2m1 code * e4m3 block scale * factor (a 1-element fp32 device tensor), [M, K] in dtype."""
    m, k, cpad = _check_nvfp4(t)
    if dtype not in _TL_DTYPES:
        raise ValueError(f"dtype must be one of {list(_TL_DTYPES)}, got {dtype}")
    check_device(_dequantize_kernel, packed=t.packed, scales=t.scales, alpha=factor)
    out = torch.empty((m, k), dtype=dtype, device=t.packed.device)
    bm, bk = QUANT_BLOCK
    _dequantize_kernel[(triton.cdiv(m, bm), triton.cdiv(k, bk))](
        t.packed, t.scales.view(torch.uint8), factor, out, m, k, cpad,
        BLOCK_M=bm, BLOCK_K=bk, OUT_DTYPE=_TL_DTYPES[dtype], INTERPRET=interpreting(_dequantize_kernel),
        num_warps=4, **launch_options(_dequantize_kernel),
    )
    return out


UNIT_SHIFT = 2.0 ** -7  # fp16 unit weights are stored times this (the W4A16 kernel's tile uses the same factor)


def unit_multiplier(global_sf: torch.Tensor, dtype: torch.dtype) -> float:
    """The host float that turns unit_weight_nvfp4(t, dtype) into the dequantized weight: alpha / 2^-7 for fp16,
    alpha for bf16/fp32 (alpha = fl(1 / global_sf); exact: a power-of-two factor). Reads the GPU once: call it once
    per layer, not per GEMM."""
    return float(ref.alpha_of(global_sf)) / (UNIT_SHIFT if dtype == torch.float16 else 1.0)


def unit_weight_nvfp4(t: ref.Nvfp4Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[N, K] in dtype, exact: fp16 W_unit * 2^-7 (the W4A16 kernel's shift; W_unit = e2m1 * sf in [2^-10, 2688] keeps
    its lowest bit >= 2^-17 there), bf16/fp32 W_unit. Times unit_multiplier(...) it is the dequantized weight; fed
    to cuBLAS with that multiplier as the GEMM's alpha, the weight never rounds (as in w4a16_gemm)."""
    shift = UNIT_SHIFT if dtype == torch.float16 else 1.0
    return _dequantize(t, torch.full((1,), shift, dtype=torch.float32, device=t.packed.device), dtype)


# ----------------------------------------------------------------------------------------------------------------------
# W4A16 GEMM


@triton.jit
def e2m1_fp16_scaled(codes):
    """e2m1 codes (int32) -> fp16 values times 2^-14, exactly, in two integer ops: with the magnitude index in fp16's
    bits 9-11 the exponent field is e2m1's and the top mantissa bit its mantissa, so the fp16 value is
    2^(e - 15) (1 + m/2) = e2m1 * 2^-14 for e >= 1, and the subnormal m * 2^-1 * 2^-14 for e == 0."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _weight_tile(PACKED, SF, ncols, k0, N, K, CPAD, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 A_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile for the MMA in A_DTYPE: fp16 W_unit * 2^-7 (the 2^7 goes into alpha), bf16
    and the interpreter's bf16 stand-in fp32 W_unit; exact either way (see w4a16_gemm)."""
    pk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(PACKED + ncols[:, None].to(tl.int64) * (K // 2) + pk[None, :],
                     mask=(ncols[:, None] < N) & (pk[None, :] < K // 2), other=0)
    codes = unpack_tile(packed, BLOCK_N, BLOCK_K)
    c16 = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    sf = scales_tile(SF, ncols[:, None], c16[None, :], (ncols[:, None] < N) & (c16[None, :] < K // 16), CPAD,
                     BLOCK_N, BLOCK_K, INTERPRET)
    if A_DTYPE == tl.float16:
        # (e2m1 * 2^-14) * (sf * 2^7): sf * 2^7 <= 57344 fits fp16, the product's lowest bit is >= 2^-17 > 2^-24
        w = e2m1_fp16_scaled(codes) * (sf * 128.0).to(tl.float16)
    elif INTERPRET:
        w = e2m1_values_f32(codes) * sf  # the interpreter's bf16 arithmetic is unreliable: fp32, same values
    else:
        w = (e2m1_values_f32(codes) * sf).to(tl.bfloat16)
    return w


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles sweep the columns together, so
    their weight tiles stay in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def mma_operand(v, INTERPRET: tl.constexpr):
    """A loaded 16-bit MMA operand tile: as stored, or under the interpreter a bf16 tile widened exactly to fp32 (the
    interpreter's bf16 arithmetic is unreliable; the values are the same)."""
    if INTERPRET and v.dtype == tl.bfloat16:
        v = bf16_to_f32(v, INTERPRET)
    return v


@triton.jit
def load_mma_operand(ptrs, mask, INTERPRET: tl.constexpr):
    """mma_operand of a masked load (masked lanes 0)."""
    return mma_operand(tl.load(ptrs, mask=mask, other=0.0), INTERPRET)


@triton.jit
def _w4a16_kernel(
    A, PACKED, SF, ALPHA, BIAS, C, M, N, K, CPAD, stride_am, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ncols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_dtype: tl.constexpr = A.dtype.element_ty
    if SWAP:  # C^T = W X^T: the dequantized tile is wgmma's register operand, X's tile the shared-memory one
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = A + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
        a_mask = (rows[:, None] < M) & (ks[None, :] < K)
        a = load_mma_operand(a_ptrs, a_mask, INTERPRET)
        w = _weight_tile(PACKED, SF, ncols, k0, N, K, CPAD, BLOCK_N, BLOCK_K, a_dtype, INTERPRET)
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if SWAP:
        acc = tl.trans(acc)
    alpha = tl.load(ALPHA)
    if a_dtype == tl.float16:
        alpha = alpha * 128.0  # exact: undoes the tile's 2^-7
    y = mul_rn(acc, tl.broadcast_to(alpha, acc.shape), INTERPRET)
    if HAS_BIAS:
        y = y + load_f32(BIAS + ncols, ncols < N, INTERPRET)[None, :]
    if GELU:
        y = gelu_tanh_f32_device(y, INTERPRET)
    tl.store(C + rows[:, None].to(tl.int64) * stride_cm + ncols[None, :], round_to(y, C.dtype.element_ty, INTERPRET),
             mask=(rows[:, None] < M) & (ncols[None, :] < N))


def w4a16_available(device: torch.device) -> bool:
    """The W4A16 Triton GEMM is the fast path here: an sm_90 GPU (its launch configs are Hopper's), or the
    interpreter (tests)."""
    if interpreting(_w4a16_kernel):
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def w4a16_gemm(x: torch.Tensor, t: ref.Nvfp4Tensor, bias: torch.Tensor | None = None, *, gelu: bool = False,
               alpha: torch.Tensor | None = None, config: tuple | None = None, tune: bool = False) -> torch.Tensor:
    """x [M, K] fp16/bf16 (rows contiguous) @ NVFP4 weight [N, K]^T -> [M, N] in x.dtype:
    (x @ W_unit^T) * alpha (+ bias) (-> tanh-GELU, quant.py's sigmoid form), fp32 accumulation. The math of
    nvfp4.w4a16_linear_reference; bit-equal to it when every product and partial sum is exact in fp32 (the
    accumulation order is tl.dot's). alpha: [1] fp32 = nvfp4.alpha_of(t.global_scale), precomputed by the caller
    (saves a launch per call). tune: pick the fastest of GEMM_CONFIGS once per shape (GPU)."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be a 2-D fp16/bf16 tensor, got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have contiguous rows, got strides {x.stride()}")
    n, k, cpad = _check_nvfp4(t)
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {k}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {list(bias.shape)}")
    if alpha is None:
        alpha = ref.alpha_of(t.global_scale)
    check_device(_w4a16_kernel, x=x, packed=t.packed, scales=t.scales, bias=bias, alpha=alpha)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    interp = interpreting(_w4a16_kernel)

    def launch(cfg):
        bm, bn, bk, group_m, stages, warps, swap = cfg
        _w4a16_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
            x, t.packed, t.scales.view(torch.uint8), alpha, bias if bias is not None else alpha, out,
            m, n, k, cpad, x.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, SWAP=swap, HAS_BIAS=bias is not None, GELU=gelu,
            INTERPRET=interp, num_stages=stages, num_warps=warps, **launch_options(_w4a16_kernel),
        )

    if config is None:
        if interp:
            config = GEMM_CONFIG_INTERPRETER
        else:
            config = autotune(_GEMM_TUNED, (m, n, k, x.dtype, gelu, bias is not None), GEMM_CONFIGS, launch,
                              enabled=tune, what="w4a16_gemm", device=x.device)
    launch(config)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Unit GEMM: both operands already dequantized to their exact 16-bit unit values


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps, tma). tma=False: one program per output tile, operand tiles
# by masked pointer loads. tma=True: persistent (one program per SM, looping over the output tiles in grouped order),
# operand tiles by TMA copies from host tensor descriptors (rows and columns outside the matrix arrive as zeros, as
# the masked loads' other=0). The K loop is the same for every config: tl.dot's fp32 accumulation over BLOCK_K
# slices in increasing k, so the result depends on K only (not on M, N, the tile shape or how a tile is loaded;
# tests/kernels/test_h3_gpu.py and tools/profile_h3.py --gemm-sweep check that bit for bit at the H3 decoder's shapes).
UNIT_GEMM_CONFIGS = [
    (128, 256, 64, 8, 3, 8, False),
    (128, 128, 64, 8, 4, 8, False),
    (256, 128, 64, 8, 3, 8, False),
    (128, 128, 64, 8, 3, 8, False),
    (128, 128, 64, 8, 5, 4, False),
    (128, 128, 64, 8, 5, 4, True),
    (128, 128, 64, 8, 4, 8, True),
    (128, 256, 64, 8, 4, 8, True),
    (128, 256, 64, 8, 3, 8, True),
    (256, 128, 64, 8, 3, 8, True),
]
UNIT_GEMM_CONFIG_INTERPRETER = (16, 32, 32, 2, 1, 4, False)
# On sm_90 the TMA kernel: 128 x 128 tiles, five stages, four warps where both N and K are at most
# UNIT_GEMM_NARROW (the H3 blocks' q/k/v/o: N = K = 2048); 128 x 256 tiles, four stages, eight warps otherwise (ff1:
# N = 16384, ff2: K = 8192): the fastest of the sweep at each of those shapes (docs/performance.md, session 19).
# Operands a TMA descriptor cannot address (a row stride not a multiple of 16 bytes, a base address not 16-byte
# aligned) take the pointer kernel at the same tile shape, with the same bits.
UNIT_GEMM_NARROW = 4096
UNIT_GEMM_SMALL = (128, 128, 64, 8, 5, 4, True)
UNIT_GEMM_LARGE = (128, 256, 64, 8, 4, 8, True)


def unit_gemm_config(m: int, n: int, k: int) -> tuple:
    """The unit GEMM's launch config for an [m, k] @ [n, k]^T call on a GPU: a fixed function of the shape (never
    timed per call). Every config gives the same bits (the K loop above), so this choice changes speed only."""
    return UNIT_GEMM_SMALL if n <= UNIT_GEMM_NARROW and k <= UNIT_GEMM_NARROW else UNIT_GEMM_LARGE


@triton.jit
def _unit_gemm_kernel(
    A, B, ALPHA, C, M, N, K, stride_am, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ncols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = A + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
        b_ptrs = B + ncols[:, None].to(tl.int64) * stride_bn + ks[None, :]
        a_mask = (rows[:, None] < M) & (ks[None, :] < K)
        b_mask = (ncols[:, None] < N) & (ks[None, :] < K)
        acc = tl.dot(load_mma_operand(a_ptrs, a_mask, INTERPRET), tl.trans(load_mma_operand(b_ptrs, b_mask, INTERPRET)),
                     acc)
    y = mul_rn(acc, tl.broadcast_to(tl.load(ALPHA), acc.shape), INTERPRET)
    tl.store(C + rows[:, None].to(tl.int64) * stride_cm + ncols[None, :], round_to(y, C.dtype.element_ty, INTERPRET),
             mask=(rows[:, None] < M) & (ncols[None, :] < N))


@triton.jit
def _unit_gemm_tma_kernel(
    a_desc, b_desc, ALPHA, C, M, N, K, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, INTERPRET: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    alpha = tl.load(ALPHA)
    # persistent: program p computes tiles p, p + NUM_PROGRAMS, ... (grid = min(NUM_PROGRAMS, tiles))
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # the pointer kernel's K loop
            a = mma_operand(a_desc.load([pid_m * BLOCK_M, k0]), INTERPRET)
            b = mma_operand(b_desc.load([pid_n * BLOCK_N, k0]), INTERPRET)
            acc = tl.dot(a, tl.trans(b), acc)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ncols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y = mul_rn(acc, tl.broadcast_to(alpha, acc.shape), INTERPRET)
        tl.store(C + rows[:, None].to(tl.int64) * stride_cm + ncols[None, :],
                 round_to(y, C.dtype.element_ty, INTERPRET), mask=(rows[:, None] < M) & (ncols[None, :] < N))


def _tma_addressable(t: torch.Tensor) -> bool:
    """A 2-D tensor with contiguous rows that a TMA descriptor can address: 16-byte aligned base and row stride."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def unit_gemm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
              config: tuple | None = None) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T with both in bf16 (rows contiguous), fp32 accumulation, -> out_dtype(fl(acc * alpha));
    alpha: [1] fp32 device tensor. For exact unit values (unit_weight_nvfp4 of two NVFP4 tensors) this is the W4A16
    GEMM's result on the same units bit for bit (same tl.dot K loop, the weight tile read instead of decoded), and its
    K-only accumulation order makes a row's result independent of the other rows. config: one of
    UNIT_GEMM_CONFIGS (default unit_gemm_config(M, N, K): a fixed function of the shape, never tuned per call)."""
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2 or t.dtype != torch.bfloat16 or t.stride(1) != 1:
            raise ValueError(f"{name} must be a 2-D bf16 tensor with contiguous rows, got {t.dtype} "
                             f"{list(t.shape)} strides {t.stride()}")
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"a has {k} columns, b {b.shape[1]}")
    if not isinstance(alpha, torch.Tensor) or alpha.numel() != 1 or alpha.dtype != torch.float32:
        raise ValueError("alpha must be a one-element fp32 tensor")
    check_device(_unit_gemm_tma_kernel, a=a, b=b, alpha=alpha)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    interp = interpreting(_unit_gemm_tma_kernel)
    if config is None:
        config = UNIT_GEMM_CONFIG_INTERPRETER if interp else unit_gemm_config(m, n, k)
    bm, bn, bk, group_m, stages, warps, tma = config
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if tma and tma_available(_unit_gemm_tma_kernel, a.device) and _tma_addressable(a) and _tma_addressable(b):
        from triton.tools.tensor_descriptor import TensorDescriptor

        # one program per SM (under the interpreter 4, so that each program loops over several tiles)
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
        _unit_gemm_tma_kernel[(min(programs, tiles),)](
            TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, bk]),
            TensorDescriptor(b, [n, k], [b.stride(0), 1], [bn, bk]),
            alpha, out, m, n, k, out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, NUM_PROGRAMS=programs, INTERPRET=interp,
            num_stages=stages, num_warps=warps, **launch_options(_unit_gemm_tma_kernel),
        )
        return out
    _unit_gemm_kernel[(tiles,)](
        a, b, alpha, out, m, n, k, a.stride(0), b.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, INTERPRET=interp, num_stages=stages, num_warps=warps,
        **launch_options(_unit_gemm_kernel),
    )
    return out
