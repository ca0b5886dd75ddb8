"""How far is fastremover's output from the released MiniMax-Remover pipeline, difference by difference?
python tools/upstream_diff.py [--out bench/results] [--steps 12] [--seed 42] [--preset tiny]

The figures of docs/upstream.md. "Upstream" is the released pipeline (zibojia/MiniMax-Remover, pinned to diffusers
0.33.1) as its own code computes it: the upstream-order reference (fastremover.bench.reference.ReferencePipeline:
upstream's transformer structure, diffusers' VAE and UniPC, scipy dilation) with diffusers 0.33.1's schedule
(--schedule minimax-remover) and upstream's export (uint8 by truncation, every pixel the model's, 4k+1 frames, the
output at the run size). On the CPU in fp32 with random weights at `--preset` (tiny by default), 9-frame 96x64
synthetic clips (10 frames for the frame-tail row, 88x56 for the padding row, 512x288 for the crop row: --crop auto
crops only frames whose crop box, at least 256 on a side, is under half the frame).

Each row switches ONE behaviour of `fastremover remove --upstream-compatible` back to fastremover's default and
reports the PSNR (dB, uint8 frames, whole frames) between that output and upstream's; the last rows compare the plain
defaults and --upstream-compatible itself with upstream. Rows that are not a pixel comparison say what they measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastremover.bench.harness import script_environment  # noqa: E402
from fastremover.bench.reference import ReferencePipeline  # noqa: E402
from fastremover.config import EngineConfig  # noqa: E402
from fastremover.masks import dilate_masks  # noqa: E402
from fastremover.media import synthetic_clip  # noqa: E402
from fastremover.models.loading import random_models  # noqa: E402
from fastremover.options import UPSTREAM_COMPATIBLE, RunOptions, upstream_compatible  # noqa: E402
from fastremover.pipeline import RemovalPipeline  # noqa: E402


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def truncate(pixels: torch.Tensor) -> np.ndarray:
    """Upstream's export: postprocess_video's (x * 0.5 + 0.5).clamp(0, 1), then export_to_video's (f * 255) as uint8."""
    x = (pixels[0] * 0.5 + 0.5).clamp(0, 1).float().permute(1, 2, 3, 0).numpy()
    return (x * 255).astype(np.uint8)


