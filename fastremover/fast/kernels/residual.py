"""Gated residual add: x + branch * gate[b], bit-exact to the eager composition.

Replaces this eager composition of fastremover/models/transformer.py (TransformerBlock.forward, after attention and
after the FFN):

    x = (x.float() + branch * gate).to(x.dtype)          # branch in the model dtype (or fp32), gate [B, 1, D] fp32

Layout: x, branch [M, D] token-major (M = B * S), gate [B, D] fp32, b = token // S. Programs cover
[BLOCK_M, BLOCK_D] tiles (8 x 512 for D = 1536: no masked lanes).

Rounding points (no reduction): branch and x widened to fp32 exactly; p = branch * gate rounded to fp32;
x + p rounded to fp32; RNE to x.dtype. Eager runs the multiply and the add as two kernels, so the product is rounded
before the add; an FMA would round once and differ in the last bit for a few elements per million, which after the
dtype rounding shows up as rare one-ulp differences. So the product is an explicit `mul.rn.f32` (inline PTX; ptxas
never contracts a `.rn` multiply), and the kernel is also compiled with enable_fp_fusion=False. The interpreter
(numpy) never fuses; it uses the plain `*`. Result: bit-exact to eager on the GPU and in the interpreter, for every
combination of x/branch dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastremover.fast.kernels._common import (
    FLOAT_DTYPES,
    check_device,
    check_out,
    check_tensor,
    check_tokens_per_batch,
    interpreting,
    into,
    launch_options,
    load_f32,
    mul_rn,
    round_to,
)


@triton.jit
def _gate_residual_kernel(
    X, BR, G, Y, M, D, S,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # int32: M < 2^31 (checked by the wrapper)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    b = rows // S
    g = tl.load(G + b[:, None] * D + cols[None, :], mask=mask, other=0.0)
    x = load_f32(X + offs, mask, INTERPRET)
    br = load_f32(BR + offs, mask, INTERPRET)
    y = x + mul_rn(br, g, INTERPRET)
    tl.store(Y + offs, round_to(y, Y.dtype.element_ty, INTERPRET), mask=mask)


def _blocks(d: int) -> tuple[int, int]:
    block_d = min(512, triton.next_power_of_2(d))
    return max(1, 4096 // block_d), block_d


def gate_residual(
    x: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor,
    tokens_per_batch: int,
    *,
    inplace: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(x.float() + branch.float() * gate[b]).to(x.dtype), b = token // tokens_per_batch.

    x [M, D] fp16/bf16/fp32 contiguous; branch [M, D] fp16/bf16/fp32 (may differ from x's dtype); gate [B, D] fp32.
    inplace=True writes into x and returns it; otherwise into `out` (x.dtype, [M, D]) or a new tensor."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, d = x.shape
    check_tensor("branch", branch, ndim=2, dtypes=FLOAT_DTYPES, shape=(m, d))
    check_tensor("gate", gate, ndim=2, dtypes=(torch.float32,))
    if gate.shape[1] != d:
        raise ValueError(f"gate must be [B, {d}] to match x [M, {d}], got {tuple(gate.shape)}")
    check_tokens_per_batch(tokens_per_batch, m, gate.shape[0])
    if m >= 2**31 - 4096:
        raise ValueError(f"at most 2^31 - 4096 tokens per call, got M={m}")
    if inplace and out is not None:
        raise ValueError("pass either inplace=True or out=, not both")
    check_device(_gate_residual_kernel, x=x, branch=branch, gate=gate, out=out)
    check_out("out", out, (m, d), x.dtype, x.device)
    y = x if inplace else (out if out is not None else torch.empty_like(x))
    if m and d:
        block_m, block_d = _blocks(d)
        grid = (triton.cdiv(m, block_m), triton.cdiv(d, block_d))
        _gate_residual_kernel[grid](
            x, branch, gate, y, m, d, tokens_per_batch,
            BLOCK_M=block_m, BLOCK_D=block_d, INTERPRET=interpreting(_gate_residual_kernel),
            num_warps=8, **launch_options(_gate_residual_kernel),
        )
    return y


def gate_residual_reference(
    x: torch.Tensor,
    branch: torch.Tensor,
    gate: torch.Tensor,
    tokens_per_batch: int,
    *,
    inplace: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager torch: `(x.float() + branch * gate).to(x.dtype)` on the [B, S, D] view, gate as [B, 1, D] (the
    branch * gate product promotes to fp32 like the transformer's `self.attn1(n, rope) * gate`). Same signature as
    `gate_residual`."""
    m, d = x.shape
    b = m // tokens_per_batch
    xb = x.view(b, tokens_per_batch, d)
    y = (xb.float() + branch.view(b, tokens_per_batch, d) * gate[:, None, :]).to(x.dtype).view(m, d)
    return into(y, x if inplace else out)


