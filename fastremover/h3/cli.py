"""`fastremover h3-decode LATENTS.safetensors -o OUT.mp4`: MiniMax-H3 latents -> video with the H3 ViT VAE decoder.

    --weights PATH|random   a VAE checkpoint (.safetensors file, or a folder with diffusion_pytorch_model.safetensors
                            and config.json) or deterministic random weights at --preset (tiny | full)
    --tier 36L|8L           every block, or 8 evenly spaced ones (faster, approximate)
    --tiles-per-call N      spatial tiles decoded per decoder call (same output bits with --blocks nvfp4*)
    --blocks dense|nvfp4|nvfp4-fused   fp32 blocks (the release's precision), the eager NVFP4 blocks, or the fused
                            Triton NVFP4 blocks (a CUDA GPU with Triton, or TRITON_INTERPRET=1)
    --cuda-graphs           replay per-shape CUDA graphs of the fused block stack for small calls (CUDA only)

The latents file holds one tensor (or the one named by --key) shaped [C, T, h, w] or [1, C, T, h, w]: raw VAE
latents, or with --normalized the DiT's normalized ones (denormalized with the config's latent statistics). Every
check that needs no decoding runs first; a bad input prints one line and exits with code 2; the video is written
atomically (fastremover.media.write_video).
"""

from __future__ import annotations

import argparse
import os
import sys

from fastremover.env import triton_interpret
from fastremover.errors import FastRemoverError

BLOCKS = ("dense", "nvfp4", "nvfp4-fused")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("h3-decode", help="decode MiniMax-H3 latents to a video (the H3 ViT VAE decoder)")
    p.add_argument("latents", help="a .safetensors file with the latents [C, T, h, w] or [1, C, T, h, w]")
    p.add_argument("-o", "--output", required=True,
                   help="output .mp4/.mov/.mkv, a folder ending in / for PNG frames, or .png")
    p.add_argument("--weights", default="random", help="VAE checkpoint file/folder, or random (default; for tests)")
    p.add_argument("--preset", choices=["tiny", "full"], default="full", help="config for --weights random")
    p.add_argument("--weights-seed", type=int, default=0)
    p.add_argument("--tier", choices=["36L", "8L"], default="36L", help="36L: every block; 8L: 8 evenly spaced ones")
    p.add_argument("--tiles-per-call", type=int, default=1, help="spatial tiles per decoder call (default 1)")
    p.add_argument("--blocks", choices=BLOCKS, default="dense", help="block precision / implementation (default dense)")
    p.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs for small fused NVFP4 calls (CUDA only)")
    p.add_argument("--key", default=None, help="tensor name in the latents file (default: its only tensor)")
    p.add_argument("--normalized", action="store_true", help="the latents are normalized: denormalize them first")
    p.add_argument("--fps", type=float, default=24.0, help="frame rate of the output video (default 24)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--max-decoded-gib", type=float, default=4.0, help="refuse outputs larger than this (uint8 frames)")
    p.set_defaults(func=run)
    return p


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the floating-point dtypes


def _latent_shape(path: str, key: str | None) -> tuple[str, list[int]]:
    """(key, shape [1, C, T, h, w]) of the latents tensor, read from the safetensors header alone (no torch, nothing
    decoded); FastRemoverError for a missing or unreadable file, a missing key, a wrong rank, dtype or empty axis."""
    from safetensors import safe_open

    if not os.path.exists(path):
        raise FastRemoverError(f"no such file: {path}")
    if os.path.isdir(path):
        raise FastRemoverError(f"{path} is a folder; give the .safetensors file of the latents")
    try:
        with safe_open(path, framework="numpy") as f:
            keys = list(f.keys())
            if key is None:
                if len(keys) != 1:
                    raise FastRemoverError(f"{path} holds {len(keys)} tensors {keys[:5]}; name one with --key")
                key = keys[0]
            if key not in keys:
                raise FastRemoverError(f"{path} has no tensor {key!r} (it has {keys[:5]})")
            view = f.get_slice(key)
            shape, dtype = list(view.get_shape()), view.get_dtype()
    except FastRemoverError:
        raise
    except Exception as e:  # not a safetensors file, truncated, unreadable, ...
        raise FastRemoverError(f"cannot read {path} as safetensors: {e}") from None
    if len(shape) == 4:
        shape = [1, *shape]
    if len(shape) != 5 or shape[0] != 1:
        raise FastRemoverError(f"the latents must be [C, T, h, w] or [1, C, T, h, w], got {list(shape)}")
    if dtype not in FLOAT_DTYPES:
        raise FastRemoverError(f"the latents must be floating point, got {dtype}")
    if 0 in shape:
        names = ["batch", "channels", "frames", "height", "width"]
        raise FastRemoverError(f"the latents {shape[1:]} have no {names[shape.index(0)]}: every axis needs at least 1")
    return key, shape


