"""Attention backends side by side on the GPU: python tools/bench_attention.py --bench [--layouts] [--v-bias B] [--out F]

fp16 SDPA against every registered backend (fastremover.ops.attention) at the DiT's shapes (12 heads x 128, S = 32760
and 7290): time, TFLOP/s and cosine against SDPA; the 8-bit backends with and without K/V centring, and their kernels
alone on our codes. `--layouts` surveys q/k/v/o memory layouts for SDPA and cuDNN's FP8 kernel.
"""

from __future__ import annotations

import argparse
import json
import math





def _load() -> None:
    """The heavy imports (torch, the package), after the arguments are parsed: --help stays fast."""
    global torch, _cos, registry, quantize_qkv, sdpa, _time_ms
    import torch
    import torch.nn.attention
    from fastremover.bench.metrics import cosine as _cos
    from fastremover.ops import attention as registry
    from fastremover.ops.attention.quantize import quantize_qkv
    from fastremover.ops.attention.sdpa import sdpa
    from fastremover.timing import cuda_time_ms as _time_ms
    global unavailable_reason
    unavailable_reason = registry.unavailable_reason


# ----------------------------------------------------------------------------------------------------------------------
# cuDNN plan surveys (every plan cuDNN can build for a shape, timed; the engine runs the heuristics' choice)


def _survey(graph, run_plan, time_ms, check=None) -> list[dict]:
    """Time run_plan(i) for every plan the graph built; check() adds fields measured after each plan's runs."""
    rows = []
    for i in range(graph.plans):
        name = graph.graph.get_plan_name_at_index(i)
        try:
            ms = time_ms(lambda: run_plan(i))
            rows.append({"plan": i, "name": name, "ms": ms, **(check() if check else {})})
        except Exception as exc:
            rows.append({"plan": i, "name": name, "error": repr(exc)[:200]})
    return rows


def survey_plans(q, k, v, dq, dk, dv, time_ms) -> list[dict]:
    """Every FP8 plan cuDNN can build for these inputs, timed with `time_ms(fn)`."""
    from fastremover.ops.attention.cudnn_fp8 import _bhsd, _Fp8Graph

    out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    graph = _Fp8Graph(q, k, v, _bhsd(out), out.dtype, 1.0 / math.sqrt(q.shape[-1]), q.device, all_plans=True)
    scale_o = torch.reciprocal(dv)
    return _survey(graph, lambda i: graph.run(q, k, v, dq, dk, dv, out, scale_o, plan=i), time_ms)


def survey_plans_half(q, k, v, time_ms) -> list[dict]:
    """Every fp16/bf16 SDPA plan cuDNN can build for these inputs, timed, with each one's output compared to the
    heuristics' choice."""
    from fastremover.ops.attention.cudnn_fp8 import _HalfGraph, sdpa_half

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ref = sdpa_half(q, k, v)
    graph = _HalfGraph(q, k, v, out, 1.0 / math.sqrt(q.shape[-1]), q.device, all_plans=True)
    return _survey(graph, lambda i: graph.run(q, k, v, out, plan=i), time_ms,
                   check=lambda: {"equal_to_default": bool(torch.equal(out, ref))})


