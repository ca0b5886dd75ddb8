"""Launch configurations of the fast step's streaming kernels at W2 and W1 token counts (do_bench medians, L2 flushed),
with GB/s against a plain device copy of the same size (the achievable HBM floor on this GPU). The W2 fast step
spends ~37 ms per step on these kernels against ~17 ms of bandwidth floor (bench/results/profile-step-w2-fast-*):
which tile / warp counts close the gap?

  static GELU   quant.quant_fp8_static(h, gelu=True) on the FFN hidden [S, 8960] fp16 -> e4m3
  static o      quant.quant_fp8_static(o) on the attention output [S, 1536] bf16 -> e4m3
  adaln res     adaln.gate_residual_adaln(fp8=True): x, branch [S, 1536] fp16 -> x, e4m3 + row scales
  qk            qk_norm_rope(fp8_amax=, centre=) on a column slice of the fused QKV [S, 4608] fp16 -> e4m3
  colstats      quant_fp8_centred's statistics pass on V (column slice) -> [3, NBLK, 1536] partials
  tensor quant  quant_fp8_centred's quantization pass on V

    python experiments/elementwise_sweep.py --out elementwise.json
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.testing

from fastremover.fast.kernels import adaln, qk_norm_rope, quant
from fastremover.fast.kernels._common import interpreting, launch_options, row_segments
from _provenance import save_experiment

D, FFN, HEADS = 1536, 8960, 12


def _ms(fn) -> float:
    fn()
    if not torch.cuda.is_available():  # a CPU smoke run under TRITON_INTERPRET=1 (tiny --tokens): no timing
        return 1.0
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=60, return_mode="median")


def sweep(s: int) -> list[dict]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    rows = []
    INTERP = interpreting(quant._static_quant_kernel)

    def record(kernel, config, ms, nbytes):
        rows.append({"tokens": s, "kernel": kernel, "config": config, "ms": ms, "gbps": nbytes / ms / 1e6})
        print(f"S={s:6d} {kernel:14s} {config:34s} {ms:8.4f} ms {nbytes / ms / 1e6:8.0f} GB/s", flush=True)

    # the floor: a device copy of a 587 MB (W2) fp16 tensor, GB/s counting read + write
    big = torch.randn(s, FFN, device=dev, generator=g).to(f16)
    big2 = torch.empty_like(big)
    record("copy", "torch copy_ fp16", _ms(lambda: big2.copy_(big)), 2 * big.numel() * 2)
    del big2

    # static quant: GELU on [S, 8960] fp16, plain on [S, 1536] bf16
    amax = torch.tensor([8.0], device=dev)
    o = torch.randn(s, D, device=dev, generator=g).to(bf16)
    for name, x, gelu in (("static GELU", big, True), ("static o", o, False)):
        m, n = x.shape
        q = torch.empty(m, n, device=dev, dtype=torch.float8_e4m3fn)
        rs = torch.empty(m, 1, device=dev, dtype=f32)
        for bm, bn, w in ((16, 256, 4), (32, 256, 4), (32, 256, 8), (64, 256, 8), (8, 512, 4), (16, 512, 4),
                          (16, 512, 8), (32, 512, 8), (32, 128, 4), (64, 128, 4), (16, 1024, 8)):
            def run(bm=bm, bn=bn, w=w):
                quant._static_quant_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
                    x, amax, q, rs, m, n, 1.0, GELU=gelu, BLOCK_M=bm, BLOCK_N=bn, INTERPRET=INTERP, num_warps=w,
                    **launch_options(quant._static_quant_kernel))
            record(name, f"BM={bm} BN={bn} warps={w}", _ms(run), m * n * (x.element_size() + 1) + 4 * m)
    del big

    # adaLN with the gated residual, fp8 out
    x = torch.randn(s, D, device=dev, generator=g).to(f16)
    br = torch.randn(s, D, device=dev, generator=g).to(f16)
    gate, shift, scale = (torch.randn(1, D, device=dev, generator=g) * 0.1 for _ in range(3))
    y = torch.empty(s, D, device=dev, dtype=torch.float8_e4m3fn)
    rs = torch.empty(s, 1, device=dev, dtype=f32)
    head, tail = row_segments(D)
    for w in (1, 2, 4, 8):
        def run(w=w):
            adaln._adaln_kernel[(s,)](x, br, gate, shift, scale, y, rs, D, s, float(D), 1e-6, HEAD=head, TAIL=tail,
                                      FP8=True, RESIDUAL=True, INTERPRET=INTERP, num_warps=w,
                                      **launch_options(adaln._adaln_kernel))
        record("adaln res", f"warps={w}", _ms(run), s * D * (2 + 2 + 2 + 1) + 4 * s)

    # q/k norm + rope + codes on a column slice of the fused QKV output
    qkv = torch.randn(s, 3 * D, device=dev, generator=g).to(f16)
    k = qkv[:, D:2 * D]
    wk = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(f16)
    cos, sin = torch.rand(s, 64, device=dev, generator=g), torch.rand(s, 64, device=dev, generator=g)
    centre = torch.randn(1, D, device=dev, generator=g) * 0.1
    kamax = qk_norm_rope.rope_amax_bound(wk) + 0.5
    yk = torch.empty(s, D, device=dev, dtype=torch.float8_e4m3fn)
    hh, ht = row_segments(HEADS)
    for w in (1, 2, 4):
        def run(w=w):
            qk_norm_rope._qk_norm_rope_kernel[(s,)](
                k, wk, cos, sin, yk, kamax, centre, s, k.stride(0), 1.0 / D, 1e-6, H=HEADS, HALF=64, HH=hh, HT=ht,
                HALF_P=64, DTYPE=triton.language.float16, FP8=True, HAS_CENTRE=True, INTERPRET=INTERP, num_warps=w,
                **launch_options(qk_norm_rope._qk_norm_rope_kernel))
        record("qk", f"warps={w}", _ms(run), s * D * 3 + s * 128 * 4)

    # V: the column statistics pass (old: one 64-row tile per program), then the quantization pass
    v = qkv[:, 2 * D:]
    for bm, bn, rpb, w in ((32, 128, 0, 4), (32, 128, 0, 8), (64, 128, 0, 4), (32, 128, 512, 4), (32, 128, 1024, 4),
                           (32, 128, 2048, 4), (16, 128, 0, 4), (32, 128, 0, 2)):
        rpb = rpb or quant.column_stats_config(s, D)[2]
        nblk = triton.cdiv(s, rpb)
        part = torch.empty(3, 1, nblk, D, device=dev, dtype=f32)

        def run(bm=bm, bn=bn, rpb=rpb, w=w, nblk=nblk, part=part):
            quant._column_stats_kernel[(nblk, triton.cdiv(D, bn), 1)](
                v, part[0], part[1], part[2], s, D, v.stride(0), nblk, rpb, BLOCK_M=bm, BLOCK_N=bn, INTERPRET=INTERP,
                num_warps=w, **launch_options(quant._column_stats_kernel))
        record("colstats", f"BM={bm} BN={bn} rows={rpb} warps={w}", _ms(run), s * D * 2)
    mean = torch.randn(1, D, device=dev, generator=g)
    vq = torch.empty(s, D, device=dev, dtype=torch.float8_e4m3fn)
    sc = torch.empty(1, device=dev, dtype=f32)
    for bm, bn, w in ((16, 256, 4), (32, 256, 8), (64, 128, 4), (32, 512, 8), (16, 512, 4)):
        def run(bm=bm, bn=bn, w=w):
            quant._tensor_quant_kernel[(triton.cdiv(s, bm), triton.cdiv(D, bn))](
                v, mean, amax, vq, sc, s, D, s, v.stride(0), HAS_MEAN=True, BLOCK_M=bm, BLOCK_N=bn, INTERPRET=INTERP,
                num_warps=w, **launch_options(quant._tensor_quant_kernel))
        record("tensor quant", f"BM={bm} BN={bn} warps={w}", _ms(run), s * D * 3)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32760, 7290])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = [r for s in a.tokens for r in sweep(s)]
    print("\nbest per kernel:")
    for s in a.tokens:
        for kernel in dict.fromkeys(r["kernel"] for r in rows):
            best = min((r for r in rows if r["tokens"] == s and r["kernel"] == kernel), key=lambda r: r["ms"])
            print(f"S={s:6d} {kernel:14s} {best['config']:34s} {best['ms']:8.4f} ms {best['gbps']:8.0f} GB/s")
    save_experiment(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
