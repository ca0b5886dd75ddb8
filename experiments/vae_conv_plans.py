"""Where the fast VAE's cuDNN convs spend their time at W2, and whether another cuDNN plan is faster (H200).

    python experiments/vae_conv_plans.py [--frames 81 --height 480 --width 832] [--top 8] [--out PATH]

1. Runs the fast VAE (fp16, default options) on a W2-sized clip: both removal encodes and the decode, once to warm
   up and once recorded: every F.conv3d / F.conv2d call is timed with CUDA events and grouped by its signature
   (input shape and strides, weight shape, stride, padding, bias or not).
2. For the `--top` signatures by total time: one sample input (pass 3 keeps them), timed as called (torch's cuDNN
   heuristics, what runs today), with torch.backends.cudnn.benchmark=True, and every plan cuDNN-frontend builds for
   the bias-free conv (its heuristics' list, mode A + FALLBACK, all plans built), each plan checked against the
   default call (torch.equal and max |difference|).

The question it answers: could a pinned plan (chosen by name, so the same in every process) buy back time in the
convs that dominate the encode and decode? Prints one table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastremover.bench.harness import script_environment  # noqa: E402
from fastremover.fast.cudnn_conv import _CudnnConvPlans  # noqa: E402
from fastremover.timing import cuda_time_ms  # noqa: E402


def _time_ms(fn) -> float:
    return cuda_time_ms(fn, iters=5, warmup=1)


class Recorder:
    """Wraps F.conv3d / F.conv2d: per signature, call count and summed CUDA time; optionally keeps samples."""

    def __init__(self):
        self.events: list[tuple[tuple, torch.cuda.Event, torch.cuda.Event]] = []
        self.keep: set[tuple] = set()
        self.samples: dict[tuple, tuple] = {}
        self.orig = {"conv3d": F.conv3d, "conv2d": F.conv2d}

    def key(self, name, x, w, b, args):
        return (name, tuple(x.shape), tuple(x.stride()), tuple(w.shape), tuple(w.stride()), b is not None, args)

    def wrap(self, name):
        orig = self.orig[name]

        def call(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
            if dilation not in (1, (1,) * (x.dim() - 2)) or groups != 1:
                raise NotImplementedError("the recorder covers dilation 1, groups 1")
            nd = x.dim() - 2
            args = tuple(tuple(a) if isinstance(a, (tuple, list)) else (a,) * nd for a in (stride, padding))
            k = self.key(name, x, w, b, args)
            if k in self.keep and k not in self.samples:
                self.samples[k] = (x.clone(memory_format=torch.preserve_format), w, b, args)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            y = orig(x, w, b, *args)
            e.record()
            self.events.append((k, s, e))
            return y

        return call

    def __enter__(self):
        F.conv3d, F.conv2d = self.wrap("conv3d"), self.wrap("conv2d")
        return self

    def __exit__(self, *exc):
        F.conv3d, F.conv2d = self.orig["conv3d"], self.orig["conv2d"]

    def table(self) -> dict:
        torch.cuda.synchronize()
        out: dict[tuple, list] = {}
        for k, s, e in self.events:
            out.setdefault(k, []).append(s.elapsed_time(e))
        self.events.clear()
        return out


def _frontend_survey(x, w, args, ref, ms_default):
    """Every plan cuDNN-frontend offers for the bias-free conv (the graph fast/cudnn_conv.py builds), each timed and
    compared with torch's output `ref`."""
    plans = _CudnnConvPlans(x, w, ref, *args, names=None)
    y = torch.empty_strided(ref.shape, ref.stride(), dtype=ref.dtype, device=ref.device)
    rows = [{"name": name, "error": why} for name, why in plans.failed.items()]
    for name, i in plans.built.items():
        try:
            ms = _time_ms(lambda i=i: plans.run(i, x, w, y))
            rows.append({"plan": i, "name": name, "ms": round(ms, 4), "vs_default": round(ms / ms_default, 3),
                         "equal": bool(torch.equal(y, ref)),
                         "max_abs_diff": float((y.float() - ref.float()).abs().max()),
                         "workspace_mib": round(plans.workspace[i] / 2**20, 1)})
        except Exception as exc:  # noqa: BLE001 - a plan that does not run is a row, not a failure
            rows.append({"plan": i, "name": name, "error": repr(exc)[:160]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    from fastremover import media
    from fastremover.fast.vae import FastWanVAE
    from fastremover.models.loading import PRESETS, random_init_
    from fastremover.models.vae import WanVAE, WanVAEConfig

    t0 = time.time()
    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float16
    vae = random_init_(WanVAE(WanVAEConfig.from_dict(PRESETS["minimax-remover"]["vae"])), 1).eval()
    fast = FastWanVAE(vae, device=dev, dtype=dtype)
    video, mask = media.synthetic_clip(args.frames, args.height, args.width, seed=0)
    x = torch.from_numpy(video.frames).to(dev).permute(3, 0, 1, 2)[None].float().div_(127.5).sub_(1.0).to(dtype)
    m = torch.from_numpy(mask).to(dev)[None, None].expand(1, 3, -1, -1, -1).to(dtype).contiguous()

    def encode():
        with torch.no_grad():
            return fast.encode_removal_inputs(x, m)

    def decode(z):
        with torch.no_grad():
            return fast.decode(z)

    za, _ = encode()
    decode(za)
    torch.cuda.synchronize()
    rec = Recorder()
    stage = {}
    for name, fn in (("encode", encode), ("decode", lambda: decode(za))):
        with rec:
            fn()
        stage[name] = rec.table()
    signatures = []
    for name, tab in stage.items():
        for k, ts in tab.items():
            signatures.append({"stage": name, "key": k, "calls": len(ts), "ms": sum(ts)})
    signatures.sort(key=lambda r: -r["ms"])
    totals = {name: round(sum(sum(ts) for ts in tab.values()), 2) for name, tab in stage.items()}
    top = signatures[: args.top]
    rec.keep = {r["key"] for r in top}
    with rec:
        encode()
        decode(za)
    rec.table()
    results = []
    for r in top:
        k = r["key"]
        xs, w, b, cargs = rec.samples[k]
        conv = F.conv3d if k[0] == "conv3d" else F.conv2d
        ref = conv(xs, w, None, *cargs)
        ms_default = _time_ms(lambda: conv(xs, w, None, *cargs))
        torch.backends.cudnn.benchmark = True
        try:
            ms_bench = _time_ms(lambda: conv(xs, w, None, *cargs))
            yb = conv(xs, w, None, *cargs)
            bench_equal = bool(torch.equal(yb, ref))
        finally:
            torch.backends.cudnn.benchmark = False
        try:
            plans = _frontend_survey(xs, w, tuple(cargs), ref, ms_default)
        except Exception as exc:  # noqa: BLE001
            plans = [{"error": repr(exc)[:300]}]
        flops = 2 * ref.numel() * w[0].numel()
        ok = [q for q in plans if "ms" in q]
        best = min(ok, key=lambda q: q["ms"]) if ok else None
        results.append({"stage": r["stage"], "conv": k[0], "x": list(k[1]), "x_stride": list(k[2]), "w": list(k[3]),
                        "bias": k[5], "stride_padding": [list(a) for a in k[6]], "calls": r["calls"], "total_ms": round(r["ms"], 2),
                        "default_ms": round(ms_default, 4), "default_tflops": round(flops / ms_default / 1e9, 1),
                        "benchmark_ms": round(ms_bench, 4), "benchmark_equal": bench_equal,
                        "plans": plans, "best": best})
        del xs
    out = {**script_environment(), "shape": [args.frames, args.height, args.width], "stage_conv_ms": totals,
           "signatures": [{**s, "key": [str(v) for v in s["key"]],
                           "ms": round(s["ms"], 2)} for s in signatures[:40]],
           "top": results, "wall_s": round(time.time() - t0, 1)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"conv time by stage (ms): {totals}")
    print(f"{'stage':7} {'x':>26} {'w':>18} {'calls':>5} {'total':>8} {'call':>7} {'TF/s':>6} {'bench':>7} "
          f"{'best plan':>9} {'eq':>3}  name")
    for r in results:
        b = r["best"] or {}
        print(f"{r['stage']:7} {str(r['x']):>26} {str(r['w']):>18} {r['calls']:5d} {r['total_ms']:8.1f} "
              f"{r['default_ms']:7.3f} {r['default_tflops']:6.1f} {r['benchmark_ms']:7.3f} "
              f"{b.get('ms', float('nan')):9.3f} {str(b.get('equal', '-'))[:1]:>3}  {b.get('name', '')[:60]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