def upstream(ref: ReferencePipeline, frames, mask, steps: int, seed: int, dilate: int) -> np.ndarray:
    """The released pipeline's output for a clip it can take unchanged (sides multiples of 16): its VAE encodes the
    first 4k+1 frames and drops the rest."""
    kept = (len(frames) - 1) // 4 * 4 + 1
    h, w = frames.shape[1:3]
    result = ref(frames[:kept], mask[:kept], height=h, width=w, steps=steps, seed=seed, iterations=dilate,
                 schedule="minimax-remover")
    return truncate(result.pixels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results", help="folder for the JSON (default bench/results; '' = none)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--dilate", type=int, default=6)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--weights-seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(0)

    models = random_models(args.preset, seed=args.weights_seed)
    ref = ReferencePipeline(models, device="cpu", dtype=torch.float32)
    pipe = RemovalPipeline(models, EngineConfig(device="cpu", precision="fp32", mode="eager"))
    base = RunOptions(steps=args.steps, seed=args.seed, dilate=args.dilate)
    compat = upstream_compatible(base)
    default = RunOptions()

    def ours(frames, mask, options):
        return pipe.remove(frames, mask, options)

    # A small object on a short path, so that --crop auto does crop (a box under half the frame).
    video, mask = synthetic_clip(9, 64, 96, seed=1, object_fraction=0.05, travel=0.25)
    frames = video.frames
    theirs = upstream(ref, frames, mask, args.steps, args.seed, args.dilate)
    rows = []

    def row(what: str, option: str, options: RunOptions, clip=(frames, mask, theirs), note: str = "", **extra):
        f, m, up = clip
        result = ours(f, m, options)
        out = result.frames
        n = min(len(out), len(up))
        rec = {"what": what, "restores": option, "psnr_db": round(psnr(out[:n], up[:n]), 2),
               "frames_ours": len(out), "frames_upstream": len(up),
               "crop_boxes": [list(w.box) if w.box else None for w in result.windows if w.ran], **extra}
        if note:
            rec["note"] = note
        rows.append(rec)
        print(f"{what:<44} {rec['psnr_db']:>7} dB   ({option})", flush=True)
        return out

    # One behaviour at a time back to fastremover's: the other schedule, rounding, compositing (crop and the frame
    # tail have clips of their own below).
    for name, value in (("schedule", "diffusers"), ("rounding", "round"), ("composite", True)):
        flag = {"composite": "--no-composite"}.get(name, f"--{name.replace('_', '-')} {UPSTREAM_COMPATIBLE[name]}")
        row(f"{name}: {value}", flag, dataclasses.replace(compat, **{name: value}))

    # Crop: --crop auto crops only where the box (the mask's with context, sides >= 256) is under half the frame.
    video_big, mask_big = synthetic_clip(9, 288, 512, seed=1, object_fraction=0.02, travel=0.1)
    up_big = upstream(ref, video_big.frames, mask_big, args.steps, args.seed, args.dilate)
    row("crop: auto, 9 frames 512x288", "--crop off", dataclasses.replace(compat, crop="auto"),
        clip=(video_big.frames, mask_big, up_big))
    row("--upstream-compatible, 9 frames 512x288", "--upstream-compatible", compat,
        clip=(video_big.frames, mask_big, up_big))

    # Frame tail: a 10-frame clip (4k+2). Upstream outputs 9 frames; fastremover keeps 10 (padding to 13 frames for the
    # VAE, so even the first 9 differ).
    video10, mask10 = synthetic_clip(10, 64, 96, seed=1, object_fraction=0.05, travel=0.25)
    up10 = upstream(ref, video10.frames, mask10, args.steps, args.seed, args.dilate)
    clip10 = (video10.frames, mask10, up10)
    row("frame_tail: keep, 10 frames", "--frame-tail drop",
        dataclasses.replace(compat, frame_tail="keep"), clip=clip10, note="PSNR over the 9 frames upstream outputs")
    row("--upstream-compatible, 10 frames", "--upstream-compatible", compat, clip=clip10)

    # Native size that is not a multiple of 16: upstream cannot run it; it resizes every clip to its run size (and
    # writes that size). fastremover pads (replicate) to the next multiple of 16 and crops back; --size WxH resizes as
    # upstream does (and resizes back to the source size).
    video_odd, mask_odd = synthetic_clip(9, 56, 88, seed=1, object_fraction=0.05, travel=0.25)
    padded = ours(video_odd.frames, mask_odd, compat).frames
    resized = ours(video_odd.frames, mask_odd, dataclasses.replace(compat, size="96x64")).frames
    rows.append({"what": "native size 88x56: replicate padding to 96x64 vs resizing to 96x64 (both at 88x56)",
                 "restores": "--size 96x64", "psnr_db": round(psnr(padded, resized), 2),
                 "note": "not against upstream, which cannot run 88x56: between fastremover's padding and a resize "
                         "like upstream's (upstream then writes 96x64; fastremover resizes back to 88x56)"})
    print(f"{'padding vs resize at 88x56':<44} {rows[-1]['psnr_db']:>7} dB", flush=True)

    # Dilation: the same L1 diamond for iterations >= 1; at 0 scipy dilates until nothing changes (the whole frame for a
    # connected mask), fastremover does not dilate.
    import scipy.ndimage

    same = all(np.array_equal(dilate_masks(mask, d)[i], scipy.ndimage.binary_dilation(mask[i], iterations=d))
               for d in (1, 6, 16) for i in range(len(mask)))
    zero = float(np.mean([scipy.ndimage.binary_dilation(mask[i], iterations=0).mean() for i in range(len(mask))]))
    rows.append({"what": "dilation: masks for --dilate 1, 6, 16 equal scipy's binary_dilation(iterations=N)",
                 "restores": "--dilate N", "identical": same,
                 "note": f"--dilate 0: fastremover masks {float(mask.mean()) * 100:.1f}% of the pixels (the mask as "
                         f"given); upstream's iterations=0 masks {zero * 100:.1f}% (dilation until stable)"})
    print(f"{'dilation masks identical (1, 6, 16)':<44} {same}", flush=True)

    row("fastremover's defaults", "--upstream-compatible", dataclasses.replace(default, steps=args.steps,
                                                                             seed=args.seed, dilate=args.dilate))
    compat_out = row("--upstream-compatible", "--upstream-compatible", compat)
    differing = int((compat_out != theirs).any(axis=-1).sum())
    rows[-1]["pixels_differing"] = differing
    rows[-1]["max_abs_difference"] = int(np.abs(compat_out.astype(int) - theirs.astype(int)).max())

    record = {**script_environment(), "preset": args.preset, "weights_seed": args.weights_seed, "steps": args.steps,
              "seed": args.seed, "dilate": args.dilate, "device": "cpu", "precision": "fp32",
              "clip": "synthetic_clip(9, 64, 96, seed=1, object_fraction=0.05, travel=0.25)",
              "upstream": "ReferencePipeline (upstream order) with diffusers 0.33.1's schedule, uint8 by truncation, "
                          "4k+1 frames, no compositing", "rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"upstream-diff-cpu-{_dt.date.today().isoformat()}-{record['commit'][:7]}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
