"""Would the FFN's first GEMM with the GELU and the FP8 quantization in its epilogue beat cuBLAS + our streaming pass?

At W2 the fast step runs ff1 as `torch._scaled_mm` (row-wise scales, fast accumulation, fp16 out: [32760, 8960],
587 MB written) and then `quant.quant_fp8_static(gelu=True)` reads those 587 MB back and writes the e4m3 codes
(0.247 ms per layer, 7.4 ms per step, bench/results/elementwise-sweep-*-4b4a529.json). A Triton FP8 GEMM that applies
the scales, bias, tanh-GELU and the static-scale quantization to its fp32 accumulator writes the 293 MB of codes
directly - if its main loop stays close to cuBLAS's ~1390 TFLOP/s. This experiment measures that, side by side on the
same inputs, before any of it goes into the engine:

  cuBLAS               torch._scaled_mm (the shipped GEMM), fp16 out
  cuBLAS + quant       the shipped pair: _scaled_mm, then quant_fp8_static(gelu=True)
  triton fp16 <cfg>    our persistent TMA GEMM with the same epilogue as cuBLAS (scales, bias), fp16 out
  triton fused <cfg>   the same GEMM, epilogue + GELU + static quantization, e4m3 out

and checks the fused codes against the shipped pair's (fraction equal, fraction more than one e4m3 step apart,
cosine of the dequantized values).

    python experiments/ffn1_fused_gemm.py --out ffn1.json            (GPU)
    TRITON_INTERPRET=1 python experiments/ffn1_fused_gemm.py --smoke  (CPU: the kernel's logic at a tiny shape)
    python experiments/ffn1_fused_gemm.py --shipped --out ffn1.json  (GPU: the engine's kernel, its configs)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from _provenance import save_experiment
from fastremover.fast.kernels._common import interpreting, launch_options, quantize_fp8
from fastremover.fast.kernels.gemm_fp8 import TensorDescriptor, _tile_coords  # TensorDescriptor: None on old Triton
from fastremover.fast.kernels.quant import gelu_tanh_f32_device, quant_fp8_static, quant_fp8_weight

FP8 = torch.float8_e4m3fn


@triton.jit
def _epilogue(acc, rows, cols, M, N, RS, WS, BIAS, inv, FUSED: tl.constexpr, INTERPRET: tl.constexpr):
    """acc * sa[m] * sw[n] + bias[n] (fp32), then fp16, or tanh-GELU and e4m3 codes with the static inverse scale."""
    sa = tl.load(RS + rows, mask=rows < M, other=0.0)
    sw = tl.load(WS + cols, mask=cols < N, other=0.0)
    b = tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = acc * sa[:, None] * sw[None, :] + b[None, :]
    if FUSED:
        out = quantize_fp8(gelu_tanh_f32_device(y, INTERPRET), inv, INTERPRET)
    else:
        out = y.to(tl.float16)
    return out


@triton.jit
def _ffn1_kernel(a_desc, b_desc, c_desc, RS, WS, BIAS, AMAX, M, N, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 NUM_SMS: tl.constexpr, FUSED: tl.constexpr, SUBTILE: tl.constexpr, WARP_SPEC: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Persistent: program p takes tiles p, p + NUM_SMS, ... A [M, K] e4m3 (activations), B [N, K] e4m3 (weights,
    K-major), C [M, N]; fp32 accumulation on the tensor cores."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    inv = 0.0
    if FUSED:
        inv = tl.math.div_rn(448.0, tl.maximum(tl.load(AMAX), 1e-12))
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        rows = off_m + tl.arange(0, BLOCK_M)
        if SUBTILE:  # two [BLOCK_M, BLOCK_N / 2] halves: half the epilogue's registers live at a time
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            cols0 = off_n + tl.arange(0, BLOCK_N // 2)
            c_desc.store([off_m, off_n], _epilogue(acc0, rows, cols0, M, N, RS, WS, BIAS, inv, FUSED, INTERPRET))
            cols1 = cols0 + BLOCK_N // 2
            c_desc.store([off_m, off_n + BLOCK_N // 2],
                         _epilogue(acc1, rows, cols1, M, N, RS, WS, BIAS, inv, FUSED, INTERPRET))
        else:
            cols = off_n + tl.arange(0, BLOCK_N)
            c_desc.store([off_m, off_n], _epilogue(acc, rows, cols, M, N, RS, WS, BIAS, inv, FUSED, INTERPRET))


def ffn1(a, sa, w, sw, bias, amax, *, fused: bool, cfg: tuple, num_sms: int):
    """a [M, K] e4m3, sa [M, 1] fp32, w [N, K] e4m3, sw [1, N] fp32, bias [N] fp16, amax [1] fp32 -> [M, N] fp16
    (fused=False) or e4m3 codes of gelu(.) with the static scale amax / 448."""
    bm, bn, bk, group_m, stages, warps, subtile, ws = cfg
    m, k = a.shape
    n = w.shape[0]
    c = torch.empty(m, n, device=a.device, dtype=FP8 if fused else torch.float16)
    a_desc = TensorDescriptor(a, [m, k], [k, 1], [bm, bk])
    b_desc = TensorDescriptor(w, [n, k], [k, 1], [bn, bk])
    c_desc = TensorDescriptor(c, [m, n], [n, 1], [bm, bn // 2 if subtile else bn])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(num_sms, tiles),)
    _ffn1_kernel[grid](a_desc, b_desc, c_desc, sa, sw, bias, amax, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                       GROUP_M=group_m, NUM_SMS=grid[0], FUSED=fused, SUBTILE=subtile, WARP_SPEC=ws,
                       INTERPRET=interpreting(_ffn1_kernel), num_stages=stages, num_warps=warps,
                       **launch_options(_ffn1_kernel))
    return c


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps, epilogue subtile, warp specialization)
CONFIGS = [
    (128, 256, 128, 8, 3, 8, True, False),
    (128, 256, 128, 8, 3, 8, False, False),
    (128, 256, 128, 8, 3, 8, True, True),
    (128, 128, 128, 8, 4, 8, False, False),
    (128, 128, 128, 8, 4, 8, False, True),
    (128, 256, 64, 8, 4, 8, True, False),
]


# the shipped kernel's configurations (gemm_fp8.CONFIG's fields): more CTAs per SM so that one program's epilogue
# overlaps another's main loop (128 x 128 tiles: two fit an SM's shared memory and registers), and the GELU on the
# MUFU's tanh.approx
SHIPPED_CONFIGS = [  # 2 CTAs per SM only with 4 warps: at 8 warps the 128 x 128 kernels take 178-193 registers per
    # thread, two CTAs would need 94K of the SM's 64K (offline sm_90 compile: 4 warps 212-255 registers, shared memory
    # 82 KB with BLOCK_K 64 / 4 stages, 115 KB with BLOCK_K 128 / 3 stages - two of those just fit 228 KB)
    (128, 256, 128, 8, 3, 8, 1, "sigmoid"),
    (128, 256, 128, 8, 3, 8, 1, "tanh"),
    (128, 128, 128, 8, 3, 4, 2, "sigmoid"),
    (128, 128, 64, 8, 4, 4, 2, "sigmoid"),
    (128, 128, 64, 8, 4, 4, 2, "tanh"),
    (128, 128, 128, 8, 3, 4, 2, "tanh"),
    (128, 128, 64, 8, 3, 4, 2, "tanh"),
    (128, 128, 64, 8, 4, 4, 1, "tanh"),
]


def _gemm_inputs(m: int, k: int, n: int, dev: torch.device):
    """Seeded ff1 operands: a [M, K] e4m3 with row scales sa [M, 1], w [N, K] e4m3 with sw [1, N], bias [N] fp16."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, generator=g)
    sa = x.abs().amax(1, keepdim=True) / 448.0
    a = (x / sa).to(FP8)
    w, sw = quant_fp8_weight(torch.randn(n, k, device=dev, generator=g) / k ** 0.5)
    bias = (0.1 * torch.randn(n, device=dev, generator=g)).to(torch.float16)
    return a, sa, w, sw.view(1, -1).contiguous(), bias


