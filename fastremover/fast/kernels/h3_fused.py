"""Fused Triton kernels of the NVFP4 MiniMax-H3 decoder block, bit-identical to its eager op-by-op path.

The eager references are in fastremover/fast/h3_nvfp4.py (the eager block calls them); that module's docstring lists
every rounding point. Here, per kernel:

    residual_norm_quantize(h, residual, norm)   h fp32 [M, D] updated IN PLACE:
        residual (o bf16 [M, D], bias bf16 [D], scale fp32 [D]):  h = fl(h + mul.rn(fp32(bf16(o + bias)), scale))
        norm (gamma fp32 [D], eps, global_sf [1]):  returns NVFP4(bf16(mul.rn(mul.rn(h, rstd), gamma)))
            rstd = div.rn(1, sqrt.rn(fl(mul.rn(sumsq, fl(1/D)) + eps))), sumsq in the fixed lane order of
            h3_nvfp4.sumsq_reference: T = min(128, D/4) lanes, each accumulates fl(acc + mul.rn(x, x)) over its
            4-wide vectors in column order, then shuffle-down trees (within warps of 32, then over the warps).
        One program per R rows holds the lane partials [R, T] and loops over the D / 4T column chunks (static);
        with both parts it stores h, then re-reads it for the normalization (a barrier between).
    qkv_epilogue(q, k, v, bq, bk, bv, cos, sin)  -> q, k, v bf16 [M, H, Dh]: bias, per-head RMSNorm, partial RoPE
        (each rotary element's partner, d +- R/2, is recomputed from its own load rather than shuffled), v + bias.
    swiglu_quantize(u, bias, global_sf)          u bf16 [M, 2F] value first -> NVFP4 of
        bf16(mul.rn(bf16(value + b), bf16(div.rn(g, 1 + exp(-g))))), g = bf16(gate + b).

Products that the eager path rounds before an add go through `mul.rn` (_common.mul_rn; with enable_fp_fusion=False
on every launch as well), so nothing is contracted into an FMA. NVFP4 quantization follows nvfp4.py's rounding
points (1)-(10) with reciprocal="exact" (IEEE divisions, bit-equal to the torch reference) or "approx"
(rcp.approx.ftz.f32, FlashInfer's, GPU only). Padding: the quantizing kernels run over the 128-row padded scale grid;
padding rows read as zero (swiglu forces them to zero, so the bias cannot leak in), so their block scales are
written as 0; scale columns past D / 16 (only when D / 16 is not a multiple of 4) are zeroed by the allocation.

bf16 rounding (`bf16_rn`) is one inline-PTX cvt.rn.bf16.f32 on the GPU, so the compiler cannot fold a round trip
into a neighbouring add. Under TRITON_INTERPRET=1: bf16 conversions use _common's exact emulation; `exp` is numpy's (the GPU uses libdevice
expf, as ATen's CUDA silu); sqrt.rn / div.rn are numpy's IEEE operations. So the interpreter reproduces the GPU's
rounding everywhere except exp, and the tests compare swiglu_quantize with its reference given numpy's exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastremover.fast import nvfp4 as ref
from fastremover.fast.kernels._common import interpreting, launch_options, load_f32, mul_rn, round_through, round_to
from fastremover.fast.kernels.nvfp4 import nvfp4_tile, swizzled_offsets

try:  # the GPU exponential (CUDA's expf); absent in CPU-only builds of Triton
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover
    libdevice = None

ROWS = 4  # rows per program of the row kernels (GPU)
ROWS_INTERPRETER = 256  # the interpreter pays per program: fewer, larger ones
SWIGLU_BLOCK = (8, 64)  # rows x columns per swiglu program (GPU)
SWIGLU_BLOCK_INTERPRETER = (256, 128)


def norm_lanes(width: int) -> int:
    """The lane count T of the fixed RMSNorm summation order for rows of `width` (a power-of-two lane count)."""
    t = min(128, width // 4)
    if width % 4 or t < 1 or t & (t - 1) or width % (4 * t):
        raise ValueError(f"row width {width}: the RMSNorm order needs width = 4 * T * k with T = min(128, width / 4) "
                         "a power of two")
    return t


# ----------------------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def bf16_rn(v, INTERPRET: tl.constexpr):
    """fp32 -> the nearest-even bf16 value, kept in fp32. On the GPU one inline-PTX cvt.rn.bf16.f32 (the bits moved
    back to the high half), so the compiler cannot fold the round trip into a neighbouring add; under the
    interpreter _common's exact emulation."""
    if INTERPRET:
        out = round_through(v, tl.bfloat16, INTERPRET)
    else:
        out = tl.inline_asm_elementwise("{ .reg .b16 t; cvt.rn.bf16.f32 t, $1; mov.b32 $0, {0, t}; }", "=r,r", [v],
                                        dtype=tl.float32, is_pure=True, pack=1)
    return out


