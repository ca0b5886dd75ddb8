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
    round_through,
    round_to,
)
from fastremover.fast.kernels.vae_norm import _check_frame_dense
from fastremover.fast.kernels.vae_norm import add_bias  # the one eager "conv bias add" (fp32 opmath, one rounding)


@triton.jit(do_not_specialize=["M", "S"])  # rows only: masks and the batch index
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
# buffer, the interior of a zero-padded frame). Here a program adds one (b, t, h) row of W*C contiguous values, so any
# B/T/H strides work and the loads are vectorized. (Measured on the H200: the same W2 VAE time as torch's add, whose
# residual adds were already vectorized; the 180 ms of slow strided adds in the W2 encode profile are the convs' own
# bias adds, which `bias=` below can take over.) Rounding: both operands widened to fp32 exactly, one fp32 add,
# RNE to the dtype - torch's half add (fp32 opmath) bit for bit.
#
# With `bias` (a conv bias the fast VAE deferred from the conv that produced y, `FastWanVAE(fuse_bias=True)`) the
# kernel computes what the conv's own bias add and then the residual add would have: yb = RNE_dtype(y + bias[c])
# (fp32 add of the exactly widened operands, as torch's `conv_out.add_(bias)`), then RNE_dtype(yb + s) - two
# roundings to the dtype, like the two eager adds, in one pass. (For fp16/bf16 operands the compiler may emit
# widen-add-round as a native `add.rn.f16`/`add.rn.bf16` (x2): the same bits, since fp32's 24-bit significand is
# more than 2p+2 bits for both, so rounding through fp32 first never changes the result.)


