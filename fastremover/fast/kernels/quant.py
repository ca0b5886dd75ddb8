"""Row-wise fp8 (float8_e4m3fn) quantization, plain and fused with the tanh-GELU of the FFN; per-channel weight quant.

Scale rule (everywhere in fastremover.fast): for a row y (fp32),
    row_scale = max(amax(|y|), 1e-12) / 448          correctly rounded fp32 division (torch `/`)
    inv_scale = 448 / max(amax(|y|), 1e-12)          correctly rounded fp32 division, once per row
    q         = RNE_e4m3(y * inv_scale)              rounded fp32 product, then round-to-nearest-even
so q * row_scale ~= y with relative error <= 2^-4 (3 mantissa bits), and |y * inv_scale| <= 448 * (1 + 2^-23)^2
always rounds to +-448 at the top: nothing ever overflows. (A per-element division would be a correctly rounded
quotient too, but costs ~10 GPU instructions per element; the product is one.) Saturation: values past 448 would clamp to +-448 (torch's
own cast turns |v| >= 464 into NaN; unreachable here). A NaN anywhere in a row makes that row's scale NaN (as torch's
amax does), and so every code of the row NaN; an inf makes the scale inf (inf elements -> NaN codes, others -> 0).

Kernels (one program per row; the row lives in registers as HEAD + TAIL power-of-two segments, see `row_segments`:
8960 -> 8192 + 1024 lanes, 1536 -> 1024 + 512):
    quant_fp8_rowwise(x)       y = x.float()
    gelu_tanh_quant_fp8(h)     y = gelu_tanh(h.float()) in fp32, then the same quantization
    gelu_tanh_f32(h)           y alone (fp32) - the exact intermediate of gelu_tanh_quant_fp8, for tests/debugging
Static per-tensor scale (the amax is GIVEN, a [1] device tensor times a host factor: a bound known before the tensor
exists, so one streaming pass with no reduction; 2D tiles):
    quant_fp8_static(x, amax, amax_mult=1.0, gelu=False)   y = x.float() or gelu_tanh(x.float()); codes with the
                                         rule above for amax = amax[0] * amax_mult (saturating, so a bound below the
                                         true amax clamps instead of overflowing); also writes the [M, 1] row-scale
                                         vector (every row the same scale) that the row-wise FP8 GEMM reads.
Per-tensor (the 8-bit attention's q/k/v; two tile kernels, no host sync):
    quant_fp8_tensorwise(x, mean=None)   y = x.float() [- mean[b, col]], one scale for the whole tensor:
                                         amax by tile maxima + one fp32 atomic max, then codes with the rule above.
    quant_fp8_centred(x, S)              the same with mean = x's own mean over each batch's S rows, found by one
                                         statistics pass instead of a mean pass plus an amax pass: per-column partial
                                         sums, maxima and minima of row blocks, then one reduction over the blocks
                                         (fixed order) that also gives amax|y| = max over columns of
                                         max(fl(colmax - mean), fl(mean - colmin)) - exactly max_r |fl(x_r - mean)|,
                                         since v -> fl(v - mean) is monotone and RNE is symmetric (one partial
                                         maximum per reduction program; the quantization kernel takes the max of
                                         those: no atomic, no zero-filled buffer, three kernels in all). So the codes
                                         and scale are bit-identical to quant_fp8_tensorwise(x, returned mean); the mean
                                         itself differs from torch.mean in summation order only. (A NaN in a column
                                         makes that column's mean, and so its codes, NaN.)
Reduction: amax is a max, so its value does not depend on the order; with y bit-identical to eager, scale and codes
are bit-identical too (quant_fp8_rowwise always is).

GELU (tanh approximation) in the sigmoid form, which needs one exp2 and one division instead of tanhf:
    0.5 * x * (1 + tanh(u)) = x / (1 + exp(-2u)),   u = kBeta * (x + kKappa * x^3)
    inner = kBeta * fma(kKappa, (x * x) * x, x)       as PyTorch's CUDA kernel (ActivationGeluKernel.cu) forms u
    y     = x / (1 + exp2(inner * -2 log2(e)))        GPU: ex2.approx + the fast fp32 division; interpreter: numpy
    kBeta = float(M_SQRT2 * M_2_SQRTPI * 0.5) = 0.7978845834732056, kKappa = float(0.044715)
This is the same function, not torch's rounding: PyTorch's `(0.5x)(1 + tanhf(u))` cancels for x in [-3, -1] and
flushes y to -0 below x ~ -5, where this form keeps relative accuracy. The fp8 quantization that follows has a
spacing of 2^-4 relative to the row max, so a few-ulp fp32 difference is invisible there; the previous bit-exact
libdevice-tanhf form was ALU-bound at 0.77 ms for 32760 x 8960 (24 % of HBM bandwidth). Asserted bound against
torch's F.gelu(h.float(), approximate="tanh"): |diff| <= 2^-20 * max(1, |y|)
(tests/kernels/test_kernels.py::test_gelu_tanh_f32_matches_torch, CPU and GPU).
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
    interpreting,
    into,
    launch_options,
    load_f32,
    mul_rn,
    quantize_fp8,
    row_num_warps,
    row_segments,
    store_fp8_row,
)

GELU_BETA = tl.constexpr(float(torch.tensor(1.41421356237309504880 * 1.12837916709551257390 * 0.5,
                                            dtype=torch.float32)))
GELU_KAPPA = tl.constexpr(float(torch.tensor(0.044715, dtype=torch.float32)))
MINUS_TWO_LOG2E = tl.constexpr(float(torch.tensor(-2.0 * 1.4426950408889634, dtype=torch.float32)))


@triton.jit
def gelu_tanh_f32_device(x, INTERPRET: tl.constexpr):
    """fp32 tanh-GELU in the sigmoid form x / (1 + exp(-2u)) (see the module docstring)."""
    inner = GELU_BETA * tl.fma(GELU_KAPPA, (x * x) * x, x)
    # exp2 overflows to inf for very negative x: x / inf = -0, the limit (torch gives -0 there too)
    return x / (1.0 + tl.exp2(inner * MINUS_TWO_LOG2E))


@triton.jit
def _quant_rows_kernel(
    X, Q, RS, N,
    HEAD: tl.constexpr, TAIL: tl.constexpr, GELU: tl.constexpr, QUANT: tl.constexpr, INTERPRET: tl.constexpr,
):
    """QUANT: Q is float8e4nv and RS the [M] row scales; else Q is fp32 and receives y (gelu_tanh_f32)."""
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.arange(0, HEAD)
    c1 = HEAD + tl.arange(0, TAIL)
    m0 = c0 < N
    m1 = c1 < N
    y0 = load_f32(X + row * N + c0, m0, INTERPRET)
    y1 = load_f32(X + row * N + c1, m1, INTERPRET)
    if GELU:
        y0 = gelu_tanh_f32_device(y0, INTERPRET)
        y1 = gelu_tanh_f32_device(y1, INTERPRET)
    q_row = Q + row * N
    if QUANT:
        store_fp8_row(y0, y1, m0, m1, q_row, c0, c1, RS + row, INTERPRET)
    else:
        tl.store(q_row + c0, y0, mask=m0)
        tl.store(q_row + c1, y1, mask=m1)


def _launch_rows(name: str, x: torch.Tensor, gelu: bool, quant: bool, out, out_scale):
    check_tensor(name, x, ndim=2, dtypes=FLOAT_DTYPES)
    m, n = x.shape
    check_row_width(name, n)
    check_device(_quant_rows_kernel, **{name: x, "out": out, "out_scale": out_scale})
    q_dtype = torch.float8_e4m3fn if quant else torch.float32
    check_out("out", out, (m, n), q_dtype, x.device)
    q = out if out is not None else torch.empty((m, n), dtype=q_dtype, device=x.device)
    if quant:
        check_out("out_scale", out_scale, (m, 1), torch.float32, x.device)
        rs = out_scale if out_scale is not None else torch.empty((m, 1), dtype=torch.float32, device=x.device)
    else:
        rs = q  # unused
    if m:
        head, tail = row_segments(n)
        _quant_rows_kernel[(m,)](
            x, q, rs, n,
            HEAD=head, TAIL=tail, GELU=gelu, QUANT=quant, INTERPRET=interpreting(_quant_rows_kernel),
            num_warps=row_num_warps(head + tail), **launch_options(_quant_rows_kernel),
        )
    return (q, rs) if quant else q


def quant_fp8_rowwise(
    x: torch.Tensor, *, out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 contiguous (K <= 16384) -> (q float8_e4m3fn [M, K], row_scale fp32 [M, 1])."""
    return _launch_rows("x", x, gelu=False, quant=True, out=out, out_scale=out_scale)


