"""Can cuDNN run the VAE's 3x3x3 convs in FP8 on Hopper, and how fast vs its fp16 conv? (GPU experiment.)

For the fast VAE's per-call shapes (channels-last, the causal 2-frame cache + new frames as one input, spatial
padding 1): torch's fp16 conv3d (cuDNN, what the fast VAE runs; for 96 channels also with channels zero-padded to
128) vs a cudnn-frontend graph with e4m3 image and
weight (fp32 accumulate) and fp16 output, with and without a fused per-tensor scale multiply. Every plan cuDNN
builds is timed; prints ms, TFLOP/s and the error vs fp16 (cosine). --out writes JSON.

    python experiments/cudnn_fp8_conv.py [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import cudnn

from fastremover.ops.attention.cudnn_fp8 import _build, _dtype  # graph build (all plans: the survey), dtype map
from fastremover.timing import cuda_time_ms
from _provenance import save_experiment

FP8 = torch.float8_e4m3fn


def time_ms(fn):
    return cuda_time_ms(fn, iters=10)


def build(handle, x, w, out, with_scale: bool = False):
    """The conv (causal cache included in x, spatial padding 1) as a cuDNN graph on x's / w's dtype (e4m3 or fp16),
    fp32 accumulate, fp16 output (with_scale: times a per-tensor fp32 scale S first), every plan built."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    X = g.tensor(name="X", dim=list(x.shape), stride=list(x.stride()), data_type=_dtype(cudnn, x.dtype))
    W = g.tensor(name="W", dim=list(w.shape), stride=list(w.stride()), data_type=_dtype(cudnn, w.dtype))
    Y = g.conv_fprop(image=X, weight=W, pre_padding=[0, 1, 1], post_padding=[0, 1, 1], stride=[1, 1, 1],
                     dilation=[1, 1, 1], compute_data_type=cudnn.data_type.FLOAT, name="conv")
    S = None
    if with_scale:
        Y.set_data_type(cudnn.data_type.FLOAT)
        S = g.tensor(name="S", dim=[1, 1, 1, 1, 1], stride=[1, 1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
        Y = g.mul(a=Y, b=S, compute_data_type=cudnn.data_type.FLOAT, name="scale")
    Y.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(cudnn.data_type.HALF)
    g, ws, n = _build(g, x.device, all_plans=True)
    return g, X, W, Y, S, n, ws


def survey(handle, rows, shape_key, label, x, w, ref, flop, scale=None, fidelity: bool = True):
    """Build the conv graph for x / w (fp16, or e4m3 with an fp32 `scale` fused when given) and time every plan;
    one row per plan. fidelity: cosine vs torch's fp16 conv (and, for fp16 inputs, whether the bits are equal)."""
    out = torch.empty(ref.shape, dtype=torch.float16, device=x.device).to(memory_format=torch.channels_last_3d)
    try:
        g, X, W, Y, S, n, ws = build(handle, x, w, out, with_scale=scale is not None)
    except Exception as exc:
        rows.append({"shape": shape_key, "variant": label, "error": repr(exc)[:300]})
        return
    pack = {X: x, W: w, Y: out}
    if S is not None:
        pack[S] = scale
    for i in range(n):
        row = {"shape": shape_key, "variant": f"{label} plan {i}", "plan": g.get_plan_name_at_index(i)}
        try:
            ms = time_ms(lambda: g.execute_plan_at_index(pack, ws, i, handle=handle))
            row.update(ms=ms, tflops=flop / ms / 1e9,
                       cos=float(F.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0))
                       if fidelity else None)
            if fidelity and x.dtype == torch.float16:
                row["equal_to_torch"] = bool(torch.equal(out, ref))
        except Exception as exc:
            row["error"] = repr(exc)[:200]
        rows.append(row)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--half-only", action="store_true", help="only the fp16 rows (no FP8 graphs)")
    p.add_argument("--half-plans", action="store_true",
                   help="also build and time every fp16 cuDNN plan (slow: ran past 60 s for six shapes)")
    args = p.parse_args()
    dev = torch.device("cuda")
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    rows = []
    # (C_in, C_out, T_in (2 cache + new), H, W): encoder level 0/1/2, decoder levels
    shapes = [(96, 96, 4, 480, 832), (192, 192, 4, 240, 416), (384, 384, 6, 120, 208), (384, 384, 6, 60, 104),
              (192, 192, 3, 480, 832), (96, 96, 3, 480, 832)]
    for cin, cout, t, h, w in shapes:
        g_ = torch.Generator(device=dev).manual_seed(cin + t)
        x = torch.randn(1, cin, t, h, w, device=dev, generator=g_).half().to(memory_format=torch.channels_last_3d)
        wt = (torch.randn(cout, cin, 3, 3, 3, device=dev, generator=g_) / (27 * cin) ** 0.5).half()
        wt = wt.to(memory_format=torch.channels_last_3d)
        flop = 2.0 * cout * cin * 27 * (t - 2) * h * w
        ref = F.conv3d(x, wt, padding=(0, 1, 1))
        ms = time_ms(lambda: F.conv3d(x, wt, padding=(0, 1, 1)))
        rows.append({"shape": [cin, cout, t, h, w], "variant": "torch fp16 conv3d (cuDNN)", "ms": ms,
                     "tflops": flop / ms / 1e9})
        if cin % 128:  # the 96-channel convs run at ~280 TFLOP/s vs ~620 at 192+: would zero-padded channels pay?
            for pin, pout in ((cin, 128 * -(-cout // 128)), (128 * -(-cin // 128), 128 * -(-cout // 128))):
                xp = torch.zeros(1, pin, t, h, w, device=dev, dtype=torch.float16).to(memory_format=torch.channels_last_3d)
                xp[:, :cin] = x
                wp = torch.zeros(pout, pin, 3, 3, 3, device=dev, dtype=torch.float16)
                wp[:cout, :cin] = wt
                wp = wp.to(memory_format=torch.channels_last_3d)
                yp = F.conv3d(xp, wp, padding=(0, 1, 1))
                ms = time_ms(lambda: F.conv3d(xp, wp, padding=(0, 1, 1)))
                rows.append({"shape": [cin, cout, t, h, w], "variant": f"torch fp16 padded to {pin}->{pout}", "ms": ms,
                             "tflops": flop / ms / 1e9, "equal_to_torch": bool(torch.equal(yp[:, :cout], ref))})
        if args.half_plans:  # fp16 through the frontend: is there a faster engine than torch's pick?
            survey(handle, rows, [cin, cout, t, h, w], "cudnn-fe fp16", x, wt, ref, flop)
        if args.half_only:
            continue
        sx = x.abs().amax().float() / 448
        sw = wt.abs().amax().float() / 448
        x8 = (x.float() / sx).to(FP8).to(memory_format=torch.channels_last_3d)
        w8 = (wt.float() / sw).to(FP8).to(memory_format=torch.channels_last_3d)
        scale = (sx * sw).reshape(1, 1, 1, 1, 1).contiguous()
        # unscaled, the fp16 output holds conv(codes): it overflows (|sum| ~ 27 * C * 90^2), so only the scaled graph
        # gets a fidelity number (the unscaled one is timed, for the cost of the scale)
        survey(handle, rows, [cin, cout, t, h, w], "cudnn fp8 scale=False", x8, w8, ref, flop, fidelity=False)
        survey(handle, rows, [cin, cout, t, h, w], "cudnn fp8 scale=True", x8, w8, ref, flop, scale=scale)
    for r in rows:
        if "error" in r:
            print(f"{str(r['shape']):<26} {r['variant']:<34} ERROR {r['error'][:150]}")
        else:
            print(f"{str(r['shape']):<26} {r['variant']:<34} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s"
                  f"  cos {r['cos'] if r.get('cos') is not None else float('nan'):.5f}  {r.get('plan', '')[:50]}"
                  + (f"  equal {r['equal_to_torch']}" if "equal_to_torch" in r else ""))
    save_experiment(args.out, rows)


if __name__ == "__main__":
    main()
