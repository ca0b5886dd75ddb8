"""The Wan VAE's channel RMS norm (+ SiLU) on channels-last video, fused: one read, one write (plus an optional tail).

Replaces this eager composition of fastremover/models/vae.py (RMSNorm.forward on the GPU path, then F.silu, in
ResidualBlock / Encoder / Decoder; norm alone in AttentionBlock):

    y = F.normalize(x.float(), dim=1).to(x.dtype) * sqrt(C) * gamma        # x.float() only for fp16/bf16
    y = F.silu(y)                                                          # silu=True

Layout: x [B, C, T, H, W] "frame-dense channels-last": channel stride 1, W stride C, H stride W*C (what
`torch.channels_last_3d` gives, and any time slice of such a tensor), B and T strides free. So a slice
`buf[:, :, 2:]` of a channels-last causal-conv input buffer is a valid `out`. 4-D [N, C, H, W] channels-last input
is treated as [N, C, 1, H, W]. Grid: (pixel blocks of BLOCK_M rows, B*T frames); each program holds BLOCK_M pixel
rows of next_power_of_2(C) lanes (96 -> 128) and reduces over the channel axis.

Two modes (`precise=`): one kernel, the same rounding points; they differ in how steps 3 and 6 are computed.
precise=False (the default, and the fast VAE's) replaces the two per-element IEEE divisions - the kernel's cost: it is
ALU-bound, not memory-bound - by a reciprocal per pixel row and Triton's fast sigmoid (H200, [1, 96, 2, 480, 832] fp16:
0.113 ms per call in the experiment's copy of the kernel, 0.125 ms through this wrapper, vs 0.565 ms for the 4-warp
precise kernel shipped before and 0.42-0.47 ms for precise=True at 8 warps; a copy takes 0.079 ms:
experiments/vae_norm_variants.py, bench/results/vae-norm-variants-*.json. The wrapper's timings at the smaller
deep-level shapes include its Python launch overhead, which the back-to-back timing loop does not hide).

Rounding points (fp32 arithmetic, compiled with enable_fp_fusion=False and non-ftz libdevice, see _common.py):
    0. `bias=` only (a conv bias deferred into the norm, see below): x = round_to_dtype(x + bias), both widened to
       fp32 exactly, one fp32 add, RNE to x.dtype - what torch's `conv_out.add_(bias)` after a cuDNN conv computes
       (its half/bf16 add: fp32 opmath, one rounding to the dtype), bit for bit. Everything below runs on that x.
       (The compiler emits it as a native `add.rn.f16x2`/`add.rn.bf16x2` for a bias of x's dtype: the same bits,
       fp32 having more than 2p+2 significand bits for both formats.)
    1. x widened to fp32 exactly; ss = sum over channels of x*x. For fp16/bf16 every square is exact in fp32, so
       the only rounding is in the additions; their order is Triton's tl.sum tree, NOT ATen's (ATen's CUDA
       vector_norm order depends on the tensor's layout and the reduction config it picks): ss can differ from
       eager's by a few fp32 ulps. The tree depends on the block layout, so on C and the warp count (4 warps in
       fast mode, 8 in precise mode: for C >= 192 the two modes may sum in different orders).
    2. denom = max(sqrt_rn(ss), 1e-12) (IEEE sqrt like sqrtf; NaN propagates like clamp_min).
    3. precise: n = div_rn(x, denom), rounded to the dtype   (eager: x / denom in fp32, `.to(dtype)`)
       fast:    r = div_rn(1, denom) per pixel row, n = x * r (one rounded fp32 product), rounded to the dtype
    4. n = n * float32(sqrt(C)), rounded to the dtype        (eager: dtype tensor * Python scalar, computed in fp32)
    5. n = n * gamma, rounded to the dtype                   (fp16*fp16 / bf16*bf16 products are exact in fp32)
    6. silu, rounded to the dtype:
       precise: div_rn(n, 1 + exp(-n))                      (ATen's SiluFunctor: x / (1 + ::exp(-x)) in fp32;
                GPU: libdevice __nv_expf = CUDA's expf; interpreter: numpy's exp)
       fast:    n * tl.sigmoid(n), where tl.sigmoid(v) is `1 / (1 + exp(-v))` written with Triton's own exp and `/`
                (triton/language/standard.py). Compiled for sm_90: a rounded multiply by -log2(e), `ex2.approx.f32`,
                an add, `div.full.f32` (approximate division, max 2 fp32 ulps), then the rounded product with n; no
                libdevice call, no FMA (test_sm90_codegen_of_the_norm_kernel checks the opcodes). Interpreted: numpy's
                fp32 exp and an IEEE division (np.divide), i.e. the precise formula's ingredients: the CPU tests
                cannot see the GPU's approximation error, only the GPU tests do.

    7. `quant_scale=` only: the dtype value v of step 6 (or 5) becomes the e4m3 code RNE_sat(v * RN(1 / s)), one
       rounded fp32 product, then `cvt.rn.satfinite` (interpreter: _common.f32_to_fp8e4m3_rne, bit for bit); the
       codes of conv3d_fp8.quantize_activation(v, s) for the kernel's v. Caveat: the e4m3-output compile may lay
       the block out differently (1-byte stores), so step 1's tl.sum can add in another order than in the same call
       with dtype output: v is the norm of the same x within the bound below, not always the dtype call's bits
       (precise mode given the denominators: bit-exact, GPU test; the interpreter: bit-exact to the dtype call).
       Used by the fast VAE's FP8 convs with a static scale (see fastremover/fast/vae/).

Precise mode: steps 2-6 are bit-exact to the eager ops given the same denominator: `out_norm=` returns the kernel's
fp32 denominators and `vae_rms_norm_given_denominator` is the eager composition from them; the GPU tests check
torch.equal (the CPU interpreter: torch.equal without SiLU; with SiLU numpy's exp and torch's CPU exp may differ in
the last fp32 bit). Step 1 is the one place it is not bit-exact. Against the full eager op (step 1 included), fp16/bf16
outputs differ from eager in a small fraction of elements (measured: well under 0.1 %), by 1 ulp, by up to 3 where a
1-ulp flip at step 3 is carried through the two rounded products of steps 4-5 (H200: one element in 1.5e8 at 3 ulps,
fp16, C=96), or by a few ulps where SiLU of a negative input amplifies a 1-ulp input difference (|diff| stays below
2^-mant of the frame's largest output).

Fast mode: x * RN(1/denom), rounded once more, has a relative error of at most ~2^-23 (two fp32 roundings) against
the correctly rounded x / denom, far below the fp16 (2^-11) / bf16 (2^-8) spacing, so step 3 yields eager's value
or, when x / denom lies that close to a rounding midpoint, its neighbour: the same kind of 1-ulp step-3 flip the sum
order of step 1 causes in precise mode (both fp32 errors together are still far below the dtype spacing, so never 2
ulps at step 3), carried through steps 4-5 the same way. The fast sigmoid's relative error (ex2.approx ~2^-22, the
rounding of v*log2(e) ~|v|*2^-24, div.full 2 ulps: below ~2^-19 for |n| < 16, nearly every element of a unit-RMS row
times gamma) again only moves the last rounding, by 1 ulp, near a midpoint. So the asserted bound vs the eager op is
the precise mode's: each element within 3 dtype ulps of eager's or within one dtype ulp of its frame's largest
|output| (tiny values, SiLU of negative inputs), at most 0.1 % of the elements differing (tests/parity/test_vae_fast.py: CPU
interpreter at small shapes, the GPU at [1, 96, 2, 480, 832] fp16 and the other real shapes). Measured: H200, fp16,
C = 96/192/384 at the fast VAE's call shapes: 3.7-4.5e-5 of the elements differ from the precise kernel, max |diff|
3.9e-3 (5.9e-3 at C=192); CPU interpreter (the tests' shapes, and runs of 1.5-3e5 elements): at most 1.1e-4 of the
elements differ from eager, and every difference of more than 1 ulp was below the frame floor. Edge cases: for
n < -87.3 the sigmoid is an fp32 subnormal and loses relative precision (SiLU is then below 1e-36, under the floor;
below -88.7 both modes give -0, exp overflowing); a row norm above 2^126 (fp32/bf16 inputs only) makes r subnormal
and the row loses precision. NaN rows stay NaN (1/NaN), zero rows stay 0, as in precise mode.

Both modes are deterministic: every output element is computed by the same instruction sequence on every launch (the
grid and the block layout depend only on the shape, C, dtype and mode; the channel sum is tl.sum's fixed tree inside
one program; no atomics, no split reductions), and ex2.approx / div.full are deterministic instructions, so equal
inputs give equal bits run after run (tested: two calls, torch.equal).

fp32 inputs run the same code (the dtype roundings are then no-ops; eager skips the `.float()` round trip too).

`bias=` (C elements, fp32 or x.dtype): x is a conv output whose bias the conv did not add (fastremover/fast/vae/
`fuse_bias`); the kernel adds it first (step 0), so `vae_rms_norm(x, gamma, bias=b)` is bit-identical to
`vae_rms_norm(add_bias(x, b), gamma)`, i.e. to the norm of x after torch's `x.add_(b.view(1, C, 1, 1, 1))` - it only
saves that add's pass over x. The biased x itself is not written anywhere: only defer a bias this way when the norm
is the conv output's one consumer.

`tail=` additionally stores the last k frames of the output (k = tail.shape[2]) into a second tensor: the causal
cache of the conv that consumes `out` (see fastremover/fast/vae/), written in the same pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastremover.fast.kernels._common import (
    check_device,
    f32_to_fp8e4m3_rne,
    interpreting,
    launch_options,
    load_f32,
    round_through,
    round_to,
)

try:  # libdevice is only called on the compiled path (the interpreter cannot run extern calls)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice

NORM_EPS = 1e-12  # F.normalize's default eps (the denominator is max(||x||, eps))
MAX_CHANNELS = 4096
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@triton.jit
def _exp_f32(v, INTERPRET: tl.constexpr):
    if INTERPRET:
        e = tl.exp(v)
    else:
        e = libdevice.exp(v)
    return e


@triton.jit(do_not_specialize=["HW", "T", "TAIL_T0"])  # one compile per (C, flags, dtype), not per frame count
def _vae_norm_kernel(
    X, GAMMA, BIAS, Y, TAIL, NORM, QS,
    HW, T, TAIL_T0,
    sxb, sxt, syb, syt, stb, stt,
    scale, eps,
    C: tl.constexpr, TAIL_C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
    SILU: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISE: tl.constexpr, QUANT: tl.constexpr, INTERPRET: tl.constexpr,
):
    frame = tl.program_id(1)
    b = frame // T
    t = frame - b * T
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < HW
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    pix = rows.to(tl.int64)[:, None] * C + cols[None, :]
    b64 = b.to(tl.int64)
    t64 = t.to(tl.int64)

    x = load_f32(X + (b64 * sxb + t64 * sxt) + pix, mask, INTERPRET)
    if HAS_BIAS:  # step 0: the deferred conv bias, one fp32 add rounded to the dtype (masked lanes stay 0)
        bias = load_f32(BIAS + cols, cmask, INTERPRET)
        x = round_through(x + bias[None, :], X.dtype.element_ty, INTERPRET)
    ss = tl.sum(x * x, axis=1)
    denom = tl.maximum(tl.sqrt_rn(ss), eps, propagate_nan=tl.PropagateNan.ALL)
    if PRECISE:  # step 3: one IEEE division per element (~10 instructions each: the kernel's main cost)
        n = tl.math.div_rn(x, tl.broadcast_to(denom[:, None], x.shape))
    else:  # step 3 fast: an IEEE reciprocal per pixel row a thread holds (sm_90, C=96, 16-divisible strides: 8
        # channels x 4 rows per thread, so 4 reciprocals for 32 elements), then a rounded fp32 product per element
        n = x * tl.math.div_rn(1.0, denom)[:, None]
    n = round_through(n, X.dtype.element_ty, INTERPRET)
    n = round_through(n * scale, X.dtype.element_ty, INTERPRET)
    g = load_f32(GAMMA + cols, cmask, INTERPRET)
    n = round_through(n * g[None, :], X.dtype.element_ty, INTERPRET)
    if SILU:
        if PRECISE:  # step 6: ATen's x / (1 + expf(-x))
            n = tl.math.div_rn(n, 1.0 + _exp_f32(-n, INTERPRET))
        else:  # step 6 fast: tl.sigmoid = 1 / (1 + exp(-x)), compiled: ex2.approx and div.full (approximate)
            n = n * tl.sigmoid(n)
    out = round_to(n, X.dtype.element_ty, INTERPRET)
    if QUANT:  # step 7: e4m3 codes of the dtype value, RNE_sat(v * RN(1 / s)) (conv3d_fp8's activation codes)
        inv = tl.math.div_rn(1.0, tl.load(QS))
        out = f32_to_fp8e4m3_rne(out.to(tl.float32) * inv, INTERPRET)
    tl.store(Y + (b64 * syb + t64 * syt) + pix, out, mask=mask)
    if HAS_TAIL:  # the tail holds the first TAIL_C channels (all C, or the real ones of a zero-padded x)
        if t >= TAIL_T0:
            tail_pix = rows.to(tl.int64)[:, None] * TAIL_C + cols[None, :]
            tl.store(TAIL + (b64 * stb + (t64 - TAIL_T0) * stt) + tail_pix, out,
                     mask=rmask[:, None] & (cols < TAIL_C)[None, :])
    if HAS_NORM:
        tl.store(NORM + frame.to(tl.int64) * HW + rows, denom, mask=rmask)


def _blocks(c: int, precise: bool = False) -> tuple[int, int, int]:
    """(BLOCK_C, BLOCK_M, num_warps): 4096 lanes per program (C <= MAX_CHANNELS: whole channel rows). Fast mode: 4
    warps (32 lanes per thread; 8 warps measured no faster: 0.119 vs 0.115 ms in the variant kernel, C = 96). Precise mode: 8 warps (16 lanes per thread): its per-element IEEE divisions make it ALU-bound,
    and twice the warps hide more of their latency - H200, [1, 96, 2, 480, 832] fp16: 0.565 -> 0.420 ms, and
    0.29 -> 0.22 / 0.26 -> 0.18 ms at C = 192 / 384, torch.equal to the 4-warp output at all four measured shapes
    (bench/results/vae-norm-variants-*.json). Steps 2-6 are the same instructions at either warp count; only tl.sum's
    tree (step 1) can change with it (for C >= 192 the channels spread over more threads), which is the step that is
    not bit-exact to eager anyway."""
    block_c = triton.next_power_of_2(c)
    block_m = max(1, 4096 // block_c)
    return block_c, block_m, 8 if precise else 4


def _as_5d(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 4:
        return t.unsqueeze(2)
    if t.dim() != 5:
        raise ValueError(f"{name} must be [B, C, T, H, W] or [N, C, H, W], got shape {tuple(t.shape)}")
    return t


def _check_frame_dense(name: str, t: torch.Tensor) -> None:
    """Channel stride 1, W stride C, H stride W*C (sizes of 1 may have any stride)."""
    _, c, _, h, w = t.shape
    ok = (c == 1 or t.stride(1) == 1) and (w == 1 or t.stride(4) == c) and (h == 1 or t.stride(3) == w * c)
    if not ok:
        raise ValueError(
            f"{name} must be channels-last (torch.channels_last_3d, or a time slice of such a tensor); got shape "
            f"{tuple(t.shape)} strides {t.stride()}"
        )


def _check_bias(bias, x5: torch.Tensor) -> None:
    c = x5.shape[1]
    if bias is None:
        return
    if (not isinstance(bias, torch.Tensor) or bias.numel() != c or bias.dtype not in (torch.float32, x5.dtype)
            or bias.device != x5.device):
        raise ValueError(f"bias must be a float32 or {x5.dtype} tensor of {c} elements (any shape) on {x5.device}, "
                         f"got {getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")


def _check_args(x, gamma, out, tail, out_norm, bias=None, channels=None, quant_scale=None):
    x5 = _as_5d("x", x)
    if x5.dtype not in DTYPES:
        raise ValueError(f"x must have dtype in {[str(d) for d in DTYPES]}, got {x5.dtype}")
    b, c, t, h, w = x5.shape
    if not 1 <= c <= MAX_CHANNELS:
        raise ValueError(f"x must have 1..{MAX_CHANNELS} channels, got {c}")
    _check_frame_dense("x", x5)
    if not isinstance(gamma, torch.Tensor) or gamma.numel() != c or gamma.dtype != x5.dtype:
        raise ValueError(f"gamma must be a {x5.dtype} tensor of {c} elements (any shape), got "
                         f"{getattr(gamma, 'dtype', type(gamma).__name__)} {tuple(getattr(gamma, 'shape', ()))}")
    y_dtype = x5.dtype if quant_scale is None else FP8
    if quant_scale is not None and (not isinstance(quant_scale, torch.Tensor) or quant_scale.dtype != torch.float32
                                    or quant_scale.numel() != 1 or quant_scale.device != x5.device):
        raise ValueError(f"quant_scale must be a one-element fp32 tensor on {x5.device}, got "
                         f"{getattr(quant_scale, 'dtype', type(quant_scale).__name__)}")
    out5 = _as_5d("out", out)
    if out5 is not None:
        if tuple(out5.shape) != tuple(x5.shape) or out5.dtype != y_dtype:
            raise ValueError(f"out must be {y_dtype} {tuple(x.shape)}, got {out5.dtype} {tuple(out.shape)}")
        _check_frame_dense("out", out5)
    tail5 = _as_5d("tail", tail)
    if tail5 is not None:
        k = tail5.shape[2]
        if (tail5.shape[0] != b or not 1 <= tail5.shape[1] <= c or tail5.shape[3:] != x5.shape[3:]
                or not 1 <= k <= t or tail5.dtype != y_dtype):
            raise ValueError(f"tail must be {y_dtype} [B, C', k, H, W] with 1 <= C' <= {c}, 1 <= k <= {t} and x's "
                             f"other sizes {tuple(x5.shape)}, got {tail5.dtype} {tuple(tail5.shape)}")
        _check_frame_dense("tail", tail5)
    if out_norm is not None:
        if (not isinstance(out_norm, torch.Tensor) or out_norm.dtype != torch.float32
                or tuple(out_norm.shape) != (b * t * h * w,) or not out_norm.is_contiguous()):
            raise ValueError(f"out_norm must be a contiguous fp32 tensor of {b * t * h * w} elements (one per pixel, "
                             "frame-major: b, t, h, w)")
    _check_bias(bias, x5)
    if channels is not None and (not isinstance(channels, int) or isinstance(channels, bool) or not 1 <= channels <= c):
        raise ValueError(f"channels must be an int in 1..{c} (x's channel count), got {channels!r}")
    return x5, out5, tail5


def vae_rms_norm(
    x: torch.Tensor,
    gamma: torch.Tensor,
    *,
    silu: bool = True,
    out: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    out_norm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    precise: bool = False,
    channels: int | None = None,
    quant_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(F.normalize(x.float(), dim=1).to(x.dtype) * sqrt(C) * gamma) (silu=False: without the silu).

    x: [B, C, T, H, W] or [N, C, H, W], fp16/bf16/fp32, frame-dense channels-last (see the module docstring).
    gamma: C elements (the module's [C, 1, 1, 1] or [C, 1, 1] parameter is fine), x.dtype.
    out: where to write (same shape/dtype, frame-dense channels-last; may be a slice of a bigger buffer); default a
    new channels-last tensor. tail: [B, C', k, H, W], C' <= C: also receives the last k output frames' first C'
    channels (C' < C: a cache that leaves out x's zero padding channels). out_norm: fp32 [B*T*H*W]
    receives the per-pixel denominators max(||x||, 1e-12) (for tests). bias: C elements, fp32 or x.dtype: normalize
    round_to_dtype(x + bias) instead of x (a deferred conv bias, rounding point 0; x itself is not changed).
    precise: False (default): fast math at steps 3 and 6 (a reciprocal per pixel, tl.sigmoid), within the tested ulp
    bound of the module docstring; True: the eager ops' roundings, bit-exact given the denominator. channels: the C
    of sqrt(C) when x carries zero padding channels behind its real ones (default x's channel count; the padding adds
    exact zeros to the sum of squares, and a zero gamma keeps its outputs zero). quant_scale: a one-element fp32
    device tensor s: write float8_e4m3fn codes RNE_sat(y * RN(1 / s)) of the x.dtype result y instead of y (out and
    tail then e4m3; the codes conv3d_fp8.quantize_activation gives for y and s; rounding point 7). Returns out."""
    x5, out5, tail5 = _check_args(x, gamma, out, tail, out_norm, bias, channels, quant_scale)
    check_device(_vae_norm_kernel, x=x, gamma=gamma, out=out, tail=tail, out_norm=out_norm, bias=bias,
                 quant_scale=quant_scale)
    if out is None:
        fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
        out = torch.empty(x.shape, dtype=x.dtype if quant_scale is None else FP8, device=x.device,
                          memory_format=fmt)
        out5 = _as_5d("out", out)
    b, c, t, h, w = x5.shape
    hw = h * w
    if b * t * hw == 0:
        return out
    if b * t > 65535:
        raise ValueError(f"at most 65535 frames (B*T) per call, got {b * t}")
    block_c, block_m, warps = _blocks(c, bool(precise))
    gamma_flat = gamma.reshape(c)
    if not gamma_flat.is_contiguous():
        gamma_flat = gamma_flat.contiguous()
    bias_flat = gamma_flat if bias is None else bias.reshape(c)
    if not bias_flat.is_contiguous():
        bias_flat = bias_flat.contiguous()
    tail_arg = tail5 if tail5 is not None else out5
    tail_t0 = t - tail5.shape[2] if tail5 is not None else 0
    grid = (triton.cdiv(hw, block_m), b * t)
    _vae_norm_kernel[grid](
        x5, gamma_flat, bias_flat, out5, tail_arg, out_norm if out_norm is not None else x5,
        quant_scale if quant_scale is not None else gamma_flat,
        hw, t, tail_t0,
        x5.stride(0), x5.stride(2), out5.stride(0), out5.stride(2), tail_arg.stride(0), tail_arg.stride(2),
        float(channels or c) ** 0.5, NORM_EPS,
        C=c, TAIL_C=tail5.shape[1] if tail5 is not None else c, BLOCK_C=block_c, BLOCK_M=block_m, SILU=bool(silu),
        HAS_TAIL=tail5 is not None,
        HAS_NORM=out_norm is not None, HAS_BIAS=bias is not None, PRECISE=bool(precise),
        QUANT=quant_scale is not None,
        INTERPRET=interpreting(_vae_norm_kernel),
        num_warps=warps, **launch_options(_vae_norm_kernel),
    )
    return out


