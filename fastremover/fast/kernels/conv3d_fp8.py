"""FP8 (e4m3) implicit-GEMM causal 3x3x3 conv3d for the Wan VAE (Triton, Hopper), with its eager reference.

Replaces, for the VAE's 3x3x3 causal convs (`vae.CausalConv3d` with padding 1, stride 1), the eager

    stream = cat([zeros(2 - P), prev (P frames, P in 0..2), x], dim=2)     # the causal front padding / cache
    y      = F.conv3d(stream, weight, bias, padding=(0, 1, 1))               # [B, Cout, T, H, W]

by one kernel that reads `prev` and `x` through two pointers (no concatenation) and computes with fp8 operands.

Numerics (the only rounding points; everything else is exact):
    weights     per output channel, once at load (`quantize_conv_weight`, the house rule of quant.py):
                s_w[o] = max(amax |w[o]|, 1e-12) / 448,  w_q = RNE_e4m3(w / s_w[o])       (correctly rounded division)
    activations one per-tensor scale over every frame the conv reads (prev and x), on the device, no host sync
                (`activation_scale`; or a caller-given fp32 [1] tensor):
                s_a = max(amax(|prev|, |x|), 1e-12) / 448
                q   = RNE_sat_e4m3(v * inv),  inv = RN(1 / s_a)                            (one fp32 product)
                A multiply by the reciprocal (not a division per element, which is ~10 instructions in the GEMM's
                hot loop); the eager reference does the same two operations, so its codes are bit-identical.
                |v * inv| <= 448 (1 + 2^-22) for every v of the tensor, which rounds to 448: nothing saturates
                except a caller-given scale that is too small (then +-448, like `cvt.rn.satfinite`).
    GEMM        acc[m, o] = sum over K = 27 * Cin of q_x * q_w: fp8 x fp8 products are exact in fp32 (4 x 4
                significant bits); the sum is accumulated by the tensor cores (see the bounds below).
    epilogue    y = RN_dtype( RN( RN(acc * RN(s_a * s_w[o])) + bias[o] ) )   fp32, no FMA (enable_fp_fusion=False),
                bias fused, output in x's dtype (fp16/bf16), channels_last_3d.
    NaN in prev/x makes s_a NaN (as torch's amax) and so every output NaN; inf makes s_a inf (codes 0 / NaN).

Eager reference (`causal_conv3d_fp8_reference`): the same scales and codes (bit-identical), dequantized to fp32
(xd = RN(q_x * s_a), wd = RN(q_w * s_w)), the zero / cached front frames concatenated, F.conv3d computed in float64
(so the reference is the exact sum of the fp32 products up to 2^-53: no TF32, no cuDNN algorithm choice, no
summation order in it), rounded to fp32, + fp32 bias, rounded to the dtype. Kernel vs reference is not bit-exact
(fp32 accumulation vs an exact sum, and the scale applied after the sum instead of before). With
S = conv(|xd|, |wd|) (the sum of absolute products) and ulp_dtype the output dtype's unit in the last place:
    any IEEE fp32 accumulation (the interpreter: numpy's fp32 matmul per K-chunk, fp32 adds across chunks):
        |y - y_ref| <= (K + 8) * 2^-24 * (S + |bias|) + ulp_dtype(|y_ref| + that)
        [(K - 1) u S for any fp32 summation order, u S for each of the scale/dequant roundings, u |y| for each
        bias add, and the two final roundings to the dtype at most one ulp apart]
    Hopper fp8 wgmma: the tensor cores do NOT accumulate fp8 products in IEEE fp32: the running sum keeps only
        about 14 significant bits (DeepSeek-V3 report, sec. 3.3.2 "Increasing Accumulation Precision", which
        promotes to fp32 every 128 K-elements for that reason). Left alone over K = 10368 (324 k32 instructions)
        the truncation error grows with K and is biased toward zero. So the kernel promotes: the tensor-core
        partial sum covers one BLOCK_K chunk (<= 128 K-elements, <= 4 instructions) and is then added to an fp32
        register accumulator (`tl.dot(..., max_num_imprecise_acc=BLOCK_K)`, `precise_acc=True`, the default; it
        costs a second accumulator's registers and a wait per chunk). Bound asserted by the GPU tests:
            |y - y_ref| <= 2^-9 * (S + |bias|) + ulp_dtype(|y_ref| + that)
        (model: <= 4 truncations of ~2^-13 relative per chunk = 2^-11 S, times 4 margin; the tests print the
        measured max |y - y_ref| / (S + |bias|)). `precise_acc=False` leaves Triton's sm_90 default (no promotion:
        faster, error grows with K); the bench and the gpu test print its error too.

Kernel (`_conv3d_fp8_kernel`): implicit GEMM, M = B*T*H*W output pixels, N = Cout, K = 27*Cin ordered
(kt, kh, kw, cin) - the weight's layout [Cout, 27*Cin] K-major (what fp8 wgmma wants for B).
    * a program owns BLOCK_M (64 / 128) consecutive output pixels and BLOCK_N0 + BLOCK_N1 output channels, one or
      two power-of-two column blocks sharing the A tile (96 = 64 + 32, 192 = 128 + 64) so no MMA column is wasted
      (tl.arange needs powers of two); Cout = 384 takes 3 programs of 128 or 2 of 128 + 64. The accumulators stay
      <= 64 fp32 registers per thread (x2 with the promotion's partial sum): the candidates that spilled in the
      offline sm_90 compile are excluded (`candidate_configs`; tools/bench_conv3d_fp8.py --codegen).
    * one flat K loop over (tap, Cin chunk of BLOCK_K) so Triton software-pipelines it (num_stages); BLOCK_K =
      the largest of 128 / 64 / 32 dividing Cin (Cin 96 -> 32, 192 -> 64, 384 -> 128); Cin = 16, 48, ... run 32-wide
      chunks with the tail channels masked. Numerics depend on Cin only, never on the tuned config.
    * tap (kt, kh, kw) of output pixel m = ((b*T + t)*H + h)*W + w reads virtual frame v = t + kt of
      zeros(2 - P) ++ prev ++ x: x pixel m + delta if v >= 2, else prev pixel mp + delta, with
      delta = ((kt - 2)*H + kh - 1)*W + kw - 1 and mp = ((b*P + t + P)*H + h)*W + w. Both tensors are addressed
      from x's base pointer (prev through its element offset from x, see the kernel's doc); spatial zero padding
      and frames before the stream are load masks (no concatenation, no padded copy). A row reads BLOCK_K
      contiguous channels (NDHWC): 16-byte cp.async loads into the pipelined shared-memory stages.
    * activations: `quantize="pass"` (default) quantizes prev and x once (one elementwise pass, 3 bytes/element of
      HBM traffic) and the GEMM loads fp8 tiles straight into shared memory; `quantize="fused"` loads fp16 tiles and
      quantizes in registers in the K loop. The fused form repeats the conversion (cvt + mul + cvt) for every one of
      the 27 taps and every N-program of a pixel tile (27-54x per element) and moves 2 bytes instead of 1 per
      element per tap through L2/L1; the pass moves ~0.46 GB at 480x832x96ch x 4 frames (~0.1 ms of HBM time,
      an estimate) against a GEMM of 0.8 TFLOP. tools/bench_conv3d_fp8.py measures both (`--bench`, variant "fused").
    * grid: pid -> (pixel tile, N block) with the N blocks of a pixel tile adjacent (its A rows are shared in L2).

TMA kernel (`_conv3d_fp8_tma_kernel`, the default on sm_90+ for quantize="pass"; `kernel="pointer"` forces the one
above): the activations are first quantized into ONE e4m3 stream tensor [B, P + T, H, W, Cin] (prev's frames, then
x's: `quantize_stream`, or written there directly by the VAE's norm kernel, `conv3d_fp8_stream`). A program owns a
BH x BW pixel patch of one output frame (BW = `tma_tile_width(W)`: 64 at 832 columns, 8 at 104) and one or two
power-of-two column blocks; tap (kt, kh, kw) is ONE TMA box load at (b, P + t + kt - 2, h0 + kh - 1, w0 + kw - 1, c0),
and the TMA unit fills every element outside the tensor with zeros - exactly the conv's spatial zero padding and the
zero frames before the stream (frame index < 0) - so there is no mask, no per-element address arithmetic, and the
[1, 1, BH, BW, BLOCK_K] box reshaped to [BH*BW, BLOCK_K] reaches wgmma through ldmatrix as its register operand (B
straight from shared memory; seen offline as LDSM in the SASS). A channel tail reads zeros past Cin (and the next tap's weights, times 0). Weights come in
[BLOCK_N, BLOCK_K] boxes of [Cout, 27 Cin]; the output leaves through a TMA store (rows past the frame's edge dropped)
after the same epilogue as above; an optional residual r is added in fp32 to the conv's dtype value and rounded once
more: the bits of the conv followed by torch.add. Same K order (tap, channel chunk) and promotion (per BLOCK_K chunk,
written out in the kernel) as the pointer kernel, so the same bounds; in the interpreter both give identical bits.
H200 (`--bench --sweep`, bench/results/conv3d-fp8-tma-sweep-*.json, GEMM alone, 4 frames): 96 ch at 480x832 481
TFLOP/s (whole call with the amax and quantization passes 404; the pointer kernel's whole call 330; cuDNN fp16 250),
192 ch 877, 384 ch at 120x208 1079 (cuDNN fp16 about 500-530). Those 192 / 384-channel runs had no promotion in
effect (Triton 3.6 dropped it for BLOCK_K > 32, found afterwards; their max error/S 6-8e-4 equals the unpromoted
one): they are the fast VAE's default (precise_acc=False) numbers. The written-out promotion that replaced it (FADD counts checked
offline by tools/bench_conv3d_fp8.py --codegen) ran on the H200 at 80178cb: max error/S 0.7-1.4e-4 against 5.7-6.8e-4 unpromoted, at all
four real shapes of tests/kernels/test_conv3d_fp8.py (which asserts under half).

Autotuning: a few configs per (Cin, Cout, quantize mode, accumulation, M bucket) are timed on the first call with
that key (triton.testing.do_bench: that first call synchronizes the host once; later calls never do, so a CUDA
graph should be captured after one warm-up call). FASTREMOVER_CONV3D_FP8_TUNE=0 disables tuning (heuristic config).

Interpreter (TRITON_INTERPRET=1, CPU tests): Triton's interpreter runs the fp8 tl.dot itself (it widens the e4m3
codes to fp16 - exact - and calls numpy's fp32 matmul), so no emulation of the dot is needed; fp32 -> e4m3 casts go
through _common.f32_to_fp8e4m3_rne (the interpreter's own cast rounds wrongly), bf16 through load_f32 / round_to.
`max_num_imprecise_acc` is ignored there (numpy accumulates in IEEE fp32), which is why the interpreter bound is
the tighter one above.

Refusals (ValueError, so the caller falls back to fp16 cuDNN; `supported(cin, cout)` asks first): Cin or Cout not
a multiple of 16 (the VAE's conv_in, Cin = 3, and the decoder's conv_out, Cout = 3; the encoder's conv_out, 384 -> 32,
is accepted - whether it pays is the caller's call), a prev with more than 2 frames, tensors not channels_last_3d,
mismatched shapes/dtypes/devices, more than 2^31 - 2^20 output pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastremover.env import kernel_tuning
from fastremover.fast.kernels._common import (
    FP8_MAX,
    PatchConfig,
    autotune,
    check_device,
    check_tensor,
    f32_to_fp8e4m3_rne,
    interpreting,
    launch_options,
    load_f32,
    patch_width,
    pow2_split,
    round_through,
    round_to,
    row_scale_of,
)
from fastremover.fast.kernels._common import tma_available as _tma_available

FP8 = torch.float8_e4m3fn
TAPS = 27  # 3 x 3 x 3
CACHE_FRAMES = 2  # frames a 3-tap causal conv needs from before the chunk
ACT_DTYPES = (torch.float16, torch.bfloat16)
P_OFF_BIAS = 1 << 62  # see _conv3d_fp8_kernel's P_OFF
QUANT_MODES = ("pass", "fused")
KERNELS = ("auto", "tma", "pointer")

# ----------------------------------------------------------------------------------------------------------------------
# Device code


@triton.jit
def _to_e4m3(v, INTERPRET: tl.constexpr):
    """fp32 -> e4m3, RNE, saturating. GPU: one `cvt.rn.satfinite.e4m3x2.f32` per pair (it saturates by itself, so the
    explicit clamp of _common.f32_to_fp8e4m3_rne is skipped in the hot loop); interpreter: the bit-exact emulation."""
    if INTERPRET:
        q = f32_to_fp8e4m3_rne(v, INTERPRET)
    else:
        q = v.to(tl.float8e4nv)
    return q


@triton.jit
def _amax_partial_kernel(P, X, PART, n_p, n_x, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """PART[pid] = max |v| over this program's blocks of prev then x (grid-strided); NaN if any was NaN."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(pid, tl.cdiv(n_p, BLOCK), nprog):
        idx = tl.cast(i, tl.int64) * BLOCK + offs
        m = idx < n_p
        v = tl.abs(load_f32(P + idx, m, INTERPRET))
        amax = tl.maximum(amax, v)
        nan = tl.maximum(nan, (v != v).to(tl.int32))
    for i in range(pid, tl.cdiv(n_x, BLOCK), nprog):
        idx = tl.cast(i, tl.int64) * BLOCK + offs
        m = idx < n_x
        v = tl.abs(load_f32(X + idx, m, INTERPRET))
        amax = tl.maximum(amax, v)
        nan = tl.maximum(nan, (v != v).to(tl.int32))
    a = tl.max(amax, axis=0)
    tl.store(PART + pid, tl.where(tl.max(nan, axis=0) > 0, float("nan"), a))


