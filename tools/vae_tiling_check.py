"""The tiled Wan VAE's memory-capped GPU check: encode + decode 81x1088x1920 under a 24 GiB cap (GPU).

    python tools/vae_tiling_check.py --gpu-check [--fast] [--frames 81] [--height 1088] [--width 1920] [--cap-gib 24]

Prints `fastremover.fast.vae_tiling.gpu_check`'s JSON (the plan, tiles, peak memory, the memory model against the
allocator). tests/test_vae_tiling.py runs the same check as a GPU test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Tiled Wan VAE: 1080p memory-capped GPU check")
    p.add_argument("--gpu-check", action="store_true", help="encode + decode 81x1088x1920 under a 24 GiB cap")
    p.add_argument("--fast", action="store_true", help="run the capped encode/decode through the fast VAE")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--height", type=int, default=1088)
    p.add_argument("--width", type=int, default=1920)
    p.add_argument("--cap-gib", type=float, default=24.0)
    args = p.parse_args(argv)
    import torch

    from fastremover.fast.vae_tiling import gpu_check
    if not args.gpu_check:
        p.print_help()
        return 2
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    print(json.dumps(gpu_check(args.frames, args.height, args.width, args.cap_gib, fast=args.fast)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
