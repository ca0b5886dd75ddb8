"""The FP8 causal conv3d kernel (fastremover/fast/kernels/conv3d_fp8.py) in the lab: GPU benchmark against cuDNN fp16
and the offline sm_90 codegen check.

    python tools/bench_conv3d_fp8.py --bench [--out results.json] [--no-variants] [--sweep] [--shapes 0,1,4]
    python tools/bench_conv3d_fp8.py --codegen [--quick]      # no GPU needed (Triton's bundled ptxas)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings


def _load() -> None:
    """The kernel module's names the code below uses, imported after the arguments are parsed (so --help is fast)."""
    import fastremover.fast.kernels.conv3d_fp8 as kernel

    from fastremover.bench.metrics import cosine
    from dataclasses import asdict

    globals().update(cosine=cosine, asdict=asdict)
    globals().update({name: getattr(kernel, name) for name in ('F', 'TAPS', 'TmaConfig', '_conv3d_fp8_kernel', '_conv3d_fp8_tma_kernel', '_conv_tma', '_use_tma', 'activation_scale', 'block_k_for', 'candidate_configs', 'causal_conv3d_fp8', 'causal_conv3d_fp8_reference', 'default_config', 'interpreting', 'launch_options', 'quantize_activation', 'quantize_conv_weight', 'quantize_stream', 'tma_candidate_configs', 'torch', 'triton', 'tuned_config')})


# ----------------------------------------------------------------------------------------------------------------------
# Benchmark (GPU): python tools/bench_conv3d_fp8.py --bench [--out results.json]

# (Cin, Cout, T, H, W): the 3x3x3 convs of the Wan VAE at W2's 480x832, 4- and 1-frame chunks
# (in this order: if the time budget runs out, the 1-frame shapes are the ones skipped)
BENCH_SHAPES = [
    (96, 96, 4, 480, 832), (192, 192, 4, 240, 416), (384, 384, 4, 120, 208), (384, 384, 4, 60, 104),
    (96, 96, 1, 480, 832), (192, 192, 1, 240, 416), (384, 384, 1, 120, 208), (384, 384, 1, 60, 104),
]