def bench(seq_lens=(32760, 7290), heads: int = 12, head_dim: int = 128, k_bias: float = 1.0,
          v_bias: float = 0.0) -> list[dict]:
    """fp16 SDPA vs the 8-bit backends at the DiT's shapes; q, k ~ N(0, 1) with a shared per-channel offset on K of
    size k_bias (trained DiTs have one; it is what smoothing removes), v ~ N(0, 1) plus a shared per-channel offset
    of size v_bias (a long same-sign P @ V sum: what exposes a reduced-precision accumulator)."""
    from fastremover.ops.attention.cudnn_fp8 import sdpa_fp8

    rows = []
    dev = torch.device("cuda")
    for s in seq_lens:
        g = torch.Generator(device=dev).manual_seed(s)
        qkv = torch.randn(1, s, 3, heads, head_dim, device=dev, generator=g, dtype=torch.float16)
        qkv[:, :, 1] += (k_bias * torch.randn(heads, head_dim, device=dev, generator=g)).half()
        qkv[:, :, 2] += (v_bias * torch.randn(heads, head_dim, device=dev, generator=g)).half()
        q, k, v = qkv.unbind(2)  # strided views, as the fused QKV projection produces them
        flop = 4.0 * s * s * heads * head_dim
        ref = sdpa(q, k, v)
        base_ms = _time_ms(lambda: sdpa(q, k, v))
        rows.append({"seq": s, "backend": "sdpa-fp16", "ms": base_ms, "tflops": flop / base_ms / 1e9, "cos": 1.0,
                     "speedup": 1.0})
        try:  # cuDNN's fp16 SDPA through the frontend (own heuristics) and torch's flash backend, for reference
            from fastremover.ops.attention.cudnn_fp8 import sdpa_half

            out = sdpa_half(q, k, v)
            ms = _time_ms(lambda: sdpa_half(q, k, v))
            rows.append({"seq": s, "backend": "cudnn-frontend-fp16", "ms": ms, "tflops": flop / ms / 1e9,
                         "cos": _cos(out, ref), "speedup": base_ms / ms})
        except Exception as exc:
            rows.append({"seq": s, "backend": "cudnn-frontend-fp16", "error": repr(exc)[:300]})
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            ms = _time_ms(lambda: sdpa(q, k, v))
        rows.append({"seq": s, "backend": "sdpa-fp16 (flash)", "ms": ms, "tflops": flop / ms / 1e9,
                     "speedup": base_ms / ms})
        for backend in (registry.get(n) for n in registry.names()):
            if backend.precision != "16bit" or backend.name == "sdpa":
                continue
            if unavailable_reason(backend.name, dev) is None:
                try:
                    out = backend.call(q, k, v)
                    ms = _time_ms(lambda: backend.call(q, k, v))
                    rows.append({"seq": s, "backend": backend.name, "ms": ms, "tflops": flop / ms / 1e9,
                                 "cos": _cos(out, ref), "speedup": base_ms / ms})
                except Exception as exc:
                    rows.append({"seq": s, "backend": backend.name, "error": repr(exc)[:300]})
        for backend in (registry.get(n) for n in registry.names()):
            if backend.precision != "8bit":
                continue
            name = backend.name
            why = unavailable_reason(name, dev)
            if why:
                rows.append({"seq": s, "backend": name, "error": why})
                continue
            centred_default = backend.takes_codes  # the backends the fast transformer feeds centre V
            for smooth, smooth_v in ((True, centred_default), (True, not centred_default), (False, False)):
                fn = backend.call
                label = name + (" smooth_v" if smooth_v else " no smooth_v")
                try:
                    out = fn(q, k, v, smooth_k=smooth, smooth_v=smooth_v)
                    ms = _time_ms(lambda: fn(q, k, v, smooth_k=smooth, smooth_v=smooth_v))
                except Exception as exc:  # report, keep benchmarking the rest
                    rows.append({"seq": s, "backend": label, "smooth_k": smooth, "error": repr(exc)[:300]})
                    continue
                rows.append({"seq": s, "backend": label, "smooth_k": smooth, "smooth_v": smooth_v, "ms": ms,
                             "tflops": flop / ms / 1e9, "cos": _cos(out, ref), "speedup": base_ms / ms})
            if backend.output == "fp8-codes":  # the kernel alone (quantization excluded), fp8 output codes
                q8, k8, v8, sq, sk, sv = quantize_qkv(q, k, v)
                inv = torch.reciprocal(sv)
                o8 = sdpa_fp8(q8, k8, v8, sq, sk, sv, scale_o=inv)
                ms = _time_ms(lambda: sdpa_fp8(q8, k8, v8, sq, sk, sv, scale_o=inv))
                rows.append({"seq": s, "backend": "fp8 kernel only (fp8 out)", "ms": ms, "tflops": flop / ms / 1e9,
                             "cos": _cos(o8.float() * sv, ref), "speedup": base_ms / ms})
                try:
                    for plan in survey_plans(q8, k8, v8, sq, sk, sv, _time_ms):
                        if "ms" in plan:
                            plan["tflops"] = flop / plan["ms"] / 1e9
                        rows.append({"seq": s, "backend": f"fp8 plan {plan['plan']}: {plan['name'][:60]}", **plan})
                except Exception as exc:
                    rows.append({"seq": s, "backend": "fp8 plan survey", "error": repr(exc)[:300]})
                ms = _time_ms(lambda: quantize_qkv(q, k, v))
                rows.append({"seq": s, "backend": "quantize q/k/v only", "ms": ms})
            elif backend.takes_codes:  # the kernel alone (16-bit output), our codes in
                rows += _kernel_only_rows(backend, s, q, k, v, ref, flop, base_ms,
                                          contiguous=backend.row_split_block_m is None)
    return rows


