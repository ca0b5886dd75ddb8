"""NVFP4 on Hopper: the DiT's block GEMMs as cuBLAS fp16, the FP8 path, W4A16 (Triton) and dequantize + cuBLAS, plus
the quantizer; a table and a JSON file.

    python tools/bench_nvfp4.py OUT.json [--shapes w1,w2] [--tune]

Per (M, N, K) of the block GEMMs at W1 (M = 7290) and W2 (M = 32760): TFLOP/s (2 M N K / median time of
triton.testing.do_bench) of
    fp16      torch.nn.functional.linear, fp16 weight + bias (cuBLAS)
    fp8       torch._scaled_mm with row-wise scales, activations pre-quantized (the fast mode's FP8 GEMM alone)
    w4a16     fastremover.fast.kernels.nvfp4.w4a16_gemm (weights packed NVFP4, dequantized in the load path)
    deq+mm    unit_weight_nvfp4 (exact W_unit * 2^-7 in fp16) every call into a transient buffer, then cuBLAS addmm
              with the multiplier as alpha (Nvfp4Linear's default on sm_90)
and each path's output against the fp16 GEMM of the original weight (relative error, cosine), the weight bytes, and
the quantizer's time per weight / activation matrix. No W4A8 row: see kernels/nvfp4.py. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

import torch
import torch.nn.functional as F


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - a copy without git
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--shapes", default="s1k,s4k,w1,w2", help="M values: s1k=1024, s4k=4096, w1=7290, w2=32760")
    ap.add_argument("--tune", action="store_true", help="autotune the W4A16 launch config per shape")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_nvfp4 needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from fastremover.fast import nvfp4 as n
    from fastremover.fast.kernels import nvfp4 as kn
    from fastremover.fast.kernels.nvfp4 import quantize_nvfp4, unit_multiplier, unit_weight_nvfp4, w4a16_gemm
    from fastremover.fast.kernels.quant import quant_fp8_rowwise, quant_fp8_weight

    ms = {"s1k": 1024, "s4k": 4096, "w1": 7290, "w2": 32760}
    rows = []
    torch.manual_seed(0)
    for tag in args.shapes.split(","):
        m = ms[tag]
        for name, nn_, k in (("qkv/O", 1536, 1536), ("FF1", 8960, 1536), ("FF2", 1536, 8960)):
            w = (torch.randn(nn_, k, device="cuda") * 0.02).half()
            bias = (torch.randn(nn_, device="cuda") * 0.1).half()
            x = torch.randn(m, k, device="cuda").half()
            flop = 2.0 * m * nn_ * k
            ref = F.linear(x, w, bias).float()

            def fid(y):
                y = y.float()
                return {"rel_err": ((y - ref).norm() / ref.norm()).item(),
                        "cos": F.cosine_similarity(y.flatten(), ref.flatten(), dim=0).item()}

            t = quantize_nvfp4(w)
            alpha = n.alpha_of(t.global_scale)
            mult = unit_multiplier(t.global_scale, torch.float16)
            qa, sa = quant_fp8_rowwise(x)
            qw, sw = quant_fp8_weight(w)
            sw = sw.view(1, -1).contiguous()
            paths = {
                "fp16": lambda: F.linear(x, w, bias),
                "fp8": lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sw, bias=bias.to(torch.bfloat16),
                                                out_dtype=torch.bfloat16, use_fast_accum=True),
                "w4a16": lambda: w4a16_gemm(x, t, bias, alpha=alpha, tune=args.tune),
                "deq+mm": lambda: torch.addmm(bias, x, unit_weight_nvfp4(t, torch.float16).t(), alpha=mult),
            }
            row = {"workload": tag, "gemm": name, "M": m, "N": nn_, "K": k,
                   "weight_bytes": {"fp16": w.numel() * 2, "fp8": qw.numel() + sw.numel() * 4,
                                    "nvfp4": t.nbytes()}}
            for p, fn in paths.items():
                y = fn()
                t_ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                row[p] = {"ms": t_ms, "tflops": flop / t_ms / 1e9, **fid(y)}
            row["w4a16_config"] = kn._GEMM_TUNED.get((m, nn_, k, x.dtype, False, True))
            row["quantize_weight_ms"] = do_bench(lambda: quantize_nvfp4(w), warmup=5, rep=20, return_mode="median")
            row["quantize_activation_ms"] = do_bench(lambda: quantize_nvfp4(x, t.global_scale), warmup=5, rep=20,
                                                     return_mode="median")
            rows.append(row)
            print(f"{tag} {name:<6} M={m:<6} N={nn_:<5} K={k:<5} " + "  ".join(
                f"{p} {row[p]['tflops']:7.1f} TF/s ({row[p]['rel_err']:.4f})" for p in paths) +
                f"  quant x {row['quantize_activation_ms']:.3f} ms", flush=True)

    print(f"\n{'workload':<4} {'gemm':<6} " + " ".join(f"{p:>16}" for p in ("fp16", "fp8", "w4a16", "deq+mm")))
    for r in rows:
        print(f"{r['workload']:<8} {r['gemm']:<6} " + " ".join(
            f"{r[p]['tflops']:8.1f} ({r[p]['ms']:.3f})" for p in ("fp16", "fp8", "w4a16", "deq+mm"))
            + f"  w4a16 config {r['w4a16_config']}")
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "commit": _commit(), "command": " ".join([sys.executable, *sys.argv])}
    import triton

    env["triton"] = triton.__version__
    with open(args.out, "w") as fh:
        json.dump({"environment": env, "rows": rows}, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
