"""Experiment (GPU): the H3 blocks' unit GEMM with TMA loads (host tensor descriptors), one tile per program or
persistent, against kernels/nvfp4.unit_gemm at the decoder's shapes (M = 7188: 4 tiles per call).

    python experiments/unit_gemm_tma.py [--m 7188] [--out FILE]

For each shape (q/k/v/o and ff2: N = 2048; ff1: N = 16384) and each launch config: the time (triton do_bench) and
whether the output equals unit_gemm's at its default config bit for bit. The K loop is unit_gemm's (tl.dot's fp32
accumulation over BLOCK_K = 64 slices in increasing k), so equal bits are expected; TMA only changes how the tiles
reach shared memory (out-of-bounds rows are zero-filled by the copy engine instead of masked loads).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _tile(tile_id, num_m, num_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_n
    first_m = (tile_id // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile_id % per_group) % size_m, (tile_id % per_group) // size_m


@triton.jit
def _tma_kernel(a_desc, b_desc, ALPHA, C, M, N, K, stride_cm,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                NUM_PROGRAMS: tl.constexpr, PERSISTENT: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = num_m * num_n
    alpha = tl.load(ALPHA)
    if PERSISTENT:
        for tile_id in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _tile(tile_id, num_m, num_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([pid_m * BLOCK_M, k0])
                b = b_desc.load([pid_n * BLOCK_N, k0])
                acc = tl.dot(a, b.T, acc)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            y = (acc * alpha).to(C.dtype.element_ty)
            tl.store(C + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], y,
                     mask=(rows[:, None] < M) & (cols[None, :] < N))
    else:
        pid_m, pid_n = _tile(tl.program_id(0), num_m, num_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            b = b_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, b.T, acc)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y = (acc * alpha).to(C.dtype.element_ty)
        tl.store(C + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], y,
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


def tma_gemm(a, b, alpha, config, persistent):
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, group_m, stages, warps = config
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    programs = min(sms, tiles) if persistent else tiles
    _tma_kernel[(programs,)](a_desc, b_desc, alpha, out, m, n, k, out.stride(0),
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, NUM_PROGRAMS=programs,
                             PERSISTENT=persistent, num_stages=stages, num_warps=warps)
    return out


CONFIGS = [
    (128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8), (128, 256, 64, 8, 3, 8), (256, 128, 64, 8, 3, 8),
    (128, 256, 64, 8, 4, 8), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 5, 4), (128, 256, 64, 4, 3, 8),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=7188)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from fastremover.fast import nvfp4 as ref
    from fastremover.fast.kernels import nvfp4 as K

    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "m": args.m, "shapes": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, (n, k) in {"qkv/o": (2048, 2048), "ff1": (16384, 2048), "ff2": (2048, 8192)}.items():
        xq = K.quantize_nvfp4(torch.randn(args.m, k, device="cuda", generator=g))
        wq = K.quantize_nvfp4(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        alpha = ref.alpha_of(xq.global_scale) * ref.alpha_of(wq.global_scale)
        xu, wu = K.unit_weight_nvfp4(xq, torch.bfloat16), K.unit_weight_nvfp4(wq, torch.bfloat16)
        base = K.unit_gemm(xu, wu, alpha)
        flop = 2 * args.m * n * k
        row = {"gemm": label, "N": n, "K": k, "default": list(K.unit_gemm_config(args.m, n, k)),
               "default_ms": triton.testing.do_bench(lambda: K.unit_gemm(xu, wu, alpha)),
               "cublas_ms": triton.testing.do_bench(lambda: xu @ wu.t()), "tma": []}
        for persistent in (False, True):
            for c in CONFIGS:
                try:
                    y = tma_gemm(xu, wu, alpha, c, persistent)
                    ms = triton.testing.do_bench(lambda: tma_gemm(xu, wu, alpha, c, persistent))
                    row["tma"].append({"config": list(c), "persistent": persistent, "ms": ms,
                                       "tflops": flop / ms / 1e9, "equal": bool(torch.equal(y, base))})
                except Exception as e:  # a config that does not compile: say so, go on
                    row["tma"].append({"config": list(c), "persistent": persistent,
                                       "error": f"{type(e).__name__}: {str(e)[:160]}"})
        res["shapes"].append(row)
        best = min((t for t in row["tma"] if "ms" in t and t["equal"]), key=lambda t: t["ms"], default=None)
        print(f"{label:6s} default {row['default_ms']:.4f} ms  cuBLAS {row['cublas_ms']:.4f} ms  best TMA "
              f"{best and (best['config'], best['persistent'], round(best['ms'], 4))}", flush=True)
        for t in row["tma"]:
            print("   ", t.get("config"), t.get("persistent"), round(t["ms"], 4) if "ms" in t else t["error"],
                  t.get("equal"), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
