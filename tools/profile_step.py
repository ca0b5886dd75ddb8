"""Where the GPU time goes, kernels grouped by name under torch.profiler (real configs, random weights):
one `FastTransformer.forward_step` at a workload's token count, or (--vae) one encode of both inputs and one decode
of the fast VAE at the workload's size.

    python tools/profile_step.py --workload w2 --modes exact fast [--attention fp8] [--graph] [--out FILE]

A steady-state step is profiled (step 1: step 0 also calibrates the 8-bit attention's K centres); --graph profiles it
as a CUDA-graph replay, as the denoise loop runs it.
    python tools/profile_step.py --vae [--workload w2] [--vae-precision fp8] [--out FILE]
    python tools/profile_step.py --workload w1 --compare shipped serial unfused-ffn1 [--burst 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from typing import Callable

from fastremover.config import TransformerOptions


GROUPS = (  # kernel-name patterns -> a readable group (first match wins)
    ("attention", r"fmha|flash|attention|sdpa|cudnn_generated|sm90_xmma_fprop|_attn"),
    ("gemm", r"gemm|sm90_xmma|cutlass|nvjet|matmul|_scaled_mm"),
    ("adaln", r"adaln"),
    ("qk_norm_rope", r"qk_norm_rope"),
    ("gate_residual", r"gate_residual"),
    ("quant/gelu", r"quant|gelu|amax"),
)

VAE_GROUPS = (
    ("conv (cuDNN)", r"conv|cudnn|xmma|implicit|sm90|sm80|gemm|nhwc|fprop|cutlass|nvjet"),
    ("norm+silu (Triton)", r"vae_rms|_rms_norm|_norm_kernel"),
    ("conv fp8 (Triton)", r"conv3d_fp8|_conv3d"),
    ("copy / cat / pad", r"copy|cat|pad|fill|Memset|Memcpy"),
    ("elementwise", r"elementwise|vectorized|add|mul|clamp|silu"),
    ("attention", r"fmha|flash|attention"),
)



def _load() -> None:
    """The heavy imports (torch, the package), after the arguments are parsed: --help stays fast."""
    global torch, WORKLOADS, environment, resolve_attention, FastTransformer, random_models
    import torch
    from fastremover.bench.harness import WORKLOADS, environment
    from fastremover.engine.build import resolve_attention
    from fastremover.fast.transformer_fast import FastTransformer
    from fastremover.models.loading import random_models

def group_of(name: str, groups=GROUPS) -> str:
    for group, pattern in groups:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def kernel_times(fn: Callable[[], object], groups, top: int, digits: int = 3) -> tuple[dict, list]:
    """Run fn once under the profiler: (ms per group, largest first; the `top` kernels as name/ms/count)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kernel: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if us and ev.key:
            by_kernel[ev.key] += us
            counts[ev.key] += ev.count
    by_group: dict[str, float] = defaultdict(float)
    for name, us in by_kernel.items():
        by_group[group_of(name, groups)] += us / 1000.0
    largest = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
    return (
        {k: round(v, digits) for k, v in sorted(by_group.items(), key=lambda kv: -kv[1])},
        [{"name": n[:120], "ms": round(us / 1000.0, digits), "count": counts[n]} for n, us in largest],
    )


def real_model():
    return random_models("minimax-remover", seed=0).transformer.to("cuda").to_inference_dtype(torch.float16)