@triton.jit
def store_nvfp4_tile(PACKED, SF, packed, sf_bits, rows, col0, M, MPAD, K, CPAD, R: tl.constexpr, N: tl.constexpr):
    """Codes of rows < M, scales of rows < MPAD (padding rows: the zeros computed for them), columns col0..col0+N."""
    pcols = col0 // 2 + tl.arange(0, N // 2)
    tl.store(PACKED + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :], packed,
             mask=(rows[:, None] < M) & (pcols[None, :] < K // 2))
    c16 = col0 // 16 + tl.arange(0, N // 16)
    tl.store(SF + swizzled_offsets(rows[:, None], c16[None, :], CPAD), sf_bits,
             mask=(rows[:, None] < MPAD) & (c16[None, :] < K // 16))


@triton.jit
def halve(s, R: tl.constexpr, W: tl.constexpr, L: tl.constexpr):
    """[R, W, L] -> [R, W, L/2]: lane t += lane t + L/2 (one shuffle-down step)."""
    return tl.sum(tl.reshape(s, (R, W, 2, L // 2)), axis=2)


@triton.jit
def lane_tree(s, R: tl.constexpr, W: tl.constexpr, L: tl.constexpr):
    """[R, W, L] (L a power of two <= 32) -> [R, W] by halving steps L/2, ..., 1."""
    if L >= 32:
        s = halve(s, R, W, 32)
    if L >= 16:
        s = halve(s, R, W, 16)
    if L >= 8:
        s = halve(s, R, W, 8)
    if L >= 4:
        s = halve(s, R, W, 4)
    if L >= 2:
        s = halve(s, R, W, 2)
    return tl.reshape(s, (R, W))


@triton.jit
def add_squares(acc, x, R: tl.constexpr, T: tl.constexpr, INTERPRET: tl.constexpr):
    """acc [R, T] += the squares of x [R, 4T] (lane t owns columns 4t..4t+3), one rounded add per element, in order."""
    sq = mul_rn(x, x, INTERPRET)
    evens, odds = tl.split(tl.reshape(sq, (R, T, 2, 2)))  # (element 4t + 2a + b) -> b = 0 / 1
    s0, s2 = tl.split(evens)
    s1, s3 = tl.split(odds)
    acc = acc + s0
    acc = acc + s1
    acc = acc + s2
    return acc + s3


@triton.jit
def rstd_of(acc, inv_w, eps, R: tl.constexpr, LANES: tl.constexpr, WARPS: tl.constexpr, INTERPRET: tl.constexpr):
    """Lane partials [R, T = WARPS * LANES] -> rstd [R]: the shuffle trees (within warps of LANES, then over the
    WARPS), then div.rn(1, sqrt.rn(fl(mul.rn(s, 1/W) + eps)))."""
    per_warp = lane_tree(tl.reshape(acc, (R, WARPS, LANES)), R, WARPS, LANES)
    total = lane_tree(tl.reshape(per_warp, (R, 1, WARPS)), R, 1, WARPS)
    sigma2 = tl.reshape(total, (R,))
    v = mul_rn(sigma2, tl.full(sigma2.shape, inv_w, tl.float32), INTERPRET) + eps
    return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), tl.sqrt_rn(v))


# ----------------------------------------------------------------------------------------------------------------------
# residual_norm_quantize


@triton.jit
def _residual_norm_quantize_kernel(
    H, O, BIAS, SCALE, GAMMA, GSF, PACKED, SF, M, MPAD, CPAD, inv_d, eps,
    D: tl.constexpr, T: tl.constexpr, LANES: tl.constexpr, R: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_NORM: tl.constexpr, APPROX: tl.constexpr, INTERPRET: tl.constexpr,
):
    CH: tl.constexpr = 4 * T
    rows = tl.program_id(0) * R + tl.arange(0, R)
    row_ok = rows[:, None] < M
    base = rows[:, None].to(tl.int64) * D
    acc = tl.zeros((R, T), dtype=tl.float32)
    for k in tl.static_range(D // CH):
        cols = k * CH + tl.arange(0, CH)
        h = tl.load(H + base + cols[None, :], mask=row_ok, other=0.0)
        if HAS_RESIDUAL:
            o = load_f32(O + base + cols[None, :], row_ok, INTERPRET)
            biased = bf16_rn(o + load_f32(BIAS + cols, cols < D, INTERPRET)[None, :], INTERPRET)
            h = h + mul_rn(biased, tl.broadcast_to(tl.load(SCALE + cols)[None, :], biased.shape), INTERPRET)
            tl.store(H + base + cols[None, :], h, mask=row_ok)
        if HAS_NORM:
            acc = add_squares(acc, h, R, T, INTERPRET)
    if HAS_NORM:
        rstd = rstd_of(acc, inv_d, eps, R, LANES, T // LANES, INTERPRET)
        g = tl.load(GSF)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # the stores above are read back by other threads of this program
        for k in tl.static_range(D // CH):
            cols = k * CH + tl.arange(0, CH)
            h = tl.load(H + base + cols[None, :], mask=row_ok, other=0.0)
            y = mul_rn(h, tl.broadcast_to(rstd[:, None], h.shape), INTERPRET)
            y = mul_rn(y, tl.broadcast_to(tl.load(GAMMA + cols)[None, :], y.shape), INTERPRET)
            packed, sf_bits = nvfp4_tile(bf16_rn(y, INTERPRET), g, R, CH, APPROX, INTERPRET)
            store_nvfp4_tile(PACKED, SF, packed, sf_bits, rows, k * CH, M, MPAD, D, CPAD, R, CH)


def _new_nvfp4(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    mpad, cpad = ref.padded_scale_shape(m, k)
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=device)
    alloc = torch.zeros if cpad * ref.BLOCK != k else torch.empty  # padding scale columns: zeroed here
    scales = alloc((mpad, cpad), dtype=torch.uint8, device=device)
    return packed, scales, mpad, cpad


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {list(shape)}, got {got}")


def _check_gsf(gsf: torch.Tensor) -> None:
    if not isinstance(gsf, torch.Tensor) or gsf.numel() != 1 or gsf.dtype != torch.float32:
        raise ValueError("global_sf must be a one-element fp32 tensor")


def _check_reciprocal(reciprocal: str, kernel) -> bool:
    if reciprocal not in ("exact", "approx"):
        raise ValueError(f"reciprocal must be 'exact' or 'approx', got {reciprocal!r}")
    if reciprocal == "approx" and interpreting(kernel):
        raise ValueError("reciprocal='approx' needs the GPU (rcp.approx.ftz.f32 is PTX)")
    return reciprocal == "approx"


def residual_norm_quantize(h: torch.Tensor, residual=None, norm=None, *, reciprocal: str = "exact"
                           ) -> ref.Nvfp4Tensor | None:
    """In place on h (contiguous fp32 [M, D]): residual = (o bf16 [M, D], bias bf16 [D], scale fp32 [D]) adds
    bf16(o + bias) * scale; norm = (gamma fp32 [D], eps, global_sf [1] fp32) returns NVFP4 of the bf16 RMSNorm of
    the updated h. Equal to h3_nvfp4.residual_norm_quantize_reference (its h and its Nvfp4Tensor)."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError("h must be a contiguous fp32 [M, D] tensor")
    m, d = h.shape
    t = norm_lanes(d)
    approx = _check_reciprocal(reciprocal, _residual_norm_quantize_kernel)
    if residual is None and norm is None:
        return None
    o, bias, scale = residual if residual is not None else (h, h, h)
    if residual is not None:
        _check("o", o, (m, d), torch.bfloat16)
        _check("bias", bias, (d,), torch.bfloat16)
        _check("scale", scale, (d,), torch.float32)
    gamma, eps, gsf = norm if norm is not None else (h, 0.0, h.new_ones(1))
    if norm is not None:
        _check("gamma", gamma, (d,), torch.float32)
        _check_gsf(gsf)
        packed, scales, mpad, cpad = _new_nvfp4(m, d, h.device)
    else:
        packed, scales, mpad, cpad = h, h, m, 4
    rows = mpad if norm is not None else m
    inv_d = float(torch.tensor(1.0 / d, dtype=torch.float32))
    interp = interpreting(_residual_norm_quantize_kernel)
    rp = ROWS_INTERPRETER if interp else ROWS
    _residual_norm_quantize_kernel[(triton.cdiv(rows, rp),)](
        h, o, bias, scale, gamma, gsf, packed, scales, m, mpad, cpad, inv_d, float(eps),
        D=d, T=t, LANES=min(t, 32), R=rp, HAS_RESIDUAL=residual is not None, HAS_NORM=norm is not None, APPROX=approx,
        INTERPRET=interp, num_warps=4,
        **launch_options(_residual_norm_quantize_kernel),
    )
    if norm is None:
        return None
    return ref.Nvfp4Tensor(packed, scales.view(ref.FP8), gsf.reshape(1).clone())


# ----------------------------------------------------------------------------------------------------------------------
# swiglu_quantize


@triton.jit
def _exp_f32(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        e = tl.exp(x)
    else:
        e = libdevice.exp(x)  # __nv_expf: the expf ATen's CUDA silu calls (tl.exp would be ex2.approx-based)
    return e


@triton.jit
def _swiglu_quantize_kernel(
    U, BIAS, GSF, PACKED, SF, M, MPAD, CPAD,
    F: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, APPROX: tl.constexpr, INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (rows[:, None] < M) & (cols[None, :] < F)
    base = rows[:, None].to(tl.int64) * (2 * F) + cols[None, :]
    value = bf16_rn(load_f32(U + base, ok, INTERPRET) + load_f32(BIAS + cols, cols < F, INTERPRET)[None, :], INTERPRET)
    gate = bf16_rn(load_f32(U + base + F, ok, INTERPRET)
                   + load_f32(BIAS + F + cols, cols < F, INTERPRET)[None, :], INTERPRET)
    silu = bf16_rn(tl.math.div_rn(gate, 1.0 + _exp_f32(-gate, INTERPRET)), INTERPRET)
    hidden = bf16_rn(mul_rn(value, silu, INTERPRET), INTERPRET)
    hidden = tl.where(ok, hidden, 0.0)  # padding rows and columns: zero, whatever the bias
    packed, sf_bits = nvfp4_tile(hidden, tl.load(GSF), R, BN, APPROX, INTERPRET)
    pcols = tl.program_id(1) * (BN // 2) + tl.arange(0, BN // 2)
    tl.store(PACKED + rows[:, None].to(tl.int64) * (F // 2) + pcols[None, :], packed,
             mask=(rows[:, None] < M) & (pcols[None, :] < F // 2))
    c16 = tl.program_id(1) * (BN // 16) + tl.arange(0, BN // 16)
    tl.store(SF + swizzled_offsets(rows[:, None], c16[None, :], CPAD), sf_bits,
             mask=(rows[:, None] < MPAD) & (c16[None, :] < CPAD))


def swiglu_quantize(u: torch.Tensor, bias: torch.Tensor, global_sf: torch.Tensor, *, reciprocal: str = "exact"
                    ) -> ref.Nvfp4Tensor:
    """u bf16 [M, 2F] (value first, contiguous), bias bf16 [2F] -> NVFP4 [M, F] of the bf16 SwiGLU; equal to
    h3_nvfp4.swiglu_quantize_reference (on the GPU; under the interpreter given numpy's exp)."""
    if not isinstance(u, torch.Tensor) or u.dim() != 2 or u.shape[1] % 32:
        raise ValueError("u must be a [M, 2F] tensor with F a multiple of 16")
    m, f = u.shape[0], u.shape[1] // 2
    _check("u", u, (m, 2 * f), torch.bfloat16)
    _check("bias", bias, (2 * f,), torch.bfloat16)
    _check_gsf(global_sf)
    approx = _check_reciprocal(reciprocal, _swiglu_quantize_kernel)
    mpad, cpad = ref.padded_scale_shape(m, f)
    packed = torch.empty((m, f // 2), dtype=torch.uint8, device=u.device)
    scales = torch.empty((mpad, cpad), dtype=torch.uint8, device=u.device)  # the grid covers all of it
    bm, bn = SWIGLU_BLOCK_INTERPRETER if interpreting(_swiglu_quantize_kernel) else SWIGLU_BLOCK
    _swiglu_quantize_kernel[(triton.cdiv(mpad, bm), triton.cdiv(cpad * 16, bn))](
        u, bias, global_sf, packed, scales, m, mpad, cpad, F=f, R=bm, BN=bn, APPROX=approx,
        INTERPRET=interpreting(_swiglu_quantize_kernel), num_warps=4, **launch_options(_swiglu_quantize_kernel),
    )
    return ref.Nvfp4Tensor(packed, scales.view(ref.FP8), global_sf.reshape(1).clone())


# ----------------------------------------------------------------------------------------------------------------------
# qkv_epilogue


@triton.jit
def _qkv_epilogue_kernel(
    Q, K, V, BQ, BK, BV, COS, SIN, QO, KO, VO, M, S, inv_dh, eps,
    H: tl.constexpr, DH: tl.constexpr, ROT: tl.constexpr, RT: tl.constexpr, INTERPRET: tl.constexpr,
):
    D: tl.constexpr = H * DH
    which = tl.program_id(1)
    RH: tl.constexpr = RT * H
    hr = tl.arange(0, RH)
    tokens = tl.program_id(0) * RT + hr // H
    ok = (tokens < M)[:, None]
    base = tokens.to(tl.int64)[:, None] * D + ((hr % H) * DH)[:, None]
    bbase = ((hr % H) * DH)[:, None]
    d = tl.arange(0, DH)[None, :]
    if which == 2:
        v = bf16_rn(load_f32(V + base + d, ok, INTERPRET) + load_f32(BV + bbase + d, d < DH, INTERPRET), INTERPRET)
        tl.store(VO + base + d, round_to(v, tl.bfloat16, INTERPRET), mask=ok)
    else:
        src, bias, dst = Q, BQ, QO
        if which == 1:
            src, bias, dst = K, BK, KO
        x = bf16_rn(load_f32(src + base + d, ok, INTERPRET) + load_f32(bias + bbase + d, d < DH, INTERPRET), INTERPRET)
        T: tl.constexpr = DH // 4
        acc = add_squares(tl.zeros((RH, T), dtype=tl.float32), x, RH, T, INTERPRET)
        rstd = rstd_of(acc, inv_dh, eps, RH, T, 1, INTERPRET)[:, None]  # DH <= 128: one warp of DH / 4 lanes
        normed = bf16_rn(mul_rn(x, tl.broadcast_to(rstd, x.shape), INTERPRET), INTERPRET)
        HALF: tl.constexpr = ROT // 2
        rotary = d < ROT
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        px = bf16_rn(load_f32(src + base + partner, ok & rotary, INTERPRET)
                     + load_f32(bias + bbase + partner, rotary, INTERPRET), INTERPRET)
        pn = bf16_rn(mul_rn(px, tl.broadcast_to(rstd, px.shape), INTERPRET), INTERPRET)
        rotated = tl.where(d < HALF, -pn, pn)
        trig = (tokens % S).to(tl.int64)[:, None] * ROT + d
        cos = load_f32(COS + trig, ok & rotary, INTERPRET)
        sin = load_f32(SIN + trig, ok & rotary, INTERPRET)
        a = bf16_rn(mul_rn(normed, cos, INTERPRET), INTERPRET)
        b = bf16_rn(mul_rn(rotated, sin, INTERPRET), INTERPRET)
        out = tl.where(rotary, bf16_rn(a + b, INTERPRET), normed)
        tl.store(dst + base + d, round_to(out, tl.bfloat16, INTERPRET), mask=ok)


def qkv_epilogue(q, k, v, bq, bk, bv, cos, sin, *, heads: int, eps: float):
    """q, k, v bf16 [M, D] (contiguous GEMM outputs), biases bf16 [D], cos/sin bf16 [S, R] (row m is token m % S)
    -> q, k, v bf16 [M, H, Dh]; equal to h3_nvfp4.qkv_epilogue_reference."""
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise ValueError("q must be a 2-D [M, D] tensor")
    m, d = q.shape
    if heads < 1 or d % heads:
        raise ValueError(f"D={d} is not a multiple of heads={heads}")
    dh = d // heads
    if dh & (dh - 1) or not 8 <= dh <= 128 or heads & (heads - 1):
        raise ValueError("the kernel needs power-of-two heads and head dims in [8, 128]")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(name, t, (m, d), torch.bfloat16)
    for name, t in (("bq", bq), ("bk", bk), ("bv", bv)):
        _check(name, t, (d,), torch.bfloat16)
    if cos.dim() != 2 or m % max(cos.shape[0], 1):
        raise ValueError(f"cos must be [S, R] with M={m} a multiple of S")
    s, r = cos.shape
    _check("cos", cos, (s, r), torch.bfloat16)
    _check("sin", sin, (s, r), torch.bfloat16)
    if r % 2 or r > dh:
        raise ValueError(f"the rotary width {r} must be even and at most the head dim {dh}")
    outs = [torch.empty((m, heads, dh), dtype=torch.bfloat16, device=q.device) for _ in range(3)]
    rt = max(1, 512 // heads) if interpreting(_qkv_epilogue_kernel) else max(1, 128 // heads)
    inv_dh = float(torch.tensor(1.0 / dh, dtype=torch.float32))
    _qkv_epilogue_kernel[(triton.cdiv(m, rt), 3)](
        q, k, v, bq, bk, bv, cos, sin, *outs, m, s, inv_dh, float(eps), H=heads, DH=dh, ROT=r, RT=rt,
        INTERPRET=interpreting(_qkv_epilogue_kernel), num_warps=4, **launch_options(_qkv_epilogue_kernel),
    )
    return tuple(outs)