@triton.jit
def _amax_finalize_kernel(PART, n, SA, BLOCK: tl.constexpr):
    """SA[0] = max(max PART, 1e-12) / 448 (div.rn), NaN if a partial is NaN (max is order-free: exact)."""
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, tl.cdiv(n, BLOCK)):
        m = i * BLOCK + offs < n
        v = tl.load(PART + i * BLOCK + offs, mask=m, other=0.0)
        amax = tl.maximum(amax, v)
        nan = tl.maximum(nan, (v != v).to(tl.int32))
    tl.store(SA, row_scale_of(tl.max(amax, axis=0), tl.max(nan, axis=0) > 0))


@triton.jit
def _quant_act_kernel(P, X, PQ, XQ, SA, n_p, n_x, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """PQ/XQ = RNE_sat_e4m3(v * RN(1 / SA[0])) elementwise over the flat (dense) storage of prev and x."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    inv = tl.math.div_rn(1.0, tl.load(SA))
    for i in range(pid, tl.cdiv(n_p, BLOCK), nprog):
        idx = tl.cast(i, tl.int64) * BLOCK + offs
        m = idx < n_p
        tl.store(PQ + idx, _to_e4m3(load_f32(P + idx, m, INTERPRET) * inv, INTERPRET), mask=m)
    for i in range(pid, tl.cdiv(n_x, BLOCK), nprog):
        idx = tl.cast(i, tl.int64) * BLOCK + offs
        m = idx < n_x
        tl.store(XQ + idx, _to_e4m3(load_f32(X + idx, m, INTERPRET) * inv, INTERPRET), mask=m)


@triton.jit
def _tap_chunk(it, n_chunks, BLOCK_K: tl.constexpr):
    """K step `it` of both conv kernels -> (tap, first channel c0, kt, kh, kw): the K order is (tap, channel chunk)
    with tap = (kt, kh, kw) row-major over the 3x3x3 kernel."""
    tap = it // n_chunks
    c0 = (it - tap * n_chunks) * BLOCK_K
    return tap, c0, tap // 9, (tap // 3) % 3, tap % 3


@triton.jit(do_not_specialize=["M", "T", "H", "W", "NP"])  # one compile per config, whatever the frame size
def _conv3d_fp8_kernel(
    X, P_OFF, WQ, WS, BIAS, SA, Y,
    M, T, H, W, NP, CIN, COUT, KTOT,
    BLOCK_M: tl.constexpr, BLOCK_N0: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K: tl.constexpr,
    IN_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, PROMOTE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Y[m, o] (= y[b, o, t, h, w], NDHWC) for BLOCK_M pixels x (BLOCK_N0 + BLOCK_N1) channels; see the module doc.

    X [B*T*H*W, CIN] and prev [B*NP*H*W, CIN] (NP = 0..2 cached frames) are fp16/bf16 (quantized here with SA) or,
    with IN_FP8, already e4m3. prev is addressed from X's base: its element offset from X is P_OFF - 2^62 (biased so
    the argument is always an i64: one compile whatever the distance between the two allocations; Triton still
    specializes its divisibility by 16). The row offset is written as select(pixel) * CIN + (v < 2) * p_off so that
    Triton's alignment analysis still sees 16-element divisibility: then the A tile is a 16-byte vectorized,
    cp.async-pipelined load. A select between two pointers, or between two offsets one of which has p_off added,
    loses it: the sm_90 compile then issues one scalar load per element and no cp.async for A (checked offline;
    tools/bench_conv3d_fp8.py --codegen asserts no scalar byte/halfword loads).
    WQ [COUT, KTOT = 27*CIN] e4m3 K-major; WS [COUT] fp32; BIAS [COUT] any float (unused without HAS_BIAS)."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(COUT, BLOCK_N0 + BLOCK_N1)
    pid_m = pid // n_blocks
    n_start = (pid % n_blocks) * (BLOCK_N0 + BLOCK_N1)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    w_ = rows % W
    h_ = (rows // W) % H
    bt = rows // (W * H)
    t_ = bt % T
    b_ = bt // T
    pix_x = rows.to(tl.int64)  # the row's own pixel in x's index space
    pix_p = ((b_.to(tl.int64) * NP + t_ + NP) * H + h_) * W + w_  # the same pixel in prev's index space
    p_off = P_OFF - (1 << 62)  # elements from X to prev

    sa = tl.load(SA)
    if not IN_FP8:
        inv = tl.math.div_rn(1.0, sa)
    offs_k = tl.arange(0, BLOCK_K)
    n0 = n_start + tl.arange(0, BLOCK_N0)
    acc0 = tl.zeros([BLOCK_M, BLOCK_N0], dtype=tl.float32)
    if BLOCK_N1 > 0:
        n1 = n_start + BLOCK_N0 + tl.arange(0, BLOCK_N1)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N1], dtype=tl.float32)

    n_chunks = tl.cdiv(CIN, BLOCK_K)
    for it in range(0, 27 * n_chunks):  # (tap, channel chunk), tap = (kt, kh, kw)
        tap, c0, kt, kh, kw = _tap_chunk(it, n_chunks, BLOCK_K)
        delta = ((kt - 2) * H + (kh - 1)) * W + (kw - 1)
        hh = h_ + (kh - 1)
        ww = w_ + (kw - 1)
        v = t_ + kt  # virtual frame of zeros(2 - NP) ++ prev ++ x
        in_x = v >= 2
        ok = row_ok & (hh >= 0) & (hh < H) & (ww >= 0) & (ww < W) & (v >= 2 - NP)
        row_ptr = X + (tl.where(in_x, pix_x, pix_p) + delta) * CIN + (v < 2).to(tl.int64) * p_off
        cc = c0 + offs_k
        c_ok = cc < CIN
        a_ptrs = row_ptr[:, None] + cc[None, :]
        a_mask = ok[:, None] & c_ok[None, :]
        if IN_FP8:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        else:  # quantize in registers: RNE_sat_e4m3(v * inv)
            a = _to_e4m3(load_f32(a_ptrs, a_mask, INTERPRET) * inv, INTERPRET)
        kk = tap * CIN + cc
        b0 = tl.load(WQ + n0.to(tl.int64)[None, :] * KTOT + kk[:, None],
                     mask=c_ok[:, None] & (n0 < COUT)[None, :], other=0.0)
        if PROMOTE > 0:
            acc0 = tl.dot(a, b0, acc0, max_num_imprecise_acc=PROMOTE)
        else:
            acc0 = tl.dot(a, b0, acc0)
        if BLOCK_N1 > 0:
            b1 = tl.load(WQ + n1.to(tl.int64)[None, :] * KTOT + kk[:, None],
                         mask=c_ok[:, None] & (n1 < COUT)[None, :], other=0.0)
            if PROMOTE > 0:
                acc1 = tl.dot(a, b1, acc1, max_num_imprecise_acc=PROMOTE)
            else:
                acc1 = tl.dot(a, b1, acc1)

    out_rows = rows.to(tl.int64)[:, None] * COUT
    _conv_epilogue(acc0, n0, sa, WS, BIAS, Y, out_rows, row_ok, COUT, HAS_BIAS, INTERPRET)
    if BLOCK_N1 > 0:
        _conv_epilogue(acc1, n1, sa, WS, BIAS, Y, out_rows, row_ok, COUT, HAS_BIAS, INTERPRET)


@triton.jit
def _conv_epilogue(acc, n, sa, WS, BIAS, Y, out_rows, row_ok, COUT, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    n_ok = n < COUT
    sc = sa * tl.load(WS + n, mask=n_ok, other=0.0)
    y = acc * sc[None, :]
    if HAS_BIAS:
        y = y + load_f32(BIAS + n, n_ok, INTERPRET)[None, :]
    tl.store(Y + out_rows + n[None, :], round_to(y, Y.dtype.element_ty, INTERPRET),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _quant_stream_kernel(P, X, S, SA, n_p, n_x, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """S[b] = RNE_sat_e4m3(v * RN(1 / SA[0])) over prev[b] ++ x[b] (each batch's flat NDHWC storage, prev's frames
    first): the fp8 stream the TMA kernel reads. Grid (programs, B); n_p / n_x elements per batch."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inv = tl.math.div_rn(1.0, tl.load(SA))
    s_base = b * (n_p + n_x)
    for i in range(pid, tl.cdiv(n_p, BLOCK), nprog):
        idx = tl.cast(i, tl.int64) * BLOCK + offs
        m = idx < n_p
        tl.store(S + s_base + idx, _to_e4m3(load_f32(P + b * n_p + idx, m, INTERPRET) * inv, INTERPRET), mask=m)
    for i in range(pid, tl.cdiv(n_x, BLOCK), nprog):
        idx = tl.cast(i, tl.int64) * BLOCK + offs
        m = idx < n_x
        tl.store(S + s_base + n_p + idx, _to_e4m3(load_f32(X + b * n_x + idx, m, INTERPRET) * inv, INTERPRET),
                 mask=m)


@triton.jit(do_not_specialize=["T", "H", "W", "NP"])
def _conv3d_fp8_tma_kernel(
    XD, WD0, WD1, WS, BIAS, SA, YD0, YD1, RD0, RD1,
    T, H, W, NP, CIN, COUT,
    BH: tl.constexpr, BW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N0: tl.constexpr, BLOCK_N1: tl.constexpr,
    HAS_BIAS: tl.constexpr, PROMOTE: tl.constexpr, OUT_BF16: tl.constexpr, HAS_RES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """y[b, t, h0:h0+BH, w0:w0+BW, n:n+BLOCK_N0(+BLOCK_N1)] for one BH x BW pixel patch of one output frame.

    XD: tensor descriptor of the fp8 stream [B, NP + T, H, W, CIN] (prev's NP frames, then x's T), box
    [1, 1, BH, BW, BLOCK_K]. Tap (kt, kh, kw) of the patch is ONE box load at (b, NP + t + kt - 2, h0 + kh - 1,
    w0 + kw - 1, c0): the TMA unit zero-fills every element outside the tensor, which is exactly the conv's zero
    padding - spatially (h or w out of [0, H) / [0, W)) and causally (a frame index < 0: the zeros before the stream
    when fewer than 2 frames are cached). No masks, no address arithmetic per element, no padded copy.
    WD0 / WD1: the weight [COUT, 27*CIN] e4m3 (K-major), boxes [BLOCK_N0 / BLOCK_N1, BLOCK_K].
    YD0 / YD1: y [B, T, H, W, COUT] (x's dtype), boxes [1, 1, BH, BW, BLOCK_N0 / BLOCK_N1]; the TMA store drops the
    rows of a patch that hang over the frame's edge.
    RD0 / RD1 (HAS_RES): a residual r [B, T, H, W, COUT] of y's dtype, same boxes: y = RN_dtype(y_conv + r) with
    y_conv the conv's dtype value widened exactly (one fp32 add): the bits of the conv followed by torch's add.
    Same K order (tap, channel chunk), accumulation (tensor cores, promoted every BLOCK_K with PROMOTE) and epilogue
    rounding as _conv3d_fp8_kernel; only the summation order inside the tensor cores' chunks can differ."""
    BM: tl.constexpr = BH * BW
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(COUT, BLOCK_N0 + BLOCK_N1)
    pid_n = pid % n_blocks
    pid_m = pid // n_blocks
    tiles_w = tl.cdiv(W, BW)
    tiles_h = tl.cdiv(H, BH)
    w0 = (pid_m % tiles_w) * BW
    h0 = ((pid_m // tiles_w) % tiles_h) * BH
    bt = pid_m // (tiles_w * tiles_h)
    t = bt % T
    b = bt // T
    n_start = pid_n * (BLOCK_N0 + BLOCK_N1)
    acc0 = tl.zeros([BM, BLOCK_N0], dtype=tl.float32)
    if BLOCK_N1 > 0:
        acc1 = tl.zeros([BM, BLOCK_N1], dtype=tl.float32)
    n_chunks = tl.cdiv(CIN, BLOCK_K)  # a tail chunk reads zeros past CIN (and weights of the next tap: x 0)
    for it in range(0, 27 * n_chunks):  # (tap, channel chunk), tap = (kt, kh, kw)
        tap, c0, kt, kh, kw = _tap_chunk(it, n_chunks, BLOCK_K)
        a = XD.load([b, NP + t + kt - 2, h0 + kh - 1, w0 + kw - 1, c0]).reshape(BM, BLOCK_K)
        k = tap * CIN + c0
        b0 = WD0.load([n_start, k])
        # PROMOTE: the chunk's tensor-core sum starts from zero and is added to the fp32 accumulator here. (Passing
        # acc0 with max_num_imprecise_acc=BLOCK_K, as the pointer kernel does, loses the promotion in Triton 3.6 when
        # BLOCK_K > 32: the dot is split into K = 32 wgmmas marked "never promote". The nonzero
        # max_num_imprecise_acc also keeps Triton from folding the add back into the dot.)
        if PROMOTE > 0:
            acc0 += tl.dot(a, b0.T, tl.zeros([BM, BLOCK_N0], dtype=tl.float32), max_num_imprecise_acc=PROMOTE)
        else:
            acc0 = tl.dot(a, b0.T, acc0)
        if BLOCK_N1 > 0:
            b1 = WD1.load([n_start + BLOCK_N0, k])
            if PROMOTE > 0:
                acc1 += tl.dot(a, b1.T, tl.zeros([BM, BLOCK_N1], dtype=tl.float32), max_num_imprecise_acc=PROMOTE)
            else:
                acc1 = tl.dot(a, b1.T, acc1)
    sa = tl.load(SA)
    out_ty: tl.constexpr = tl.bfloat16 if OUT_BF16 else tl.float16
    y0 = _scale_bias(acc0, n_start + tl.arange(0, BLOCK_N0), sa, WS, BIAS, COUT, HAS_BIAS, INTERPRET)
    if HAS_RES:  # the conv's dtype value, then + r in fp32, rounded once more (conv, then torch.add)
        r0 = RD0.load([b, t, h0, w0, n_start]).reshape(BM, BLOCK_N0).to(tl.float32)
        y0 = round_through(y0, out_ty, INTERPRET) + r0
    YD0.store([b, t, h0, w0, n_start], round_to(y0, out_ty, INTERPRET).reshape(1, 1, BH, BW, BLOCK_N0))
    if BLOCK_N1 > 0:
        y1 = _scale_bias(acc1, n_start + BLOCK_N0 + tl.arange(0, BLOCK_N1), sa, WS, BIAS, COUT, HAS_BIAS, INTERPRET)
        if HAS_RES:
            r1 = RD1.load([b, t, h0, w0, n_start + BLOCK_N0]).reshape(BM, BLOCK_N1).to(tl.float32)
            y1 = round_through(y1, out_ty, INTERPRET) + r1
        YD1.store([b, t, h0, w0, n_start + BLOCK_N0],
                  round_to(y1, out_ty, INTERPRET).reshape(1, 1, BH, BW, BLOCK_N1))


@triton.jit
def _scale_bias(acc, n, sa, WS, BIAS, COUT, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 RN(RN(acc * RN(sa * ws[n])) + bias[n]) (no FMA: enable_fp_fusion=False), _conv_epilogue's value."""
    n_ok = n < COUT
    y = acc * (sa * tl.load(WS + n, mask=n_ok, other=0.0))[None, :]
    if HAS_BIAS:
        y = y + load_f32(BIAS + n, n_ok, INTERPRET)[None, :]
    return y


# ----------------------------------------------------------------------------------------------------------------------
# Configs and autotuning


@dataclass(frozen=True)
class ConvConfig:
    """Launch shape of _conv3d_fp8_kernel: BLOCK_M pixels x (block_n0 + block_n1) channels per program."""

    block_m: int
    block_n0: int
    block_n1: int
    num_warps: int
    num_stages: int


def block_k_for(cin: int) -> int:
    """BLOCK_K (channels of one tap per K step): 128 / 64 / 32, the largest dividing Cin, else 32 (masked tail)."""
    for bk in (128, 64, 32):
        if cin % bk == 0:
            return bk
    return 32


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# fp32 accumulator registers per thread at most (x2 with precise_acc: the tensor cores' partial sum is a second
# accumulator); above this the sm_90 compile spills (checked offline: 128 x 192 per 8 warps spills, 128 x 128 not).
ACC_REGS_MAX = 64
SMEM_BUDGET = 160 * 1024  # bytes of pipelined A + B stages (the H200 gives a program up to 227 KB)


def candidate_configs(cin: int, cout: int, m: int, in_fp8: bool = True) -> list[ConvConfig]:
    """At most 3 configs to time (each distinct one is a compile on first use: keep it short), best guess first.

    Columns per program: Cout itself if <= 256, else a divisor (192 / 128 / 96 / 64) - always exact, two blocks
    where it is not a power of two; pixel tiles of 128 or 64 rows; warps so the accumulator stays <= ACC_REGS_MAX
    registers per thread; as many stages (<= 4) as fit SMEM_BUDGET."""
    bk = block_k_for(cin)
    widths = [wd for wd in dict.fromkeys(([cout] if cout <= 256 else []) + [192, 128, 96, 64, 32, 16])
              if cout % wd == 0 and pow2_split(wd) and wd >= min(cout, 64)]
    if not widths:  # Cout a multiple of 16 always has 16; keep a masked fallback anyway
        widths = [min(128, triton.next_power_of_2(cout))]
    cands = []
    for wd in widths:
        for bm in (128, 64):
            for warps in (4, 8):
                if bm * wd > ACC_REGS_MAX * 32 * warps or (warps == 8 and bm * wd <= 64 * 32 * 4):
                    continue
                if bk == 128 and (warps == 4 or (bm == 128 and not _pow2(wd))):  # spills (offline sm_90 compile)
                    continue
                per_stage = bm * bk * (1 if in_fp8 else 2) + bk * wd
                stages = max(2, min(4, SMEM_BUDGET // per_stage))
                n0, n1 = pow2_split(wd) or (wd, 0)
                cands.append(ConvConfig(bm, n0, n1, warps, stages))
    small = m < 128 * 132 * 2  # under two waves of 128-pixel tiles: prefer 64-pixel tiles
    cands.sort(key=lambda c: (-(c.block_m * (c.block_n0 + c.block_n1)), (c.block_m == 128) == small,
                              -(c.block_n0 + c.block_n1)))
    return cands[:3]


def default_config(cin: int, cout: int, m: int, in_fp8: bool = True) -> ConvConfig:
    """The heuristic config (used untuned and in the interpreter): the first candidate."""
    return candidate_configs(cin, cout, m, in_fp8)[0]


# TMA kernel (_conv3d_fp8_tma_kernel): fp32 accumulator registers per thread at most. Its A tile comes from shared
# memory one wgmma step at a time (ldmatrix), not as a whole loaded register tile, so it affords more than the pointer
# kernel. Offline sm_90 compile: 128 regs never spilled; 192 did not at BLOCK_K 32 / 64 but did at 128 (256 px x 96 ch
# on 4 warps), 256 did.
TMA_ACC_REGS_MAX = 128
TMA_ACC_REGS_MAX_PROMOTE = 96  # with promotion (a second accumulator for each chunk's sum): 128 spilled, 96 did not
TMA_SMEM_BUDGET = 192 * 1024  # bytes of the pipelined A + B stages (offline compile: shared = (stages - 1) x stage
#                               + ~24 KB of barriers and epilogue staging; the H200 gives a program 227 KB)
TMA_TILE_WIDTHS = (64, 32, 16, 8)  # pixels of a patch along W
TMA_MAX_STAGES = 6  # a K step is short (BLOCK_K = 32 at 96 channels): keep several TMA loads in flight


@dataclass(frozen=True)
class TmaConfig(PatchConfig):
    """Launch shape of _conv3d_fp8_tma_kernel: a bh x bw pixel patch x (block_n0 + block_n1) channels per program."""


def tma_tile_width(w: int) -> int:
    """The patch width of the TMA kernel on frames w wide: _common.patch_width over TMA_TILE_WIDTHS."""
    return patch_width(w, TMA_TILE_WIDTHS)


def tma_candidate_configs(cin: int, cout: int, h: int, w: int, m: int, limit: int | None = 6,
                          promote: bool = False) -> list[TmaConfig]:
    """Configs to time for the TMA kernel, best guess first (at most `limit`), from the H200 sweep
    (bench/results/conv3d-fp8-tma-sweep-*.json): one power-of-two column block of 128 or 64 where it divides Cout
    (192 channels: 3 programs of 64 beat 128 + 64), else Cout as two blocks (96 = 64 + 32); 256-pixel patches with 8
    warps for single blocks, 128-pixel ones for split blocks and for few pixels; registers within TMA_ACC_REGS_MAX;
    each shape at 3 stages and at the most that fit TMA_SMEM_BUDGET (fewer stages leave shared memory for a second
    program per SM: 192 channels ran 0.91 ms at 3 stages, 1.01 at 6). promote: precise accumulation (a second
    accumulator per chunk): registers within TMA_ACC_REGS_MAX_PROMOTE instead."""
    bk = block_k_for(cin)
    regs_max = TMA_ACC_REGS_MAX_PROMOTE if promote else TMA_ACC_REGS_MAX
    bw = tma_tile_width(w)
    widths = [wd for wd in (128, 64) if cout % wd == 0] or [
        wd for wd in dict.fromkeys(([cout] if cout <= 256 else []) + [192, 96, 32, 16])
        if cout % wd == 0 and pow2_split(wd) and wd >= min(cout, 16)]
    few_tiles = m < 128 * 132 * 2  # under two waves of 128-pixel patches
    cands = []
    for wd in widths:
        n0, n1 = pow2_split(wd)
        tiles = (128, 256) if n1 or few_tiles else (256, 128)
        for bm in tiles:
            for warps in (8, 4) if bm == 256 else (4, 8):
                if bm * wd > regs_max * 32 * warps or (warps == 8 and bm * wd <= 128 * 96):
                    continue
                most = min(TMA_MAX_STAGES, 1 + TMA_SMEM_BUDGET // (bm * bk + wd * bk))
                for stages in dict.fromkeys((3, most) if most >= 3 else (most,)):
                    if stages >= 2:
                        cands.append(TmaConfig(bm // bw, bw, n0, n1, warps, stages))
    return cands if limit is None else cands[:limit]


def tma_supported(cin: int, cout: int) -> bool:
    """Channel counts the TMA kernel takes: those of the pointer kernel (a channel tail past the last full BLOCK_K
    chunk reads zeros: the box hangs over the tensor's channel extent)."""
    return supported(cin, cout)


def tma_available(device: torch.device) -> bool:
    """The TMA kernel can run on `device` (_common.tma_available)."""
    return _tma_available(_conv3d_fp8_tma_kernel, device)


_TUNED: dict[tuple, ConvConfig] = {}


def _tune_key(cin: int, cout: int, m: int, in_dtype: torch.dtype, promote: int, has_bias: bool,
              device: torch.device) -> tuple:
    """Tuning cache key: channels, M rounded up to a power of two, GEMM input dtype, accumulation, bias, device."""
    return (cin, cout, 1 << max(0, (m - 1).bit_length()), in_dtype, promote, has_bias, device.index)


def tuned_config(kernel: str, cin: int, cout: int, m: int, w: int, promote: int, has_bias: bool,
                 device: torch.device):
    """The config autotuning picked for a conv ("tma" or "pointer" kernel, fp8 GEMM input), None before its first
    call."""
    key = _tune_key(cin, cout, m, FP8, promote, has_bias, device)
    return _TUNED.get(("tma",) + key + (tma_tile_width(w), False) if kernel == "tma" else key)


def _tuning_enabled() -> bool:
    return kernel_tuning().conv3d_fp8_tune  # FASTREMOVER_CONV3D_FP8_TUNE


# ----------------------------------------------------------------------------------------------------------------------
# Wrappers


def supported(cin: int, cout: int) -> bool:
    """True for the channel counts the FP8 kernel takes (multiples of 16); callers fall back to cuDNN otherwise."""
    return cin > 0 and cout > 0 and cin % 16 == 0 and cout % 16 == 0


def _is_cl3d(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last_3d)


def _check_act(name: str, t, dtypes: tuple) -> None:
    check_tensor(name, t, ndim=5, dtypes=dtypes, dims=" [B, C, T, H, W]", contiguous=False)
    if not _is_cl3d(t):
        raise ValueError(f"{name} must be contiguous in channels_last_3d memory (NDHWC); "
                         f"call .contiguous(memory_format=torch.channels_last_3d); got strides {t.stride()}")


def _check_prev_x(prev, x, dtypes: tuple) -> None:
    _check_act("x", x, dtypes)
    if prev is None:
        return
    _check_act("prev", prev, dtypes)
    if prev.dtype != x.dtype:
        raise ValueError(f"prev must have x's dtype {x.dtype}, got {prev.dtype}")
    b, c, _, h, w = x.shape
    if not (1 <= prev.shape[2] <= CACHE_FRAMES) or (prev.shape[0], prev.shape[1], prev.shape[3], prev.shape[4]) != (
            b, c, h, w):
        raise ValueError(f"prev must be [B, C, 1..{CACHE_FRAMES}, H, W] = [{b}, {c}, 1..2, {h}, {w}] (the cached "
                         f"frames before x), got {tuple(prev.shape)}")
    if prev.device != x.device:
        raise ValueError(f"prev must be on x's device {x.device}, got {prev.device}")


def _check_scale(name: str, s, device) -> None:
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
        raise ValueError(f"{name} must be a one-element fp32 tensor, got "
                         f"{type(s).__name__ if not isinstance(s, torch.Tensor) else (s.dtype, tuple(s.shape))}")
    if s.device != device:
        raise ValueError(f"{name} must be on {device} (a device tensor: no host sync), got {s.device}")


def _grid_cap(device: torch.device, interp: bool) -> int:
    if interp:
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def quantize_conv_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [Cout, Cin, 3, 3, 3] fp16/bf16/fp32 -> (w_q float8_e4m3fn [Cout, 27*Cin] K-major, K ordered
    (kt, kh, kw, cin); w_scale fp32 [Cout]). Per output channel: s = max(amax |w[o]|, 1e-12) / 448 (a tensor
    division: correctly rounded on CPU and CUDA), q = RNE(w / s), clamped to +-448 (a no-op: |w / s| <= 448).
    Plain torch, once at load."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 5 or tuple(weight.shape[2:]) != (3, 3, 3):
        raise ValueError(f"weight must be [Cout, Cin, 3, 3, 3], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"weight must be fp16/bf16/fp32, got {weight.dtype}")
    cout, cin = weight.shape[:2]
    if not supported(cin, cout):
        raise ValueError(f"conv3d_fp8 needs Cin and Cout multiples of 16 (got Cin={cin}, Cout={cout}); "
                         "use the fp16 cuDNN conv for this layer")
    wk = weight.detach().float().permute(0, 2, 3, 4, 1).reshape(cout, TAPS * cin)
    amax = wk.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    scale = amax / amax.new_full((), FP8_MAX)
    q = (wk / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
    return q, scale.view(cout).contiguous()


def dequantize_conv_weight(w_q: torch.Tensor, w_scale: torch.Tensor, cin: int) -> torch.Tensor:
    """(w_q, w_scale) -> fp32 [Cout, Cin, 3, 3, 3] with wd = RN(q * s[o]) (the reference's weights)."""
    cout = w_q.shape[0]
    wd = w_q.float() * w_scale.float().view(cout, 1)
    return wd.view(cout, 3, 3, 3, cin).permute(0, 4, 1, 2, 3).contiguous()


def activation_scale(prev: torch.Tensor | None, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """s_a = max(amax(|prev|, |x|), 1e-12) / 448 as an fp32 [1] device tensor (two launches, no host sync; NaN if
    any input is NaN). prev/x fp16/bf16 channels_last_3d, as for causal_conv3d_fp8."""
    _check_prev_x(prev, x, ACT_DTYPES)
    check_device(_amax_partial_kernel, x=x, prev=prev, out=out)
    if out is not None:
        _check_scale("out", out, x.device)
    sa = out if out is not None else torch.empty(1, dtype=torch.float32, device=x.device)
    interp = interpreting(_amax_partial_kernel)
    n_p = prev.numel() if prev is not None else 0
    n_x = x.numel()
    block = 4096
    nprog = max(1, min(triton.cdiv(n_p, block) + triton.cdiv(n_x, block), _grid_cap(x.device, interp)))
    part = torch.empty(nprog, dtype=torch.float32, device=x.device)
    _amax_partial_kernel[(nprog,)](prev if prev is not None else x, x, part, n_p, n_x, BLOCK=block,
                                   INTERPRET=interp, num_warps=8, **launch_options(_amax_partial_kernel))
    _amax_finalize_kernel[(1,)](part, nprog, sa, BLOCK=1024, num_warps=4, **launch_options(_amax_finalize_kernel))
    return sa


def quantize_activation(prev: torch.Tensor | None, x: torch.Tensor, act_scale: torch.Tensor
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(prev, x) fp16/bf16 -> e4m3 codes RNE_sat(v * RN(1 / act_scale)), same shapes, channels_last_3d; one launch."""
    _check_prev_x(prev, x, ACT_DTYPES)
    check_device(_quant_act_kernel, x=x, prev=prev, act_scale=act_scale)
    _check_scale("act_scale", act_scale, x.device)
    interp = interpreting(_quant_act_kernel)
    xq = torch.empty_like(x, dtype=FP8, memory_format=torch.channels_last_3d)
    pq = torch.empty_like(prev, dtype=FP8, memory_format=torch.channels_last_3d) if prev is not None else None
    n_p = prev.numel() if prev is not None else 0
    n_x = x.numel()
    block = 4096
    nprog = max(1, min(triton.cdiv(n_p, block) + triton.cdiv(n_x, block), 4 * _grid_cap(x.device, interp)))
    _quant_act_kernel[(nprog,)](prev if prev is not None else x, x, pq if pq is not None else xq, xq, act_scale,
                                n_p, n_x, BLOCK=block, INTERPRET=interp, num_warps=8,
                                **launch_options(_quant_act_kernel))
    return pq, xq


def _check_weights(w_q, w_scale, bias, cin: int) -> int:
    """Validate (w_q, w_scale) from quantize_conv_weight and the bias for an input of cin channels; returns Cout."""
    if not isinstance(w_q, torch.Tensor) or w_q.dim() != 2 or w_q.dtype != FP8 or not w_q.is_contiguous():
        raise ValueError("w_q must be a contiguous float8_e4m3fn [Cout, 27*Cin] tensor (quantize_conv_weight), got "
                         f"{(w_q.dtype, tuple(w_q.shape)) if isinstance(w_q, torch.Tensor) else type(w_q).__name__}")
    cout = w_q.shape[0]
    if not supported(cin, cout):
        raise ValueError(f"conv3d_fp8 needs Cin and Cout multiples of 16 (got Cin={cin}, Cout={cout}); "
                         "use the fp16 cuDNN conv for this layer")
    if w_q.shape[1] != TAPS * cin:
        raise ValueError(f"w_q must be [Cout, 27*Cin] = [{cout}, {TAPS * cin}] for x's Cin={cin}, got "
                         f"{tuple(w_q.shape)}")
    if not isinstance(w_scale, torch.Tensor) or w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (cout,):
        raise ValueError(f"w_scale must be fp32 [{cout}]")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (cout,)
                             or bias.dtype not in (torch.float16, torch.bfloat16, torch.float32)):
        raise ValueError(f"bias must be None or a float [{cout}] tensor")
    return cout


def causal_conv3d_fp8(
    prev: torch.Tensor | None,
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    quantize: str = "pass",
    precise_acc: bool = True,
    out_dtype: torch.dtype | None = None,
    config: ConvConfig | TmaConfig | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """The causal 3x3x3 conv (padding 1, stride 1) of the stream zeros(2 - P) ++ prev ++ x, with fp8 operands.

    prev  None (zeros: the first chunk) or the P = 1..2 cached frames [B, Cin, P, H, W]
    x     the new frames [B, Cin, T, H, W]; prev and x fp16/bf16, channels_last_3d (each frame a contiguous [H, W, C]).
          Already-quantized e4m3 prev/x (from quantize_activation) are accepted too; then act_scale and out_dtype
          are required.
    w_q, w_scale  from quantize_conv_weight ([Cout, 27*Cin] e4m3, [Cout] fp32); bias None or [Cout] (any float dtype,
          applied in fp32).
    act_scale  None: activation_scale(prev, x) (computed on the device); or a one-element fp32 device tensor.
    out   optional [B, Cout, T, H, W] channels_last_3d tensor of the output dtype (x's dtype, or out_dtype).
    quantize  "pass": quantize prev/x in one elementwise pass, GEMM on fp8 loads; "fused": quantize in the GEMM loop.
    precise_acc  promote the tensor-core partial sums to fp32 every BLOCK_K (see the module doc); False: Triton's
          sm_90 default (no promotion).
    config  a ConvConfig (pointer kernel) or TmaConfig (TMA kernel) to launch with (skips autotuning).
    kernel  "auto": the TMA kernel (_conv3d_fp8_tma_kernel) on an sm_90+ GPU with quantize="pass", else the pointer
          kernel (_conv3d_fp8_kernel); "tma" / "pointer" force one (ValueError where "tma" cannot run).
    Returns y [B, Cout, T, H, W] channels_last_3d. Raises ValueError for Cin/Cout not multiples of 16 (use cuDNN)."""
    in_fp8 = isinstance(x, torch.Tensor) and x.dtype == FP8
    _check_prev_x(prev, x, (FP8,) if in_fp8 else ACT_DTYPES)
    b, cin, t, h, w = x.shape
    cout = _check_weights(w_q, w_scale, bias, cin)
    if quantize not in QUANT_MODES:
        raise ValueError(f"quantize must be one of {QUANT_MODES}, got {quantize!r}")
    if in_fp8:
        if act_scale is None or out_dtype is None:
            raise ValueError("e4m3 prev/x need the act_scale they were quantized with and an out_dtype")
    if out_dtype is None:
        out_dtype = x.dtype
    if out_dtype not in ACT_DTYPES:
        raise ValueError(f"out_dtype must be fp16 or bf16, got {out_dtype}")
    check_device(_conv3d_fp8_kernel, x=x, prev=prev, w_q=w_q, w_scale=w_scale, bias=bias, act_scale=act_scale,
                 out=out)
    if act_scale is None:
        act_scale = activation_scale(prev, x)
    _check_scale("act_scale", act_scale, x.device)
    shape = (b, cout, t, h, w)
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != out_dtype:
            raise ValueError(f"out must be {out_dtype} {shape}, got "
                             f"{(out.dtype, tuple(out.shape)) if isinstance(out, torch.Tensor) else type(out)}")
        if not _is_cl3d(out):
            raise ValueError("out must be contiguous in channels_last_3d memory")
    y = out if out is not None else torch.empty(shape, dtype=out_dtype, device=x.device,
                                                memory_format=torch.channels_last_3d)
    m = b * t * h * w
    if m >= 2**31 - 2**20:
        raise ValueError(f"B*T*H*W = {m} output pixels: the kernel indexes pixels in int32 (split the chunk)")
    if m == 0:
        return y
    promote = block_k_for(cin) if precise_acc else 0
    if _use_tma(kernel, quantize, cin, cout, x.device, y, config):
        if in_fp8:  # already-quantized frames: the kernel reads one stream tensor
            stream = (torch.cat([prev.view(torch.uint8), x.view(torch.uint8)], dim=2).contiguous(
                memory_format=torch.channels_last_3d).view(FP8) if prev is not None else x)
        else:
            stream = quantize_stream(prev, x, act_scale)
        n_prev = prev.shape[2] if prev is not None else 0
        _conv_tma(stream, n_prev, w_q, w_scale, bias, act_scale, y, promote, config)
        return y
    if isinstance(config, TmaConfig):
        raise ValueError("a TmaConfig needs the TMA kernel (kernel='tma' or 'auto' where it runs)")
    if not in_fp8 and quantize == "pass":
        prev, x = quantize_activation(prev, x, act_scale)
        in_fp8 = True
    n_prev = prev.shape[2] if prev is not None else 0
    # prev's element offset from x (see the kernel), biased by 2^62 so it is always passed as an i64
    p_off = (P_OFF_BIAS + (prev.data_ptr() - x.data_ptr()) // x.element_size()) if prev is not None else P_OFF_BIAS
    interp = interpreting(_conv3d_fp8_kernel)
    bk = block_k_for(cin)

    def launch(c: ConvConfig):
        grid = (triton.cdiv(m, c.block_m) * triton.cdiv(cout, c.block_n0 + c.block_n1),)
        _conv3d_fp8_kernel[grid](
            x, p_off, w_q, w_scale, bias if bias is not None else w_scale, act_scale, y,
            m, t, h, w, n_prev, cin, cout, TAPS * cin,
            BLOCK_M=c.block_m, BLOCK_N0=c.block_n0, BLOCK_N1=c.block_n1, BLOCK_K=bk,
            IN_FP8=x.dtype == FP8, HAS_BIAS=bias is not None, PROMOTE=promote, INTERPRET=interp,
            num_warps=c.num_warps, num_stages=c.num_stages, **launch_options(_conv3d_fp8_kernel),
        )

    if config is None:
        if interp:
            config = default_config(cin, cout, m, x.dtype == FP8)
        else:
            key = _tune_key(cin, cout, m, x.dtype, promote, bias is not None, x.device)
            config = autotune(_TUNED, key, candidate_configs(cin, cout, m, x.dtype == FP8), launch, _tuning_enabled(),
                              "conv3d_fp8", device=x.device)
    launch(config)
    return y


def _use_tma(kernel: str, quantize: str, cin: int, cout: int, device: torch.device, y: torch.Tensor,
             config=None) -> bool:
    """Which kernel runs: "tma" (refused with a clear error where it cannot), "pointer", or "auto" = TMA on an sm_90+
    GPU for quantize="pass" (the TMA kernel reads fp8 only) and a 16-byte aligned output, else the pointer kernel;
    a given config's type decides under "auto" (ConvConfig: pointer, TmaConfig: TMA)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "pointer":
        return False
    ok = tma_supported(cin, cout) and y.data_ptr() % 16 == 0
    if kernel == "tma":
        if quantize != "pass":
            raise ValueError("kernel='tma' reads fp8 frames: it needs quantize='pass'")
        if not tma_available(device):
            raise ValueError("kernel='tma' needs Triton tensor descriptors and an sm_90+ GPU (or TRITON_INTERPRET=1)")
        if not ok:
            raise ValueError("kernel='tma' needs Cin/Cout multiples of 16 and a 16-byte aligned out")
        return True
    if isinstance(config, ConvConfig):
        return False
    if isinstance(config, TmaConfig):
        return _use_tma("tma", quantize, cin, cout, device, y)
    return (quantize == "pass" and ok and not interpreting(_conv3d_fp8_tma_kernel) and device.type == "cuda"
            and tma_available(device))


def quantize_stream(prev: torch.Tensor | None, x: torch.Tensor, act_scale: torch.Tensor) -> torch.Tensor:
    """(prev, x) fp16/bf16 -> the e4m3 stream prev ++ x [B, Cin, P + T, H, W] channels_last_3d, codes
    RNE_sat(v * RN(1 / act_scale)) (those of quantize_activation); one launch."""
    _check_prev_x(prev, x, ACT_DTYPES)
    check_device(_quant_stream_kernel, x=x, prev=prev, act_scale=act_scale)
    _check_scale("act_scale", act_scale, x.device)
    interp = interpreting(_quant_stream_kernel)
    b, c, t, h, w = x.shape
    n_prev = prev.shape[2] if prev is not None else 0
    s = torch.empty((b, c, n_prev + t, h, w), dtype=FP8, device=x.device, memory_format=torch.channels_last_3d)
    n_p = n_prev * h * w * c  # per batch element
    n_x = t * h * w * c
    block = 4096
    nprog = max(1, min(triton.cdiv(n_p + n_x, block), 4 * _grid_cap(x.device, interp) // max(1, b)))
    _quant_stream_kernel[(nprog, b)](prev if prev is not None else x, x, s, act_scale, n_p, n_x, BLOCK=block,
                                     INTERPRET=interp, num_warps=8, **launch_options(_quant_stream_kernel))
    return s


def conv3d_fp8_stream(stream: torch.Tensor, n_prev: int, w_q: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, act_scale: torch.Tensor, out_dtype: torch.dtype, *,
                      out: torch.Tensor | None = None, precise_acc: bool = True,
                      config: TmaConfig | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The causal conv of an already-quantized e4m3 stream by the TMA kernel: stream [B, Cin, n_prev + T, H, W]
    channels_last_3d holds the n_prev (0..2) cached frames then the T new ones, as codes of act_scale (e.g. written
    by vae_norm.vae_rms_norm(..., quant_scale=act_scale) straight into the stream's last T frames). Returns y
    [B, Cout, T, H, W] of out_dtype, channels_last_3d: causal_conv3d_fp8 of the same codes, bit for bit.
    residual: optional y-shaped out_dtype channels_last_3d tensor (16-byte aligned) added in the epilogue: the bits of
    torch.add(conv, residual) (a residual block's shortcut; saves the add's pass over y).
    ValueError where the TMA kernel cannot run (tma_available) or for bad arguments."""
    check_tensor("stream", stream, ndim=5, dtypes=(FP8,), dims=" [B, C, T, H, W]", contiguous=False)
    if not _is_cl3d(stream) or stream.data_ptr() % 16:
        raise ValueError("stream must be contiguous in channels_last_3d memory (NDHWC) and 16-byte aligned")
    b, cin, f, h, w = stream.shape
    if not isinstance(n_prev, int) or not 0 <= n_prev <= CACHE_FRAMES or n_prev >= f:
        raise ValueError(f"n_prev must be 0..{CACHE_FRAMES} and below the stream's {f} frames, got {n_prev!r}")
    cout = _check_weights(w_q, w_scale, bias, cin)  # (tma_supported == supported)
    if out_dtype not in ACT_DTYPES:
        raise ValueError(f"out_dtype must be fp16 or bf16, got {out_dtype}")
    check_device(_conv3d_fp8_tma_kernel, stream=stream, w_q=w_q, w_scale=w_scale, bias=bias, act_scale=act_scale,
                 out=out)
    _check_scale("act_scale", act_scale, stream.device)
    if not tma_available(stream.device):
        raise ValueError("conv3d_fp8_stream needs the TMA kernel: Triton tensor descriptors and an sm_90+ GPU")
    shape = (b, cout, f - n_prev, h, w)
    if out is not None:
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != out_dtype
                or not _is_cl3d(out) or out.data_ptr() % 16):
            raise ValueError(f"out must be a 16-byte aligned channels_last_3d {out_dtype} {shape} tensor")
    if residual is not None and (not isinstance(residual, torch.Tensor) or tuple(residual.shape) != shape
                                 or residual.dtype != out_dtype or residual.device != stream.device
                                 or not _is_cl3d(residual) or residual.data_ptr() % 16):
        raise ValueError(f"residual must be a 16-byte aligned channels_last_3d {out_dtype} {shape} tensor on "
                         f"{stream.device}")
    y = out if out is not None else torch.empty(shape, dtype=out_dtype, device=stream.device,
                                                memory_format=torch.channels_last_3d)
    if y.numel():
        _conv_tma(stream, n_prev, w_q, w_scale, bias, act_scale, y, block_k_for(cin) if precise_acc else 0, config,
                  residual)
    return y


def _frames_last(v: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] channels_last_3d -> the same memory as a contiguous [B, T, H, W, C] view."""
    return v.permute(0, 2, 3, 4, 1)


def _conv_tma(stream: torch.Tensor, n_prev: int, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
              act_scale: torch.Tensor, y: torch.Tensor, promote: int, config: TmaConfig | None = None,
              residual: torch.Tensor | None = None) -> None:
    """y = the conv of the e4m3 stream [B, Cin, n_prev + T, H, W] (channels_last_3d) by the TMA kernel (autotuned
    on the first call per key unless `config` is given)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if config is not None and not isinstance(config, TmaConfig):
        raise ValueError(f"the TMA kernel takes a TmaConfig, got {type(config).__name__}")
    b, cin, _, h, w = stream.shape
    cout, t = y.shape[1], y.shape[2]
    s5, y5 = _frames_last(stream), _frames_last(y)
    r5 = _frames_last(residual) if residual is not None else y5
    bk = block_k_for(cin)
    interp = interpreting(_conv3d_fp8_tma_kernel)

    def desc(v, box):
        return TensorDescriptor(v, list(v.shape), list(v.stride()), box)

    def launch(c: TmaConfig):
        n1 = c.block_n1 or c.block_n0  # an unused second block still needs a valid descriptor
        grid = (b * t * triton.cdiv(h, c.bh) * triton.cdiv(w, c.bw) * triton.cdiv(cout, c.block_n0 + c.block_n1),)
        _conv3d_fp8_tma_kernel[grid](
            desc(s5, [1, 1, c.bh, c.bw, bk]), desc(w_q, [c.block_n0, bk]), desc(w_q, [n1, bk]), w_scale,
            bias if bias is not None else w_scale, act_scale,
            desc(y5, [1, 1, c.bh, c.bw, c.block_n0]), desc(y5, [1, 1, c.bh, c.bw, n1]),
            desc(r5, [1, 1, c.bh, c.bw, c.block_n0]), desc(r5, [1, 1, c.bh, c.bw, n1]),
            t, h, w, n_prev, cin, cout,
            BH=c.bh, BW=c.bw, BLOCK_K=bk, BLOCK_N0=c.block_n0, BLOCK_N1=c.block_n1, HAS_BIAS=bias is not None,
            PROMOTE=promote, OUT_BF16=y.dtype == torch.bfloat16, HAS_RES=residual is not None, INTERPRET=interp,
            num_warps=c.num_warps, num_stages=c.num_stages, **launch_options(_conv3d_fp8_tma_kernel),
        )

    m = b * t * h * w
    if config is None:
        cands = tma_candidate_configs(cin, cout, h, w, m, promote=promote > 0)
        if interp:
            config = cands[0]
        else:
            # the candidates depend on w only through its patch width: widths of one patch width share a tuning
            # (like M's power of two), so a crop of a new width reuses one (configs change the speed, never the bits)
            key = ("tma",) + _tune_key(cin, cout, m, FP8, promote, bias is not None, y.device) + (
                tma_tile_width(w), residual is not None)
            config = autotune(_TUNED, key, cands, launch, _tuning_enabled(), "conv3d_fp8", device=y.device)
    launch(config)


# ----------------------------------------------------------------------------------------------------------------------
# Eager references


def activation_scale_reference(prev: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """max(amax(|prev|, |x|), 1e-12) / 448 in fp32, shape [1] (NaN propagates through torch's amax)."""
    amax = x.float().abs().amax()
    if prev is not None:
        amax = torch.maximum(amax, prev.float().abs().amax())  # torch.maximum propagates NaN
    amax = amax.clamp_min(1e-12).reshape(1)
    return amax / amax.new_full((), FP8_MAX)


def quantize_activation_reference(v: torch.Tensor, act_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes RNE(clamp(v * RN(1 / s), +-448)) (the clamp only matters for a caller-given scale; torch's own cast
    would give NaN at |v| >= 464), same layout as v."""
    s = act_scale.float().reshape(1)
    inv = torch.ones_like(s) / s  # tensor / tensor: correctly rounded on CPU and CUDA
    return (v.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _causal_stream(frames: list[torch.Tensor], prev: torch.Tensor | None) -> torch.Tensor:
    """The eager causal conv input: zeros for the missing cache frames ++ (prev ++) x, concatenated along time."""
    stream = torch.cat(frames, dim=2)
    missing = CACHE_FRAMES - (prev.shape[2] if prev is not None else 0)
    return F.pad(stream, (0, 0, 0, 0, missing, 0)) if missing > 0 else stream


def causal_conv3d_fp8_reference(
    prev: torch.Tensor | None,
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    return_abs_sum: bool = False,
):
    """Eager dequantize-quantize semantics of causal_conv3d_fp8 (see the module doc for the bound between them).

    Same activation scale and codes as the kernel, dequantized to fp32, the zero / cached front frames concatenated,
    F.conv3d in float64 (exact sum of the fp32 products up to 2^-53), rounded to fp32, + fp32 bias, rounded to x's
    dtype, channels_last_3d. return_abs_sum=True also returns S = conv(|xd|, |wd|) in fp32 (the bound's scale)."""
    cin = x.shape[1]
    s = act_scale if act_scale is not None else activation_scale_reference(prev, x)
    s = s.float().reshape(1)
    frames = [quantize_activation_reference(v, s).float() * s for v in ((prev, x) if prev is not None else (x,))]
    stream = _causal_stream(frames, prev)
    wd = dequantize_conv_weight(w_q, w_scale, cin)
    y = F.conv3d(stream.double(), wd.double(), None, padding=(0, 1, 1)).float()
    if bias is not None:
        y = y + bias.float().view(1, -1, 1, 1, 1)
    y = y.to(x.dtype).contiguous(memory_format=torch.channels_last_3d)
    if out is not None:
        out.copy_(y)
        y = out
    if not return_abs_sum:
        return y
    abs_sum = F.conv3d(stream.abs().double(), wd.abs().double(), None, padding=(0, 1, 1)).float()
    return y, abs_sum


def fp16_conv_reference(prev: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """What the eager VAE computes: cat + F.conv3d in x's dtype (cuDNN on the GPU), channels_last_3d."""
    stream = _causal_stream([prev, x] if prev is not None else [x], prev).contiguous(
        memory_format=torch.channels_last_3d)
    return F.conv3d(stream, weight.to(x.dtype), bias.to(x.dtype) if bias is not None else None, padding=(0, 1, 1))
