"""Bench of the MiniMax-H3 video decoder: dense fp32 eager vs NVFP4 eager vs NVFP4 fused (GPU).

    python tools/bench_h3.py [--preset full] [--latent-frames 7] [--height 448] [--width 448] [--tier 36L]
                             [--tiles-per-call 1] [--cuda-graphs] [--repeats 2] [--skip-dense]
                             [--out bench/results/h3.json]

One process, random weights (random_decoder, seed 0), one random latent clip. For each implementation: the median
wall time of --repeats warm decodes (after one warm-up decode; torch.cuda.synchronize around each), the peak GPU
memory of a decode (torch.cuda.max_memory_allocated, weights included), and the PSNR of its [0, 1] pixels against the
dense decode of the same tier. The fused run is repeated with the dense block weights freed (freeze) for the memory
figure, and its output is checked bit-equal to the eager NVFP4 one. JSON to --out (and stdout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastremover.fast import h3_nvfp4 as H  # noqa: E402
from fastremover.models import h3_decoder as h3  # noqa: E402


def _timed(fn, repeats: int, cuda: bool):
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()  # warm-up (kernel compilation, graph capture)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, out = [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times), (torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a - b) ** 2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1 / mse)).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="full", choices=sorted(h3.PRESETS))
    p.add_argument("--latent-frames", type=int, default=7)
    p.add_argument("--height", type=int, default=448, help="pixels (a multiple of the patch size)")
    p.add_argument("--width", type=int, default=448)
    p.add_argument("--tier", default="36L", choices=list(h3.TIERS))
    p.add_argument("--tiles-per-call", type=int, default=1)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-dense", action="store_true", help="no dense fp32 decode (long clips at high resolution, "
                   "where it takes most of the time): no PSNR figures")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cuda (the bench) or cpu (a smoke run: no memory figures; the "
                   "fused path then needs TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("bench_h3 needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    cfg = h3.preset(args.preset)
    model = h3.random_decoder(cfg, seed=0, device=args.device)
    g = torch.Generator(device=args.device).manual_seed(1)
    z = torch.randn(1, cfg.latent_channels, args.latent_frames, args.height // cfg.patch_size,
                    args.width // cfg.patch_size, device=args.device, generator=g)
    kw = dict(tier=args.tier, tiles_per_call=args.tiles_per_call)
    from fastremover.bench.harness import script_environment

    res = {**script_environment(),
           "config": {**vars(args), "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
                      "frames_out": h3.temporal_plan(cfg, args.latent_frames)[2]}}
    with torch.no_grad():
        if args.skip_dense:
            dense = ref_px = None
        else:
            dense, t, mem = _timed(lambda: model.decode(z, **kw), args.repeats, cuda)
            ref_px = model.to_pixels(dense)
            res["dense_eager"] = {"seconds": t, "peak_gib": mem, "psnr_db": None}  # the reference
        window = z[:, :, :cfg.chunk_tokens + cfg.overlap_tokens]
        stack = H.build_nvfp4_stack(model, window, tier=args.tier, freeze=False, cuda_graphs=args.cuda_graphs)
        eager, t, mem = _timed(lambda: model.decode(z, blocks=stack, **kw), args.repeats, cuda)
        res["nvfp4_eager"] = {"seconds": t, "peak_gib_with_dense_weights": mem,
                              "psnr_db": None if ref_px is None else _psnr(model.to_pixels(eager), ref_px)}
        stack.fused = True
        fused, t, mem = _timed(lambda: model.decode(z, blocks=stack, **kw), args.repeats, cuda)
        res["nvfp4_fused"] = {"seconds": t, "peak_gib_with_dense_weights": mem,
                              "psnr_db": None if ref_px is None else _psnr(model.to_pixels(fused), ref_px),
                              "bit_equal_to_eager": bool(torch.equal(fused, eager))}
        del dense, eager, fused
        stack.freeze()
        if cuda:
            torch.cuda.empty_cache()
        _, t, mem = _timed(lambda: model.decode(z, blocks=stack, **kw), args.repeats, cuda)
        res["nvfp4_fused_frozen"] = {"seconds": t, "peak_gib": mem, "resident_gib": H.resident_bytes(model) / 2**30
                                     + H.resident_bytes(stack) / 2**30}
        res["block_weights"] = H.block_linear_bytes(cfg, len(stack.indices))
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