def bench(shapes=None, dtype: "torch.dtype | None" = None, out_path: str | None = None, budget_s: float = 40.0,
          variants: bool = True, device: str = "cuda", sweep: bool = False, kernel: str = "auto") -> list[dict]:
    """Time FP8 conv (activation scale + [quantize pass] + GEMM) vs cuDNN fp16 F.conv3d (channels_last_3d, on the
    already concatenated stream) per shape; print and return rows (and write JSON to out_path).
    variants=True also times quantize="fused" and precise_acc=False with the tuned config of the default (no extra
    tuning) and reports their error against the reference. The default kernel ("auto": TMA on sm_90+) is timed
    against the pointer kernel. sweep=True also times the TMA GEMM with every candidate config (and other stage
    counts for the first three). kernel: the causal_conv3d_fp8 kernel to time as "fp8" ("auto" / "tma" / "pointer").
    Stops adding shapes past budget_s seconds.
    device="cpu" (tiny shapes, TRITON_INTERPRET=1) only exercises the code path (the tests do); its times mean
    nothing."""
    dtype = dtype or torch.float16
    import triton.testing

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("conv3d_fp8 bench needs a CUDA GPU")

    def timed(fn) -> float:
        if dev.type == "cuda":
            return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    t_start = time.time()
    shapes = shapes or BENCH_SHAPES
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    print(f"{dev_name}  dtype={dtype}  triton {triton.__version__}  torch {torch.__version__}")
    print("cudnn = F.conv3d fp16 channels_last_3d on the concatenated stream (default heuristics / benchmark=True);"
          " fp8 = activation scale + quantize pass + GEMM; gemm = GEMM alone; ratio = cudnn(benchmark) / fp8")
    print(f"{'Cin->Cout':>10s} {'T':>2s} {'HxW':>8s} {'cudnn ms':>9s} {'cudnnB ms':>9s} {'fp8 ms':>8s} {'ratio':>6s} "
          f"{'cudnnB TF/s':>10s} {'fp8 TF/s':>9s} {'gemm ms':>8s} {'cos':>9s} {'err/S':>8s} config")
    for cin, cout, t, h, w in shapes:
        if time.time() - t_start > budget_s:
            print(f"(budget of {budget_s:.0f} s reached: skipping the remaining shapes)")
            break
        with torch.no_grad():
            x = (torch.randn(1, cin, t, h, w, device=dev, generator=g)).to(dtype).contiguous(
                memory_format=torch.channels_last_3d)
            prev = (torch.randn(1, cin, 2, h, w, device=dev, generator=g)).to(dtype).contiguous(
                memory_format=torch.channels_last_3d)
            weight = torch.randn(cout, cin, 3, 3, 3, device=dev, generator=g) * (1.0 / math.sqrt(27 * cin))
            bias = torch.randn(cout, device=dev, generator=g) * 0.1
            w_q, w_s = quantize_conv_weight(weight)
            stream = torch.cat([prev, x], dim=2).contiguous(memory_format=torch.channels_last_3d)
            wh, bh = weight.to(dtype).contiguous(memory_format=torch.channels_last_3d), bias.to(dtype)
            flops = 2.0 * t * h * w * cout * TAPS * cin

            def cudnn():
                return F.conv3d(stream, wh, bh, padding=(0, 1, 1))

            def fp8(**kw):
                return causal_conv3d_fp8(prev, x, w_q, w_s, bias, **{"kernel": kernel, **kw})

            y16 = cudnn()
            y8 = fp8()  # autotunes (first call for this key): the default kernel ("auto")
            m = t * h * w
            promote = block_k_for(cin)
            kname = "tma" if _use_tma(kernel, "pass", cin, cout, x.device, y8) else "pointer"
            cfg = tuned_config(kname, cin, cout, m, w, promote, True, x.device) or (
                tma_candidate_configs(cin, cout, h, w, m)[0] if kname == "tma" else default_config(cin, cout, m))
            t16 = timed(cudnn)
            prev_bm = torch.backends.cudnn.benchmark
            try:
                torch.backends.cudnn.benchmark = True
                cudnn()  # cuDNN's own algorithm search
                t16b = timed(cudnn)
            finally:
                torch.backends.cudnn.benchmark = prev_bm
            t8 = timed(lambda: fp8(config=cfg))
            sa = activation_scale(prev, x)
            if kname == "tma":
                s8 = quantize_stream(prev, x, sa)
                y_g = torch.empty_like(y8)
                t_gemm = timed(lambda: _conv_tma(s8, prev.shape[2], w_q, w_s, bias, sa, y_g, promote, cfg))
                yp = fp8(kernel="pointer")  # the pointer kernel for comparison (tunes)
                cfg_p = tuned_config("pointer", cin, cout, m, w, promote, True, x.device) or default_config(
                    cin, cout, m)
                tp = timed(lambda: fp8(kernel="pointer", config=cfg_p))
            else:
                pq, xq = quantize_activation(prev, x, sa)
                t_gemm = timed(lambda: causal_conv3d_fp8(pq, xq, w_q, w_s, bias, sa, out_dtype=dtype, config=cfg))
                yp, cfg_p, tp = y8, cfg, t8
            # error vs the reference on output frame 0 (it reads both cached frames; the fp64 reference of all frames
            # would cost seconds per shape), with the scale of the whole chunk
            y_ref, s_abs = causal_conv3d_fp8_reference(prev, x[:, :, :1], w_q, w_s, bias, sa, return_abs_sum=True)
            s_abs += bias.abs().view(1, -1, 1, 1, 1)

            def err_over_s(y):
                return float(((y[:, :, :1].float() - y_ref.float()).abs() / s_abs).max())

            err = err_over_s(y8)
            row = {"cin": cin, "cout": cout, "t": t, "h": h, "w": w, "kernel": kname, "cudnn_fp16_ms": t16,
                   "cudnn_fp16_benchmark_ms": t16b, "fp8_ms": t8, "fp8_gemm_only_ms": t_gemm,
                   "ratio_cudnn_over_fp8": t16 / t8, "ratio_cudnn_benchmark_over_fp8": t16b / t8,
                   "cudnn_tflops": flops / t16 / 1e9, "cudnn_benchmark_tflops": flops / t16b / 1e9,
                   "fp8_tflops": flops / t8 / 1e9, "cos_vs_fp16": cosine(y8, y16), "max_err_over_S_frame0": err,
                   "config": asdict(cfg), "pointer_ms": tp, "pointer_tflops": flops / tp / 1e9,
                   "pointer_config": asdict(cfg_p), "pointer_max_err_over_S_frame0": err_over_s(yp),
                   "variants": {}, "sweep": []}
            if sweep and kname == "tma":
                tried = tma_candidate_configs(cin, cout, h, w, m, limit=None)
                tried += [TmaConfig(c.bh, c.bw, c.block_n0, c.block_n1, c.num_warps, st) for c in tried[:3]
                          for st in (3, 4, 8) if st != c.num_stages]
                for c in tried:
                    try:
                        _conv_tma(s8, prev.shape[2], w_q, w_s, bias, sa, y_g, promote, c)
                        tc = timed(lambda: _conv_tma(s8, prev.shape[2], w_q, w_s, bias, sa, y_g, promote, c))
                        row["sweep"].append({"config": asdict(c), "gemm_ms": tc, "tflops": flops / tc / 1e9})
                    except Exception as e:  # e.g. out of shared memory: report, keep sweeping
                        row["sweep"].append({"config": asdict(c), "error": f"{type(e).__name__}: {e}"[:300]})
            if variants and time.time() - t_start < budget_s:
                for name, kw in (("fused", {"quantize": "fused", "config": cfg_p, "kernel": "pointer"}),
                                 ("imprecise_acc", {"precise_acc": False, "config": cfg})):
                    try:
                        yv = fp8(**kw)
                        tv = timed(lambda: fp8(**kw))
                        row["variants"][name] = {"ms": tv, "tflops": flops / tv / 1e9,
                                                 "max_err_over_S_frame0": err_over_s(yv),
                                                 "cos_vs_fp16": cosine(yv, y16)}
                        yv = None
                    except Exception as e:  # report, keep benchmarking
                        row["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            y_ref = s_abs = None  # free the big tensors before the next shape
            rows.append(row)
            print(f"{cin:>4d}->{cout:<4d} {t:>2d} {h:>3d}x{w:<4d} {t16:9.3f} {t16b:9.3f} {t8:8.3f} {t16b / t8:6.2f} "
                  f"{flops / t16b / 1e9:10.0f} {flops / t8 / 1e9:9.0f} {t_gemm:8.3f} {row['cos_vs_fp16']:9.6f} "
                  f"{err:8.1e} {cfg}")
            print(f"{'':>14s} kernel {kname}; pointer kernel {tp:8.3f} ms {flops / tp / 1e9:6.0f} TF/s  err/S "
                  f"{row['pointer_max_err_over_S_frame0']:.1e}  {cfg_p}")
            for v in sorted(row["sweep"], key=lambda v: v.get("gemm_ms", 1e9)):
                print(f"{'':>14s} sweep {v['config']}: " + (f"{v['gemm_ms']:8.3f} ms {v['tflops']:6.0f} TF/s"
                                                           if "gemm_ms" in v else v["error"]))
            for name, v in row["variants"].items():
                if "error" in v:
                    print(f"{'':>14s} {name}: {v['error']}")
                else:
                    print(f"{'':>14s} {name:14s} {v['ms']:8.3f} ms {v['tflops']:6.0f} TF/s  err/S "
                          f"{v['max_err_over_S_frame0']:.1e}  cos {v['cos_vs_fp16']:.6f}")
            x = prev = stream = y16 = y8 = yp = s8 = y_g = pq = xq = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    elapsed = time.time() - t_start
    print(f"elapsed {elapsed:.1f} s (including compiles and autotuning)")
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": dev_name, "dtype": str(dtype), "triton": triton.__version__,
                       "torch": torch.__version__, "elapsed_s": elapsed, "rows": rows}, f, indent=1)
    return rows