def gelu_tanh_quant_fp8(
    h: torch.Tensor, *, out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, N] fp16/bf16/fp32 contiguous (N <= 16384) -> row-wise fp8 of y = F.gelu(h.float(), approximate="tanh")."""
    return _launch_rows("h", h, gelu=True, quant=True, out=out, out_scale=out_scale)


def gelu_tanh_f32(h: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 y that gelu_tanh_quant_fp8 quantizes (same device code), [M, N] fp32."""
    return _launch_rows("h", h, gelu=True, quant=False, out=out, out_scale=None)


@triton.jit(do_not_specialize=["M"])  # M only masks rows (vectors run along N)
def _static_quant_kernel(X, AMAX, Q, RS, M, N, amax_mult, GELU: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    y = load_f32(X + offs, mask, INTERPRET)
    if GELU:
        y = gelu_tanh_f32_device(y, INTERPRET)
    amax = tl.maximum(mul_rn(tl.load(AMAX), amax_mult, INTERPRET), 1e-12)
    tl.store(Q + offs, quantize_fp8(y, tl.math.div_rn(448.0, amax), INTERPRET), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(RS + rows, tl.broadcast_to(tl.math.div_rn(amax, 448.0), rows.shape), mask=rows < M)


def quant_fp8_static(
    x: torch.Tensor, amax: torch.Tensor, amax_mult: float = 1.0, *, gelu: bool = False,
    out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] fp16/bf16/fp32 contiguous, amax [1] fp32 on x's device -> (codes float8_e4m3fn [M, N], row_scale fp32
    [M, 1], every row = a / 448) for a = max(fl(amax[0] * amax_mult), 1e-12) and y = x.float() (gelu: the tanh-GELU of
    it, `gelu_tanh_f32`): codes = RNE_e4m3(sat(y * fl(448 / a))). Bit-exact to `quant_fp8_static_reference`."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("amax", amax, ndim=1, dtypes=(torch.float32,), shape=(1,))
    m, n = x.shape
    check_device(_static_quant_kernel, x=x, amax=amax, out=out, out_scale=out_scale)
    check_out("out", out, (m, n), torch.float8_e4m3fn, x.device)
    check_out("out_scale", out_scale, (m, 1), torch.float32, x.device)
    q = out if out is not None else torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    rs = out_scale if out_scale is not None else torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and n:
        block_m, block_n = 16, min(256, triton.next_power_of_2(n))
        _static_quant_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            x, amax, q, rs, m, n, float(amax_mult), GELU=gelu, BLOCK_M=block_m, BLOCK_N=block_n,
            INTERPRET=interpreting(_static_quant_kernel), num_warps=4, **launch_options(_static_quant_kernel))
    return q, rs