def _kernel_only_rows(backend, s: int, q, k, v, ref, flop: float, base_ms: float, contiguous: bool) -> list[dict]:
    """Bench rows of an FP8 library kernel alone on our q/k/v codes (quantization excluded); with `contiguous`, also
    on contiguous copies of the codes (the strided views are what the engine passes)."""
    codes_fn = backend.codes_call
    label = f"{backend.name} kernel only"
    q8, k8, v8, sq, sk, sv = quantize_qkv(q, k, v)
    rows = []
    try:
        o = codes_fn(q8, k8, v8, sq, sk, sv)
        ms = _time_ms(lambda: codes_fn(q8, k8, v8, sq, sk, sv))
        rows.append({"seq": s, "backend": label, "ms": ms, "tflops": flop / ms / 1e9, "cos": _cos(o, ref),
                     "speedup": base_ms / ms})
        if contiguous:
            qc, kc, vc = (t.contiguous() for t in (q8, k8, v8))
            ms = _time_ms(lambda: codes_fn(qc, kc, vc, sq, sk, sv))
            rows.append({"seq": s, "backend": f"{label}, contiguous q/k/v", "ms": ms, "tflops": flop / ms / 1e9,
                         "speedup": base_ms / ms})
    except Exception as exc:  # report, keep benchmarking the rest
        rows.append({"seq": s, "backend": label, "error": repr(exc)[:300]})
    return rows


