"""Row-wise fp8 (float8_e4m3fn) quantization, plain and fused with the tanh-GELU of the FFN; per-channel weight quant.

Scale rule (everywhere in fastremover.fast): for a row y (fp32),
    row_scale = max(amax(|y|), 1e-12) / 448          correctly rounded fp32 division (torch `/`)
    q         = RNE_e4m3(y / row_scale)              correctly rounded fp32 division, then round-to-nearest-even
so q * row_scale ~= y with relative error <= 2^-4 (3 mantissa bits), and |y / row_scale| <= 448 * (1 + 2^-23)
always rounds to +-448 at the top: nothing ever overflows. Saturation: values past 448 would clamp to +-448 (torch's
own cast turns |v| >= 464 into NaN; unreachable here). A NaN anywhere in a row makes that row's scale NaN (as torch's
amax does), and so every code of the row NaN; an inf makes the scale inf (inf elements -> NaN codes, others -> 0).

Kernels (one program per row; the row lives in registers as HEAD + TAIL power-of-two segments, see `row_segments`:
8960 -> 8192 + 1024 lanes, 1536 -> 1024 + 512):
    quant_fp8_rowwise(x)       y = x.float()
    gelu_tanh_quant_fp8(h)     y = gelu_tanh(h.float()) in fp32, then the same quantization
    gelu_tanh_f32(h)           y alone (fp32) - the exact intermediate of gelu_tanh_quant_fp8, for tests/debugging
Reduction: amax is a max, so its value does not depend on the order; with y bit-identical to eager, scale and codes
are bit-identical too (quant_fp8_rowwise always is).

GELU (tanh approximation), written exactly like PyTorch's CUDA kernel (ActivationGeluKernel.cu) as nvcc compiles it:
    x3    = (x * x) * x                                       two rounded products
    inner = kBeta * fma(kKappa, x3, x)                        nvcc contracts `x + kKappa * x_cube` into one FMA
    y     = (0.5 * x) * (1 + tanh(inner))                     0.5 * x exact; 1 + t rounded; product rounded
    kBeta = float(M_SQRT2 * M_2_SQRTPI * 0.5) = 0.7978845834732056, kKappa = float(0.044715)
    tanh: libdevice __nv_tanhf on the GPU (the CUDA math library's tanhf, what torch calls);
          interpreter: sign(u) * (1 - 2 / (exp(2|u|) + 1)) with |u| clamped to 20 (numpy exp).
Measured on the CPU (interpreter vs torch's CPU F.gelu(h.float(), approximate="tanh"), 2^20 N(0, 3^2) inputs plus
2^20 points evenly over [-12, 12]): 93 % bit-identical, max |diff| = 2.4e-7 = 2^-22 absolute, i.e. tanh differs
from torch's in its last bit and nothing else. Counted in ulps of y it looks worse where 1 + tanh cancels
(x in [-3, -1]: up to 6 ulps with |y| >= 0.1; x < -5: torch's tanh is exactly -1 and y = -0 where ours gives
-1.5e-7); torch's own result has the same absolute error against float64 (4.3e-7 both). For fp8 (spacing 2^-4
relative to the row max) this is invisible. Asserted bound: |diff| <= 2^-21 * max(1, |y|)
(tests/test_kernels.py::test_gelu_tanh_f32_matches_torch). The GPU path should be bit-identical to torch's CUDA gelu
(same formula and rounding points, same FMA contraction, same tanhf); the gpu test asserts the same bound and prints
the bit-identical fraction.
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
    row_num_warps,
    row_segments,
    store_fp8_row,
)

try:  # libdevice is only called on the compiled path (the interpreter cannot run extern calls)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice

GELU_BETA = tl.constexpr(float(torch.tensor(1.41421356237309504880 * 1.12837916709551257390 * 0.5,
                                            dtype=torch.float32)))
GELU_KAPPA = tl.constexpr(float(torch.tensor(0.044715, dtype=torch.float32)))


@triton.jit
def _tanh_f32(u, INTERPRET: tl.constexpr):
    if INTERPRET:
        a = tl.minimum(tl.abs(u), 20.0)  # tanh(20) == 1 in fp32; keeps exp finite
        t = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
        t = tl.where(u < 0, -t, t)
    else:
        t = libdevice.tanh(u)
    return t


@triton.jit
def gelu_tanh_f32_device(x, INTERPRET: tl.constexpr):
    """fp32 tanh-GELU, torch's CUDA formula and rounding points (see the module docstring)."""
    inner = GELU_BETA * tl.fma(GELU_KAPPA, (x * x) * x, x)
    return (0.5 * x) * (1.0 + _tanh_f32(inner, INTERPRET))


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


def quant_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel fp8 of a Linear weight w [N, K] (plain torch, runs once at load):
    scale [N] fp32 = max(amax_k |w[n]|, 1e-12) / 448, q [N, K] float8_e4m3fn = RNE(w / scale[:, None])."""
    check_tensor("w", w, ndim=2, dtypes=FLOAT_DTYPES)
    q, scale = fp8_rowwise_reference(w)
    return q, scale.view(-1)


# ----------------------------------------------------------------------------------------------------------------------
# Eager references


def fp8_rowwise_reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager torch row-wise quantization of y [..., K] (computed in fp32): (q float8_e4m3fn, row_scale [..., 1]).
    The clamp is a no-op on every finite input (|y / scale| <= 448 * (1 + 2^-23), which torch rounds to 448 anyway);
    it only documents the kernels' saturation (torch alone would give NaN at |v| >= 464)."""
    yf = y.float()
    amax = yf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    # A tensor divisor, not the Python scalar 448: CUDA's `tensor / scalar` multiplies by a rounded reciprocal,
    # which differs from a correctly rounded division (and from the CPU, and from the kernels' div.rn) in the last bit.
    scale = amax / amax.new_full((), 448.0)
    return (yf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def quant_fp8_rowwise_reference(x: torch.Tensor, *, out=None, out_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    q, rs = fp8_rowwise_reference(x.float())
    return into(q, out), into(rs, out_scale)


def gelu_tanh_reference(h: torch.Tensor, *, out=None) -> torch.Tensor:
    """fp32 y = F.gelu(h.float(), approximate="tanh")."""
    return into(torch.nn.functional.gelu(h.float(), approximate="tanh"), out)


def gelu_tanh_quant_fp8_reference(h: torch.Tensor, *, out=None, out_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    q, rs = fp8_rowwise_reference(gelu_tanh_reference(h))
    return into(q, out), into(rs, out_scale)
