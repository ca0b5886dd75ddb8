"""Where does the fused VAE norm + SiLU kernel's time go? (GPU experiment, not part of the package.)

Times fastremover.fast.kernels.vae_norm.vae_rms_norm on the fast VAE's real per-call shapes (channels-last fp16,
two frames per call at full resolution) against variants of the same kernel: a plain copy (the memory floor),
the division by the row norm as a multiply by its reciprocal, a fast-math SiLU, no intermediate roundings, and
other block sizes. Prints ms per call and effective GB/s; --out writes JSON.

    python experiments/vae_norm_variants.py [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from fastremover.fast.kernels._common import launch_options, load_f32, round_through, round_to
from fastremover.fast.kernels.vae_norm import _exp_f32, vae_rms_norm
from fastremover.timing import cuda_time_ms
from _provenance import save_experiment


@triton.jit
def _variant_kernel(X, GAMMA, Y, HW, sxt, syt, scale, eps,
                    C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
                    COPY: tl.constexpr, RCP: tl.constexpr, FAST_SILU: tl.constexpr, ROUND: tl.constexpr):
    t = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < HW)[:, None] & (cols < C)[None, :]
    pix = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = load_f32(X + t * sxt + pix, mask, False)
    if COPY:
        n = x
    else:
        ss = tl.sum(x * x, axis=1)
        denom = tl.maximum(tl.sqrt_rn(ss), eps)
        if RCP:
            n = x * tl.math.div_rn(1.0, denom)[:, None]
        else:
            n = tl.math.div_rn(x, tl.broadcast_to(denom[:, None], x.shape))
        if ROUND:
            n = round_through(n, Y.dtype.element_ty, False)
            n = round_through(n * scale, Y.dtype.element_ty, False)
        else:
            n = n * scale
        g = load_f32(GAMMA + cols, cols < C, False)
        n = n * g[None, :]
        if ROUND:
            n = round_through(n, Y.dtype.element_ty, False)
        if FAST_SILU:
            n = n * tl.sigmoid(n)
        else:
            n = tl.math.div_rn(n, 1.0 + _exp_f32(-n, False))
    tl.store(Y + t * syt + pix, round_to(n, Y.dtype.element_ty, False), mask=mask)


def run_variant(x, gamma, out, *, copy=False, rcp=False, fast_silu=False, rounding=True, block_m=None, warps=None,
                fusion=False):
    b, c, t, h, w = x.shape
    block_c = triton.next_power_of_2(c)
    block_m = block_m or max(1, 4096 // block_c)
    warps = warps or (4 if block_c * block_m <= 4096 else 8)
    opts = launch_options(_variant_kernel)
    if fusion:
        opts = {**opts, "enable_fp_fusion": True}
    grid = (triton.cdiv(h * w, block_m), t)
    _variant_kernel[grid](x, gamma, out, h * w, x.stride(2), out.stride(2), float(c) ** 0.5, 1e-12,
                          C=c, BLOCK_C=block_c, BLOCK_M=block_m, COPY=copy, RCP=rcp, FAST_SILU=fast_silu,
                          ROUND=rounding, num_warps=warps, **opts)
    return out


def time_ms(fn):
    return cuda_time_ms(fn, iters=20)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    shapes = [(96, 2, 480, 832), (192, 2, 240, 416), (384, 4, 120, 208), (384, 4, 60, 104)]
    for c, t, h, w in shapes:
        g = torch.Generator(device="cuda").manual_seed(c)
        x = torch.randn(1, c, t, h, w, device="cuda", generator=g).half().to(memory_format=torch.channels_last_3d)
        gamma = (1 + 0.1 * torch.randn(c, device="cuda", generator=g)).half()
        out = torch.empty_like(x)
        gb = 2 * x.numel() * 2 / 1e9
        ref = vae_rms_norm(x, gamma, precise=True)  # the variants below are compared with the precise mode
        ms = time_ms(lambda: vae_rms_norm(x, gamma, out=out, precise=True))
        rows.append({"shape": [c, t, h, w], "variant": "vae_rms_norm precise=True", "ms": ms, "gbps": gb / ms * 1e3})
        fast = vae_rms_norm(x, gamma)
        ms = time_ms(lambda: vae_rms_norm(x, gamma, out=out))
        d = (fast.float() - ref.float()).abs()
        rows.append({"shape": [c, t, h, w], "variant": "vae_rms_norm (fast, default)", "ms": ms,
                     "gbps": gb / ms * 1e3, "equal_to_precise": bool(torch.equal(fast, ref)),
                     "frac_diff": float((d > 0).float().mean()), "max_abs_diff": float(d.max())})
        variants = {
            "copy (memory floor)": dict(copy=True),
            "same math (variant kernel)": dict(),
            "rcp-mul norm": dict(rcp=True),
            "fast silu": dict(fast_silu=True),
            "rcp-mul + fast silu": dict(rcp=True, fast_silu=True),
            "rcp + fast silu + no roundings": dict(rcp=True, fast_silu=True, rounding=False),
            "rcp + fast silu + fma fusion": dict(rcp=True, fast_silu=True, fusion=True),
            "same math BLOCK_M x2": dict(block_m=2 * max(1, 4096 // triton.next_power_of_2(c))),
            "same math 8 warps": dict(warps=8),
            "rcp-mul + fast silu 8 warps": dict(rcp=True, fast_silu=True, warps=8),
        }
        for name, kw in variants.items():
            o = torch.empty_like(x)
            run_variant(x, gamma, o, **kw)
            ms = time_ms(lambda: run_variant(x, gamma, o, **kw))
            d = (o.float() - ref.float()).abs()
            row = {"shape": [c, t, h, w], "variant": name, "ms": ms, "gbps": gb / ms * 1e3}
            if not kw.get("copy"):
                row["equal_to_precise"] = bool(torch.equal(o, ref))
                row["frac_diff"] = float((d > 0).float().mean())
                row["max_abs_diff"] = float(d.max())
            rows.append(row)
    for r in rows:
        extra = "" if "frac_diff" not in r else f"  equal_precise={r['equal_to_precise']} diff_frac={r['frac_diff']:.2e} max={r['max_abs_diff']:.2e}"
        print(f"{str(r['shape']):<22} {r['variant']:<32} {r['ms']:7.3f} ms {r['gbps']:7.0f} GB/s{extra}")
    save_experiment(args.out, rows)


if __name__ == "__main__":
    main()
