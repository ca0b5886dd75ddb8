"""Which FP8 GEMM configuration is fastest at the DiT's linear shapes? One process, one H200, random data.

For M tokens (W2 32760, W1 7290) and each block linear (qkv 4608x1536, o 1536x1536, ff1 8960x1536, ff2 1536x8960):
  fp16          F.linear, the exact mode's GEMM
  rowwise       torch._scaled_mm, per-row activation / per-channel weight scales, fp16 out + bias (the fast mode now)
  rowwise-fa    the same with use_fast_accum=True (the FP8 tensor cores' own accumulator, no fp32 promotion)
  tensor        one scale per operand (scalar tensors), fp16 out + bias
  tensor-fa     the same with use_fast_accum=True
and for each the cosine of its output against the fp16 GEMM of the dequantized operands (fp32 math), so the speed of
the fast-accumulation variants comes with its cost.

    python experiments/gemm_scales.py --out gemm.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (4608, 1536), "o": (1536, 1536), "ff1": (8960, 1536), "ff2": (1536, 8960)}
FP8 = torch.float8_e4m3fn


def rowwise(x):
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    return (x.float() * (448.0 / amax)).to(FP8), amax / 448.0


def tensorwise(x):
    amax = x.float().abs().amax().clamp_min(1e-12)
    return (x.float() * (448.0 / amax)).to(FP8), (amax / 448.0).reshape(())


def main(argv=None) -> int:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[32760, 7290])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for m in a.tokens:
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device=dev, generator=g).half()
            w = (torch.randn(n, k, device=dev, generator=g) * k ** -0.5).half()
            bias = (torch.randn(n, device=dev, generator=g) * 0.1).half()
            qa_r, sa_r = rowwise(x)
            qw_r, sw_r = rowwise(w)
            qa_t, sa_t = tensorwise(x)
            qw_t, sw_t = tensorwise(w)
            ref_r = F.linear(qa_r.float() * sa_r, qw_r.float() * sw_r, bias.float())
            ref_t = F.linear(qa_t.float() * sa_t, qw_t.float() * sw_t, bias.float())
            variants = {
                "fp16": (lambda: F.linear(x, w, bias), None),
                "rowwise": (lambda: torch._scaled_mm(qa_r, qw_r.t(), scale_a=sa_r, scale_b=sw_r.view(1, -1),
                                                     bias=bias, out_dtype=torch.float16), ref_r),
                "rowwise-fa": (lambda: torch._scaled_mm(qa_r, qw_r.t(), scale_a=sa_r, scale_b=sw_r.view(1, -1),
                                                        bias=bias, out_dtype=torch.float16, use_fast_accum=True), ref_r),
                "tensor": (lambda: torch._scaled_mm(qa_t, qw_t.t(), scale_a=sa_t, scale_b=sw_t, bias=bias,
                                                    out_dtype=torch.float16), ref_t),
                "tensor-fa": (lambda: torch._scaled_mm(qa_t, qw_t.t(), scale_a=sa_t, scale_b=sw_t, bias=bias,
                                                       out_dtype=torch.float16, use_fast_accum=True), ref_t),
            }
            flop = 2.0 * m * n * k
            for vname, (fn, ref) in variants.items():
                try:
                    y = fn()
                    ms = triton.testing.do_bench(fn, rep=200, return_mode="median")
                except RuntimeError as e:
                    rows.append({"m": m, "linear": name, "variant": vname, "error": str(e)[:200]})
                    print(f"{m:6d} {name:4s} {vname:10s} ERROR {str(e)[:100]}")
                    continue
                cos = None if ref is None else F.cosine_similarity(y.float().flatten(), ref.flatten(), dim=0).item()
                err = None if ref is None else ((y.float() - ref).norm() / ref.norm()).item()
                rows.append({"m": m, "linear": name, "variant": vname, "ms": ms, "tflops": flop / ms / 1e9,
                             "cos_vs_dequant_fp32": cos, "rel_err_vs_dequant_fp32": err})
                print(f"{m:6d} {name:4s} {vname:10s} {ms:8.4f} ms {flop / ms / 1e9:7.0f} TF/s"
                      + ("" if err is None else f"  rel err {err:.2e}"))
    print("\nper-step totals (30 layers, ms):")
    for m in a.tokens:
        for vname in ("fp16", "rowwise", "rowwise-fa", "tensor", "tensor-fa"):
            tot = sum(r.get("ms", float("nan")) for r in rows if r["m"] == m and r["variant"] == vname)
            print(f"  M={m:6d} {vname:10s} {30 * tot:8.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