@triton.jit(do_not_specialize=["T", "H"])  # index math only; ROW and the strides stay specialized (vector loads)
def _add_rows_kernel(
    Y, S, O, BIAS, ROW, T, H,
    syb, syt, syh, ssb, sst, ssh, sob, sot, soh,
    C: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
    HAS_S: tl.constexpr = True,
):
    r = tl.program_id(0)
    h = (r % H).to(tl.int64)
    bt = r // H
    t = (bt % T).to(tl.int64)
    b = (bt // T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ROW
    y = load_f32(Y + b * syb + t * syt + h * syh + cols, mask, INTERPRET)
    if HAS_BIAS:  # the deferred conv bias first, rounded to the dtype (a row is W pixels of C channels; C is a
        # constexpr so `% C` is a multiply-shift, not an integer division)
        bias = load_f32(BIAS + cols % C, mask, INTERPRET)
        y = round_through(y + bias, O.dtype.element_ty, INTERPRET)
    if HAS_S:
        s = load_f32(S + b * ssb + t * sst + h * ssh + cols, mask, INTERPRET)
        y = y + s
    tl.store(O + b * sob + t * sot + h * soh + cols, round_to(y, O.dtype.element_ty, INTERPRET), mask=mask)


def _row_dense(t: torch.Tensor) -> bool:
    _, c, _, _, w = t.shape
    return (c == 1 or t.stride(1) == 1) and (w == 1 or t.stride(4) == c)


def _check_bias(bias, y: torch.Tensor) -> None:
    c = y.shape[1]
    if (not isinstance(bias, torch.Tensor) or bias.numel() != c or bias.dtype not in (torch.float32, y.dtype)
            or bias.device != y.device):
        raise ValueError(f"bias must be a float32 or {y.dtype} tensor of {c} elements (any shape) on {y.device}, got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")


def add_frames(
    y: torch.Tensor, s: torch.Tensor, *, out: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y + s for channels-last [B, C, T, H, W] tensors of one dtype (views with any B/T/H strides are fine), written
    into `out` (default: y, in place). Bit-exact to torch's add. Operands that are not channels-last with contiguous
    (W, C) rows go to torch's add (the same values, just its slower strided kernel).

    bias: C elements, fp32 or y.dtype: (y + bias, rounded to the dtype) + s, rounded again - bit-exact to
    `y.add_(bias.view(1, C, 1, 1, 1))` followed by `torch.add(y, s)` (a conv bias deferred into the residual add).
    y itself is only written when out is None (in place)."""
    for name, t in (("y", y), ("s", s), ("out", out)):
        if t is not None:
            if not isinstance(t, torch.Tensor) or t.dim() != 5 or t.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be a 5-D fp16/bf16/fp32 tensor")
            if t.shape != y.shape or t.dtype != y.dtype:
                raise ValueError(f"{name} must match y ({y.dtype} {tuple(y.shape)}), got {t.dtype} {tuple(t.shape)}")
    if bias is not None:
        _check_bias(bias, y)
    if not all(_row_dense(t) for t in (y, s, out) if t is not None):
        return add_frames_reference(y, s, out=out, bias=bias)
    check_device(_add_rows_kernel, y=y, s=s, out=out, bias=bias)
    o = y if out is None else out
    _launch_rows(y, s, o, bias)
    return o


def _launch_rows(y: torch.Tensor, s: torch.Tensor | None, o: torch.Tensor, bias: torch.Tensor | None) -> None:
    """One launch of _add_rows_kernel over 5-D row-dense y / s / o (s None: the bias-only variant)."""
    b, c, t_, h, w = y.shape
    row = w * c
    if not y.numel():
        return
    block = min(2048, triton.next_power_of_2(row))
    grid = (b * t_ * h, triton.cdiv(row, block))
    bias_arg = y
    if bias is not None:
        bias_arg = bias.reshape(c)
        if not bias_arg.is_contiguous():
            bias_arg = bias_arg.contiguous()
    s_arg = y if s is None else s
    _add_rows_kernel[grid](
        y, s_arg, o, bias_arg, row, t_, h,
        y.stride(0), y.stride(2), y.stride(3), s_arg.stride(0), s_arg.stride(2), s_arg.stride(3),
        o.stride(0), o.stride(2), o.stride(3),
        C=c if bias is not None else 1,  # (C=1 without a bias: that variant compiles once, as before)
        BLOCK=block, HAS_BIAS=bias is not None, INTERPRET=interpreting(_add_rows_kernel), HAS_S=s is not None,
        num_warps=4, **launch_options(_add_rows_kernel),
    )


def add_frames_reference(
    y: torch.Tensor, s: torch.Tensor, *, out: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Eager torch, same signature as `add_frames`: [y + bias, rounded to the dtype, then] torch.add(y, s)."""
    if bias is not None:
        _check_bias(bias, y)
        yb = add_bias(y, bias)  # torch's fp32-opmath add_, also for an fp32 bias
        if out is None:  # in place, like the kernel
            y.copy_(yb)
            yb = y
        return torch.add(yb, s, out=y if out is None else out)
    return torch.add(y, s, out=y if out is None else out)


# ----------------------------------------------------------------------------------------------------------------------
# A conv's own bias add, in place (the VAE convs whose bias cannot be deferred into a consumer kernel: conv_in, the
# resample convs, time_conv, shortcuts, ...). ATen's cuDNN path runs `F.conv3d(x, w, b)` as the bias-free conv and
# then `out.add_(b.view(1, C, 1, 1, 1))`, which on a channels-last output takes torch's generic strided kernel (the
# W2 encode profile: 180 ms of bias adds before fuse_bias took over most of them). This is the same add - both
# operands widened to fp32, one add, RNE to the dtype (the HAS_S=False variant of the row kernel above, rounding
# point = the bias step there) - over contiguous (W, C) rows: bit-identical to torch's add_, at memory speed.


def add_bias_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y += bias over the channel axis, in place, for a channels-last [B, C, T, H, W] or [N, C, H, W] y (views with
    any B/T/H strides are fine; other layouts go to the eager reference). Bit-exact to torch's
    `y.add_(bias.view(1, C, 1, 1[, 1]))` for an fp32 or y.dtype bias. Returns y."""
    if not isinstance(y, torch.Tensor) or y.dim() not in (4, 5) or y.dtype not in FLOAT_DTYPES:
        raise ValueError("y must be a 4-D or 5-D fp16/bf16/fp32 tensor")
    y5 = y.unsqueeze(2) if y.dim() == 4 else y
    _check_bias(bias, y5)
    if not _row_dense(y5):
        return add_bias_reference_(y, bias)
    check_device(_add_rows_kernel, y=y, bias=bias)
    _launch_rows(y5, None, y5, bias)
    return y


def add_bias_reference_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Eager torch, same signature as `add_bias_`: y.copy_(vae_norm.add_bias(y, bias)) - torch's fp32-opmath `add_`
    bit for bit, also for an fp32 bias."""
    if not isinstance(y, torch.Tensor) or y.dim() not in (4, 5) or y.dtype not in FLOAT_DTYPES:
        raise ValueError("y must be a 4-D or 5-D fp16/bf16/fp32 tensor")
    _check_bias(bias, y)
    return y.copy_(add_bias(y, bias))


# ----------------------------------------------------------------------------------------------------------------------
# Channel-padding copy (the fast VAE's causal caches into its conv input buffers)
#
# With `FastWanVAE(pad_channels=...)` a conv input buffer is C channels wide (e.g. 128) while the conv's cache keeps
# only the C' real ones (96): the cached frames go into the buffer's front with zeros in channels C'..C-1. torch's
# strided copy + fill of that took as long as the padding saved (H200, W2 decode: 0.935 s vs 0.936 unpadded); here one
# program writes BLOCK_W whole pixels (C lanes, the last C - C' zero) of one (b, t, h) row. A pure copy: bit-exact.


@triton.jit(do_not_specialize=["T", "H", "W", "SHIFT", "TS"])  # index math and the pixel mask only
def _pad_copy_kernel(
    S, D, T, H, W, SHIFT, TS,
    ssb, sst, ssh, sdb, sdt, sdh,
    CS: tl.constexpr, CD: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0)
    h = (r % H).to(tl.int64)
    bt = r // H
    t = bt % T
    b = (bt // T).to(tl.int64)
    ts = ((t + SHIFT) % TS).to(tl.int64)  # the source frame (a ring's older slot first)
    px = (tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    inside = (px < W)[:, None]
    v = tl.load(S + b * ssb + ts * sst + h * ssh + px[:, None] * CS + cols[None, :],
                mask=inside & (cols < CS)[None, :], other=0.0)
    tl.store(D + b * sdb + t.to(tl.int64) * sdt + h * sdh + px[:, None] * CD + cols[None, :], v,
             mask=inside & (cols < CD)[None, :])


def _check_pad_copy(dst: torch.Tensor, src: torch.Tensor, shift: int) -> None:
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor) or t.dim() != 5 or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a 5-D fp16/bf16/fp32 tensor")
        _check_frame_dense(name, t)
    b, c, t_, h, w = dst.shape
    if (src.shape[0], src.shape[2], src.shape[3], src.shape[4]) != (b, t_, h, w) or not 1 <= src.shape[1] <= c:
        raise ValueError(f"src must be [B, C' <= {c}, T, H, W] with dst's other sizes {tuple(dst.shape)}, got "
                         f"{tuple(src.shape)}")
    if src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError("src and dst must have one dtype and device")
    if not isinstance(shift, int) or isinstance(shift, bool) or not 0 <= shift < max(t_, 1):
        raise ValueError(f"shift must be an int in [0, {t_}), got {shift!r}")


def pad_copy_(dst: torch.Tensor, src: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """dst[:, :C'] = src with its frames rotated by `shift` (frame t of dst takes src frame (t + shift) % T), and
    dst[:, C':] = 0. dst [B, C, T, H, W], src [B, C', T, H, W], C' <= C, one dtype, both channels-last with dense
    (H, W, C) frames (a time slice of a channels-last buffer is fine). Returns dst."""
    _check_pad_copy(dst, src, shift)
    check_device(_pad_copy_kernel, dst=dst, src=src)
    b, c, t_, h, w = dst.shape
    if dst.numel():
        block_c = triton.next_power_of_2(c)
        block_w = max(1, min(triton.next_power_of_2(w), 4096 // block_c))
        grid = (b * t_ * h, triton.cdiv(w, block_w))
        _pad_copy_kernel[grid](
            src, dst, t_, h, w, shift, t_,
            src.stride(0), src.stride(2), src.stride(3), dst.stride(0), dst.stride(2), dst.stride(3),
            CS=src.shape[1], CD=c, BLOCK_W=block_w, BLOCK_C=block_c, num_warps=4,
        )
    return dst


def pad_copy_reference_(dst: torch.Tensor, src: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """Eager torch, same signature as `pad_copy_`."""
    _check_pad_copy(dst, src, shift)
    c_src = src.shape[1]
    dst[:, :c_src].copy_(src.roll(-shift, dims=2) if shift else src)
    dst[:, c_src:].zero_()
    return dst
