"""The Triton FP8 attention kernel (experiments/attention_fp8.py, a lab experiment) in the lab: benchmark against
torch SDPA and the offline sm_90 codegen report.

    python experiments/bench_attention_fp8.py --bench [--out FILE]     # H200
    python experiments/bench_attention_fp8.py --codegen [--out FILE]   # no GPU needed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent  # experiments/: the kernel module lives beside this script


def _load() -> None:
    """The kernel module's names the code below uses, imported after the arguments are parsed (so --help is fast)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import attention_fp8 as kernel

    from fastremover.bench.metrics import cosine

    globals().update(cosine=cosine)
    globals().update({name: getattr(kernel, name) for name in ('AUTOTUNE_CONFIGS', 'AttnConfig', 'P_LOG2', 'SEQ_ALIGN', '_attn_fp8_kernel', '_check_rows', '_prepare', '_select_config', '_sync', '_time_ms', 'attention_fp8', 'attention_fp8_qkv', 'interpreting', 'quantize_qkv_fp8', 'torch', 'triton', 'tuning_report')})


# ----------------------------------------------------------------------------------------------------------------------
# Offline codegen report (no GPU needed): python experiments/bench_attention_fp8.py --codegen


def compile_sm90(cfg: AttnConfig, head_dim: int = 128, v_t: bool = True, out_dtype: str = "fp16",
                 seq: int = 32760, heads: int = 12):
    """Compile the attention kernel for sm_90 on this machine (Triton ships ptxas; no GPU needed), with the
    specialization a real launch on quantize_qkv_fp8's output (per-head scales) of shape [B, seq, heads, head_dim]
    gets: integer arguments equal to 1 become constants, those divisible by 16 are marked so, pointers
    are 16-byte aligned. Returns triton's CompiledKernel (asm["ptx"], asm["sass"], asm["ttgir"])."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = _attn_fp8_kernel
    names = list(kern.arg_names)
    S, H, D = seq, heads, head_dim  # (batch only enters the batch strides, which are multiples of 16 anyway)
    s_pad = -(-S // SEQ_ALIGN) * SEQ_ALIGN
    tma1 = cfg.tma == 1
    ints = dict(S=S, H=H, sqb=H * S * D, sqs=D, sqh=S * D, q_rb=H * S if tma1 else 0, q_rh=S if tma1 else 0, q_ch=0)
    ints.update(skb=H * S * D, sks=D, skh=S * D, k_rb=H * S if tma1 else 0, k_rh=S if tma1 else 0, k_ch=0)
    if v_t:
        ints.update(svb=H * D * s_pad, svs=1, svh=D * s_pad, svd=s_pad, v_rb=H * D if tma1 else 0,
                    v_rh=D if tma1 else 0, v_ch=0)
    else:  # a contiguous [B, S, H, D] v (heads-minor rows)
        ints.update(svb=S * H * D, svs=H * D, svh=D, svd=1, v_rb=S if tma1 else 0, v_rh=0, v_ch=D if tma1 else 0)
    ints.update(sob=S * H * D, sos=H * D, soh=D, qsb=H, qsh=1, ksb=H, ksh=1, vsb=H, vsh=1)
    sig, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in ("Q", "K", "V"):
            sig[n] = "*fp8e4nv"
        elif n == "O":
            sig[n] = f"*{out_dtype}"
        elif n in ("QS", "KS", "VS"):
            sig[n] = "*fp32"
        elif n == "qk_mult":
            sig[n] = "fp32"
        elif n in ints:
            val = ints[n]
            if val == 1:
                constexprs[n] = 1
            else:
                sig[n] = "i32"
                if val % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        if sig.get(n, "").startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    if tma1:
        sig["Q"] = f"tensordesc<fp8e4nv[{cfg.block_m}, {D}]>"
        sig["K"] = f"tensordesc<fp8e4nv[{cfg.block_n}, {D}]>"
        sig["V"] = f"tensordesc<fp8e4nv[{D}, {cfg.block_n}]>" if v_t else f"tensordesc<fp8e4nv[{cfg.block_n}, {D}]>"
        for n in ("Q", "K", "V"):
            attrs.pop((names.index(n),), None)
    constexprs.update(HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=cfg.tma, V_T=v_t,
                      WARP_SPEC=cfg.warp_spec, PV_ACC=cfg.pv_acc, P_SHIFT=P_LOG2, INTERPRET=False)
    for n in constexprs:
        sig[n] = "constexpr"
    src = ASTSource(fn=kern, signature={n: sig[n] for n in names}, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def codegen_summary(compiled) -> dict:
    """Counts in the SASS that tell how the kernel will run: tensor-core MMAs (QGMMA = fp8 wgmma, HGMMA = 16-bit,
    HMMA = pre-Hopper mma.sync), exp2 (MUFU.EX2), shared-memory traffic outside TMA (LDS/STS/LDSM/STSM: layout
    conversions), local-memory spills (LDL/STL), TMA loads (UTMALDG), and the register / shared-memory use."""
    import re

    from codegen_check import resource_usage

    try:
        sass = compiled.asm["sass"]
    except Exception as e:  # cuobjdump unavailable
        return {"error": f"no SASS: {e}"}
    count = lambda pat: len(re.findall(pat, sass))  # noqa: E731
    return {"resources": resource_usage(compiled), "shared": getattr(compiled.metadata, "shared", None),
            "QGMMA": count(r"\bQGMMA\b"), "HGMMA": count(r"\bHGMMA\b"),
            "HMMA": count(r"\bHMMA\b"), "MUFU.EX2": count(r"MUFU\.EX2"), "F2FP.E4M3": count(r"F2FP\.[A-Z.]*E4M3"),
            "LDS": count(r"\bLDS(\.\w+)*\b"), "STS": count(r"\bSTS(\.\w+)*\b"), "LDSM": count(r"\bLDSM\b"),
            "STSM": count(r"\bSTSM\b"), "UTMALDG": count(r"UTMALDG"), "LDGSTS": count(r"LDGSTS"),
            "LDL/STL": count(r"\b(LDL|STL)\b"), "SHFL": count(r"\bSHFL\b"), "PRMT": count(r"\bPRMT\b"),
            "instructions": sass.count("\n")}


def codegen_report(configs=None, head_dim: int = 128) -> list[dict]:
    rows = []
    for cfg in (configs or list(AUTOTUNE_CONFIGS) + [dataclasses.replace(AUTOTUNE_CONFIGS[0], pv_acc=0),
                                                     dataclasses.replace(AUTOTUNE_CONFIGS[0], tma=2)]):
        for v_t in ((True,) if cfg.warp_spec else (True, False)):  # WS + a D-contiguous fp8 V does not build
            row = {"config": cfg.name, "v_t": v_t}
            t0 = time.perf_counter()
            try:
                row.update(codegen_summary(compile_sm90(cfg, head_dim, v_t)))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# Benchmark (H200): python experiments/bench_attention_fp8.py --bench [--out FILE]


def bench(seq: int = 32760, heads: int = 12, head_dim: int = 128, batch: int = 1, seed: int = 0,
          budget_s: float = 55.0, device: str = "cuda") -> dict:
    """The H200 measurement (see main); device="cpu" under TRITON_INTERPRET=1 only smoke-tests the code path."""
    from fastremover.ops.attention.sdpa import sdpa

    t_start = time.perf_counter()
    dev = device
    B, S, H, D = batch, seq, heads, head_dim
    flops = 4.0 * B * H * S * S * D
    tf = lambda ms: flops / ms * 1e-9  # noqa: E731
    g = torch.Generator(device=dev).manual_seed(seed)
    qkv = torch.randn((B, S, 3, H, D), generator=g, device=dev, dtype=torch.float32).to(torch.float16)
    q, k, v = qkv.unbind(2)
    res: dict = {"shape": {"B": B, "S": S, "H": H, "D": D}, "flops": flops,
                 "device": torch.cuda.get_device_name() if dev == "cuda" else dev,
                 "torch": torch.__version__, "triton": triton.__version__}

    def log(msg):
        print(f"[bench {time.perf_counter() - t_start:5.1f}s] {msg}", flush=True)

    o_ref = sdpa(q, k, v)
    ms_sdpa = _time_ms(lambda: sdpa(q, k, v), reps=10)
    res["sdpa_fp16"] = {"ms": ms_sdpa, "tflops": tf(ms_sdpa)}
    log(f"torch SDPA fp16 (default backend): {ms_sdpa:.3f} ms  {tf(ms_sdpa):.0f} TFLOP/s")

    q8, k8, v8, sc = quantize_qkv_fp8(q, k, v)
    ms_q = _time_ms(lambda: quantize_qkv_fp8(q, k, v), reps=10)
    res["quantize"] = {"ms": ms_q}
    log(f"quantize_qkv_fp8 (smooth K, per-head scales): {ms_q:.3f} ms")

    p_ref = _prepare(q8, k8, v8, sc.q, sc.k, sc.v, None, torch.float16, True)
    chosen = _select_config(p_ref, None)  # tunes on first use (progress on stderr)
    res["tuning"] = tuning_report()
    log(f"chosen config {chosen.name}")
    o = attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v)
    _sync()
    ms_a = _time_ms(lambda: attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v), reps=10)
    ms_t = _time_ms(lambda: attention_fp8_qkv(q, k, v), reps=10)
    cos_head = cosine(o, o_ref)
    rel_emul, _ = _check_rows(p_ref, o, chosen.block_n)
    res["fp8"] = {"config": chosen.name, "ms": ms_a, "tflops": tf(ms_a), "ratio_vs_sdpa": ms_sdpa / ms_a,
                  "ms_with_quantize": ms_t, "tflops_with_quantize": tf(ms_t), "ratio_with_quantize": ms_sdpa / ms_t,
                  "cos_vs_sdpa": cos_head, "rel_l2_vs_emulation_sampled_rows": rel_emul}
    log(f"fp8 attention [{chosen.name}]: {ms_a:.3f} ms  {tf(ms_a):.0f} TFLOP/s  x{ms_sdpa / ms_a:.2f} vs SDPA; "
        f"with quantize {ms_t:.3f} ms  {tf(ms_t):.0f} TFLOP/s  x{ms_sdpa / ms_t:.2f};  cos {cos_head:.5f}; "
        f"rel. error vs emulation {rel_emul:.2e}")

    fid = {}
    for label, kw in (("tensor_scales", dict(granularity="tensor")), ("no_smoothing", dict(smooth_k=False))):
        fid[label] = cosine(attention_fp8_qkv(q, k, v, **kw), o_ref)
    kb = k + 4.0 * torch.randn((H, D), generator=g, device=dev, dtype=torch.float32).to(torch.float16)
    o_ref_b = sdpa(q, kb, v)
    fid["kbias4_smooth"] = cosine(attention_fp8_qkv(q, kb, v), o_ref_b)
    fid["kbias4_no_smoothing"] = cosine(attention_fp8_qkv(q, kb, v, smooth_k=False), o_ref_b)
    res["fidelity_cos_vs_sdpa"] = fid
    log(f"cos vs SDPA: {json.dumps({k_: round(v_, 5) for k_, v_ in fid.items()})}")

    # Does the transposed (sequence-contiguous) V pay? v8c: the same codes with stride 1 along D, transposed by
    # attention_fp8 in each call, or fed as is (Triton then transposes each fp8 tile through shared memory).
    variants = {}
    v8c = v8.contiguous()
    cfg = chosen or AUTOTUNE_CONFIGS[0]
    base = cfg if not cfg.warp_spec else AUTOTUNE_CONFIGS[0]  # accumulation variants on a non-specialized build
    plans = [("v_d_major_transposed_in_call", cfg,
              lambda: attention_fp8(q8, k8, v8c, sc.q, sc.k, sc.v, config=cfg)),
             ("v_d_major_no_transpose", base,  # (Triton 3.6 cannot build this with warp specialization)
              lambda: attention_fp8(q8, k8, v8c, sc.q, sc.k, sc.v, config=base, transpose_v=False))]
    alts = [dataclasses.replace(base, pv_acc=0), dataclasses.replace(base, pv_acc=2),
            dataclasses.replace(cfg, tma=2 if cfg.tma != 2 else 1)]
    for alt in alts:
        plans.append((f"config_{alt.name}", alt,
                      lambda alt=alt: attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v, config=alt)))
    for label, vcfg, fn in plans:
        if time.perf_counter() - t_start > budget_s:
            variants[label] = {"error": "skipped: time budget"}
            continue
        try:
            out_v = fn()
            _sync()
            ms_v = _time_ms(fn, reps=5)
            variants[label] = {"ms": ms_v, "tflops": tf(ms_v), "cos_vs_sdpa": cosine(out_v, o_ref),
                               "rel_l2_vs_emulation_sampled_rows": _check_rows(p_ref, out_v, vcfg.block_n)[0]}
        except Exception as e:
            variants[label] = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
        log(f"variant {label}: {variants[label]}")
    res["variants"] = variants
    res["elapsed_s"] = time.perf_counter() - t_start
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", action="store_true", help="benchmark vs torch SDPA (needs a CUDA GPU)")
    ap.add_argument("--seq", type=int, default=32760)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--codegen", action="store_true",
                    help="compile every config for sm_90 here (no GPU needed) and print SASS statistics")
    args = ap.parse_args(argv)
    _load()
    if args.codegen:
        if interpreting(_attn_fp8_kernel):
            print("unset TRITON_INTERPRET for --codegen", file=sys.stderr)
            return 2
        rows = codegen_report(head_dim=args.head_dim)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(rows, fh, indent=1)
        return 0
    if not args.bench:
        ap.print_help()
        return 0
    if not torch.cuda.is_available() or interpreting(_attn_fp8_kernel):
        print("--bench needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)", file=sys.stderr)
        return 2
    res = bench(args.seq, args.heads, args.head_dim, args.batch)
    f = res["fp8"]
    print(f"\nSUMMARY S={args.seq} H={args.heads} D={args.head_dim}: SDPA {res['sdpa_fp16']['tflops']:.0f} TFLOP/s | "
          f"fp8 {f['tflops']:.0f} TFLOP/s (x{f['ratio_vs_sdpa']:.2f}) | with quantize {f['tflops_with_quantize']:.0f} "
          f"(x{f['ratio_with_quantize']:.2f}) | cos {f['cos_vs_sdpa']:.5f} | target x1.40, cos >= 0.998 | "
          f"{res['elapsed_s']:.1f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
        print(f"wrote {args.out}")
    return 0


if __name__ != "__main__":  # imported (experiments, tests): everything at once
    _load()

if __name__ == "__main__":
    sys.exit(main())
