"""Do the one-row-per-program kernels (GELU + row quantization at 8960 wide, adaLN + row quantization and q/k
RMSNorm + RoPE at 1536) run faster with another warp count? Same kernels and arguments as the wrappers, only
num_warps changed; W2 (32760 tokens) and W1 (7290) rows; do_bench medians with L2 flushed; GB/s over the minimum
traffic (inputs read once, outputs written once).

    python experiments/row_kernel_warps.py --out rows.json
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.testing

from fastremover.fast.kernels import adaln, qk_norm_rope, quant
from fastremover.fast.kernels._common import launch_options, row_segments
from fastremover.models.transformer import rope_cos_sin
from _provenance import save_experiment


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, rows = "cuda", []
    g = torch.Generator(device=dev).manual_seed(0)
    for m, grid in ((32760, (21, 30, 52)), (7290, (9, 27, 30))):
        h = torch.randn(m, 8960, device=dev, generator=g).half()
        x = (torch.randn(m, 1536, device=dev, generator=g) * 4).half()
        shift, scale = (torch.randn(1, 1536, device=dev, generator=g) for _ in range(2))
        w = (1 + 0.1 * torch.randn(1536, device=dev, generator=g)).half()
        cos, sin = rope_cos_sin(grid, 128, 1024, dev)
        q8 = torch.empty(m, 8960, device=dev, dtype=torch.float8_e4m3fn)
        rs = torch.empty(m, 1, device=dev)
        a8 = torch.empty(m, 1536, device=dev, dtype=torch.float8_e4m3fn)
        amax = qk_norm_rope.rope_amax_bound(w)
        hh, ht = row_segments(8960)
        dh, dt = row_segments(1536)
        ph, pt = row_segments(768)
        cases = {
            "gelu_quant 8960": (lambda nw: quant._quant_rows_kernel[(m,)](
                h, q8, rs, 8960, HEAD=hh, TAIL=ht, GELU=True, QUANT=True, INTERPRET=False, num_warps=nw,
                **launch_options(quant._quant_rows_kernel)), m * 8960 * 3),
            "adaln fp8 1536": (lambda nw: adaln._adaln_kernel[(m,)](
                x, x, shift, shift, scale, a8, rs, 1536, m, 1536.0, 1e-6, HEAD=dh, TAIL=dt, FP8=True, RESIDUAL=False,
                INTERPRET=False,
                num_warps=nw, **launch_options(adaln._adaln_kernel)), m * 1536 * 3),
            "qk_norm_rope fp8 1536": (lambda nw: qk_norm_rope._qk_norm_rope_kernel[(m,)](
                x, w, cos, sin, a8, amax, cos, 768, m, 1536, 1.0 / 1536, 1e-6, HALF=64, HEAD=ph, TAIL=pt,
                DTYPE=triton.language.float16, FP8=True, HAS_CENTRE=False, INTERPRET=False, num_warps=nw,
                **launch_options(qk_norm_rope._qk_norm_rope_kernel)), m * 1536 * 3),
        }
        for name, (fn, nbytes) in cases.items():
            for nw in (1, 2, 4, 8, 16):
                try:
                    fn(nw)
                    ms = triton.testing.do_bench(lambda: fn(nw), rep=100, return_mode="median")
                except Exception as exc:  # report, go on
                    rows.append({"m": m, "kernel": name, "num_warps": nw, "error": repr(exc)[:200]})
                    continue
                rows.append({"m": m, "kernel": name, "num_warps": nw, "ms": ms, "gbps": nbytes / ms / 1e6})
                print(f"M={m:6d} {name:24s} warps={nw:2d} {ms:8.4f} ms {nbytes / ms / 1e6:7.0f} GB/s")
    save_experiment(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
