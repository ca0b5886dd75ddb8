"""What the fast transformer's cuBLASLt FP8 GEMMs launch at W1's shapes (torch._scaled_mm, row-wise scales, bias,
fp16 out, fast accumulation): kernels and memsets per call under the profiler, and ms per call as a CUDA graph of
`calls` back-to-back calls. Run it once as is and once with CUBLASLT_WORKSPACE_SIZE=0 (read once per process) to see
whether the memsets belong to cuBLASLt's workspace-using kernels and what the other kernels cost.

    python experiments/gemm_memsets.py --label default --out a.json
    CUBLASLT_WORKSPACE_SIZE=0 python experiments/gemm_memsets.py --label ws0 --out b.json
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
import os
import statistics
from collections import Counter

import torch

from _provenance import save_experiment
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # profile_step lives in tools/
from profile_step import capture

SHAPES = {  # name: (M, K, N); the attention's tail split runs the rows after it in two chunks
    "w1": {  # 7290 tokens: 7040 + 250
        "qkv": (7290, 1536, 4608), "o main": (7040, 1536, 1536), "o tail": (250, 1536, 1536),
        "ff2 main": (7040, 8960, 1536), "ff2 tail": (250, 8960, 1536),
    },
    "w2": {  # 32760 tokens: 32384 + 376
        "qkv": (32760, 1536, 4608), "o main": (32384, 1536, 1536), "o tail": (376, 1536, 1536),
        "ff2 main": (32384, 8960, 1536), "ff2 tail": (376, 8960, 1536),
    },
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--workload", default="w1", choices=sorted(SHAPES))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (m, k, n) in SHAPES[a.workload].items():
        x = torch.randn(m, k, device=dev, generator=g).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device=dev, generator=g).to(torch.float8_e4m3fn)
        sx = torch.rand(m, 1, device=dev, generator=g) + 0.5
        sw = torch.rand(1, n, device=dev, generator=g) + 0.5
        bias = torch.randn(n, device=dev, generator=g).half()

        def fn():
            return torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=torch.float16,
                                    use_fast_accum=True)

        graph, _ = capture(lambda: [fn() for _ in range(a.calls)])
        graph.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels[ev.name[:90]] += 1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ms = []
        for _ in range(a.rounds):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end) / a.calls)
        per_call = {kname: c / a.calls for kname, c in kernels.items()}
        med = statistics.median(ms)
        rows.append({"gemm": name, "m": m, "k": k, "n": n, "ms": med, "tflops": 2 * m * k * n / med / 1e9,
                     "kernels_per_call": per_call})
        print(f"{a.label:>8} {a.workload} {name:<9} {m:5d}x{k:5d}x{n:5d} {med * 1e3:8.1f} us  {per_call}")
    save_experiment(a.out, rows, label=a.label, workload=a.workload,
                    CUBLASLT_WORKSPACE_SIZE=os.environ.get("CUBLASLT_WORKSPACE_SIZE"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
