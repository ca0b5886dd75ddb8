"""Why does FlashAttention-3's FP8 kernel take 7.37 ms per layer inside the W2 fast step but 6.7-6.9 ms alone
(bench/results/profile-step-w2-fast-*-4ae4ef6.json vs attention-flash3-exp2-variants-*)? Same process, same
inputs (S = 32760, 12 heads x 128, e4m3 codes), three loops of 30 calls, each attention call timed by CUDA events:
  alone        attention back to back
  with GEMMs   each attention call after the layer's four FP8 GEMMs (the W2 shapes, fast accumulation)
  with idle    each attention call after a 5 ms sleep on the GPU (cool-down: clocks recover)
and the SM clock / power draw sampled around each loop (torch.cuda.clock_rate / power_draw, NVML). If the kernel is
slower only next to the GEMMs and the clock is lower there, the 700 W power cap is the cause, not the kernel.

    PYTHONPATH=.fa3:$PYTHONPATH python experiments/attention_in_situ.py --out in_situ.json
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fastremover.ops.attention.quantize import quantize_qkv
from fastremover.ops.attention.flashattn3_fp8 import flash3_fp8_codes, import_error
from _provenance import save_experiment

GEMMS = {"qkv": (4608, 1536), "o": (1536, 1536), "ff1": (8960, 1536), "ff2": (1536, 8960)}


def _nvml(fn):
    try:
        return fn()
    except Exception:  # NVML missing or not permitted: report None
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if import_error():
        raise SystemExit(f"flash_attn_interface does not import: {import_error()}")
    dev, s, h, d = "cuda", 32760, 12, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, device=dev, generator=g, dtype=torch.float16) for _ in range(3))
    q8, k8, v8, sq, sk, sv = quantize_qkv(q, k, v)
    fp8 = torch.float8_e4m3fn
    gemm_args = []
    for n, kk in GEMMS.values():
        x = torch.randn(s, kk, device=dev, generator=g).to(fp8)
        w = torch.randn(n, kk, device=dev, generator=g).to(fp8)
        gemm_args.append((x, w, torch.ones(s, 1, device=dev), torch.ones(1, n, device=dev)))

    def gemms():
        for x, w, sa, sb in gemm_args:
            torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float16, use_fast_accum=True)

    def attention():
        flash3_fp8_codes(q8, k8, v8, sq, sk, sv)

    loops = {"alone": None, "with GEMMs": gemms, "with idle": lambda: torch.cuda._sleep(5_000_000)}
    for _ in range(3):
        attention()
        gemms()
    torch.cuda.synchronize()
    rows = []
    for name, before in loops.items():
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.calls)]
        clocks, power = [], []
        for start, end in events:
            if before is not None:
                before()
            start.record()
            attention()
            end.record()
        for _ in range(5):  # samples while the queued work runs
            clocks.append(_nvml(torch.cuda.clock_rate))
            power.append(_nvml(torch.cuda.power_draw))
            torch.cuda._sleep(20_000_000)
        torch.cuda.synchronize()
        ms = [st.elapsed_time(en) for st, en in events]
        row = {"loop": name, "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
               "sm_clock_mhz_samples": clocks, "power_mw_samples": power}
        rows.append(row)
        print(f"{name:12s} attention {row['ms_median']:.3f} ms median ({row['ms_min']:.3f}-{row['ms_max']:.3f}); "
              f"SM clock {clocks}; power {power}")
    save_experiment(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
