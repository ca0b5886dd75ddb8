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
def _norm_rope_store(e, o, r, W, COS_ROW, SIN_ROW, Y_ROW, p, npairs,
                     HALF: tl.constexpr, INTERPRET: tl.constexpr):
    DTYPE = Y_ROW.dtype.element_ty
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
    tl.store(Y_ROW + offs, tl.join(round_to(re, DTYPE, INTERPRET), round_to(ro, DTYPE, INTERPRET)), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    X, W, COS, SIN, Y,
    NPAIRS, S, stride_x, inv_n, eps,
    HALF: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = row % S
    p0 = tl.arange(0, HEAD)
    p1 = HEAD + tl.arange(0, TAIL)
    x_row = X + row * stride_x
    e0, o0 = _load_pairs(x_row, p0, NPAIRS, INTERPRET)
    e1, o1 = _load_pairs(x_row, p1, NPAIRS, INTERPRET)
    ss = tl.sum(e0 * e0 + o0 * o0, axis=0) + tl.sum(e1 * e1 + o1 * o1, axis=0)
    r = tl.math.rsqrt(ss * inv_n + eps)
    y_row = Y + row * (2 * NPAIRS)
    _norm_rope_store(e0, o0, r, W, COS + s * HALF, SIN + s * HALF, y_row, p0, NPAIRS, HALF, INTERPRET)
    _norm_rope_store(e1, o1, r, W, COS + s * HALF, SIN + s * HALF, y_row, p1, NPAIRS, HALF, INTERPRET)


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
) -> torch.Tensor:
    """RMSNorm over the whole H*Dh row (fp32 statistics, weight in x.dtype) then RoPE per head on (even, odd) pairs
    with table row s = token % tokens_per_batch. x [M, H*Dh] fp16/bf16/fp32 with contiguous rows (any row stride: a
    column slice of a fused QKV output works), weight [H*Dh] x.dtype, cos/sin [tokens_per_batch, Dh/2] fp32
    -> [M, H*Dh] x.dtype contiguous (into `out` if given; `out` may be x itself when x is contiguous)."""
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
    check_device(_qk_norm_rope_kernel, x=x, weight=weight, cos=cos, sin=sin, out=out)
    check_out("out", out, (m, width), x.dtype, x.device)
    y = out if out is not None else torch.empty((m, width), dtype=x.dtype, device=x.device)
    if m:
        npairs = width // 2
        head, tail = row_segments(npairs)
        inv_n = _fp32_reciprocal(width)  # fp32 1/N, as torch's CUDA mean factor
        _qk_norm_rope_kernel[(m,)](
            x, weight, cos, sin, y, npairs, tokens_per_batch, x.stride(0), inv_n, float(eps),
            HALF=head_dim // 2, HEAD=head, TAIL=tail, INTERPRET=interpreting(_qk_norm_rope_kernel),
            num_warps=row_num_warps(2 * (head + tail)), **launch_options(_qk_norm_rope_kernel),
        )
    return y


def qk_norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens_per_batch: int, heads: int,
    eps: float, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager torch: transformer.py's `apply_rope(RMSNorm(x).unflatten(-1, (heads, -1)), cos, sin)` on [B, S, H*Dh].
    Same signature as `qk_norm_rope`."""
    from fastremover.models.transformer import RMSNorm, apply_rope

    m, width = x.shape
    norm = RMSNorm(width, eps).to(device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        n = norm(x.reshape(m // tokens_per_batch, tokens_per_batch, width)).unflatten(-1, (heads, -1))
        return into(apply_rope(n, cos, sin).flatten(-2).view(m, width), out)
