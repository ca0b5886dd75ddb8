"""The tiny preset end to end on the CPU: dense vs --weights nvfp4 (W4A16) vs nvfp4-w4a4, fidelity against dense.

    python tools/nvfp4_tiny_e2e.py [--steps 12] [--frames 9] [--size 64] [--json out.json]

Random tiny weights (preset `tiny`, weights seed 0), a synthetic clip with a square mask, eager mode, fp32. For each
NVFP4 option the same pipeline is built, the DiT's block linears are replaced (fastremover.fast.nvfp4_linear), and
the run's decoded video (before compositing) and final latents are compared with the dense run's: PSNR (mean / worst
frame / inside the mask), latent cosine. A second pass runs --crop on (a box around the mask) and reports the PSNR of
the composited output inside the mask, the mode W4A4 is meant for. It also prints the real config's memory figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np
import torch

from fastremover.bench.metrics import fidelity
from fastremover.fast.nvfp4_linear import (
    Nvfp4Linear,
    format_memory_estimate,
    nvfp4_memory_estimate,
    quantize_linears_nvfp4,
)
from fastremover.models.loading import random_models
from fastremover.models.transformer import RemoverTransformerConfig
from fastremover.options import RunOptions
from fastremover.pipeline import RemovalPipeline


def synthetic_clip(frames: int, size: int, seed: int = 0, mask_side: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Smooth moving gradients plus noise, and a square mask (side mask_side, default size/4) in the middle
    (uint8 [F,S,S,3], bool [F,S,S])."""
    g = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    video = np.empty((frames, size, size, 3), np.float32)
    for f in range(frames):
        for c in range(3):
            video[f, :, :, c] = 0.5 + 0.4 * np.sin(2 * math.pi * (xx * (c + 1) + yy * (2 - c) + 0.05 * f))
    video = np.clip(video + g.normal(0, 0.03, video.shape), 0, 1)
    mask = np.zeros((frames, size, size), bool)
    half = (mask_side or size // 4) // 2
    lo, hi = size // 2 - half, size // 2 + half
    mask[:, lo:hi, lo:hi] = True
    return (video * 255).round().astype(np.uint8), mask


def run(weights: str, frames: np.ndarray, mask: np.ndarray, options: RunOptions, keep: bool):
    pipe = RemovalPipeline(random_models("tiny", 0), device="cpu", precision="fp32", mode="eager")
    report = None
    calls = []
    if weights != "dense":
        report = quantize_linears_nvfp4(pipe.models.transformer, w4a4=weights == "nvfp4-w4a4")
        for mod in pipe.models.transformer.modules():  # proof that the NVFP4 layers ran
            if isinstance(mod, Nvfp4Linear):
                mod.register_forward_hook(lambda *_: calls.append(1))
    result = pipe.remove(frames, mask, options, keep_pixels=keep)
    return result, report, len(calls)


def masked_psnr_uint8(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    d = (a.astype(np.float64) - b.astype(np.float64))[mask] / 255.0
    mse = float((d * d).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--crop-size", type=int, default=320,
                    help="frame size of the crop-mode pass (mask 16 px; crops are >= 256 px)")
    ap.add_argument("--json", default=None, help="write the numbers to this file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []

    frames, mask = synthetic_clip(args.frames, args.size)
    full = RunOptions(steps=args.steps, seed=42, crop="off")
    dense, _, _ = run("dense", frames, mask, full, keep=True)
    for weights in ("nvfp4", "nvfp4-w4a4"):
        res, report, calls = run(weights, frames, mask, full, keep=True)
        fid = fidelity(res.pixels, dense.pixels, torch.from_numpy(res.mask), res.latents, dense.latents)
        rows.append({"pass": "full frame", "weights": weights, "nvfp4_calls": calls, **fid,
                     "linear_bytes": [report.linear_bytes_before, report.linear_bytes_after]})

    cframes, cmask = synthetic_clip(args.frames, args.crop_size, seed=1, mask_side=16)
    crop = RunOptions(steps=args.steps, seed=42, crop="on")
    cdense, _, _ = run("dense", cframes, cmask, crop, keep=False)
    for weights in ("nvfp4", "nvfp4-w4a4"):
        res, _, calls = run(weights, cframes, cmask, crop, keep=False)
        boxes = [w.box for w in res.windows if w.ran]
        rows.append({"pass": f"crop {boxes[0] if boxes else None}", "weights": weights, "nvfp4_calls": calls,
                     "psnr_mask_db": masked_psnr_uint8(res.frames, cdense.frames, res.mask)})

    print(f"tiny preset, {args.frames} frames, {args.steps} steps, CPU fp32, fidelity against the dense run")
    print(f"{'pass':<34} {'weights':<11} {'PSNR mean':>9} {'worst':>7} {'in mask':>8} {'lat cos':>9} {'calls':>6}")
    for r in rows:
        def f(key, fmt):
            v = r.get(key)
            return format(v, fmt) if isinstance(v, float) else "-"
        print(f"{r['pass']:<34} {r['weights']:<11} {f('psnr_mean_db', '9.2f'):>9} {f('psnr_min_db', '7.2f'):>7} "
              f"{f('psnr_mask_db', '8.2f'):>8} {f('latent_cos', '9.6f'):>9} {r['nvfp4_calls']:>6}")
    est = nvfp4_memory_estimate(RemoverTransformerConfig())
    print("released config (estimate):")
    print(format_memory_estimate(est))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "memory_estimate": est, "args": vars(args)}, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
