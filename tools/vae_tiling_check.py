"""The tiled Wan VAE's measurements (not shipped): live tensor bytes, and the memory-capped GPU check (encode + decode
81x1088x1920 under a 24 GiB cap).

    python tools/vae_tiling_check.py --gpu-check [--fast] [--frames 81] [--height 1088] [--width 1920] [--cap-gib 24]

Prints `gpu_check`'s JSON (the plan, tiles, peak memory, the memory model against the allocator).
`LiveTensorBytes` / `measure_call_bytes` count the tensor bytes a call keeps alive; tests/parity/test_vae_tiling.py and
tests/parity/test_video_vae.py validate the memory models of fastremover/engine/tiling.py and the fast VAE with them, and
run the GPU check as a GPU test.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import weakref
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from fastremover.engine.tiling import (  # noqa: E402
    choose_tiling,
    decode_auto,
    decode_tiled,
    default_budget_bytes,
    encode_auto,
    encode_tiled,
    estimate_call_bytes,
)


# ----------------------------------------------------------------------------------------------------------------------
# Measuring: live tensor bytes


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages created inside the mode and still alive; `peak` is the maximum.

    Each op output whose storage was not seen before adds its size; a finalizer subtracts it when the storage dies
    (PyTorch keeps one Python object per storage, so the finalizer fires exactly then). Storages that exist when the
    mode starts (inputs, weights) are not counted: pass them as `exclude`. Kernel-internal workspaces are invisible.
    """

    def __init__(self, exclude=()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = weakref.WeakSet()
        for t in exclude:
            self._seen.add(t.untyped_storage())

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage in self._seen:
                    continue
                self._seen.add(storage)
                n = storage.nbytes()
                self.live += n
                weakref.finalize(storage, self._free, n)
                self.peak = max(self.peak, self.live)
        return out


def measure_call_bytes(
    fn: Callable, x: torch.Tensor, module: torch.nn.Module | None = None
) -> tuple[int, torch.Tensor]:
    """(peak live tensor bytes created by fn(x), fn(x)); parameters/buffers of `module` and x are not counted."""
    exclude = [x] + (list(module.parameters()) + list(module.buffers()) if module is not None else [])
    meter = LiveTensorBytes(exclude)
    with meter:
        y = fn(x)
    return meter.peak, y


# ----------------------------------------------------------------------------------------------------------------------
# GPU check: 81 frames at 1080p under a 24 GiB cap


def _psnr(a: torch.Tensor, b: torch.Tensor, peak: float) -> float:
    mse = (a.float() - b.float()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(peak**2 / mse)


def gpu_check(
    frames: int = 81,
    height: int = 1088,
    width: int = 1920,
    cap_gib: float = 24.0,
    seed: int = 0,
    *,
    preset: str = "minimax-remover",
    device: str = "cuda",
    small: tuple[int, int, int] = (17, 480, 832),
    fast: bool = False,
) -> dict:
    """Encode + decode a random video with random VAE weights (fp16 on CUDA) under a per-process memory cap.

    Before the cap: the memory model against the allocator (untiled calls at `small` = frames, height, width), and
    tiled (256 px tiles, 64 px overlap) vs untiled PSNR there. Then, capped: the budget is 0.9 * (cap - allocated)
    (or less if the device has less free), choose_tiling(op="both") picks the tiles, and encode + decode run tiled.
    device="cpu" runs the same steps in fp32 without memory statistics (a smoke test of this function).
    """
    from fastremover.models.loading import PRESETS, random_init_
    from fastremover.models.vae import WanVAE, WanVAEConfig

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # torch.cuda.set_per_process_memory_fraction wants an index
        dev = torch.device("cuda", torch.cuda.current_device())
    cuda = dev.type == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    cfg = WanVAEConfig.from_dict(PRESETS[preset]["vae"])
    vae = random_init_(WanVAE(cfg), seed).to(dev, dtype).eval()
    g = torch.Generator(device=dev).manual_seed(seed)
    result: dict = {"frames": frames, "height": height, "width": width, "cap_gib": cap_gib, "device": str(dev)}

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def allocated() -> int:
        return torch.cuda.memory_allocated(dev) if cuda else 0

    def reset_peak():
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)

    def peak() -> int:
        return torch.cuda.max_memory_allocated(dev) if cuda else 0

    # 1. model vs allocator (the first call of each op is a warm-up: cuDNN setup), and tiled vs untiled PSNR
    xs = torch.rand(1, 3, *small, generator=g, device=dev, dtype=dtype) * 2 - 1

    def measured_call(fn, arg):
        fn(arg)
        sync()
        base = allocated()
        reset_peak()
        out = fn(arg)
        sync()
        return peak() - base, out

    enc_bytes, zs = measured_call(vae.encode, xs)
    dec_bytes, ys = measured_call(vae.decode, zs)
    model_check = {}
    for op, measured in (("encode", enc_bytes), ("decode", dec_bytes)):
        est = estimate_call_bytes(op, *small, dtype, cfg).total
        model_check[op] = {"measured_gib": measured / 2**30, "model_gib": est / 2**30, "ratio": measured / est}
    zt = encode_tiled(vae.encode, xs, 256, 64)
    yt = decode_tiled(vae.decode, zs, 32, 8)
    model_check["quality_256_64"] = {
        "encode_latent_psnr_db": _psnr(zt, zs, (zs.float().amax() - zs.float().amin()).item()),
        "decode_psnr_db": _psnr(yt, ys, 2.0),
    }
    result["model_check"] = model_check
    del xs, zs, ys, zt, yt
    if cuda:
        torch.cuda.empty_cache()

    # 2. the capped run (the cap is restored afterwards: it would otherwise stay on for the rest of the process)
    cap = int(cap_gib * 2**30)
    previous = None
    if cuda:
        total = torch.cuda.get_device_properties(dev).total_memory
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        previous = get_fraction(dev) if get_fraction is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
    try:
        # fast=True: through the pipeline's fast VAE (exact/fast modes), tiles planned with its own memory model
        runner, call_bytes = vae, None
        if fast:
            from fastremover.fast.vae import FastWanVAE

            runner = FastWanVAE(vae, device=dev, dtype=dtype)
            call_bytes = runner.memory_bytes
            result["vae"] = runner.describe()
        x = torch.rand(1, 3, frames, height, width, generator=g, device=dev, dtype=dtype).mul_(2).sub_(1)
        sync()
        reset_peak()
        # what may still be allocated, whether or not this torch can read the cap back
        budget = int(0.9 * (cap - allocated()))
        if cuda:
            budget = min(budget, default_budget_bytes(dev))
        plan = choose_tiling(frames, height, width, dtype, budget, cfg, op="both", call_bytes=call_bytes)
        t0 = time.perf_counter()
        z = encode_auto(runner.encode, x, cfg, plan=plan) if plan else runner.encode(x)
        sync()
        t1 = time.perf_counter()
        del x
        y = decode_auto(runner.decode, z, cfg, plan=plan) if plan else runner.decode(z)
        sync()
        t2 = time.perf_counter()
        result.update(
            budget_gib=budget / 2**30,
            plan=None if plan is None else {"tile": plan.tile, "overlap": plan.overlap, "grid": plan.grid,
                                            "model_gib": plan.estimated_bytes / 2**30},
            tiles=1 if plan is None else plan.tiles,
            encode_s=t1 - t0,
            decode_s=t2 - t1,
            time_s=t2 - t0,
            peak_allocated_gib=peak() / 2**30,
            peak_reserved_gib=(torch.cuda.max_memory_reserved(dev) if cuda else 0) / 2**30,
            latent_shape=list(z.shape),
            video_shape=list(y.shape),
            finite=bool(torch.isfinite(z).all().item() and torch.isfinite(y).all().item()),
        )
        del z, y
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(previous, dev)
            torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Tiled Wan VAE: 1080p memory-capped GPU check")
    p.add_argument("--gpu-check", action="store_true", help="encode + decode 81x1088x1920 under a 24 GiB cap")
    p.add_argument("--fast", action="store_true", help="run the capped encode/decode through the fast VAE")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--height", type=int, default=1088)
    p.add_argument("--width", type=int, default=1920)
    p.add_argument("--cap-gib", type=float, default=24.0)
    args = p.parse_args(argv)
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
