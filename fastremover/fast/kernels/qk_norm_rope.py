"""Fused q/k RMSNorm (across all heads) + 3D RoPE, one program per token row.

Replaces this eager composition of fastremover/models/transformer.py (SelfAttention.forward, for q and for k):

    n = RMSNorm(x)                       # (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype) * weight
    out = apply_rope(n.unflatten(-1, (heads, -1)), cos, sin)   # fp32 rotation of (even, odd) pairs, .to(dtype)

Layout: x [M, H*Dh] token-major (M = B * S), weight [H*Dh] in x.dtype, cos/sin [S, Dh/2] fp32 (row s = token % S,
column j = pair index within the head). The row is handled as [heads, Dh/2, 2] tiles split into (even, odd)
[heads, Dh/2] tiles, in two power-of-two head segments (12 heads -> 8 + 4), so each token's cos/sin row is loaded
once and broadcast over the heads (a per-pair gather of the tables was half the kernel's memory instructions).

Reduction order and rounding points:
    1. x widened to fp32 exactly; squares rounded to fp32 (eager: x.float().pow(2) is its own tensor).
    2. ss = sum over the row of (e^2 + o^2): per pair add, then tl.sum over pairs, then over heads, per segment;
       head segment + tail segment.
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
codes are this kernel's dtype output quantized by `quant_static_reference`, bit for bit under the interpreter. On the
GPU only up to the order of step 2's sum: the compiler propagates the output store's register layout back into the
row (fp8 codes vectorize 16 per thread, 16-bit outputs 8), so the two variants sum the squares in different orders
and r can differ by an ulp; a code then moves by one e4m3 step in ~1e-6 of the elements (tests/kernels/test_kernels.py
asserts one step at most, in under 1e-4 of them).
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
def _head_offsets(h0, H: tl.constexpr, NH: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """Offsets and mask of heads [h0, h0 + NH) of a row as a [NH, 2 * HALF_P] tile (contiguous per head: the loads
    and stores vectorize; `_pairs` / `_interleave` reshape it to and from (even, odd) [NH, HALF_P] tiles)."""
    hh = h0 + tl.arange(0, NH)
    c = tl.arange(0, 2 * HALF_P)
    offs = hh[:, None] * (2 * HALF) + c[None, :]
    mask = (hh < H)[:, None] & (c < 2 * HALF)[None, :]
    return offs, mask


@triton.jit
def _pairs(v, NH: tl.constexpr, HALF_P: tl.constexpr):
    return tl.split(tl.reshape(v, (NH, HALF_P, 2)))


@triton.jit
def _interleave(e, o, NH: tl.constexpr, HALF_P: tl.constexpr):
    return tl.reshape(tl.join(e, o), (NH, 2 * HALF_P))


@triton.jit
def _rms_scale(v, r, w, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """RNE_dtype(RNE_dtype(v * r) * w), returned widened to fp32."""
    n = round_through(mul_rn(v, r, INTERPRET), DTYPE, INTERPRET)
    return round_through(mul_rn(n, w, INTERPRET), DTYPE, INTERPRET)


@triton.jit
def _norm_rope_store(e, o, r, W, c, s, Y_ROW, CENTRE_ROW, inv, h0, H: tl.constexpr, NH: tl.constexpr,
                     HALF: tl.constexpr, HALF_P: tl.constexpr,
                     DTYPE: tl.constexpr, FP8: tl.constexpr, HAS_CENTRE: tl.constexpr, INTERPRET: tl.constexpr):
    """Steps 5-6 (and the fp8 codes) for heads [h0, h0 + NH) held as (even, odd) [NH, HALF_P] tiles; c, s: the
    token's [HALF_P] cos / sin row, shared by every head (loaded once per row, not once per pair)."""
    offs, mask = _head_offsets(h0, H, NH, HALF, HALF_P)
    we, wo = _pairs(load_f32(W + offs, mask, INTERPRET), NH, HALF_P)
    ne = _rms_scale(e, r, we, DTYPE, INTERPRET)
    no = _rms_scale(o, r, wo, DTYPE, INTERPRET)
    c = c[None, :]
    s = s[None, :]
    re = mul_rn(ne, c, INTERPRET) - mul_rn(no, s, INTERPRET)
    ro = mul_rn(ne, s, INTERPRET) + mul_rn(no, c, INTERPRET)
    if FP8:  # the dtype-rounded output, minus the centre (one rounded fp32 subtraction), times inv, RNE to e4m3
        ye = round_through(re, DTYPE, INTERPRET)
        yo = round_through(ro, DTYPE, INTERPRET)
        if HAS_CENTRE:
            ce, co = _pairs(tl.load(CENTRE_ROW + offs, mask=mask, other=0.0), NH, HALF_P)
            ye = ye - ce
            yo = yo - co
        y = _interleave(quantize_fp8(ye, inv, INTERPRET), quantize_fp8(yo, inv, INTERPRET), NH, HALF_P)
    else:
        y = _interleave(round_to(re, DTYPE, INTERPRET), round_to(ro, DTYPE, INTERPRET), NH, HALF_P)
    tl.store(Y_ROW + offs, y, mask=mask)


