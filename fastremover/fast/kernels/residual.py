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
