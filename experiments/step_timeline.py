"""Where a fast-mode step's time goes between kernels: one CUDA-graph replay of a steady step under the profiler,
every kernel's start and end, and from them the time no kernel runs at all (the GPU idle between dependent kernels)
and the time only one kernel runs, per step. Writes the raw kernel list (name, stream, start, duration) as JSON.

    python experiments/step_timeline.py --workload w1 --out timeline-w1.json
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse

import torch

from _provenance import save_experiment
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # profile_step lives in tools/
from profile_step import capture, real_model, step_latents
from fastremover.engine.build import resolve_attention
from fastremover.fast.transformer_fast import FastTransformer


def coverage(intervals: list[tuple[float, float]]) -> dict:
    """us with 0, 1, 2+ kernels running between the first start and the last end."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    out = {"idle": 0.0, "one": 0.0, "two_plus": 0.0}
    active, last = 0, events[0][0]
    for t, d in events:
        span = t - last
        out["idle" if active == 0 else "one" if active == 1 else "two_plus"] += span
        active += d
        last = t
    out["span"] = events[-1][0] - events[0][0]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device("cuda")
    model = real_model()
    backend, _ = resolve_attention("auto", "fast", device)
    fast = FastTransformer(model, linear_method="fp8-rowwise", attention=backend)
    x = step_latents(model, a.workload, device)
    cond = fast.conditioning(torch.linspace(999, 1, 12, device=device), 1)
    fast.forward_step(x, cond, 0)
    g, _ = capture(lambda: fast.forward_step(x, cond, 1))
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    kernels = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start = ev.time_range.start
        kernels.append({"name": ev.name[:100], "stream": getattr(ev, "device_resource_id", None),
                        "start_us": start, "dur_us": ev.time_range.end - start})
    kernels.sort(key=lambda k: k["start_us"])
    t0 = kernels[0]["start_us"]
    for k in kernels:
        k["start_us"] -= t0
    cov = coverage([(k["start_us"], k["start_us"] + k["dur_us"]) for k in kernels])
    print(f"{a.workload}: {len(kernels)} kernels, span {cov['span'] / 1e3:.2f} ms: idle {cov['idle'] / 1e3:.3f} ms, "
          f"one kernel {cov['one'] / 1e3:.2f} ms, two or more {cov['two_plus'] / 1e3:.2f} ms")
    # the idle gaps by the kernel that follows them (what the GPU waited for)
    gaps: dict[str, list[float]] = {}
    end = 0.0
    for k in kernels:
        if k["start_us"] > end:
            gaps.setdefault(k["name"][:50], []).append(k["start_us"] - end)
        end = max(end, k["start_us"] + k["dur_us"])
    for name, gs in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"   idle before {name:<50} {len(gs):4d} gaps, {sum(gs):8.1f} us, mean {sum(gs) / len(gs):5.2f}")
    # rows: the step's kernels in start order
    save_experiment(a.out, kernels, workload=a.workload, coverage_us=cov,
                    idle_before={n: [len(gs), sum(gs)] for n, gs in gaps.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