@triton.jit(do_not_specialize=["S"])  # S only divides the row index (no compile per tokens-per-batch class)
def _qk_norm_rope_kernel(
    X, W, COS, SIN, Y, AMAX, CENTRE,  # FP8: Y float8e4nv codes, AMAX the given [1] amax, CENTRE [B, H*Dh] fp32
    S, stride_x, inv_n, eps,
    H: tl.constexpr, HALF: tl.constexpr, HH: tl.constexpr, HT: tl.constexpr, HALF_P: tl.constexpr,
    DTYPE: tl.constexpr, FP8: tl.constexpr, HAS_CENTRE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One token row as two head segments (HH + HT heads, `row_segments(H)`: 12 -> 8 + 4) of [heads, HALF_P, 2]
    tiles; HALF_P = next power of two of Dh / 2 (masked past HALF)."""
    row = tl.program_id(0).to(tl.int64)
    s = row % S
    inv = 0.0
    if FP8:
        inv = tl.math.div_rn(448.0, tl.maximum(tl.load(AMAX), 1e-12))
    x_row = X + row * stride_x
    offs0, mask0 = _head_offsets(0, H, HH, HALF, HALF_P)
    offs1, mask1 = _head_offsets(HH, H, HT, HALF, HALF_P)
    e0, o0 = _pairs(load_f32(x_row + offs0, mask0, INTERPRET), HH, HALF_P)
    e1, o1 = _pairs(load_f32(x_row + offs1, mask1, INTERPRET), HT, HALF_P)
    ss = tl.sum(tl.sum(e0 * e0 + o0 * o0, axis=1), axis=0) + tl.sum(tl.sum(e1 * e1 + o1 * o1, axis=1), axis=0)
    r = tl.math.rsqrt(ss * inv_n + eps)
    j = tl.arange(0, HALF_P)
    c = tl.load(COS + s * HALF + j, mask=j < HALF, other=0.0)
    sn = tl.load(SIN + s * HALF + j, mask=j < HALF, other=0.0)
    centre_row = CENTRE + (row // S) * (2 * HALF * H)
    y_row = Y + row * (2 * HALF * H)
    _norm_rope_store(e0, o0, r, W, c, sn, y_row, centre_row, inv, 0, H, HH, HALF, HALF_P, DTYPE, FP8, HAS_CENTRE,
                     INTERPRET)
    _norm_rope_store(e1, o1, r, W, c, sn, y_row, centre_row, inv, HH, H, HT, HALF, HALF_P, DTYPE, FP8, HAS_CENTRE,
                     INTERPRET)


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
        hh, ht = row_segments(heads)
        inv_n = _fp32_reciprocal(width)  # fp32 1/N, as torch's CUDA mean factor
        dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[x.dtype]
        _qk_norm_rope_kernel[(m,)](
            x, weight, cos, sin, y, fp8_amax if fp8 else cos, centre if centre is not None else cos,
            tokens_per_batch, x.stride(0), inv_n, float(eps), H=heads, HALF=head_dim // 2, HH=hh, HT=ht, HALF_P=triton.next_power_of_2(head_dim // 2), DTYPE=dtype, FP8=fp8,
            HAS_CENTRE=centre is not None, INTERPRET=interpreting(_qk_norm_rope_kernel),
            # 2 warps at 1536 wide (bench/results/row-kernel-warps-*.json, elementwise-sweep-*.json)
            num_warps=max(1, row_num_warps(width) // 2), **launch_options(_qk_norm_rope_kernel),
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