def _gamma_like(gamma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return gamma.reshape(x.shape[1], *([1] * (x.dim() - 2)))


def _write(y: torch.Tensor, x: torch.Tensor, out, tail) -> torch.Tensor:
    if out is None:
        fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
        out = torch.empty(x.shape, dtype=y.dtype, device=x.device, memory_format=fmt)
    out.copy_(y)
    if tail is not None:
        y5, tail5 = _as_5d("y", y), _as_5d("tail", tail)
        tail5.copy_(y5[:, : tail5.shape[1], y5.shape[2] - tail5.shape[2]:])
    return out


def vae_rms_norm_reference(
    x: torch.Tensor,
    gamma: torch.Tensor,
    *,
    silu: bool = True,
    out: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    out_norm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    precise: bool = False,
    channels: int | None = None,
    quant_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager torch, the composition of models/vae.py's RMSNorm (GPU path: F.normalize) + F.silu. Same signature as
    `vae_rms_norm` (also the CPU fallback of the fast VAE); bias: first x = add_bias(x, bias), as the conv's own
    bias add would have left it. precise is accepted and ignored: this is always the eager math (the oracle both
    kernel modes are tested against), so the fast VAE's CPU fallback computes the same values in either mode.
    quant_scale: the e4m3 codes of the result, RNE(clamp(y * RN(1 / s), +-448))."""
    _check_args(x, gamma, out, tail, out_norm, bias, channels, quant_scale)
    if bias is not None:
        x = add_bias(x, bias)
    low = x.dtype in (torch.float16, torch.bfloat16)
    xf = x.float() if low else x
    y = F.normalize(xf, dim=1).to(x.dtype) * ((channels or x.shape[1]) ** 0.5) * _gamma_like(gamma, x)
    if silu:
        y = F.silu(y)
    if out_norm is not None:
        out_norm.copy_(_denominator(xf).flatten())
    if quant_scale is not None:
        s = quant_scale.float().reshape(1)
        y = (y.float() * (torch.ones_like(s) / s)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return _write(y, x, out, tail)


def add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x + bias over the channel axis (dim 1) as a new tensor of x's dtype and memory format: both widened to fp32,
    one fp32 add, rounded to x.dtype once - the bits of torch's `conv_out.add_(bias)` (fp32 opmath for fp16/bf16) for
    an fp32 or x.dtype bias (a plain `x + bias` would promote an fp16 x to fp32 with an fp32 bias)."""
    shape = (x.shape[1],) + (1,) * (x.dim() - 2)
    if x.dtype == torch.float32:
        return x + bias.float().reshape(shape)
    return (x.float() + bias.float().reshape(shape)).to(x.dtype)


def _denominator(xf: torch.Tensor) -> torch.Tensor:
    """F.normalize's denominator: [B, T, H, W] for 5-D input, [N, H, W] for 4-D (both frame-major when flattened)."""
    return xf.norm(2, dim=1).clamp_min(NORM_EPS)


def vae_rms_norm_given_denominator(
    x: torch.Tensor, gamma: torch.Tensor, denom: torch.Tensor, *, silu: bool = True, channels: int | None = None
) -> torch.Tensor:
    """Eager ops of steps 3-6 of the module docstring from given fp32 denominators (frame-major, as `out_norm`):
    `(x.float() / denom).to(x.dtype) * sqrt(C) * gamma`, then F.silu. The kernel matches this bit for bit."""
    x5 = _as_5d("x", x)
    b, c, t, h, w = x5.shape
    d = denom.view(b, t, h, w).unsqueeze(1)
    xf = x5.float() if x.dtype in (torch.float16, torch.bfloat16) else x5
    y = (xf / d).to(x.dtype) * ((channels or c) ** 0.5) * gamma.reshape(c, 1, 1, 1)
    if silu:
        y = F.silu(y)
    return y.squeeze(2) if x.dim() == 4 else y