def _bhsd_memory(t: torch.Tensor) -> torch.Tensor:
    """The same [B, S, H, D] values stored head-major ([B, H, S, D] contiguous), viewed back as [B, S, H, D]."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def bench_layouts(seq_lens=(32760, 7290), heads: int = 12, head_dim: int = 128) -> list[dict]:
    """Does the memory layout of q/k/v/o change the attention kernels' speed? Same values, three layouts: the fused
    QKV projection's strided views ([B, S, 3, H, D] unbound), token-major contiguous [B, S, H, D], head-major
    contiguous [B, H, S, D]; for torch SDPA (fp16) and cuDNN's FP8 kernel (codes in, codes out; the output stays
    token-major where the O projection needs it, or head-major)."""
    from fastremover.ops.attention.cudnn_fp8 import sdpa_fp8

    rows = []
    dev = torch.device("cuda")
    for s in seq_lens:
        g = torch.Generator(device=dev).manual_seed(s)
        qkv = torch.randn(1, s, 3, heads, head_dim, device=dev, generator=g, dtype=torch.float16)
        flop = 4.0 * s * s * heads * head_dim
        strided = qkv.unbind(2)
        layouts = {"qkv-strided": strided, "bshd": tuple(t.contiguous() for t in strided),
                   "bhsd": tuple(_bhsd_memory(t) for t in strided)}
        ref = sdpa(*strided)
        for name, (q, k, v) in layouts.items():
            out = sdpa(q, k, v)
            ms = _time_ms(lambda: sdpa(q, k, v))
            rows.append({"seq": s, "backend": f"sdpa-fp16 in={name}", "ms": ms, "tflops": flop / ms / 1e9,
                         "equal_to_strided": bool(torch.equal(out, ref))})
            try:  # cuDNN through the frontend, output written token-major (what the O projection reads)
                from fastremover.ops.attention.cudnn_fp8 import sdpa_half

                o = torch.empty(q.shape, dtype=q.dtype, device=dev)
                sdpa_half(q, k, v, out=o)
                ms = _time_ms(lambda: sdpa_half(q, k, v, out=o))
                rows.append({"seq": s, "backend": f"cudnn-fe-fp16 in={name} out=bshd", "ms": ms,
                             "tflops": flop / ms / 1e9, "cos": _cos(o, ref)})
            except Exception as exc:
                rows.append({"seq": s, "backend": f"cudnn-fe-fp16 in={name}", "error": repr(exc)[:300]})
        if unavailable_reason("cudnn-fp8", dev) is None:
            try:  # is there a faster fp16 engine than the heuristics' choice?
                for plan in survey_plans_half(*layouts["bshd"], _time_ms):
                    if "ms" in plan:
                        plan["tflops"] = flop / plan["ms"] / 1e9
                    rows.append({"seq": s, "backend": f"fp16 plan {plan['plan']}: {plan['name'][:50]}", **plan})
            except Exception as exc:
                rows.append({"seq": s, "backend": "fp16 plan survey", "error": repr(exc)[:300]})
            q8, k8, v8, sq, sk, sv = quantize_qkv(*strided)
            inv = torch.reciprocal(sv)
            codes = {"bshd": (q8, k8, v8), "bhsd": tuple(_bhsd_memory(t) for t in (q8, k8, v8))}
            for name, (a, b, c) in codes.items():
                for out_layout in ("bshd", "bhsd"):
                    o = torch.empty(q8.shape, dtype=q8.dtype, device=dev)
                    if out_layout == "bhsd":
                        o = _bhsd_memory(o)
                    sdpa_fp8(a, b, c, sq, sk, sv, scale_o=inv, out=o)
                    ms = _time_ms(lambda: sdpa_fp8(a, b, c, sq, sk, sv, scale_o=inv, out=o))
                    rows.append({"seq": s, "backend": f"fp8 kernel in={name} out={out_layout}", "ms": ms,
                                 "tflops": flop / ms / 1e9, "cos": _cos(o.float() * sv, ref)})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--layouts", action="store_true", help="only the q/k/v/o memory-layout survey")
    parser.add_argument("--v-bias", type=float, default=0.0, help="shared per-channel offset added to v (default 0)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    _load()
    if not args.bench:
        parser.error("nothing to do (use --bench)")
    if args.layouts and args.v_bias:
        parser.error("--v-bias applies to the backend comparison, not to --layouts")
    rows = bench_layouts() if args.layouts else bench(v_bias=args.v_bias)
    for r in rows:
        if "error" in r:
            print(f"S={r['seq']:>6} {r['backend']:<28} smooth={r.get('smooth_k', '-')!s:<5} ERROR {r['error']}")
        else:
            print(f"S={r['seq']:>6} {r['backend']:<28} smooth={r.get('smooth_k', '-')!s:<5} {r['ms']:8.3f} ms "
                  f"{r.get('tflops', math.nan):7.1f} TFLOP/s  x{r.get('speedup', math.nan):5.2f}  "
                  f"cos {r.get('cos', math.nan):.5f}"
                  + (f"  equal {r['equal_to_strided']}" if "equal_to_strided" in r else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "inputs": "layouts" if args.layouts else {"k_bias": 1.0, "v_bias": args.v_bias},
                       "rows": rows}, f, indent=1)


if __name__ != "__main__":  # imported (experiments, tests): everything at once
    _load()

if __name__ == "__main__":
    main()
