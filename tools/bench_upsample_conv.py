"""The sub-pixel nearest-2x + 3x3 conv kernel (fastremover/fast/kernels/upsample_conv.py) in the lab: offline sm_90
codegen check and GPU benchmark against the eager pair (F.interpolate + cuDNN conv2d).

    python tools/bench_upsample_conv.py --codegen             # no GPU needed
    python tools/bench_upsample_conv.py --bench [--out FILE]  # GPU
"""

from __future__ import annotations

import sys



def _load() -> None:
    """The kernel module's names the code below uses, imported after the arguments are parsed (so --help is fast)."""
    import fastremover.fast.kernels.upsample_conv as kernel

    globals().update({name: getattr(kernel, name) for name in ('_TUNED', '_upsample_conv_kernel', 'block_k_for', 'candidate_configs', 'interpreting', 'phase_weights', 'torch', 'triton', 'upsample_conv2x', 'upsample_conv2x_eager', 'upsample_conv2x_reference')})


# ----------------------------------------------------------------------------------------------------------------------
# Offline codegen check and GPU benchmark: python tools/bench_upsample_conv.py --codegen | --bench

# (N frames, Cin, Cout, h, w): the W2 decoder's three upsampling convs (input sizes), 1 and 4 frames
BENCH_SHAPES = [(4, 384, 192, 60, 104), (4, 384, 192, 120, 208), (4, 192, 96, 240, 416), (1, 192, 96, 240, 416)]


def codegen_check(verbose: bool = True) -> list[str]:
    """Compile every candidate config of the W2 shapes for sm_90 without a GPU: fp16 wgmma (HGMMA) and TMA
    loads/stores present, no register spills, no shared-memory round trip through registers in the K loop."""
    import re

    from codegen_check import _compile

    problems = []
    for nf, cin, cout, h, w in BENCH_SHAPES[:3]:
        bk = block_k_for(cin)
        for cfg in candidate_configs(cin, cout, w, nf * h * w * 4):
            n1 = cfg.block_n1 or cfg.block_n0
            sig = {"XD": f"tensordesc<fp16[1, {cfg.bh}, {cfg.bw}, {bk}]>",
                   "WD0": f"tensordesc<fp16[{cfg.block_n0}, {bk}]>", "WD1": f"tensordesc<fp16[{n1}, {bk}]>",
                   "BIAS": "*fp16", "YD0": f"tensordesc<fp16[1, {cfg.bh}, 1, {cfg.bw}, {cfg.block_n0}]>",
                   "YD1": f"tensordesc<fp16[1, {cfg.bh}, 1, {cfg.bw}, {n1}]>",
                   "H": "i32", "W": "i32", "CIN": "i32", "COUT": "i32"}
            consts = dict(BH=cfg.bh, BW=cfg.bw, BLOCK_K=bk, BLOCK_N0=cfg.block_n0, BLOCK_N1=cfg.block_n1,
                          HAS_BIAS=True, INTERPRET=False)
            c = _compile(_upsample_conv_kernel, sig, consts, cfg.num_warps, cfg.num_stages, divisible=("CIN", "COUT"))
            sass = c.asm["sass"]
            counts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "UTMALDG", "UTMASTG", "LDS", "STS")}
            spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
            name = f"Cin={cin} Cout={cout} w={w} {cfg}"
            if not counts["HGMMA"] or not counts["UTMALDG"] or not counts["UTMASTG"]:
                problems.append(f"{name}: missing wgmma or TMA: {counts}")
            if spills:
                problems.append(f"{name}: {spills} spill instructions")
            if counts["LDS"] or counts["STS"]:
                problems.append(f"{name}: shared-memory loads/stores through registers: {counts}")
            if verbose:
                print(f"{name}: {counts}, STL/LDL {spills}, shared {c.metadata.shared} B", flush=True)
    return problems


def bench(out_path: str | None = None) -> list[dict]:
    """GPU: the sub-pixel kernel (tuned) vs the eager pair (F.interpolate + cuDNN conv2d, channels-last, fp16) at the
    W2 decoder's shapes; error against the float64 reference on the first frame."""
    import json
    import time

    from triton.testing import do_bench

    from fastremover.bench.metrics import cosine

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name(dev)}  triton {triton.__version__}  torch {torch.__version__}")
    print(f"{'N':>2s} {'Cin->Cout':>10s} {'h x w':>9s} {'eager ms':>9s} {'ours ms':>8s} {'ratio':>6s} {'ours TF/s':>9s} "
          f"{'cos':>9s} {'err/bound':>9s} config")
    for nf, cin, cout, h, w in BENCH_SHAPES:
        x = torch.randn(nf, cin, h, w, device=dev, generator=g).half().contiguous(memory_format=torch.channels_last)
        wt = (torch.randn(cout, cin, 3, 3, device=dev, generator=g) / (9 * cin) ** 0.5).half().contiguous(
            memory_format=torch.channels_last)
        b = (torch.randn(cout, device=dev, generator=g) * 0.1).half()
        wp = phase_weights(wt, torch.float16)
        y = upsample_conv2x(x, wp, b)  # tunes
        ye = upsample_conv2x_eager(x, wt, b)
        t_e = do_bench(lambda: upsample_conv2x_eager(x, wt, b), warmup=10, rep=50, return_mode="median")
        t_o = do_bench(lambda: upsample_conv2x(x, wp, b), warmup=10, rep=50, return_mode="median")
        yr, s = upsample_conv2x_reference(x[:1], wt, b)
        bound = (2.0**-11 + (4 * cin + 2) * 2.0**-24) * s + 2.0**-10 * (yr.float().abs() + 1e-3)
        err = float(((y[:1].float() - yr.float()).abs() / bound).max())
        flops = 2.0 * nf * 4 * h * w * cout * 4 * cin  # the sub-pixel form's FLOPs (eager does 9/4 of them)
        key = next(k for k in _TUNED if k[:3] == (cin, cout, w))
        row = {"n": nf, "cin": cin, "cout": cout, "h": h, "w": w, "eager_ms": t_e, "ours_ms": t_o,
               "ratio": t_e / t_o, "ours_tflops": flops / t_o / 1e9, "cos_vs_eager": cosine(y, ye),
               "err_over_bound_frame0": err, "config": _TUNED[key].__dict__}
        rows.append(row)
        print(f"{nf:>2d} {cin:>4d}->{cout:<5d} {h:>3d}x{w:<5d} {t_e:9.3f} {t_o:8.3f} {t_e / t_o:6.2f} "
              f"{row['ours_tflops']:9.0f} {row['cos_vs_eager']:9.6f} {err:9.3f} {_TUNED[key]}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "triton": triton.__version__,
                       "torch": torch.__version__, "time": time.time(), "rows": rows}, f, indent=1)
    return rows


def main(argv=None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="sub-pixel nearest-2x + 3x3 conv kernel: codegen check / GPU benchmark")
    ap.add_argument("--codegen", action="store_true", help="offline sm_90 compile + SASS check (no GPU needed)")
    ap.add_argument("--bench", action="store_true", help="GPU benchmark vs the eager pair")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    _load()
    if a.codegen:
        if interpreting(_upsample_conv_kernel):
            print("unset TRITON_INTERPRET for --codegen", file=sys.stderr)
            return 2
        from codegen_check import report

        return report(codegen_check())
    if a.bench:
        bench(a.out)
        return 0
    ap.print_help()
    return 2


if __name__ != "__main__":  # imported (experiments, tests): everything at once
    _load()

if __name__ == "__main__":
    sys.exit(main())
