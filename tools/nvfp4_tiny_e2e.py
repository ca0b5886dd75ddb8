"""The tiny preset end to end on the CPU: each NVFP4 option against the dense run (fastremover.bench.harness's
nvfp4_fidelity, the rows `fastremover bench` stores in its JSON).

    python tools/nvfp4_tiny_e2e.py [--steps 12] [--frames 9] [--size 64] [--crop-size 320] [--json out.json]

Random tiny weights (preset `tiny`, weights seed 0), synthetic clips, eager mode, fp32 on the CPU (fp16 on a GPU
with --device cuda). Rows: nvfp4 (the DiT's block linears, W4A16), nvfp4+vae (and the VAE's 3x3x3 convs with at
least --vae-min-in-channels inputs: the tiny VAE has 8..32 channels, so the default here is 16, not the released
model's 192), nvfp4-w4a4 on a crop (a --crop-size frame with a small object; PSNR of the composited output inside
the mask). It also prints the released config's weight-memory figures (DiT and VAE).
"""

from __future__ import annotations

import argparse
import json
import sys

from fastremover import media
from fastremover.bench.harness import BenchInputs, format_nvfp4_table, nvfp4_fidelity
from fastremover.fast.nvfp4_conv import format_vae_memory_estimate, vae_conv_memory_estimate
from fastremover.ops.linear.nvfp4 import format_memory_estimate, nvfp4_memory_estimate
from fastremover.models.loading import random_models
from fastremover.models.transformer import RemoverTransformerConfig
from fastremover.models.vae import WanVAEConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--frames", type=int, default=9, help="4k+1")
    ap.add_argument("--size", type=int, default=64, help="square frame side of the full-frame rows (multiple of 16)")
    ap.add_argument("--crop-size", type=int, default=320, help="frame side of the crop rows (crops are >= 256 px)")
    ap.add_argument("--vae-min-in-channels", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="write the rows and the memory figures to this file")
    args = ap.parse_args(argv)
    video, mask = media.synthetic_clip(args.frames, args.size, args.size, seed=0)
    cvideo, cmask = media.synthetic_clip(args.frames, args.crop_size, args.crop_size, seed=1,
                                         object_fraction=0.003, travel=0.2)
    fid = nvfp4_fidelity(random_models("tiny", 0), BenchInputs("tiny", video.frames, mask, 24.0), steps=args.steps,
                         device=args.device, crop_inputs=BenchInputs("tiny-crop", cvideo.frames, cmask, 24.0),
                         vae_min_in_channels=args.vae_min_in_channels)
    print(f"tiny preset, {args.frames} frames, {args.size}x{args.size} (crop rows {args.crop_size}x{args.crop_size})")
    print(format_nvfp4_table(fid))
    dit, vae = nvfp4_memory_estimate(RemoverTransformerConfig()), vae_conv_memory_estimate(WanVAEConfig())
    print("released config (estimate):")
    print(format_memory_estimate(dit))
    print(format_vae_memory_estimate(vae))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"fidelity": fid, "memory_estimate": {"transformer": dit, "vae": vae}, "args": vars(args)}, fh,
                      indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