# ----------------------------------------------------------------------------------------------------------------------
# Plain residual add on channels-last video tensors (the VAE's `x + shortcut`)
#
# The fast VAE's block outputs and shortcuts are channels-last 5-D tensors, often views (a time slice of a stream
# buffer, the interior of a zero-padded frame), which torch's add sends to its generic strided kernel (no vector
# loads: 180 ms of a W2 encode on the H200). Here a program adds one (b, t, h) row of W*C contiguous values, so any
# B/T/H strides work and the loads are vectorized. Rounding: both operands widened to fp32 exactly, one fp32 add,
# RNE to the dtype - torch's half add (fp32 opmath) bit for bit.


@triton.jit
def _add_rows_kernel(
    Y, S, O, ROW, T, H,
    syb, syt, syh, ssb, sst, ssh, sob, sot, soh,
    BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    r = tl.program_id(0)
    h = (r % H).to(tl.int64)
    bt = r // H
    t = (bt % T).to(tl.int64)
    b = (bt // T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ROW
    y = load_f32(Y + b * syb + t * syt + h * syh + cols, mask, INTERPRET)
    s = load_f32(S + b * ssb + t * sst + h * ssh + cols, mask, INTERPRET)
    tl.store(O + b * sob + t * sot + h * soh + cols, round_to(y + s, O.dtype.element_ty, INTERPRET), mask=mask)


def _row_dense(t: torch.Tensor) -> bool:
    _, c, _, _, w = t.shape
    return (c == 1 or t.stride(1) == 1) and (w == 1 or t.stride(4) == c)


def add_frames(y: torch.Tensor, s: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """y + s for channels-last [B, C, T, H, W] tensors of one dtype (views with any B/T/H strides are fine), written
    into `out` (default: y, in place). Bit-exact to torch's add. Operands that are not channels-last with contiguous
    (W, C) rows go to torch's add (the same values, just its slower strided kernel)."""
    for name, t in (("y", y), ("s", s), ("out", out)):
        if t is not None:
            if not isinstance(t, torch.Tensor) or t.dim() != 5 or t.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be a 5-D fp16/bf16/fp32 tensor")
            if t.shape != y.shape or t.dtype != y.dtype:
                raise ValueError(f"{name} must match y ({y.dtype} {tuple(y.shape)}), got {t.dtype} {tuple(t.shape)}")
    if not all(_row_dense(t) for t in (y, s, out) if t is not None):
        return add_frames_reference(y, s, out=out)
    check_device(_add_rows_kernel, y=y, s=s, out=out)
    o = y if out is None else out
    b, c, t_, h, w = y.shape
    row = w * c
    if y.numel():
        block = min(2048, triton.next_power_of_2(row))
        grid = (b * t_ * h, triton.cdiv(row, block))
        _add_rows_kernel[grid](
            y, s, o, row, t_, h,
            y.stride(0), y.stride(2), y.stride(3), s.stride(0), s.stride(2), s.stride(3),
            o.stride(0), o.stride(2), o.stride(3),
            BLOCK=block, INTERPRET=interpreting(_add_rows_kernel), num_warps=4, **launch_options(_add_rows_kernel),
        )
    return o


def add_frames_reference(y: torch.Tensor, s: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    return torch.add(y, s, out=y if out is None else out)