def step_latents(model, workload: str, device: torch.device) -> torch.Tensor:
    """Random transformer input latents [1, C, T, H/8, W/8] fp16 at a workload's size."""
    frames, height, width = WORKLOADS[workload]
    t = (frames - 1) // 4 + 1
    return torch.randn(1, model.config.in_channels, t, height // 8, width // 8, device=device, dtype=torch.float16)


def capture(step: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, its output) of `step` captured once, after one run on a side stream (the usual warm-up)."""
    from fastremover.timing import capture_graph

    return capture_graph(step)


def profile(model, workload: str, mode: str, attention: str, steps: int = 12, graph: bool = False) -> dict:
    device = torch.device("cuda")
    backend, notes = resolve_attention(attention, mode, device)
    fast = FastTransformer(model, linear_method="fp8-rowwise" if mode == "fast" else "dense", attention=backend)
    x = step_latents(model, workload, device)
    timesteps = torch.linspace(999, 1, steps, device=device)
    cond = fast.conditioning(timesteps, 1)
    for i in range(2):  # compile / build graphs
        fast.forward_step(x, cond, i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(3):
        fast.forward_step(x, cond, i)
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / 3
    out = {"workload": workload, "mode": mode, "attention": backend, "notes": notes, "step_ms_eager_launch": step_ms}
    step = lambda: fast.forward_step(x, cond, 1)  # noqa: E731  (step 0 also calibrates the K centres: once per run)
    if graph:
        # the step as the denoise loop runs it: captured once, replayed back to back (no launch gaps, so the clocks
        # see the loop's sustained load)
        g, _ = capture(step)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        out["step_ms_graph"] = start.elapsed_time(end) / 10
        step = g.replay
    by_group, top = kernel_times(step, GROUPS, top=20)
    del fast
    torch.cuda.empty_cache()
    return {**out, "profiled_ms_by_group": by_group, "profiled_ms_total": round(sum(by_group.values()), 3),
            "top_kernels": top}


VARIANTS = {  # --compare: FastTransformer options per label (fast mode)
    "shipped": {},
    "serial": {"concurrent": False},
    "unfused-ffn1": {"fused_ffn1": False},
    "serial-unfused": {"concurrent": False, "fused_ffn1": False},
    "no-tail-split": {"tail_overlap": False},
    "serial-no-tail-split": {"concurrent": False, "tail_overlap": False},
    "no-priority": {"stream_priority": False},
    "unfused-v-stats": {"fused_v_stats": False},
    "no-priority-unfused-v-stats": {"stream_priority": False, "fused_v_stats": False},
    "torch-gemm": {"gemm": "torch"},
    "torch-gemm-no-priority-unfused-v-stats": {"gemm": "torch", "stream_priority": False, "fused_v_stats": False},
}


def compare_graph_steps(model, workload: str, labels: list[str], attention: str = "auto", rounds: int = 4,
                        replays: int = 10, step: int = 1, burst_idle_s: float | None = None) -> dict:
    """Fast-mode step variants side by side: each captured as a CUDA graph of `step` (after an eager step 0, which
    calibrates; step 0 itself recalibrates on every replay, as the first step of every run does), then replayed in
    interleaved rounds (so clock drift hits every variant alike); ms per step as the median over rounds, and each
    variant's output compared with the first one's (torch.equal, or the cosine).

    burst_idle_s: time each round as the bench's denoise stage runs (the GPU idle for burst_idle_s, then `replays`
    replays back to back, 12 for a 12-step loop) instead of after a warm-up replay. Back-to-back rounds keep the GPU at
    its power cap, where an idle gap saved inside a step barely shows (session 12: the cuBLASLt memsets, 0.3 ms of idle
    per W1 step, gone in the timeline and in two benches, ~0 in hot rounds)."""
    device = torch.device("cuda")
    backend, notes = resolve_attention(attention, "fast", device)
    x = step_latents(model, workload, device)
    timesteps = torch.linspace(999, 1, 12, device=device)
    runs = {}
    for label in labels:
        switches = dict(VARIANTS[label])
        fused_ffn1 = switches.pop("fused_ffn1", True)
        fast = FastTransformer(model, linear_method="fp8-rowwise", attention=backend, fused_ffn1=fused_ffn1,
                               options=TransformerOptions(**switches))
        cond = fast.conditioning(timesteps, 1)
        fast.forward_step(x, cond, 0)
        g, out = capture(lambda fast=fast, cond=cond: fast.forward_step(x, cond, step))
        g.replay()
        runs[label] = {"graph": g, "out": out, "describe": fast.describe(), "ms": [], "keep": (fast, cond)}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for r in runs.values():
            if burst_idle_s is None:
                r["graph"].replay()
            else:
                torch.cuda.synchronize()
                time.sleep(burst_idle_s)
            start.record()
            for _ in range(replays):
                r["graph"].replay()
            end.record()
            torch.cuda.synchronize()
            r["ms"].append(start.elapsed_time(end) / replays)
    first = runs[labels[0]]["out"]
    rows = []
    for label, r in runs.items():
        same = bool(torch.equal(r["out"], first))
        c = float(torch.nn.functional.cosine_similarity(r["out"].float().flatten(), first.float().flatten(), dim=0))
        rows.append({"variant": label, "options": VARIANTS[label], "describe": r["describe"],
                     "step_ms_graph": sorted(r["ms"])[len(r["ms"]) // 2], "step_ms_rounds": r["ms"],
                     f"equal_to_{labels[0]}": same, f"cos_to_{labels[0]}": c})
    return {"workload": workload, "attention": backend, "notes": notes, "step": step, "rounds": rounds,
            "replays": replays, "burst_idle_s": burst_idle_s, "variants": rows}


def profile_vae(workload: str = "w2", precision: str = "auto") -> dict:
    from fastremover.fast.vae import FastWanVAE

    frames, height, width = WORKLOADS[workload]
    vae = random_models("minimax-remover", seed=0).vae
    fast = FastWanVAE(vae, device=torch.device("cuda"), dtype=torch.float16, precision=precision)
    g = torch.Generator(device="cuda").manual_seed(0)
    video = torch.rand(1, 3, frames, height, width, device="cuda", generator=g, dtype=torch.float16) * 2 - 1
    mask = (torch.rand(1, 1, frames, height, width, device="cuda", generator=g) > 0.9).half().expand(1, 3, -1, -1, -1)
    latents = torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8, device="cuda", dtype=torch.float16)
    out = {}
    for name, fn in (("encode", lambda: fast.encode_removal_inputs(video, mask)), ("decode", lambda: fast.decode(latents))):
        fn()  # compile / warm up
        torch.cuda.synchronize()
        by_group, top = kernel_times(fn, VAE_GROUPS, top=14, digits=2)
        out[name] = {"ms_by_group": by_group, "top": top}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="w2", choices=("w1", "w2", "w3"))  # = fastremover.bench.harness.WORKLOADS
    parser.add_argument("--modes", nargs="+", default=["exact", "fast"])
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--vae", action="store_true", help="profile the fast VAE instead of a denoise step")
    parser.add_argument("--vae-precision", default="auto", choices=("auto", "fp16", "fp8"),
                        help="with --vae: the fast VAE's conv precision")
    parser.add_argument("--graph", action="store_true",
                        help="profile a CUDA-graph replay of the step (as the denoise loop runs it)")
    parser.add_argument("--compare", nargs="+", default=None, choices=sorted(VARIANTS),
                        help="fast-mode variants timed side by side as graph replays (interleaved rounds)")
    parser.add_argument("--step", type=int, default=1,
                        help="with --compare: the step captured (0 = the calibrating first step of a run)")
    parser.add_argument("--burst", type=float, default=None, metavar="IDLE_S",
                        help="with --compare: rounds of 12 back-to-back replays after IDLE_S seconds of idle GPU (the "
                             "bench's denoise burst) instead of 10 replays after a warm-up one; 8 rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    _load()
    # the provenance every cited result needs (GPU, torch, commit, the command as run), as the bench's own JSON has
    env = {**environment(), "command": " ".join(["python tools/profile_step.py",
                                                 *(sys.argv[1:] if argv is None else argv)])}
    if args.compare:
        burst = {} if args.burst is None else {"rounds": 8, "replays": 12, "burst_idle_s": args.burst}
        result = compare_graph_steps(real_model(), args.workload, args.compare, args.attention, step=args.step, **burst)
        for r in result["variants"]:
            flags = {k: v for k, v in r.items() if k.startswith(("equal_to", "cos_to"))}
            print(f"{args.workload} step {args.step} {r['variant']:<18} {r['step_ms_graph']:8.3f} ms/step (graph)  "
                  f"rounds {[round(v, 2) for v in r['step_ms_rounds']]}  {flags}")
        payload = {**env, **result}
    elif args.vae:
        results = profile_vae(args.workload, args.vae_precision)
        for stage, r in results.items():
            print(f"\nfast VAE {stage}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r["ms_by_group"].items()))
            for k in r["top"]:
                print(f"   {k['ms']:8.2f} ms x{k['count']:<5} {k['name']}")
        payload = {**env, "vae_precision": args.vae_precision, "vae": results}
    else:
        model = real_model()
        results = [profile(model, args.workload, mode, args.attention, graph=args.graph) for mode in args.modes]
        for r in results:
            graph_ms = f", {r['step_ms_graph']:.1f} ms/step as a graph replay" if "step_ms_graph" in r else ""
            print(f"\n{r['workload']} {r['mode']} attention={r['attention']}: {r['step_ms_eager_launch']:.1f} ms/step "
                  f"(no graph){graph_ms}; kernels profiled {r['profiled_ms_total']:.1f} ms {r['notes']}")
            for group, ms in r["profiled_ms_by_group"].items():
                print(f"   {group:<14} {ms:8.2f} ms")
            for k in r["top_kernels"][:14]:
                print(f"      {k['ms']:8.2f} ms x{k['count']:<4} {k['name']}")
        payload = {**env, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)


if __name__ != "__main__":  # imported (experiments, tests): everything at once
    _load()

if __name__ == "__main__":
    main()