def _code_agreement(codes: torch.Tensor, ref: torch.Tensor) -> dict:
    """Fraction of e4m3 codes equal to the reference's, and fraction more than one e4m3 step apart."""
    qa, qb = codes.float(), ref.float()
    step = 0.125 * torch.maximum(qa.abs(), qb.abs()) + 2.0 ** -9
    return {"codes equal": float((qa == qb).float().mean()),
            "codes > 1 step apart": float(((qa - qb).abs() > step).float().mean())}


def run_shipped(m: int, k: int, n: int, configs) -> list[dict]:
    """gemm_fp8.gemm_fp8_gelu_quant at each configuration against the shipped pair (cuBLAS + quant_fp8_static):
    ms, and the codes' agreement with the pair's."""
    import triton.testing

    from fastremover.fast.kernels.gemm_fp8 import gemm_fp8_gelu_quant

    dev = torch.device("cuda")
    a, sa, w, sw, bias = _gemm_inputs(m, k, n, dev)
    flops = 2.0 * m * n * k

    def gemm():
        return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, bias=bias, out_dtype=torch.float16,
                                use_fast_accum=True)

    def pair():
        return quant_fp8_static(gemm(), amax, gelu=True)

    amax = (gemm().float().abs().amax() * 1.5).reshape(1)
    ref_codes, _ = pair()
    rows = []

    def timed(name, fn, extra=None):
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
        rows.append({"m": m, "k": k, "n": n, "variant": name, "ms": ms, "tflops": flops / ms / 1e9, **(extra or {})})
        print(f"M={m} K={k} N={n}  {name:44s} {ms:8.4f} ms {flops / ms / 1e9:7.0f} TFLOP/s {extra or ''}", flush=True)

    timed("cuBLAS + quant_fp8_static(gelu)", pair)
    for cfg in configs:
        label = "shipped " + "x".join(map(str, cfg[:3])) + f" g{cfg[3]} s{cfg[4]} w{cfg[5]} c{cfg[6]} {cfg[7]}"
        try:
            codes, _ = gemm_fp8_gelu_quant(a, sa, w, sw, bias, amax, config=cfg)
        except Exception as e:  # a config that does not compile / fit here: say so, go on
            print(f"config {label}: {type(e).__name__}: {str(e)[:200]}")
            rows.append({"m": m, "k": k, "n": n, "variant": label, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        check = _code_agreement(codes, ref_codes)
        timed(label, lambda cfg=cfg: gemm_fp8_gelu_quant(a, sa, w, sw, bias, amax, config=cfg), check)
    return rows


def run(m: int, k: int, n: int, configs, smoke: bool) -> list[dict]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a, sa, w, sw, bias = _gemm_inputs(m, k, n, dev)
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    flops = 2.0 * m * n * k
    rows = []

    def shipped_gemm():
        return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, bias=bias, out_dtype=torch.float16,
                                use_fast_accum=dev.type == "cuda")

    h = shipped_gemm() if dev.type == "cuda" else (a.float() @ w.float().t() * sa * sw + bias.float()).half()
    amax = (h.float().abs().amax() * 1.5).reshape(1)  # a static bound above the true amax, as the engine's
    ref_codes, _ = quant_fp8_static(h, amax, gelu=True)

    def timed(name, fn, nbytes=None):
        fn()
        if dev.type != "cuda":
            return
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
        rows.append({"m": m, "k": k, "n": n, "variant": name, "ms": ms, "tflops": flops / ms / 1e9})
        print(f"M={m} K={k} N={n}  {name:44s} {ms:8.4f} ms {flops / ms / 1e9:7.0f} TFLOP/s", flush=True)

    if dev.type == "cuda":
        import triton.testing  # noqa: F401

        timed("cuBLAS _scaled_mm fp16", shipped_gemm)
        timed("cuBLAS + quant_fp8_static(gelu)", lambda: quant_fp8_static(shipped_gemm(), amax, gelu=True))
    if TensorDescriptor is None:
        print("no triton.tools.tensor_descriptor: Triton GEMM variants skipped")
        return rows
    for cfg in configs:
        label = "x".join(map(str, cfg[:3])) + f" g{cfg[3]} s{cfg[4]} w{cfg[5]}" + (" sub" if cfg[6] else "") + (
            " ws" if cfg[7] else "")
        try:
            out16 = ffn1(a, sa, w, sw, bias, amax, fused=False, cfg=cfg, num_sms=num_sms)
            codes = ffn1(a, sa, w, sw, bias, amax, fused=True, cfg=cfg, num_sms=num_sms)
        except Exception as e:  # a config that does not compile / fit here: say so, go on
            print(f"config {label}: {type(e).__name__}: {str(e)[:200]}")
            rows.append({"m": m, "k": k, "n": n, "variant": label, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        check = {
            "fp16 max|diff| / max|h|": float((out16.float() - h.float()).abs().max() / h.float().abs().max()),
            **_code_agreement(codes, ref_codes),
            "cos": float(torch.nn.functional.cosine_similarity(codes.float().flatten(), ref_codes.float().flatten(),
                                                               dim=0)),
        }
        print(f"config {label}: " + ", ".join(f"{k_} {v:.3g}" for k_, v in check.items()))
        rows.append({"m": m, "k": k, "n": n, "variant": label, "check": check})
        timed(f"triton fp16 {label}", lambda cfg=cfg: ffn1(a, sa, w, sw, bias, amax, fused=False, cfg=cfg,
                                                           num_sms=num_sms))
        timed(f"triton fused {label}", lambda cfg=cfg: ffn1(a, sa, w, sw, bias, amax, fused=True, cfg=cfg,
                                                            num_sms=num_sms))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one tiny shape, one config (the CPU interpreter)")
    ap.add_argument("--shipped", action="store_true",
                    help="time the shipped kernel (gemm_fp8.py) at SHIPPED_CONFIGS instead of this file's variants")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.shipped:
        rows = [r for m in (32760, 7290) for r in run_shipped(m, 1536, 8960, SHIPPED_CONFIGS)]
    elif a.smoke:
        rows = run(48, 64, 96, [(32, 32, 32, 2, 2, 4, True, False), (32, 64, 32, 2, 2, 4, False, False)], True)
    else:
        rows = [r for m in (32760, 7290) for r in run(m, 1536, 8960, CONFIGS, False)]
    save_experiment(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
