"""Where the fused NVFP4 H3 decode's GPU time goes (GPU): kernels grouped by name under torch.profiler, and a sweep
of the block GEMMs' launch configs at the shapes the decode runs.

    python tools/profile_h3.py [--tier 36L] [--height 720] [--width 1280] [--latent-frames 7] [--tiles-per-call 4]
                               [--cuda-graphs] [--eager] [--gemm-sweep] [--out FILE]

One process, random weights (h3_decoder.random_decoder, seed 0), one random latent clip, as tools/bench_h3.py. The
stack is frozen (only packed block weights resident). Reported: the token rows of every block-stack call, the wall
time of a warm decode, then one profiled decode: kernel time per group, the share of the wall time the kernels
cover, the 15 longest kernels. --eager profiles the eager NVFP4 path too. --gemm-sweep times every launch config of
kernels/nvfp4.UNIT_GEMM_CONFIGS (the unit GEMM the H3 blocks run) and GEMM_CONFIGS (the W4A16 GEMM) at the calls'
(M, N, K), plus both dequantization passes and cuBLAS bf16 on the same shape as a yardstick, and says whether each
output equals the W4A16 GEMM's at its config 0 bit for bit.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUPS = (  # kernel-name patterns -> group (first match wins)
    ("w4a16 GEMM (Triton)", r"_w4a16_kernel"),
    ("unit GEMM (Triton)", r"_unit_gemm(_tma)?_kernel"),
    ("dequantize to units (Triton)", r"_dequantize_kernel"),
    ("fused norm/epilogue/swiglu (Triton)", r"residual_norm|qkv_epilogue|swiglu|_h3_"),
    ("attention quantize (Triton)", r"_quantize_kernel"),
    ("attention (SDPA)", r"fmha|flash|attention|sdpa|cudnn"),
    ("dense GEMM / conv (cuBLAS, cuDNN)", r"gemm|cutlass|nvjet|xmma|conv|sm90"),
    ("copy / fill", r"copy|Memcpy|Memset|fill|cat"),
    ("elementwise / reduce", r"elementwise|vectorized|reduce|unrolled"),
)


def _group(name: str) -> str:
    for g, pat in GROUPS:
        if re.search(pat, name, re.I):
            return g
    return "other"


def _profile(fn, torch):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    per_name: dict = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name][0] += e.device_time_total / 1e3  # us -> ms (device_time_total: the kernel's own)
            per_name[e.name][1] += 1
    groups: dict = defaultdict(float)
    for name, (ms, _) in per_name.items():
        groups[_group(name)] += ms
    total = sum(groups.values())
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:15]
    return {"wall_s": wall, "kernel_ms": total, "kernel_share_of_wall": total / 1e3 / wall if wall else None,
            "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:120], "ms": round(ms, 3), "calls": c} for n, (ms, c) in top]}


def _timed(fn, torch, repeats=2):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_sweep(rows: list[int], cfg, torch) -> list[dict]:
    import triton

    from fastremover.fast import nvfp4 as ref
    from fastremover.fast.kernels import nvfp4 as K

    d, f = cfg.dim, cfg.ffn_dim
    shapes = {"qkv/o": (d, d), "ff1": (2 * f, d), "ff2": (d, f)}
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for m in sorted(set(rows)):
        for label, (n, k) in shapes.items():
            x = torch.randn(m, k, device="cuda", generator=g)
            w = torch.randn(n, k, device="cuda", generator=g) * 0.02
            xq, wq = K.quantize_nvfp4(x), K.quantize_nvfp4(w)
            alpha = ref.alpha_of(xq.global_scale) * ref.alpha_of(wq.global_scale)
            xu = K.unit_weight_nvfp4(xq, torch.bfloat16)
            flop = 2 * m * n * k
            row = {"M": m, "N": n, "K": k, "gemm": label,
                   "dequant_activation_ms": triton.testing.do_bench(
                       lambda: K.unit_weight_nvfp4(xq, torch.bfloat16)) }
            wu = K.unit_weight_nvfp4(wq, torch.bfloat16)
            ms = triton.testing.do_bench(lambda: xu @ wu.t())
            row["cublas_bf16"] = {"ms": ms, "tflops": flop / ms / 1e9}
            base = K.w4a16_gemm(xu, wq, alpha=alpha, config=K.GEMM_CONFIGS[0])
            row["dequant_weight_ms"] = triton.testing.do_bench(lambda: K.unit_weight_nvfp4(wq, torch.bfloat16))
            row["unit_gemm_default"] = list(K.unit_gemm_config(m, n, k))
            row["unit_gemm"] = []
            for c in K.UNIT_GEMM_CONFIGS:
                try:
                    y = K.unit_gemm(xu, wu, alpha, config=c)
                    ms = triton.testing.do_bench(lambda: K.unit_gemm(xu, wu, alpha, config=c))
                    row["unit_gemm"].append({"config": list(c), "ms": ms, "tflops": flop / ms / 1e9,
                                             "equal_to_w4a16_config0": bool(torch.equal(y, base))})
                except Exception as e:
                    row["unit_gemm"].append({"config": list(c), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            row["configs"] = []
            for c in K.GEMM_CONFIGS:
                try:
                    y = K.w4a16_gemm(xu, wq, alpha=alpha, config=c)
                    ms = triton.testing.do_bench(lambda: K.w4a16_gemm(xu, wq, alpha=alpha, config=c))
                    row["configs"].append({"config": list(c), "ms": ms, "tflops": flop / ms / 1e9,
                                           "equal_to_config0": bool(torch.equal(y, base))})
                except Exception as e:  # a config that does not compile at this shape: say so, go on
                    row["configs"].append({"config": list(c), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="full")
    p.add_argument("--tier", default="36L")
    p.add_argument("--latent-frames", type=int, default=7)
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--tiles-per-call", type=int, default=4)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--eager", action="store_true", help="profile the eager NVFP4 path too")
    p.add_argument("--gemm-sweep", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from fastremover.fast import h3_nvfp4 as H
    from fastremover.models import h3_decoder as h3

    if not torch.cuda.is_available():
        print("profile_h3 needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = h3.preset(args.preset)
    model = h3.random_decoder(cfg, seed=0, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    z = torch.randn(1, cfg.latent_channels, args.latent_frames, args.height // cfg.patch_size,
                    args.width // cfg.patch_size, device="cuda", generator=gen)
    kw = dict(tier=args.tier, tiles_per_call=args.tiles_per_call)
    from fastremover.bench.harness import script_environment

    res: dict = {**script_environment(), "config": vars(args)}
    with torch.no_grad():
        window = z[:, :, :cfg.chunk_tokens + cfg.overlap_tokens]
        stack = H.build_nvfp4_stack(model, window, tier=args.tier, fused=True, cuda_graphs=args.cuda_graphs,
                                    freeze=True)
        rows: list[int] = []

        def logged(h3_, rope):
            rows.append(h3_.shape[0] * h3_.shape[1])
            return stack(h3_, rope)

        model.decode(z, blocks=logged, **kw)  # warm-up: compiles, captures; logs the calls' token rows
        res["stack_calls"] = len(rows)
        res["rows_per_call"] = sorted(set(rows))
        res["rows_total"] = sum(rows)
        res["fused"] = {"decode_s": _timed(lambda: model.decode(z, blocks=stack, **kw), torch)}
        res["fused"]["profile"] = _profile(lambda: model.decode(z, blocks=stack, **kw), torch)
        if args.eager:
            stack.fused = False
            model.decode(z, blocks=stack, **kw)
            res["eager"] = {"decode_s": _timed(lambda: model.decode(z, blocks=stack, **kw), torch, 1)}
            res["eager"]["profile"] = _profile(lambda: model.decode(z, blocks=stack, **kw), torch)
            stack.fused = True
        d, f, m = cfg.dim, cfg.ffn_dim, res["rows_total"]
        res["block_gemm_tflop"] = 2 * m * d * (4 * d + 2 * f + f) * len(stack.indices) / 1e12
    if args.gemm_sweep:
        res["gemm_sweep"] = _gemm_sweep(res["rows_per_call"], cfg, torch)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    # the short table, last
    print(f"\nH3 {args.tier} {args.width}x{args.height} t{args.tiles_per_call}: fused {res['fused']['decode_s']:.3f} s"
          + (f", eager {res['eager']['decode_s']:.3f} s" if args.eager else "")
          + f"; block GEMMs {res['block_gemm_tflop']:.1f} TFLOP over {res['stack_calls']} calls")
    for name in ("fused", "eager"):
        if name in res:
            for grp, ms in res[name]["profile"]["groups_ms"].items():
                print(f"  {name:6s} {grp:40s} {ms:9.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
