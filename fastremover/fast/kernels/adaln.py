"""Fused adaLN modulation: fp32 LayerNorm (no affine) * (1 + scale[b]) + shift[b], cast to x.dtype or quantized to fp8.

Replaces this eager composition of fastremover/models/transformer.py (TransformerBlock.forward, both norms, and the
final norm_out of RemoverTransformer.forward):

    n = (layer_norm_fp32(x, eps) * (1 + scale) + shift).to(x.dtype)       # scale, shift: [B, 1, D] fp32

Layout: x [M, D] token-major, M = B * S tokens, batch row of token m is b = m // S; shift/scale [B, D] fp32.
One program per token row; the row lives in registers as a HEAD + TAIL pair of power-of-two segments
(`row_segments`: 1536 -> 1024 + 512), so x is read once and y written once.

Reduction order and rounding points (fp32 throughout):
    1. x widened to fp32 exactly.
    2. mean = sum(x) / D: tl.sum tree reduction of each segment (Triton's order: per-thread sequential, then warp
       shuffles, then across warps), head + tail, then a correctly rounded division (`div_rn`).
    3. var = sum((x - mean)^2) / D: two-pass (NOT Welford), biased like F.layer_norm; each (x - mean) and each square
       rounded to fp32, same tree order, `div_rn`.
    4. rstd = rsqrt(var + eps): `rsqrt.approx.f32` on the GPU, the same MUFU instruction PyTorch's CUDA layer_norm
       gets from rsqrtf(); the interpreter computes 1 / sqrt(.) (two roundings, like torch's CPU kernel).
    5. ln = (x - mean) * rstd, rounded (as PyTorch's CUDA kernel; its CPU kernel uses x * rstd + (-mean * rstd)).
    6. y = ln * (1 + scale) + shift: 1 + scale rounded, the product rounded (`mul.rn.f32`, never an FMA), then the
       add rounded - exactly the three separate eager kernels.
    7. fp8=False: y rounded to x.dtype (RNE).  fp8=True: see `quant.py`: row_scale = max(amax|y|, 1e-12) / 448
       (correctly rounded), q = RNE_e4m3(y * (448 / max(amax, 1e-12))) (one div_rn per row), saturating.
So the only differences from eager are in mean/var (summation order; eager CUDA uses Welford), which move y by a few
fp32 ulps at most and flip the final fp16/bf16 rounding of a small fraction of elements by one ulp.

`gate_residual_adaln` fuses the block's gated residual add (residual.py) with the adaLN that reads its result, as
they follow each other in every block (after attention: x += o * gate, then the FFN's norm; after the FFN:
x += f * c_gate, then the next block's norm or norm_out): x_new = RNE_dtype(x + fl(branch * gate[b])) is written
back into x (residual.py's rounding points: mul.rn, add, RNE) and the same values, widened back exactly, go through
the LayerNorm above - one read of x instead of two. It is the same kernel as `adaln_modulate` (RESIDUAL=True), so the
LayerNorm code and launch (segments, warps) are shared and the output is meant to equal `adaln_modulate(gate_residual(x, ...))` bit for bit (torch.equal in the
tests).
"""

from __future__ import annotations

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
    launch_options,
    interpreting,
    into,
    load_f32,
    mul_rn,
    round_through,
    round_to,
    row_num_warps,
    row_segments,
    store_fp8_row,
)


@triton.jit
def _modulate(d, rstd, shift_row, scale_row, cols, mask, INTERPRET: tl.constexpr):
    sc = tl.load(scale_row + cols, mask=mask, other=0.0)
    sh = tl.load(shift_row + cols, mask=mask, other=0.0)
    ln = mul_rn(d, rstd, INTERPRET)
    return mul_rn(ln, 1.0 + sc, INTERPRET) + sh


