"""GPU micro-benchmark of the fused kernels against their eager compositions at the model's real shapes.

    python tools/bench_kernels.py            # M = 32760 tokens (81 frames at 480x832), fp16
    python tools/bench_kernels.py --dtype bf16 --tokens 16380

Times are triton.testing.do_bench medians (ms, L2 flushed between reps); GB/s counts the minimum DRAM traffic of the
fused kernel (each input read once, each output written once; the tiny [B, D] modulation vectors and RoPE tables are
not counted), for both columns, so the eager GB/s is an "effective" bandwidth. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse


HBM_TBPS = 4.8  # H200 peak HBM3e bandwidth, for the "% of peak" column



def _load() -> None:
    """The heavy imports (torch, the package), after the arguments are parsed: --help stays fast."""
    global torch, F
    import torch
    import torch.nn.functional as F

def _cases(m: int, dtype: torch.dtype, batch: int, dev: str = "cuda"):
    from fastremover.fast.kernels import adaln, qk_norm_rope, quant, residual
    from fastremover.models.transformer import RMSNorm, apply_rope, layer_norm_fp32, rope_cos_sin

    d, ffn, heads, head_dim, eps = 1536, 8960, 12, 128, 1e-6
    s = m // batch
    el = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dt)

    x = rnd(m, d, scale=4.0)
    shift, scale, gate = (rnd(batch, d, dt=torch.float32) for _ in range(3))
    branch = rnd(m, d)
    q = rnd(m, d, scale=3.0)
    w = (1 + 0.1 * torch.randn(d, device=dev)).to(dtype)
    # a grid with exactly s tokens: frames x rows x cols (21 x 30 x 52 = 32760 for 81 frames at 480x832)
    grid = (21, 30, s // (21 * 30)) if s % (21 * 30) == 0 else (1, 1, s)
    cos, sin = rope_cos_sin(grid, head_dim, max(1024, max(grid)), dev)
    h = rnd(m, ffn, scale=2.0)
    norm = RMSNorm(d, eps).to(device=dev, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    xo = torch.empty_like(x)
    h_amax = (h.float().abs().max() * 10).reshape(1)
    qk_amax = qk_norm_rope.rope_amax_bound(w)
    xb, sh3, sc3, g3 = x.view(batch, s, d), shift[:, None], scale[:, None], gate[:, None]

    def eager_adaln():
        return (layer_norm_fp32(xb, eps) * (1 + sc3) + sh3).to(dtype)

    def eager_adaln_fp8():
        return quant.fp8_rowwise_reference(layer_norm_fp32(xb, eps) * (1 + sc3) + sh3)

    def eager_qk():
        return apply_rope(norm(q.view(batch, s, d)).unflatten(-1, (heads, -1)), cos, sin)

    def eager_residual():
        return (xb.float() + branch.view(batch, s, d) * g3).to(dtype)

    def eager_gelu_model():  # what the eager model does (fp16 GELU output, no quantization)
        return F.gelu(h, approximate="tanh")

    return [
        # name, eager fn, fused fn, bytes moved by the fused kernel
        ("adaln_modulate", eager_adaln, lambda: adaln.adaln_modulate(x, shift, scale, s, eps, out=xo), 2 * m * d * el),
        ("adaln_modulate fp8", eager_adaln_fp8, lambda: adaln.adaln_modulate(x, shift, scale, s, eps, fp8=True),
         m * d * (el + 1) + 4 * m),
        ("qk_norm_rope", eager_qk, lambda: qk_norm_rope.qk_norm_rope(q, w, cos, sin, s, heads, eps, out=xo),
         2 * m * d * el),
        ("gate_residual (out=)", eager_residual, lambda: residual.gate_residual(x, branch, gate, s, out=xo),
         3 * m * d * el),
        ("quant_fp8_rowwise K=1536", lambda: quant.quant_fp8_rowwise_reference(x),
         lambda: quant.quant_fp8_rowwise(x), m * d * (el + 1) + 4 * m),
        ("quant_fp8_rowwise K=8960", lambda: quant.quant_fp8_rowwise_reference(h),
         lambda: quant.quant_fp8_rowwise(h), m * ffn * (el + 1) + 4 * m),
        ("gelu_tanh_quant_fp8 N=8960", lambda: quant.gelu_tanh_quant_fp8_reference(h),
         lambda: quant.gelu_tanh_quant_fp8(h), m * ffn * (el + 1) + 4 * m),
        ("  (eager model F.gelu fp16)", eager_gelu_model, lambda: quant.gelu_tanh_quant_fp8(h),
         m * ffn * (el + 1) + 4 * m),
        ("gelu static-scale fp8 N=8960", lambda: quant.quant_fp8_static_reference(h, h_amax, gelu=True),
         lambda: quant.quant_fp8_static(h, h_amax, gelu=True), m * ffn * (el + 1) + 4 * m),
        ("qk_norm_rope fp8 (static)", eager_qk, lambda: qk_norm_rope.qk_norm_rope(q, w, cos, sin, s, heads, eps,
                                                                                  fp8_amax=qk_amax),
         m * d * (el + 1)),
    ]


def benchmark(tokens: int = 32760, dtype: "torch.dtype | None" = None, batch: int = 1, reps: int = 100) -> list[dict]:
    """Print and return eager vs fused medians for every kernel at [tokens, 1536] / [tokens, 8960]."""
    dtype = dtype or torch.float16
    import triton.testing

    if not torch.cuda.is_available():
        raise RuntimeError("benchmark() needs a CUDA GPU")
    rows = []
    print(f"{torch.cuda.get_device_name()}  tokens={tokens} batch={batch} dtype={dtype}  (do_bench medians)")
    print(f"{'kernel':30s} {'eager ms':>9s} {'fused ms':>9s} {'speedup':>8s} {'eager GB/s':>11s} {'fused GB/s':>11s} "
          f"{'% peak':>7s}")
    for name, eager, fused, nbytes in _cases(tokens, dtype, batch):
        with torch.no_grad():
            fused()  # compile outside the timing
            te = triton.testing.do_bench(eager, rep=reps, return_mode="median")
            tf = triton.testing.do_bench(fused, rep=reps, return_mode="median")
        gbe, gbf = nbytes / te / 1e6, nbytes / tf / 1e6
        rows.append({"kernel": name, "eager_ms": te, "fused_ms": tf, "speedup": te / tf, "eager_gbps": gbe,
                     "fused_gbps": gbf, "bytes": nbytes})
        pct = 100 * gbf / 1e3 / HBM_TBPS
        print(f"{name:30s} {te:9.4f} {tf:9.4f} {te / tf:7.2f}x {gbe:11.0f} {gbf:11.0f} {pct:6.1f}%")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32760)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--reps", type=int, default=100, help="do_bench rep budget in ms")
    a = ap.parse_args(argv)
    _load()
    benchmark(a.tokens, torch.float16 if a.dtype == "fp16" else torch.bfloat16, a.batch, a.reps)
    return 0


if __name__ != "__main__":  # imported (experiments, tests): everything at once
    _load()

if __name__ == "__main__":
    raise SystemExit(main())
