"""Nearest 2x upsampling + 3x3 conv as one sub-pixel conv on the low-resolution frames (Triton, Hopper TMA), with its
eager reference.

Replaces the spatial part of the Wan decoder's upsampling Resample ("upsample2d" / "upsample3d", per frame):

    up = F.interpolate(x, scale_factor=2.0, mode="nearest-exact")     # [N, Cin, 2h, 2w], 4x the input
    y  = F.conv2d(up, weight, bias, padding=1)                         # [N, Cout, 2h, 2w]

Output pixel (2i + py, 2j + px) reads the upsampled rows 2i + py - 1 .. 2i + py + 1, which are the input rows i - 1, i
(py = 0: rows dy = 0 | 1, 2) or i, i + 1 (py = 1: rows dy = 0, 1 | 2); the same for columns. So each of the four
output phases (py, px) is a 2x2 conv of x with its own weights:

    Wp[py, px][o, a, b, c] = sum over dy in R(py, a), dx in R(px, b) of weight[o, c, dy, dx]
        R(0, 0) = {0}, R(0, 1) = {1, 2}, R(1, 0) = {0, 1}, R(1, 1) = {2}
    y[n, o, 2i + py, 2j + px] = bias[o] + sum over a, b in {0, 1}, c of x[n, c, i + py + a - 1, j + px + b - 1] Wp

(x = 0 outside the frame: the conv's zero padding of `up` is exactly the zero rows/columns around x). 4 taps per
output pixel instead of 9 (2.25x fewer FLOPs), and the upsampled tensor is never written.

Kernel (`_upsample_conv_kernel`): implicit GEMM per (BH x BW patch of input pixels, phase, output-channel block),
K = 4 taps x Cin ordered (tap, cin); each tap is ONE TMA box load of x [N, h, w, Cin] (channels-last) at
(n, i0 + py + a - 1, j0 + px + b - 1, c0), whose out-of-frame part the TMA unit fills with zeros (the padding);
B from the phase weights [4 Cout, 4 Cin] (K-major); fp16/bf16 tensor cores with fp32 accumulation; the bias added in
fp32 (no FMA), one rounding to the dtype. The output goes out through a TMA store into y viewed as
[N, h, 2, w, 2 Cout] - y[n, 2i + py, 2j + px, o] is element [n, i, py, j, px Cout + o] of that view - so each phase
writes its interleaved pixels directly.

Numerics: the same function, not the same bits as the eager pair. Rounding points:
    phase weights  Wp summed in fp32 from the dtype weights (at most 4 terms: exact unless their exponents are far
                   apart, then within 3 fp32 roundings, far below the next step), rounded once to the dtype (relative
                   error <= 2^-11 fp16, 2^-8 bf16 of the sum); eager uses each weight exactly.
    products       exact in fp32; sums in the tensor cores' fp32 accumulation (K = 4 Cin terms, any order).
    epilogue       RN_dtype(RN(acc + bias)).
Bound against the exact (float64) eager composition, S = conv2d(|up|, |weight|), u the dtype's unit roundoff
(2^-11 fp16, 2^-8 bf16): |y - y_ref| <= (u + (4 Cin + 2) 2^-24) (S + |bias|) + ulp_dtype(|y_ref| + that)
[each Wp within u of its exact sum, which scales S's terms by at most u; (K - 1) 2^-24 S for any fp32 summation, the
bias add, and the two final roundings to the dtype at most one ulp apart]. tests/kernels/test_upsample_conv.py asserts it
(CPU interpreter at small shapes; the GPU at the W2 decoder's shapes).

Refusals (ValueError: the caller falls back to the eager pair): Cin not a multiple of 16, Cout not a multiple of 16,
tensors not channels-last, dtypes other than fp16/bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastremover.env import kernel_tuning
from fastremover.fast.kernels._common import (
    PatchConfig,
    autotune,
    check_device,
    check_tensor,
    interpreting,
    launch_options,
    load_f32,
    patch_width,
    pow2_split,
    round_to,
    tma_available,
)

DTYPES = (torch.float16, torch.bfloat16)
# R(p, a): the 3x3 kernel rows (or columns) that tap a of phase p sums (see the module doc)
_ROWS = {(0, 0): (0,), (0, 1): (1, 2), (1, 0): (0, 1), (1, 1): (2,)}
TILE_WIDTHS = (64, 32, 16, 8)  # input pixels of a patch along w
ACC_REGS_MAX = 128  # fp32 accumulator registers per thread at most (as conv3d_fp8's TMA kernel)
SMEM_BUDGET = 160 * 1024


@triton.jit(do_not_specialize=["H", "W"])
def _upsample_conv_kernel(
    XD, WD0, WD1, BIAS, YD0, YD1,
    H, W, CIN, COUT,
    BH: tl.constexpr, BW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N0: tl.constexpr, BLOCK_N1: tl.constexpr,
    HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """y for one BH x BW patch of input pixels, one output phase, BLOCK_N0 (+ BLOCK_N1) output channels."""
    BM: tl.constexpr = BH * BW
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(COUT, BLOCK_N0 + BLOCK_N1)
    pid_n = pid % n_blocks
    rest = pid // n_blocks
    phase = rest % 4
    pid_m = rest // 4
    py = phase // 2
    px = phase % 2
    tiles_w = tl.cdiv(W, BW)
    tiles_h = tl.cdiv(H, BH)
    j0 = (pid_m % tiles_w) * BW
    i0 = ((pid_m // tiles_w) % tiles_h) * BH
    n = pid_m // (tiles_w * tiles_h)
    n_start = pid_n * (BLOCK_N0 + BLOCK_N1)
    acc0 = tl.zeros([BM, BLOCK_N0], dtype=tl.float32)
    if BLOCK_N1 > 0:
        acc1 = tl.zeros([BM, BLOCK_N1], dtype=tl.float32)
    n_chunks = CIN // BLOCK_K
    for it in range(0, 4 * n_chunks):  # (tap, channel chunk), tap = (a, b)
        tap = it // n_chunks
        c0 = (it - tap * n_chunks) * BLOCK_K
        a = XD.load([n, i0 + py + tap // 2 - 1, j0 + px + tap % 2 - 1, c0]).reshape(BM, BLOCK_K)
        k = tap * CIN + c0
        b0 = WD0.load([phase * COUT + n_start, k])
        if INTERPRET:  # the interpreter's dot misreads bf16 descriptor tiles; fp32 holds them (and their products) exactly
            a = a.to(tl.float32)
            b0 = b0.to(tl.float32)
        acc0 = tl.dot(a, b0.T, acc0)
        if BLOCK_N1 > 0:
            b1 = WD1.load([phase * COUT + n_start + BLOCK_N0, k])
            if INTERPRET:
                b1 = b1.to(tl.float32)
            acc1 = tl.dot(a, b1.T, acc1)
    out_ty = YD0.dtype
    if HAS_BIAS:
        n0 = n_start + tl.arange(0, BLOCK_N0)
        acc0 = acc0 + load_f32(BIAS + n0, n0 < COUT, INTERPRET)[None, :]
    YD0.store([n, i0, py, j0, px * COUT + n_start], round_to(acc0, out_ty, INTERPRET).reshape(1, BH, 1, BW, BLOCK_N0))
    if BLOCK_N1 > 0:
        if HAS_BIAS:
            n1 = n_start + BLOCK_N0 + tl.arange(0, BLOCK_N1)
            acc1 = acc1 + load_f32(BIAS + n1, n1 < COUT, INTERPRET)[None, :]
        YD1.store([n, i0, py, j0, px * COUT + n_start + BLOCK_N0],
                  round_to(acc1, out_ty, INTERPRET).reshape(1, BH, 1, BW, BLOCK_N1))


@dataclass(frozen=True)
class UpConvConfig(PatchConfig):
    """Launch shape: a bh x bw patch of input pixels x (block_n0 + block_n1) output channels of one phase."""


def block_k_for(cin: int) -> int:
    """Channels of one tap per K step: 64 (128-byte rows) where it divides Cin, else 32, else 16."""
    return next(bk for bk in (64, 32, 16) if cin % bk == 0)


def tile_width(w: int) -> int:
    """The patch width in input pixels: _common.patch_width over TILE_WIDTHS."""
    return patch_width(w, TILE_WIDTHS)


def candidate_configs(cin: int, cout: int, w: int, m: int, limit: int | None = 4) -> list[UpConvConfig]:
    """Configs to time, best guess first: a column block of 128 or 64 where it divides Cout, else Cout as two
    power-of-two blocks (96 = 64 + 32); 128- or 256-pixel patches; registers within ACC_REGS_MAX; 3 or 4 stages."""
    bk = block_k_for(cin)
    bw = tile_width(w)
    widths = [wd for wd in (128, 64) if cout % wd == 0] or [
        wd for wd in (cout, 32, 16) if cout % wd == 0 and wd <= 256 and pow2_split(wd)]
    few = m < 128 * 132 * 4 * 2  # (4 phases per patch)
    cands = []
    for wd in dict.fromkeys(widths):
        n0, n1 = pow2_split(wd)
        for bm in ((128, 256) if n1 or few else (256, 128)):
            for warps in ((8, 4) if bm == 256 else (4, 8)):
                if bm * wd > ACC_REGS_MAX * 32 * warps or (warps == 8 and bm * wd <= 128 * 96):
                    continue
                for stages in (3, 4):
                    if (stages - 1) * (bm + wd) * bk * 2 <= SMEM_BUDGET:
                        cands.append(UpConvConfig(bm // bw, bw, n0, n1, warps, stages))
    return cands if limit is None else cands[:limit]


def supported(cin: int, cout: int) -> bool:
    return cin > 0 and cout > 0 and cin % 16 == 0 and cout % 16 == 0


def available(device: torch.device) -> bool:
    """Triton host tensor descriptors and an sm_90+ GPU, or the interpreter (_common.tma_available)."""
    return tma_available(_upsample_conv_kernel, device)


def phase_weights(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight [Cout, Cin, 3, 3] -> the four phases' 2x2 weights as one K-major matrix [4 Cout, 4 Cin]: row
    phase * Cout + o (phase = 2 py + px), column tap * Cin + c (tap = 2 a + b); sums in fp32 (exact), one rounding to
    `dtype` (default weight's)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3):
        raise ValueError(f"weight must be [Cout, Cin, 3, 3], got {tuple(getattr(weight, 'shape', ()))}")
    dtype = dtype or weight.dtype
    wf = weight.detach().float()
    cout, cin = wf.shape[:2]
    out = wf.new_empty(2, 2, cout, 2, 2, cin)  # [py, px, o, a, b, c]
    for py in (0, 1):
        for px in (0, 1):
            for a in (0, 1):
                for b in (0, 1):
                    rows, cols = list(_ROWS[(py, a)]), list(_ROWS[(px, b)])
                    out[py, px, :, a, b] = wf[:, :, rows][:, :, :, cols].sum(dim=(2, 3))
    return out.reshape(4 * cout, 4 * cin).to(dtype).contiguous()


_TUNED: dict[tuple, UpConvConfig] = {}


def upsample_conv2x(x: torch.Tensor, w_phase: torch.Tensor, bias: torch.Tensor | None, *,
                    out: torch.Tensor | None = None, config: UpConvConfig | None = None) -> torch.Tensor:
    """conv2d(nearest_2x(x), weight, bias, padding=1) from w_phase = phase_weights(weight, x.dtype).

    x [N, Cin, h, w] fp16/bf16 channels-last; bias None or [Cout] (any float dtype, added in fp32); out optional
    [N, Cout, 2h, 2w] channels-last of x's dtype. Returns y [N, Cout, 2h, 2w] channels-last. The first call per
    shape class autotunes (one host sync); later calls never synchronize."""
    check_tensor("x", x, ndim=4, dtypes=DTYPES, dims=" [N, C, h, w]", contiguous=False)
    if not x.is_contiguous(memory_format=torch.channels_last) or x.data_ptr() % 16:
        raise ValueError("x must be contiguous in channels_last memory (NHWC) and 16-byte aligned")
    nf, cin, h, w = x.shape
    if (not isinstance(w_phase, torch.Tensor) or w_phase.dim() != 2 or w_phase.shape[1] != 4 * cin
            or w_phase.shape[0] % 4 or w_phase.dtype != x.dtype or not w_phase.is_contiguous()):
        raise ValueError(f"w_phase must be a contiguous {x.dtype} [4*Cout, {4 * cin}] tensor (phase_weights)")
    cout = w_phase.shape[0] // 4
    if not supported(cin, cout):
        raise ValueError(f"upsample_conv2x needs Cin and Cout multiples of 16, got {cin} -> {cout}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.numel() != cout):
        raise ValueError(f"bias must be None or a [{cout}] tensor")
    check_device(_upsample_conv_kernel, x=x, w_phase=w_phase, bias=bias, out=out)
    if not available(x.device):
        raise ValueError("upsample_conv2x needs Triton tensor descriptors and an sm_90+ GPU (or TRITON_INTERPRET=1)")
    shape = (nf, cout, 2 * h, 2 * w)
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype
                            or not out.is_contiguous(memory_format=torch.channels_last) or out.data_ptr() % 16):
        raise ValueError(f"out must be a 16-byte aligned channels_last {x.dtype} {shape} tensor")
    y = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device,
                                                memory_format=torch.channels_last)
    if y.numel() == 0:
        return y
    from triton.tools.tensor_descriptor import TensorDescriptor

    x4 = x.permute(0, 2, 3, 1)  # [N, h, w, Cin], contiguous
    y5 = y.permute(0, 2, 3, 1).view(nf, h, 2, w, 2 * cout)  # y[n, 2i + py, 2j + px, o] = y5[n, i, py, j, px Cout + o]
    bk = block_k_for(cin)
    bias_f = bias.reshape(cout).contiguous() if bias is not None else w_phase
    interp = interpreting(_upsample_conv_kernel)

    def desc(v, box):
        return TensorDescriptor(v, list(v.shape), list(v.stride()), box)

    def launch(c: UpConvConfig):
        n1 = c.block_n1 or c.block_n0
        grid = (nf * triton.cdiv(h, c.bh) * triton.cdiv(w, c.bw) * 4 * (cout // (c.block_n0 + c.block_n1)),)
        _upsample_conv_kernel[grid](
            desc(x4, [1, c.bh, c.bw, bk]), desc(w_phase, [c.block_n0, bk]), desc(w_phase, [n1, bk]), bias_f,
            desc(y5, [1, c.bh, 1, c.bw, c.block_n0]), desc(y5, [1, c.bh, 1, c.bw, n1]),
            h, w, cin, cout,
            BH=c.bh, BW=c.bw, BLOCK_K=bk, BLOCK_N0=c.block_n0, BLOCK_N1=c.block_n1, HAS_BIAS=bias is not None,
            INTERPRET=interp, num_warps=c.num_warps, num_stages=c.num_stages,
            **launch_options(_upsample_conv_kernel),
        )

    if config is not None:
        ok = (isinstance(config, UpConvConfig) and cout % (config.block_n0 + config.block_n1) == 0
              and all(n == 0 or (16 <= n <= 256 and n & (n - 1) == 0) for n in (config.block_n0, config.block_n1))
              and config.block_n0 > 0 and all(v >= 1 and v & (v - 1) == 0 for v in (config.bh, config.bw))
              and config.bh * config.bw >= 16 and max(config.bh, config.bw) <= 256)
        if not ok:  # a column block past Cout would store into the other phase's channels of the [.., 2 Cout] view
            raise ValueError(f"config {config} does not fit Cout={cout}: block_n0 + block_n1 must divide Cout, both "
                             "powers of two in 16..256 (block_n1 may be 0), bh and bw powers of two")
    if config is None:
        m = nf * h * w * 4
        cands = candidate_configs(cin, cout, w, m)
        # the candidates depend on w only through its tile width: widths of one tile width share a tuning
        key = (cin, cout, tile_width(w), 1 << max(0, (m - 1).bit_length()), x.dtype, bias is not None, x.device)
        tune = not interp and kernel_tuning().upconv_tune  # FASTREMOVER_UPCONV_TUNE
        config = autotune(_TUNED, key, cands, launch, tune, "upsample_conv2x", device=x.device)
    launch(config)
    return y


def upsample_conv2x_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the eager decoder computes: nearest-exact 2x, then conv2d with padding 1, in x's dtype."""
    up = F.interpolate(x, scale_factor=2.0, mode="nearest-exact")
    return F.conv2d(up, weight.to(x.dtype), bias.to(x.dtype) if bias is not None else None, padding=1)


def upsample_conv2x_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The exact composition in float64 (x and weight taken as they are): (y_ref rounded to x's dtype, S) with
    S = conv2d(|up|, |weight|) + |bias| in fp32, the bound's scale (module doc)."""
    up = F.interpolate(x.double(), scale_factor=2.0, mode="nearest-exact")
    wd = weight.double()
    y = F.conv2d(up, wd, bias.double() if bias is not None else None, padding=1)
    s = F.conv2d(up.abs(), wd.abs(), bias.double().abs() if bias is not None else None, padding=1)
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last), s.float()