@triton.jit
def _layer_norm_modulate_store(x0, x1, m0, m1, c0, c1, row, b, SHIFT, SCALE, Y, RS, D, d_f, eps,
                               FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """Steps 2-7 of the module docstring for one row held as two fp32 segments."""
    mean = tl.math.div_rn(tl.sum(x0, axis=0) + tl.sum(x1, axis=0), d_f)
    d0 = tl.where(m0, x0 - mean, 0.0)
    d1 = tl.where(m1, x1 - mean, 0.0)
    var = tl.math.div_rn(tl.sum(d0 * d0, axis=0) + tl.sum(d1 * d1, axis=0), d_f)
    rstd = tl.math.rsqrt(var + eps)

    y0 = _modulate(d0, rstd, SHIFT + b * D, SCALE + b * D, c0, m0, INTERPRET)
    y1 = _modulate(d1, rstd, SHIFT + b * D, SCALE + b * D, c1, m1, INTERPRET)

    y_row = Y + row * D
    if FP8:
        store_fp8_row(y0, y1, m0, m1, y_row, c0, c1, RS + row, INTERPRET)
    else:
        tl.store(y_row + c0, round_to(y0, Y.dtype.element_ty, INTERPRET), mask=m0)
        tl.store(y_row + c1, round_to(y1, Y.dtype.element_ty, INTERPRET), mask=m1)


@triton.jit
def _gated_add(x_row, br_row, g_row, c, m, XT: tl.constexpr, INTERPRET: tl.constexpr):
    """residual.py's gated add on one segment: RNE_XT(x + fl(branch * gate)), stored back into x's row and returned
    widened back to fp32 exactly (0 on masked lanes)."""
    y = load_f32(x_row + c, m, INTERPRET) + mul_rn(load_f32(br_row + c, m, INTERPRET),
                                                   tl.load(g_row + c, mask=m, other=0.0), INTERPRET)
    tl.store(x_row + c, round_to(y, XT, INTERPRET), mask=m)
    return tl.where(m, round_through(y, XT, INTERPRET), 0.0)


@triton.jit(do_not_specialize=["S"])  # S (tokens per batch) only divides the row index: one compile per run shape class
def _adaln_kernel(
    X, BR, G, SHIFT, SCALE, Y, RS,  # Y: x.dtype, or float8e4nv with RS the [M] fp32 row scales
    D, S, d_f, eps,
    HEAD: tl.constexpr, TAIL: tl.constexpr, FP8: tl.constexpr, RESIDUAL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """RESIDUAL: x += branch * gate[b] first (X updated in place, BR [M, D], G [B, D] fp32), then the norm of the new
    x; else BR and G are unused."""
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    c0 = tl.arange(0, HEAD)
    c1 = HEAD + tl.arange(0, TAIL)
    m0 = c0 < D
    m1 = c1 < D
    x_row = X + row * D
    if RESIDUAL:
        XT: tl.constexpr = X.dtype.element_ty
        x0 = _gated_add(x_row, BR + row * D, G + b * D, c0, m0, XT, INTERPRET)
        x1 = _gated_add(x_row, BR + row * D, G + b * D, c1, m1, XT, INTERPRET)
    else:
        x0 = load_f32(x_row + c0, m0, INTERPRET)
        x1 = load_f32(x_row + c1, m1, INTERPRET)
    _layer_norm_modulate_store(x0, x1, m0, m1, c0, c1, row, b, SHIFT, SCALE, Y, RS, D, d_f, eps, FP8, INTERPRET)


def _launch(x, branch, gate, shift, scale, y, rs, tokens_per_batch, eps, fp8, residual):
    m, d = x.shape
    if m:
        head, tail = row_segments(d)
        _adaln_kernel[(m,)](
            x, branch, gate, shift, scale, y, rs, d, tokens_per_batch, float(d), float(eps),
            HEAD=head, TAIL=tail, FP8=fp8, RESIDUAL=residual, INTERPRET=interpreting(_adaln_kernel),
            num_warps=row_num_warps(head + tail), **launch_options(_adaln_kernel),
        )


def _check_and_outputs(x, shift, scale, tokens_per_batch, eps, fp8, out, out_scale, **more):
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, d = x.shape
    check_row_width("x", d)
    check_tensor("shift", shift, ndim=2, dtypes=(torch.float32,))
    check_tensor("scale", scale, ndim=2, dtypes=(torch.float32,), shape=tuple(shift.shape))
    if shift.shape[1] != d:
        raise ValueError(f"shift/scale must be [B, {d}] to match x [M, {d}], got {tuple(shift.shape)}")
    check_tokens_per_batch(tokens_per_batch, m, shift.shape[0])
    if not isinstance(eps, (float, int)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    check_device(_adaln_kernel, x=x, shift=shift, scale=scale, out=out, out_scale=out_scale, **more)
    if not fp8 and out_scale is not None:
        raise ValueError("out_scale is only used with fp8=True")
    y_dtype = torch.float8_e4m3fn if fp8 else x.dtype
    check_out("out", out, (m, d), y_dtype, x.device)
    y = out if out is not None else torch.empty((m, d), dtype=y_dtype, device=x.device)
    if fp8:
        check_out("out_scale", out_scale, (m, 1), torch.float32, x.device)
        rs = out_scale if out_scale is not None else torch.empty((m, 1), dtype=torch.float32, device=x.device)
    else:
        rs = y  # unused (FP8=False never touches RS); any pointer will do
    return y, rs


def adaln_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    tokens_per_batch: int,
    eps: float,
    *,
    fp8: bool = False,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = LayerNorm_fp32_noaffine(x) * (1 + scale[b]) + shift[b], b = token // tokens_per_batch.

    x: [M, D] fp16/bf16/fp32 contiguous; shift, scale: [B, D] fp32 contiguous with B * tokens_per_batch == M.
    fp8=False -> y.to(x.dtype) [M, D] (written into `out` if given).
    fp8=True  -> (q float8_e4m3fn [M, D], row_scale fp32 [M, 1]) with row_scale = max(amax_row|y|, 1e-12) / 448 and
                 q = RNE_e4m3(y / row_scale) (saturating; |y / row_scale| <= 448 by construction);
                 written into `out` / `out_scale` if given.
    D <= 16384.
    """
    y, rs = _check_and_outputs(x, shift, scale, tokens_per_batch, eps, fp8, out, out_scale)
    _launch(x, x, shift, shift, scale, y, rs, tokens_per_batch, eps, fp8, residual=False)
    return (y, rs) if fp8 else y


def gate_residual_adaln(
    x: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    tokens_per_batch: int,
    eps: float,
    *,
    fp8: bool = False,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x <- (x.float() + branch.float() * gate[b]).to(x.dtype) in place (residual.gate_residual), then
    adaln_modulate(x, shift, scale, ...) of the new x, in one pass; returns what adaln_modulate returns.
    branch [M, D] fp16/bf16/fp32 contiguous, gate [B, D] fp32; the rest as adaln_modulate."""
    check_tensor("branch", branch, ndim=2, dtypes=FLOAT_DTYPES, shape=tuple(x.shape) if x.dim() == 2 else None)
    check_tensor("gate", gate, ndim=2, dtypes=(torch.float32,), shape=tuple(shift.shape) if shift.dim() == 2 else None)
    y, rs = _check_and_outputs(x, shift, scale, tokens_per_batch, eps, fp8, out, out_scale, branch=branch, gate=gate)
    _launch(x, branch, gate, shift, scale, y, rs, tokens_per_batch, eps, fp8, residual=True)
    return (y, rs) if fp8 else y


def adaln_modulate_reference(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    tokens_per_batch: int,
    eps: float,
    *,
    fp8: bool = False,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Eager torch: exactly `(layer_norm_fp32(x, eps) * (1 + scale) + shift).to(x.dtype)` of transformer.py on the
    [B, S, D] view (fp8=True: the same fp32 y, quantized by `fp8_rowwise_reference`). Same signature as
    `adaln_modulate`."""
    from fastremover.fast.kernels.quant import fp8_rowwise_reference
    from fastremover.models.transformer import layer_norm_fp32

    m, d = x.shape
    b = m // tokens_per_batch
    xb = x.view(b, tokens_per_batch, d)
    y = layer_norm_fp32(xb, eps) * (1 + scale[:, None, :]) + shift[:, None, :]
    if fp8:
        q, rs = fp8_rowwise_reference(y.view(m, d))
        return into(q, out), into(rs, out_scale)
    return into(y.to(x.dtype).view(m, d), out)


def gate_residual_adaln_reference(
    x: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
    tokens_per_batch: int, eps: float, *, fp8: bool = False, out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Eager torch: residual.gate_residual_reference(..., inplace=True), then adaln_modulate_reference. Same signature
    as `gate_residual_adaln`."""
    from fastremover.fast.kernels.residual import gate_residual_reference

    gate_residual_reference(x, branch, gate, tokens_per_batch, inplace=True)
    return adaln_modulate_reference(x, shift, scale, tokens_per_batch, eps, fp8=fp8, out=out, out_scale=out_scale)
