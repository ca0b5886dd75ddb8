"""Fused q/k RMSNorm (across all heads) + 3D RoPE, one program per token row.

Replaces this eager composition of fastremover/models/transformer.py (SelfAttention.forward, for q and for k):

    n = RMSNorm(x)                       # (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype) * weight
    out = apply_rope(n.unflatten(-1, (heads, -1)), cos, sin)   # fp32 rotation of (even, odd) pairs, .to(dtype)

Layout: x [M, H*Dh] token-major (M = B * S), weight [H*Dh] in x.dtype, cos/sin [S, Dh/2] fp32 (row s = token % S,
column j = pair index within the head). The row is handled as [pairs, 2] tiles split into (even, odd) vectors, in
two power-of-two pair segments (768 pairs -> 512 + 256).

Reduction order and rounding points:
    1. x widened to fp32 exactly; squares rounded to fp32 (eager: x.float().pow(2) is its own tensor).
    2. ss = sum over the row of (e^2 + o^2): per pair add, then tl.sum tree order per segment, head + tail.
    3. var = ss * fl(1 / (H*Dh)): PyTorch's CUDA `mean` multiplies the sum by the fp32 factor 1/N (MeanOps); its
       CPU mean divides instead (<= 1 ulp apart).
    4. r = rsqrt(var + eps): `rsqrt.approx.f32` on the GPU = torch.rsqrt's rsqrtf(); interpreter: 1 / sqrt.
    5. n = RNE_dtype(x * r) then RNE_dtype(n * weight): the product of two fp16/bf16 values is exact in fp32, so
       one rounding to dtype = torch's half-precision multiply; fp32: a plain rounded product.
    6. RoPE in fp32 from the rounded n: e' = e*c - o*s, o' = e*s + o*c, every product rounded (`mul.rn.f32`, never
       an FMA, as the separate eager kernels), then the sub/add rounded, then RNE to dtype.
Only steps 2-3 differ from eager (summation order), moving r by a few fp32 ulps; that flips the dtype rounding of n
for a small fraction of elements, by one ulp, which RoPE can carry to <= 2 ulps of the output.

FP8 output (`fp8_amax=`, the 8-bit attention's q and k codes straight from this pass): the dtype-rounded output y of
step 6, widened back to fp32, minus `centre[b]` when given (one rounded fp32 subtraction), then the per-tensor rule of
quant.py with a GIVEN amax A (a 1-element device tensor): codes = RNE_e4m3(sat(y * fl(448 / max(A, 1e-12)))). So the
codes are bit-identical to this kernel's dtype output quantized by `quant_static_reference` (tests/test_kernels.py).
The fast transformer passes a static bound as A (`rope_amax_bound`): RMSNorm leaves every |x_i| * r <= sqrt(H*Dh),
and RoPE rotates (even, odd) pairs, so no output exceeds sqrt(H*Dh) * max|weight| - a scale known before the
tensor exists, so no amax pass and no separate quantization pass. e4m3 is a floating-point format: a bound above the
true amax costs no precision until values fall under 2^-6 of the scale (the subnormals), ~1/1000 of a typical q
element here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fastremover.fast.kernels._common import (
    FLOAT_DTYPES,
    check_device,
    check_out,
    check_row_width,
    check_tensor,
    check_tokens_per_batch,
    interpreting,
    into,
    launch_options,
    load_f32,
    mul_rn,
    quantize_fp8,
    round_through,
    round_to,
    row_num_warps,
    row_segments,
)


@triton.jit
def _pair_offsets(p, npairs):
    offs = p[:, None] * 2 + tl.arange(0, 2)[None, :]
    mask = tl.broadcast_to((p < npairs)[:, None], offs.shape)
    return offs, mask


@triton.jit
def _load_pairs(row_ptr, p, npairs, INTERPRET: tl.constexpr):
    offs, mask = _pair_offsets(p, npairs)
    return tl.split(load_f32(row_ptr + offs, mask, INTERPRET))


@triton.jit
def _rms_scale(v, r, w, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """RNE_dtype(RNE_dtype(v * r) * w), returned widened to fp32."""
    n = round_through(mul_rn(v, r, INTERPRET), DTYPE, INTERPRET)
    return round_through(mul_rn(n, w, INTERPRET), DTYPE, INTERPRET)


@triton.jit
def _fp8_codes(v, DTYPE: tl.constexpr, CENTRE_ROW, offs, mask, inv, HAS_CENTRE: tl.constexpr,
               INTERPRET: tl.constexpr):
    """The dtype-rounded output value, minus the centre, times inv, RNE to e4m3 (saturating)."""
    y = round_through(v, DTYPE, INTERPRET)
    if HAS_CENTRE:
        y = y - tl.load(CENTRE_ROW + offs, mask=mask, other=0.0)
    return quantize_fp8(y, inv, INTERPRET)


@triton.jit
def _norm_rope_store(e, o, r, W, COS_ROW, SIN_ROW, Y_ROW, p, npairs, CENTRE_ROW, inv,
                     HALF: tl.constexpr, DTYPE: tl.constexpr, FP8: tl.constexpr, HAS_CENTRE: tl.constexpr,
                     INTERPRET: tl.constexpr):
    offs, mask = _pair_offsets(p, npairs)
    we, wo = tl.split(load_f32(W + offs, mask, INTERPRET))
    ne = _rms_scale(e, r, we, DTYPE, INTERPRET)
    no = _rms_scale(o, r, wo, DTYPE, INTERPRET)
    j = p % HALF
    pm = p < npairs
    c = tl.load(COS_ROW + j, mask=pm, other=0.0)
    s = tl.load(SIN_ROW + j, mask=pm, other=0.0)
    re = mul_rn(ne, c, INTERPRET) - mul_rn(no, s, INTERPRET)
    ro = mul_rn(ne, s, INTERPRET) + mul_rn(no, c, INTERPRET)
    if FP8:
        ce = _fp8_codes(re, DTYPE, CENTRE_ROW, p * 2, pm, inv, HAS_CENTRE, INTERPRET)
        co = _fp8_codes(ro, DTYPE, CENTRE_ROW, p * 2 + 1, pm, inv, HAS_CENTRE, INTERPRET)
        tl.store(Y_ROW + offs, tl.join(ce, co), mask=mask)
    else:
        tl.store(Y_ROW + offs, tl.join(round_to(re, DTYPE, INTERPRET), round_to(ro, DTYPE, INTERPRET)), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    X, W, COS, SIN, Y, AMAX, CENTRE,  # FP8: Y float8e4nv codes, AMAX the given [1] amax, CENTRE [B, 2*NPAIRS] fp32
    NPAIRS, S, stride_x, inv_n, eps,
    HALF: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, DTYPE: tl.constexpr, FP8: tl.constexpr,
    HAS_CENTRE: tl.constexpr, INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = row % S
    inv = 0.0
    if FP8:
        inv = tl.math.div_rn(448.0, tl.maximum(tl.load(AMAX), 1e-12))
    centre_row = CENTRE + (row // S) * (2 * NPAIRS)
    p0 = tl.arange(0, HEAD)
    p1 = HEAD + tl.arange(0, TAIL)
    x_row = X + row * stride_x
    e0, o0 = _load_pairs(x_row, p0, NPAIRS, INTERPRET)
    e1, o1 = _load_pairs(x_row, p1, NPAIRS, INTERPRET)
    ss = tl.sum(e0 * e0 + o0 * o0, axis=0) + tl.sum(e1 * e1 + o1 * o1, axis=0)
    r = tl.math.rsqrt(ss * inv_n + eps)
    y_row = Y + row * (2 * NPAIRS)
    _norm_rope_store(e0, o0, r, W, COS + s * HALF, SIN + s * HALF, y_row, p0, NPAIRS, centre_row, inv,
                     HALF, DTYPE, FP8, HAS_CENTRE, INTERPRET)
    _norm_rope_store(e1, o1, r, W, COS + s * HALF, SIN + s * HALF, y_row, p1, NPAIRS, centre_row, inv,
                     HALF, DTYPE, FP8, HAS_CENTRE, INTERPRET)


@functools.lru_cache(maxsize=None)
def _fp32_reciprocal(n: int) -> float:
    return float(torch.tensor(1.0, dtype=torch.float32) / n)  # correctly rounded fp32 1/n


def qk_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    tokens_per_batch: int,
    heads: int,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    fp8_amax: torch.Tensor | None = None,
    centre: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the whole H*Dh row (fp32 statistics, weight in x.dtype) then RoPE per head on (even, odd) pairs
    with table row s = token % tokens_per_batch. x [M, H*Dh] fp16/bf16/fp32 with contiguous rows (any row stride: a
    column slice of a fused QKV output works), weight [H*Dh] x.dtype, cos/sin [tokens_per_batch, Dh/2] fp32
    -> [M, H*Dh] x.dtype contiguous (into `out` if given; `out` may be x itself when x is contiguous).

    fp8_amax ([1] fp32 on x's device): e4m3 codes [M, H*Dh] instead, of (y - centre[token // tokens_per_batch]) with
    the per-tensor scale max(fp8_amax, 1e-12) / 448 (the caller holds that scale; see the module docstring);
    centre: [B, H*Dh] fp32 contiguous, only with fp8_amax."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, row_strided=True)
    m, width = x.shape
    check_row_width("x", width)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1 or width % heads:
        raise ValueError(f"heads must be a positive int dividing the row width {width}, got {heads!r}")
    head_dim = width // heads
    if head_dim % 2:
        raise ValueError(f"head_dim = {width} / {heads} = {head_dim} must be even for RoPE")
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), shape=(width,))
    check_tokens_per_batch(tokens_per_batch, m)
    check_tensor("cos", cos, ndim=2, dtypes=(torch.float32,), shape=(tokens_per_batch, head_dim // 2))
    check_tensor("sin", sin, ndim=2, dtypes=(torch.float32,), shape=(tokens_per_batch, head_dim // 2))
    if not isinstance(eps, (float, int)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    fp8 = fp8_amax is not None
    if fp8:
        check_tensor("fp8_amax", fp8_amax, ndim=1, dtypes=(torch.float32,), shape=(1,))
    if centre is not None:
        if not fp8:
            raise ValueError("centre is only used with fp8_amax")
        check_tensor("centre", centre, ndim=2, dtypes=(torch.float32,), shape=(m // tokens_per_batch, width))
    check_device(_qk_norm_rope_kernel, x=x, weight=weight, cos=cos, sin=sin, out=out, fp8_amax=fp8_amax,
                 centre=centre)
    y_dtype = torch.float8_e4m3fn if fp8 else x.dtype
    check_out("out", out, (m, width), y_dtype, x.device)
    y = out if out is not None else torch.empty((m, width), dtype=y_dtype, device=x.device)
    if m:
        npairs = width // 2
        head, tail = row_segments(npairs)
        inv_n = _fp32_reciprocal(width)  # fp32 1/N, as torch's CUDA mean factor
        dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[x.dtype]
        _qk_norm_rope_kernel[(m,)](
            x, weight, cos, sin, y, fp8_amax if fp8 else cos, centre if centre is not None else cos,
            npairs, tokens_per_batch, x.stride(0), inv_n, float(eps),
            HALF=head_dim // 2, HEAD=head, TAIL=tail, DTYPE=dtype, FP8=fp8, HAS_CENTRE=centre is not None,
            INTERPRET=interpreting(_qk_norm_rope_kernel),
            # half the row kernels' usual warps: at 1536 wide, 2 warps take 0.079 ms vs 4 warps' 0.092 at W2 (and
            # 0.0235 vs 0.0256 at W1), bench/results/row-kernel-warps-*.json
            num_warps=max(1, row_num_warps(2 * (head + tail)) // 2), **launch_options(_qk_norm_rope_kernel),
        )
    return y


def qk_norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens_per_batch: int, heads: int,
    eps: float, *, out: torch.Tensor | None = None, fp8_amax: torch.Tensor | None = None,
    centre: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager torch: transformer.py's `apply_rope(RMSNorm(x).unflatten(-1, (heads, -1)), cos, sin)` on [B, S, H*Dh]
    (with fp8_amax: quantized by `quant_static_reference`). Same signature as `qk_norm_rope`."""
    from fastremover.fast.kernels.quant import quant_static_reference
    from fastremover.models.transformer import RMSNorm, apply_rope

    m, width = x.shape
    norm = RMSNorm(width, eps).to(device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        n = norm(x.reshape(m // tokens_per_batch, tokens_per_batch, width)).unflatten(-1, (heads, -1))
        y = apply_rope(n, cos, sin).flatten(-2).view(m, width)
        if fp8_amax is not None:
            y = quant_static_reference(y, fp8_amax, centre, tokens_per_batch)
        return into(y, out)


def rope_amax_bound(weight: torch.Tensor) -> torch.Tensor:
    """A static amax for `qk_norm_rope`'s output, [1] fp32 on weight's device: |x_i| * rsqrt(mean(x^2) + eps) <=
    sqrt(H*Dh) for every element of a row, times max|weight|; RoPE rotates (even, odd) pairs, whose norm is within
    that bound too (the pair's sum of squares is <= H*Dh before the weight). 1/16 on top covers every rounding (fp16
    output rounding is 2^-11 relative)."""
    width = weight.numel()
    return (weight.detach().float().abs().max() * (width ** 0.5) * 1.0625).reshape(1)
