"""Is the FFN's GELU + static-scale quantization (quant.quant_fp8_static(gelu=True), 0.30 ms at W2 = 61 % of HBM
bandwidth) bound by the special-function unit? Its sigmoid-form GELU x / (1 + exp2(.)) costs two MUFU ops per element
(ex2 and the reciprocal inside the division) - 2 x 293M elements at 16 per clock per SM is ~0.14 ms on an H200.
Three variants of the same streaming kernel, timed side by side at W2 and W1 shapes, with their error against torch's
F.gelu(approximate="tanh") in fp32:
  sigmoid   the shipped form (ex2.approx + div.full): 2 MUFU ops
  tanh      0.5 x (1 + tanh.approx(u)): 1 MUFU op (relative error ~2^-11 on tanh; absolute <= 2^-12 |x| on GELU)
  poly-exp2 x * rcp(1 + 2^t) with 2^t on the FMA pipe (round-to-nearest split + degree-5 polynomial): 1 MUFU op
plus the plain copy-and-quantize (no GELU) as the bandwidth floor.

    python experiments/gelu_variants.py --out gelu.json
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
import triton.testing

from fastremover.fast.kernels._common import launch_options, load_f32, quantize_fp8
from fastremover.fast.kernels.quant import GELU_BETA, GELU_KAPPA, MINUS_TWO_LOG2E, gelu_tanh_f32_device
from _provenance import save_experiment



@triton.jit
def _exp2_poly(t):
    """2^t for t <= 126 on the FMA pipe: t = j + f, j = rint(t), f in [-0.5, 0.5]; 2^f by a degree-5 Taylor polynomial
    (relative error < 2e-7); 2^j added to the exponent bits."""
    t = tl.maximum(t, -126.0)
    r = t + 12582912.0  # 1.5 * 2^23: rint(t) in the low mantissa bits
    j = r - 12582912.0
    f = t - j
    p = 0.0013333558146428443
    p = p * f + 0.009618129107628477
    p = p * f + 0.05550410866482158
    p = p * f + 0.2402265069591007
    p = p * f + 0.6931471805599453
    p = p * f + 1.0
    return (p.to(tl.int32, bitcast=True) + (r.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _gelu_variant(x, VARIANT: tl.constexpr):
    if VARIANT == 0:
        y = gelu_tanh_f32_device(x, False)
    elif VARIANT == 1:
        u = GELU_BETA * tl.fma(GELU_KAPPA, (x * x) * x, x)
        th = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True,
                                       pack=1)
        y = 0.5 * x * (1.0 + th)
    elif VARIANT == 2:
        inner = GELU_BETA * tl.fma(GELU_KAPPA, (x * x) * x, x)
        y = x / (1.0 + _exp2_poly(inner * MINUS_TWO_LOG2E))
    else:
        y = x
    return y


@triton.jit
def _tile(X, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    return offs, mask, load_f32(X + offs, mask, False)


@triton.jit
def _variant_kernel(X, AMAX, Q, M, N, VARIANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs, mask, x = _tile(X, M, N, BLOCK_M, BLOCK_N)
    amax = tl.maximum(tl.load(AMAX), 1e-12)
    tl.store(Q + offs, quantize_fp8(_gelu_variant(x, VARIANT), tl.math.div_rn(448.0, amax), False), mask=mask)


@triton.jit
def _variant_f32_kernel(X, Y, M, N, VARIANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs, mask, x = _tile(X, M, N, BLOCK_M, BLOCK_N)
    tl.store(Y + offs, _gelu_variant(x, VARIANT), mask=mask)


NAMES = {0: "sigmoid (shipped)", 1: "tanh.approx", 2: "poly-exp2", 3: "no GELU (copy + quantize)"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    x_err = torch.linspace(-12, 12, 1 << 20, device="cuda")
    ref = torch.nn.functional.gelu(x_err.double(), approximate="tanh")
    for variant in (0, 1, 2):
        y = torch.empty_like(x_err)
        rows_err = (1 << 20) // 256
        _variant_f32_kernel[(triton.cdiv(rows_err, 16), 1)](x_err.view(-1, 256), y.view(-1, 256), rows_err, 256,
                                                             VARIANT=variant, BLOCK_M=16, BLOCK_N=256,
                                                             **launch_options(_variant_f32_kernel))
        err = (y.double() - ref).abs() / ref.abs().clamp_min(1.0)
        rows.append({"variant": NAMES[variant], "max_err_rel_to_max1y": float(err.max())})
        print(f"{NAMES[variant]:28s} max |y - torch| / max(1, |y|) = {float(err.max()):.2e}")
    for m in (32760, 7290):
        h = (torch.randn(m, 8960, device="cuda", generator=g) * 2).half()
        amax = torch.tensor([40.0], device="cuda")
        q = torch.empty(m, 8960, device="cuda", dtype=torch.float8_e4m3fn)
        grid = (triton.cdiv(m, 16), triton.cdiv(8960, 256))
        for variant in (3, 0, 1, 2):
            def fn():
                _variant_kernel[grid](h, amax, q, m, 8960, VARIANT=variant, BLOCK_M=16, BLOCK_N=256, num_warps=4,
                                      **launch_options(_variant_kernel))
            fn()
            ms = triton.testing.do_bench(fn, rep=100, return_mode="median")
            gbps = m * 8960 * 3 / ms / 1e6
            rows.append({"m": m, "variant": NAMES[variant], "ms": ms, "gbps": gbps})
            print(f"M={m:6d} {NAMES[variant]:28s} {ms:8.4f} ms {gbps:7.0f} GB/s")
    save_experiment(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