def _load_latents(path: str, key: str):
    """The checked tensor (see _latent_shape) as fp32 [1, C, T, h, w]."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            z = f.get_tensor(key)
    except Exception as e:  # changed since it was checked, truncated data, ...
        raise FastRemoverError(f"cannot read {path} as safetensors: {e}") from None
    return (z[None] if z.dim() == 4 else z).float()


def _check_args(args) -> None:
    """Every flag, without importing torch."""
    from fastremover.config import validate_device
    from fastremover.options import validate_gib, validate_seed

    if not isinstance(args.tiles_per_call, int) or args.tiles_per_call < 1:
        raise FastRemoverError(f"--tiles-per-call must be >= 1, got {args.tiles_per_call}")
    if not (0 < args.fps <= 1000):  # nan fails this too
        raise FastRemoverError(f"--fps must be in (0, 1000], got {args.fps}")
    validate_gib(args.max_decoded_gib)
    validate_seed(args.weights_seed, "--weights-seed")
    validate_device(args.device)
    if args.cuda_graphs and args.blocks != "nvfp4-fused":
        raise FastRemoverError("--cuda-graphs applies to the fused NVFP4 blocks; add --blocks nvfp4-fused")
    if args.cuda_graphs and (args.device or "cuda").startswith("cpu"):
        raise FastRemoverError("--cuda-graphs needs a CUDA device")
    if args.weights != "random" and not os.path.exists(args.weights):
        raise FastRemoverError(f"--weights {args.weights}: no such file or folder (or use --weights random)")


def _device(args):
    """The torch device of --device (checked by _check_args; None: a CUDA GPU if one is visible, else the CPU)."""
    from fastremover.config import validate_device
    from fastremover.engine.build import resolve_device

    return resolve_device(validate_device(args.device))


def run(args) -> int:
    """The h3-decode command (raises FastRemoverError for user errors; fastremover.cli turns it into exit 2). Every
    check that needs neither torch nor the model (flags, the output path, the latents' header) runs first."""
    from fastremover.outputs import Wanted, check_outputs

    _check_args(args)
    weights = None if args.weights == "random" else args.weights
    (target,) = check_outputs([Wanted("-o", args.output)], inputs=[args.latents, weights])
    key, shape = _latent_shape(args.latents, args.key)

    import numpy as np
    import torch

    from fastremover import media
    from fastremover.models import h3_decoder as h3

    device = _device(args)
    if args.cuda_graphs and device.type != "cuda":
        raise FastRemoverError("--cuda-graphs needs a CUDA device")
    if args.blocks == "nvfp4-fused" and device.type != "cuda" and not triton_interpret():
        raise FastRemoverError("--blocks nvfp4-fused needs a CUDA GPU with Triton (or TRITON_INTERPRET=1 for tests)")
    cfg = h3.preset(args.preset) if args.weights == "random" else h3.checkpoint_config(args.weights)
    if shape[1] != cfg.latent_channels:
        raise FastRemoverError(f"the latents have {shape[1]} channels; this decoder takes {cfg.latent_channels}")
    _, _, frames = h3.temporal_plan(cfg, shape[2])
    height, width = shape[3] * cfg.patch_size, shape[4] * cfg.patch_size
    target.check_frames(frames)
    gib = frames * height * width * 3 / 2**30
    if gib > args.max_decoded_gib:
        raise FastRemoverError(f"the video would be {frames} frames of {width}x{height} = {gib:.1f} GiB, over "
                               f"--max-decoded-gib {args.max_decoded_gib:g}")
    z = _load_latents(args.latents, key)
    if args.weights == "random":
        print(f"note: random weights ({args.preset} preset): the video shows what a random decoder makes",
              file=sys.stderr)
        model = h3.random_decoder(cfg, seed=args.weights_seed)
    else:
        model = h3.load_decoder(args.weights, cfg)
    model = model.to(device)
    z = z.to(device)
    if args.normalized:
        z = model.denormalize_latents(z)
    blocks = None
    with torch.no_grad():
        if args.blocks != "dense":
            from fastremover.fast.h3_nvfp4 import build_nvfp4_stack

            window = z[:, :, :cfg.chunk_tokens + cfg.overlap_tokens]
            blocks = build_nvfp4_stack(model, window, tier=args.tier, fused=args.blocks == "nvfp4-fused",
                                       cuda_graphs=args.cuda_graphs)
        sample = model.decode(z, tier=args.tier, tiles_per_call=args.tiles_per_call, blocks=blocks)
        pixels = model.to_pixels(sample)[0]  # [3, F, H, W] in [0, 1]
    out = (pixels.permute(1, 2, 3, 0) * 255).round().to(torch.uint8).cpu().numpy()
    media.write_video(target.write_path, np.ascontiguousarray(out), args.fps)
    print(f"wrote {args.output}: {out.shape[0]} frames {width}x{height} ({args.blocks}, tier {args.tier}, "
          f"{args.tiles_per_call} tile(s) per call)")
    return 0