@triton.jit
def _tile_values(X, MEAN, M, N, S, stride_x, HAS_MEAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 INTERPRET: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    y = load_f32(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask, INTERPRET)
    if HAS_MEAN:  # one fp32 subtraction, rounded (eager: x.float() - mean)
        y = y - tl.load(MEAN + (rows // S).to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    return rows, cols, mask, y


@triton.jit(do_not_specialize=["M", "S"])  # rows only: masks and the batch index
def _tensor_amax_kernel(X, MEAN, AMAX, M, N, S, stride_x, HAS_MEAN: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    _, _, mask, y = _tile_values(X, MEAN, M, N, S, stride_x, HAS_MEAN, BLOCK_M, BLOCK_N, INTERPRET)
    tile_max = tl.max(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1), axis=0)
    tl.atomic_max(AMAX, tile_max)  # max is order-free: the result does not depend on the programs' order


@triton.jit(do_not_specialize=["M", "S"])
def _tensor_quant_kernel(X, MEAN, AMAX, Q, SCALE, M, N, S, stride_x, HAS_MEAN: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, N_AMAX: tl.constexpr = 1,
                         AMAX_BLOCK: tl.constexpr = 1):
    """amax = the max of AMAX[0:N_AMAX] (non-negative partial maxima; AMAX_BLOCK = next power of two of N_AMAX)."""
    rows, cols, mask, y = _tile_values(X, MEAN, M, N, S, stride_x, HAS_MEAN, BLOCK_M, BLOCK_N, INTERPRET)
    a_offs = tl.arange(0, AMAX_BLOCK)
    amax = tl.max(tl.load(AMAX + a_offs, mask=a_offs < N_AMAX, other=0.0), axis=0)
    inv = tl.math.div_rn(448.0, tl.maximum(amax, 1e-12))
    tl.store(Q + rows.to(tl.int64)[:, None] * N + cols[None, :], quantize_fp8(y, inv, INTERPRET), mask=mask)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(SCALE, tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0))


def quant_fp8_tensorwise(
    x: torch.Tensor, mean: torch.Tensor | None = None, tokens_per_batch: int | None = None,
    *, out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor: x [M, N] fp16/bf16/fp32 with unit column stride (any row stride, e.g. a
    column slice of a fused QKV output) -> (codes float8_e4m3fn [M, N] contiguous, scale fp32 [1]).

    y = x.float(), or x.float() - mean[m // tokens_per_batch] when `mean` [B, N] fp32 is given (the attention's
    K smoothing); scale = max(amax|y|, 1e-12) / 448, codes = RNE(y * (448 / max(amax, 1e-12))). Bit-exact to
    `quant_fp8_tensorwise_reference`. A NaN in y gives NaN codes where it sits (the scale ignores it)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, row_strided=True)
    m, n = x.shape
    s = m if tokens_per_batch is None else tokens_per_batch
    if mean is not None:
        check_tensor("mean", mean, ndim=2, dtypes=(torch.float32,))
        if s < 1 or m % s or mean.shape != (m // s, n) or not mean.is_contiguous():
            raise ValueError(f"quant_fp8_tensorwise: mean must be contiguous [{m} // tokens_per_batch, {n}]")
    check_device(_tensor_quant_kernel, x=x, mean=mean, out=out, out_scale=out_scale)
    check_out("out", out, (m, n), torch.float8_e4m3fn, x.device)
    check_out("out_scale", out_scale, (1,), torch.float32, x.device)
    q = out if out is not None else torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = out_scale if out_scale is not None else torch.empty(1, dtype=torch.float32, device=x.device)
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    if m and n:
        block_m, block_n = 16, min(256, triton.next_power_of_2(n))
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        args = (x, mean if mean is not None else amax, amax)
        opts = dict(HAS_MEAN=mean is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                    INTERPRET=interpreting(_tensor_quant_kernel), num_warps=4, **launch_options(_tensor_quant_kernel))
        _tensor_amax_kernel[grid](*args, m, n, s, x.stride(0), **opts)
        _tensor_quant_kernel[grid](*args, q, scale, m, n, s, x.stride(0), **opts)
    else:
        scale.fill_(1e-12 / 448.0)
    return q, scale


@triton.jit(do_not_specialize=["S", "NBLK", "ROWS_PER_BLK"])  # row counts: masks and loop bounds only
def _column_stats_kernel(X, PSUM, PMAX, PMIN, S, N, stride_x, NBLK, ROWS_PER_BLK, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    _column_partials(X, PSUM, PMAX, PMIN, S, N, stride_x, NBLK, ROWS_PER_BLK, BLOCK_M, BLOCK_N, INTERPRET)


@triton.jit
def _column_partials(X, PSUM, PMAX, PMIN, S, N, stride_x, NBLK, ROWS_PER_BLK, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """Partial column sum / max / min of ROWS_PER_BLK (a multiple of BLOCK_M) of batch b's rows, BLOCK_N columns ->
    [B, NBLK, N] buffers. The rows stream through a [BLOCK_M, BLOCK_N] register tile in BLOCK_M steps (each lane adds
    its own rows in order), then one tree reduction over the tile's rows: a fixed order, so the sums are deterministic.
    (One tile per program was 0.2 ms for W2's V, a quarter of HBM bandwidth: the three cross-warp reductions and the
    partial stores dominated a 16 KB tile.)"""
    pid_m, pid_n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_max = tl.full((BLOCK_M, BLOCK_N), float("-inf"), dtype=tl.float32)
    acc_min = tl.full((BLOCK_M, BLOCK_N), float("inf"), dtype=tl.float32)
    row0 = pid_m * ROWS_PER_BLK
    for r in range(0, ROWS_PER_BLK, BLOCK_M):
        rows = row0 + r + tl.arange(0, BLOCK_M)
        mask = (rows < S)[:, None] & cmask[None, :]
        x = load_f32(X + (b * S + rows).to(tl.int64)[:, None] * stride_x + cols[None, :], mask, INTERPRET)
        acc_sum += x  # masked lanes read 0
        acc_max = tl.maximum(acc_max, tl.where(mask, x, float("-inf")))
        acc_min = tl.minimum(acc_min, tl.where(mask, x, float("inf")))
    out = (b * NBLK + pid_m).to(tl.int64) * N + cols
    tl.store(PSUM + out, tl.sum(acc_sum, axis=0), mask=cmask)
    tl.store(PMAX + out, tl.max(acc_max, axis=0), mask=cmask)
    tl.store(PMIN + out, tl.min(acc_min, axis=0), mask=cmask)


def column_stats_config(s: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, ROWS_PER_BLK, num_warps) of `_column_stats_kernel` for S rows of N columns: 32 x 128 tiles,
    4 warps, and ~32 row blocks of 256-1024 rows (bench/results/elementwise-sweep-*.json: at W2 the 1024-row blocks
    took 0.049 ms against 0.060 for 704 rows and 0.209 for one 64-row tile per program; at W1 4 warps beat 8). The
    block count sets the summation order, so it depends on the shape only, never on the device."""
    block_m, block_n = 32, min(128, triton.next_power_of_2(n))
    rows = min(1024, max(256, triton.cdiv(triton.cdiv(s, 32), block_m) * block_m))
    return block_m, block_n, rows, 4


@triton.jit
def _column_final(PSUM, PMAX, PMIN, MEAN, AMAX, b, pid_n, num_n, N, NBLK, s_f, BLOCK_B: tl.constexpr,
                  BLOCK_N: tl.constexpr, CACHE: tl.constexpr):
    """Columns [pid_n * BLOCK_N, +BLOCK_N) of batch b over its NBLK blocks (one tree reduction, fixed order):
    mean = fl(sum / S) -> MEAN [B, N]; max(fl(colmax - mean), fl(mean - colmin)) over these columns ->
    AMAX[b * num_n + pid_n] (one partial maximum per column block: the quantization kernel takes the max of them)."""
    blks = tl.arange(0, BLOCK_B)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (blks < NBLK)[:, None] & cmask[None, :]
    offs = (b * NBLK + blks).to(tl.int64)[:, None] * N + cols[None, :]
    total = tl.sum(tl.load(PSUM + offs, mask=mask, other=0.0, cache_modifier=CACHE), axis=0)
    cmax = tl.max(tl.load(PMAX + offs, mask=mask, other=float("-inf"), cache_modifier=CACHE), axis=0)
    cmin = tl.min(tl.load(PMIN + offs, mask=mask, other=float("inf"), cache_modifier=CACHE), axis=0)
    mean = tl.math.div_rn(total, s_f)
    tl.store(MEAN + b * N + cols, mean, mask=cmask)
    col_amax = tl.maximum(cmax - mean, mean - cmin)
    tl.store(AMAX + b * num_n + pid_n, tl.max(tl.where(cmask, col_amax, 0.0), axis=0))


@triton.jit(do_not_specialize=["NBLK"])
def _column_finalize_kernel(PSUM, PMAX, PMIN, MEAN, AMAX, N, NBLK, s_f, BLOCK_B: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """`_column_final` for column block program_id(0) of batch program_id(1) (no atomics, no zeroed buffer)."""
    _column_final(PSUM, PMAX, PMIN, MEAN, AMAX, tl.program_id(1), tl.program_id(0), tl.num_programs(0), N, NBLK, s_f,
                  BLOCK_B, BLOCK_N, "")


@triton.jit(do_not_specialize=["S", "NBLK", "ROWS_PER_BLK"])
def _column_stats_final_kernel(X, PSUM, PMAX, PMIN, MEAN, AMAX, COUNT, S, N, stride_x, NBLK, ROWS_PER_BLK, s_f,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                               INTERPRET: tl.constexpr):
    """`_column_stats_kernel`, then the last of a column block's NBLK programs does that block's `_column_final`
    (one launch instead of two on V's chain). "Last": an acq_rel atomic count per (batch, column block), after a CTA
    barrier so every thread's partial stores come before it (the CUDA threadfence-reduction pattern); the last
    program reads the partials from L2 (.cg) and sets its count back to 0 for the next call. The reduction itself is
    `_column_final`'s, in block order whichever program comes last: deterministic."""
    _column_partials(X, PSUM, PMAX, PMIN, S, N, stride_x, NBLK, ROWS_PER_BLK, BLOCK_M, BLOCK_N, INTERPRET)
    pid_n, b = tl.program_id(1), tl.program_id(2)
    tl.debug_barrier()
    count = COUNT + b * tl.num_programs(1) + pid_n
    if tl.atomic_add(count, 1, sem="acq_rel") == NBLK - 1:
        _column_final(PSUM, PMAX, PMIN, MEAN, AMAX, b, pid_n, tl.num_programs(1), N, NBLK, s_f, BLOCK_B, BLOCK_N,
                      ".cg")
        tl.store(count, 0)


def centred_counter_size(tokens_per_batch: int, n: int, batch: int) -> int:
    """int32 elements of the `counter` that quant_fp8_centred(fused_finalize=True) needs (one per batch and
    column block)."""
    return batch * triton.cdiv(n, column_stats_config(tokens_per_batch, n)[1])


def quant_fp8_centred(
    x: torch.Tensor, tokens_per_batch: int, *, out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None, fused_finalize: bool = False, counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, N] fp16/bf16/fp32 with unit column stride (any row stride) -> (codes float8_e4m3fn [M, N], scale fp32
    [1], mean fp32 [B, N]): x centred on its own mean over each batch's tokens_per_batch rows, one scale for the
    whole tensor (see the module docstring: bit-identical to `quant_fp8_tensorwise(x, mean, tokens_per_batch)`).

    fused_finalize: the statistics pass's last program per column block does the final reduction
    (`_column_stats_final_kernel`: two kernels instead of three). It counts programs in `counter` (int32, at least
    `centred_counter_size` elements, all 0; the kernel leaves them 0 again, so a caller can keep one per call site
    and skip the zero fill); without one a zeroed counter is allocated. Calls sharing a counter must not overlap."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, row_strided=True)
    m, n = x.shape
    s = tokens_per_batch
    if not isinstance(s, int) or isinstance(s, bool) or s < 1 or m % s:
        raise ValueError(f"quant_fp8_centred: tokens_per_batch must be a positive int dividing M={m}, got {s!r}")
    check_device(_column_stats_kernel, x=x, out=out, out_scale=out_scale)
    b = m // s
    mean = torch.empty((b, n), dtype=torch.float32, device=x.device)
    if not (m and n):
        q, scale = quant_fp8_tensorwise(x, mean, s, out=out, out_scale=out_scale)
        return q, scale, mean.zero_()
    block_m, block_n, rows_per_blk, warps = column_stats_config(s, n)
    nblk = triton.cdiv(s, rows_per_blk)
    partial = torch.empty((3, b, nblk, n), dtype=torch.float32, device=x.device)
    interp = interpreting(_column_stats_kernel)
    opts = launch_options(_column_stats_kernel)
    block_b = triton.next_power_of_2(nblk)
    if fused_finalize:
        size = centred_counter_size(s, n, b)
        if counter is None:
            counter = torch.zeros(size, dtype=torch.int32, device=x.device)
        check_tensor("counter", counter, ndim=1, dtypes=(torch.int32,))
        if counter.numel() < size or counter.device != x.device:
            raise ValueError(f"quant_fp8_centred: counter must be int32 with >= {size} elements on {x.device}")
        n_amax = triton.cdiv(n, block_n) * b
        amax = torch.empty(n_amax, dtype=torch.float32, device=x.device)  # every element written by a last program
        _column_stats_final_kernel[(nblk, triton.cdiv(n, block_n), b)](
            x, partial[0], partial[1], partial[2], mean, amax, counter, s, n, x.stride(0), nblk, rows_per_blk,
            float(s), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=block_b, INTERPRET=interp, num_warps=warps, **opts)
    else:
        _column_stats_kernel[(nblk, triton.cdiv(n, block_n), b)](
            x, partial[0], partial[1], partial[2], s, n, x.stride(0), nblk, rows_per_blk, BLOCK_M=block_m,
            BLOCK_N=block_n, INTERPRET=interp, num_warps=warps, **opts)
        fin_n = max(1, min(block_n, 8192 // block_b))
        n_amax = triton.cdiv(n, fin_n) * b
        amax = torch.empty(n_amax, dtype=torch.float32, device=x.device)  # every element written by the finalize
        _column_finalize_kernel[(triton.cdiv(n, fin_n), b)](
            partial[0], partial[1], partial[2], mean, amax, n, nblk, float(s), BLOCK_B=block_b, BLOCK_N=fin_n,
            num_warps=8, **opts)
    check_out("out", out, (m, n), torch.float8_e4m3fn, x.device)
    check_out("out_scale", out_scale, (1,), torch.float32, x.device)
    q = out if out is not None else torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = out_scale if out_scale is not None else torch.empty(1, dtype=torch.float32, device=x.device)
    qm, qn = 16, min(256, triton.next_power_of_2(n))
    _tensor_quant_kernel[(triton.cdiv(m, qm), triton.cdiv(n, qn))](
        x, mean, amax, q, scale, m, n, s, x.stride(0), HAS_MEAN=True, BLOCK_M=qm, BLOCK_N=qn,
        INTERPRET=interpreting(_tensor_quant_kernel), N_AMAX=n_amax, AMAX_BLOCK=triton.next_power_of_2(n_amax),
        num_warps=4, **launch_options(_tensor_quant_kernel))
    return q, scale, mean


def quant_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel fp8 of a Linear weight w [N, K] (plain torch, runs once at load):
    scale [N] fp32 = max(amax_k |w[n]|, 1e-12) / 448, q [N, K] float8_e4m3fn = RNE(w * (448 / max(amax, 1e-12)))."""
    check_tensor("w", w, ndim=2, dtypes=FLOAT_DTYPES)
    q, scale = fp8_rowwise_reference(w)
    return q, scale.view(-1)


# ----------------------------------------------------------------------------------------------------------------------
# Eager references


def fp8_rowwise_reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager torch row-wise quantization of y [..., K] (computed in fp32): (q float8_e4m3fn, row_scale [..., 1]).
    The clamp is a no-op on every finite input (|y * inv| <= 448 * (1 + 2^-23)^2, which torch rounds to 448 anyway);
    it only documents the kernels' saturation (torch alone would give NaN at |v| >= 464)."""
    yf = y.float()
    amax = yf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return _codes(yf, amax), _scale(amax)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    # A tensor divisor, not the Python scalar 448: CUDA's `tensor / scalar` multiplies by a rounded reciprocal,
    # which differs from a correctly rounded division (and from the CPU, and from the kernels' div.rn) in the last bit.
    return amax / amax.new_full((), 448.0)


def _codes(yf: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    inv = amax.new_full((), 448.0) / amax
    return (yf * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def quant_fp8_rowwise_reference(x: torch.Tensor, *, out=None, out_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    q, rs = fp8_rowwise_reference(x.float())
    return into(q, out), into(rs, out_scale)


def quant_fp8_tensorwise_reference(
    x: torch.Tensor, mean: torch.Tensor | None = None, tokens_per_batch: int | None = None, *, out=None, out_scale=None
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    y = x.float()
    if mean is not None:
        s = m if tokens_per_batch is None else tokens_per_batch
        y = (y.view(m // s, s, n) - mean.view(-1, 1, n)).view(m, n)
    amax = y.abs().amax().clamp_min(1e-12).view(1)
    return into(_codes(y, amax), out), into(_scale(amax), out_scale)


def quant_static_reference(y: torch.Tensor, amax: torch.Tensor, centre: torch.Tensor | None = None,
                           tokens_per_batch: int | None = None) -> torch.Tensor:
    """Per-tensor e4m3 codes of y [M, N] (fp32 math; minus centre[m // tokens_per_batch] [B, N] fp32 first) with a
    GIVEN amax ([1] fp32, e.g. a static bound): RNE_e4m3(sat(y * fl(448 / max(amax, 1e-12)))) - the rule above
    with the amax supplied, and saturating (a bound below the true amax clamps instead of overflowing)."""
    m, n = y.shape
    yf = y.float()
    if centre is not None:
        s = m if tokens_per_batch is None else tokens_per_batch
        yf = (yf.view(m // s, s, n) - centre.view(-1, 1, n)).view(m, n)
    return _codes(yf, amax.float().clamp_min(1e-12).reshape(()))


def quant_fp8_static_reference(x: torch.Tensor, amax: torch.Tensor, amax_mult: float = 1.0, *, gelu: bool = False,
                               out=None, out_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager `quant_fp8_static` on a given fp32 y (gelu=True: y = torch's tanh-GELU; bit-exact to the kernel only on
    the kernel's own GELU values, see `gelu_tanh_f32`)."""
    y = gelu_tanh_reference(x) if gelu else x.float()
    a = (amax.float() * torch.tensor(amax_mult, dtype=torch.float32, device=amax.device)).clamp_min(1e-12)
    q = _codes(y, a.reshape(()))
    return into(q, out), into(_scale(a).reshape(1, 1).expand(x.shape[0], 1).contiguous(), out_scale)


def quant_fp8_centred_reference(x: torch.Tensor, tokens_per_batch: int, *, out=None, out_scale=None):
    """Eager: torch's fp32 sequence mean, then `quant_fp8_tensorwise_reference` with it."""
    m, n = x.shape
    mean = torch.mean(x.float().view(m // tokens_per_batch, tokens_per_batch, n), dim=1)
    q, scale = quant_fp8_tensorwise_reference(x, mean, tokens_per_batch, out=out, out_scale=out_scale)
    return q, scale, mean


def gelu_tanh_reference(h: torch.Tensor, *, out=None) -> torch.Tensor:
    """fp32 y = F.gelu(h.float(), approximate="tanh")."""
    return into(torch.nn.functional.gelu(h.float(), approximate="tanh"), out)


def gelu_tanh_quant_fp8_reference(h: torch.Tensor, *, out=None, out_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    q, rs = fp8_rowwise_reference(gelu_tanh_reference(h))
    return into(q, out), into(rs, out_scale)