def codegen_check(quick: bool = False, verbose: bool = True) -> list[str]:
    """Compile the GEMM kernel for sm_90 offline (no GPU: Triton ships ptxas) for the real channel counts and check
    the SASS: fp8 tensor-core MMA (QGMMA) present, no register spills (STL/LDL, stack), and with precise_acc the
    promotion adds (FADD) present. quick=True: the default config for Cin = Cout = 96 (two-block N, BLOCK_K 32) and
    384 (BLOCK_K 128), quantize="pass", precise; else every candidate config of 96 / 192 / 384, both quantize modes.
    Must run with TRITON_INTERPRET unset. Returns the problems."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = _conv3d_fp8_kernel
    names = list(k.arg_names)
    problems = []
    classes = ((96, 96, 4 * 480 * 832), (192, 192, 4 * 240 * 416), (384, 384, 4 * 120 * 208))
    for cin, cout, m in (classes[0], classes[2]) if quick else classes:
        bk = block_k_for(cin)
        for xt in (("fp8e4nv",) if quick else ("fp8e4nv", "fp16")):
            cfgs = candidate_configs(cin, cout, m, xt == "fp8e4nv")
            for cfg in cfgs[:1] if quick else cfgs:
                sig = {"X": f"*{xt}", "P_OFF": "i64", "WQ": "*fp8e4nv", "WS": "*fp32", "BIAS": "*fp32", "SA": "*fp32",
                       "Y": "*fp16", "M": "i32", "T": "i32", "H": "i32", "W": "i32", "NP": "i32", "CIN": "i32",
                       "COUT": "i32", "KTOT": "i32"}
                consts = dict(BLOCK_M=cfg.block_m, BLOCK_N0=cfg.block_n0, BLOCK_N1=cfg.block_n1, BLOCK_K=bk,
                              IN_FP8=xt == "fp8e4nv", HAS_BIAS=True, PROMOTE=bk, INTERPRET=False)
                sig.update({c: "constexpr" for c in consts})
                # what a launch specializes: 16-byte aligned pointers, channel counts divisible by 16
                div16 = [n for n in names if sig[n].startswith("*")] + ["P_OFF", "CIN", "COUT", "KTOT"]
                attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
                src = ASTSource(fn=k, signature={n: sig[n] for n in names}, constexprs=consts, attrs=attrs)
                opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **launch_options(k)}
                c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
                sass = c.asm["sass"]
                n_q = len(re.findall(r"\bQGMMA\b", sass))
                n_spill = len(re.findall(r"\b(?:STL|LDL)\b", sass))
                n_fadd = len(re.findall(r"\bFADD\b", sass))
                n_scalar = len(re.findall(r"\bLDG\.E\.(?:U8|U16)\b", sass))  # unvectorized A-tile loads
                n_async = len(re.findall(r"\bLDGSTS\.E\.BYPASS\.128\b", sass))
                name = f"Cin={cin} Cout={cout} {xt} {cfg}"
                if n_q == 0:
                    problems.append(f"{name}: no QGMMA (fp8 wgmma) in the SASS")
                if n_spill:
                    problems.append(f"{name}: {n_spill} spill instructions (STL/LDL)")
                if n_scalar or not n_async:
                    problems.append(f"{name}: the A tile is not a 16-byte cp.async load ({n_scalar} scalar loads)")
                if n_fadd < cfg.block_m * (cfg.block_n0 + cfg.block_n1) // (32 * cfg.num_warps):
                    problems.append(f"{name}: too few FADD for the fp32 promotion of the partial sums")
                if verbose:
                    print(f"{name}: QGMMA {n_q}, STL/LDL {n_spill}, FADD {n_fadd}, LDGSTS.128 {n_async}, "
                          f"scalar LDG {n_scalar}, shared {c.metadata.shared} B", flush=True)
    problems += _codegen_check_tma(classes, quick, verbose)
    return problems


def _codegen_check_tma(classes, quick: bool, verbose: bool) -> list[str]:
    """The TMA kernel's offline sm_90 compile, precise and imprecise accumulation: TMA loads (UTMALDG) and stores
    (UTMASTG), QGMMA, no spills, and with promotion the fp32 adds (FADD) present. Printed, not asserted: LDSM (the A
    box reaches wgmma through ldmatrix as its register operand; B goes straight from shared memory) and generic
    LDS/STS (some configs' epilogues convert the accumulator's layout for the TMA store through shared memory)."""
    import re

    from codegen_check import _compile

    problems = []
    for (cin, cout, m), (h, w) in zip(classes, ((480, 832), (240, 416), (120, 208))):
        if quick and cin == 192:
            continue
        bk = block_k_for(cin)
        for promote, cfg in [(p, cf) for p in (bk, 0)
                             for cf in tma_candidate_configs(cin, cout, h, w, m, promote=p > 0)[:1 if quick else None]]:
            n1 = cfg.block_n1 or cfg.block_n0
            sig = {"XD": f"tensordesc<fp8e4nv[1, 1, {cfg.bh}, {cfg.bw}, {bk}]>",
                   "WD0": f"tensordesc<fp8e4nv[{cfg.block_n0}, {bk}]>", "WD1": f"tensordesc<fp8e4nv[{n1}, {bk}]>",
                   "WS": "*fp32", "BIAS": "*fp32", "SA": "*fp32",
                   "YD0": f"tensordesc<fp16[1, 1, {cfg.bh}, {cfg.bw}, {cfg.block_n0}]>",
                   "YD1": f"tensordesc<fp16[1, 1, {cfg.bh}, {cfg.bw}, {n1}]>",
                   "RD0": f"tensordesc<fp16[1, 1, {cfg.bh}, {cfg.bw}, {cfg.block_n0}]>",
                   "RD1": f"tensordesc<fp16[1, 1, {cfg.bh}, {cfg.bw}, {n1}]>",
                   "T": "i32", "H": "i32", "W": "i32", "NP": "i32", "CIN": "i32", "COUT": "i32"}
            consts = dict(BH=cfg.bh, BW=cfg.bw, BLOCK_K=bk, BLOCK_N0=cfg.block_n0, BLOCK_N1=cfg.block_n1,
                          HAS_BIAS=True, PROMOTE=promote, OUT_BF16=False, HAS_RES=(cin == 96), INTERPRET=False)
            c = _compile(_conv3d_fp8_tma_kernel, sig, consts, cfg.num_warps, cfg.num_stages, divisible=("CIN", "COUT"))
            sass = c.asm["sass"]
            counts = {op: len(re.findall(rf"\b{op}\b", sass))
                      for op in ("QGMMA", "UTMALDG", "UTMASTG", "LDS", "STS", "LDSM", "FADD")}
            n_spill = len(re.findall(r"\b(?:STL|LDL)\b", sass))
            name = f"TMA Cin={cin} Cout={cout} promote={promote} {cfg}"
            if not counts["QGMMA"] or not counts["UTMALDG"] or not counts["UTMASTG"]:
                problems.append(f"{name}: missing fp8 wgmma or TMA load/store: {counts}")
            if n_spill:
                problems.append(f"{name}: {n_spill} spill instructions (STL/LDL)")
            per_thread = cfg.bh * cfg.bw * (cfg.block_n0 + cfg.block_n1) // (32 * cfg.num_warps)
            if promote and counts["FADD"] < 2 * per_thread:  # the bias add and the per-chunk fp32 promotion
                problems.append(f"{name}: {counts['FADD']} FADD, fewer than the promotion needs ({2 * per_thread})")
            if verbose:
                print(f"{name}: {counts}, STL/LDL {n_spill}, shared {c.metadata.shared} B", flush=True)
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="FP8 causal conv3d kernel: GPU benchmark vs cuDNN fp16")
    ap.add_argument("--bench", action="store_true", help="run the benchmark (needs a CUDA GPU)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--budget", type=float, default=40.0, help="stop starting new shapes after this many seconds")
    ap.add_argument("--no-variants", action="store_true", help="skip the fused / imprecise-acc variants")
    ap.add_argument("--sweep", action="store_true", help="time every TMA candidate config")
    ap.add_argument("--shapes", default=None,
                    help="'all' (default: BENCH_SHAPES) or comma-separated indices into BENCH_SHAPES, e.g. 0,1,4")
    ap.add_argument("--codegen", action="store_true", help="offline sm_90 compile + SASS check (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="with --codegen: default configs only")
    a = ap.parse_args(argv)
    _load()
    if a.codegen:
        if interpreting(_conv3d_fp8_kernel):
            print("unset TRITON_INTERPRET for --codegen", file=sys.stderr)
            return 2
        from codegen_check import report

        return report(codegen_check(quick=a.quick))
    if not a.bench:
        ap.print_help()
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shapes = None if a.shapes in (None, "all") else [BENCH_SHAPES[int(i)] for i in a.shapes.split(",")]
        bench(shapes=shapes, dtype=torch.float16 if a.dtype == "fp16" else torch.bfloat16, out_path=a.out,
              budget_s=a.budget, variants=not a.no_variants, sweep=a.sweep)
    return 0


if __name__ != "__main__":  # imported (experiments, tests): everything at once
    _load()

if __name__ == "__main__":
    sys.exit(main())
