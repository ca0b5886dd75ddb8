"""Count the Triton kernel variants (compiles) a fast-mode run needs per run shape, WITHOUT a GPU.

Triton compiles a kernel once per distinct (specialization, options): every `tl.constexpr` value, every plain int's
class (== 1, divisible by 16, other; i32 or i64), every pointer's 16-byte alignment, num_warps / num_stages. This
tool computes exactly those keys with Triton's own binder (`create_function_from_signature`, the function
`JITFunction.run` uses) for an sm_90 target, by driving the real wrappers with meta-device tensors (nothing is
allocated or launched):

* the fast transformer's kernels: the calls one denoise step makes at the run shape (`transformer_launches`: the
  fast mode's cuDNN FP8 attention path, every block's kernels once);
* the fast VAE's kernels: `FastWanVAE.encode_removal_inputs` and `decode` of the run shape on the meta device, the
  CUDA choices (batch-2 pair, frames per step) forced as an H200 makes them; autotuned kernels compile every
  candidate, as a cold run with an empty cache does.

    python tools/triton_variants.py                                 # the cold real-clip shapes (issue 45)
    python tools/triton_variants.py --shape 81x256x320 --shape 41x480x864 [--json out.json]

Shapes are FRAMESxHEIGHTxWIDTH of the transformer / VAE input (the crop, padded as the engine pads it). The counts
are the compiles of a process that runs the shapes in order (the union), per kernel and per shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import defaultdict

DEFAULT_SHAPES = ("81x256x320", "81x320x512", "41x320x640", "41x480x864")  # bench --cold real: 3 windows + the frame


def _binder_for(fn, backend):
    from triton.runtime.jit import create_function_from_signature

    cache = getattr(fn, "_fr_binder", None)
    if cache is None:
        cache = fn._fr_binder = create_function_from_signature(fn.signature, fn.params, backend)
    return cache


class _Ptr:
    """A meta tensor as Triton's binder sees it: its dtype, and a data pointer with the alignment a CUDA tensor of
    the same storage offset has (the caching allocator's blocks are 512-byte aligned)."""

    def __init__(self, t):
        self.dtype = t.dtype
        self._ptr = (1 << 20) + t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return self._ptr


@contextlib.contextmanager
def recording():
    """Within: a JITFunction launch records (kernel name, its compile key) in the yielded list and does nothing else;
    the kernel wrappers' device checks and the TMA / upconv availability gates pass for meta tensors, and the
    Python-side autotuner compiles (records) every candidate and keeps the first."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction

    from fastremover.fast.kernels import _common

    backend = make_backend(GPUTarget("cuda", 90, 32))
    launches: list[tuple[str, str]] = []

    def run(self, *args, grid, warmup, **kwargs):
        args = [_Ptr(a) if isinstance(a, torch.Tensor) else a for a in args]
        kwargs = {k: _Ptr(a) if isinstance(a, torch.Tensor) else a for k, a in kwargs.items()}
        _, spec, options = _binder_for(self, backend)(*args, **kwargs)
        key = repr(spec) + repr(sorted(options.items()))
        launches.append((self.fn.__name__, key))

    def autotune(cache, key, cands, launch, enabled, what, *, device=None, persistent="default"):
        cfg = cache.get(key)
        if cfg is not None:
            return cfg
        if enabled and len(cands) > 1:
            for c in cands:  # the cold run: every candidate compiled (then timed)
                launch(c)
        cache[key] = cands[0]
        return cands[0]

    patches = []

    def patch(obj, name, value):
        patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    import importlib

    patch(JITFunction, "run", run)
    for mod_name in ("adaln", "qk_norm_rope", "quant", "residual", "vae_norm", "upsample_conv", "gemm_fp8",
                     "conv3d_fp8", "block_sparse_attention", "nvfp4", "h3_fused"):
        mod = importlib.import_module(f"fastremover.fast.kernels.{mod_name}")
        if hasattr(mod, "check_device"):
            patch(mod, "check_device", lambda *a, **k: None)
        if hasattr(mod, "autotune"):
            patch(mod, "autotune", autotune)
        if hasattr(mod, "_TUNED"):
            patch(mod, "_TUNED", {})
    from fastremover.fast.kernels import gemm_fp8, upsample_conv

    patch(upsample_conv, "available", lambda device: True)
    patch(upsample_conv, "tma_available", lambda kernel, device: True)
    patch(gemm_fp8, "fused_ffn1_available", lambda device, k, n: True)

    class _Props:
        multi_processor_count = 132  # H200

    patch(torch.cuda, "get_device_properties", lambda *a, **k: _Props())
    try:
        yield launches
    finally:
        for obj, name, old in reversed(patches):
            setattr(obj, name, old)
        _common  # noqa: B018 (imported for its side effect of loading the kernels package)


def transformer_launches(frames: int, height: int, width: int, blocks: int = 30, d: int = 1536, heads: int = 12,
                         ffn: int = 8960) -> None:
    """The Triton calls of one fast-mode denoise step (FastTransformer, cudnn-fp8 attention, fused FFN1, fused V
    statistics) at a [1, C, frames, height, width] clip: tokens S = T_lat * (H/16) * (W/16)."""
    import torch

    from fastremover.fast.kernels import adaln, gemm_fp8, qk_norm_rope, quant

    meta = torch.device("meta")
    t_lat = (frames - 1) // 4 + 1
    s = t_lat * (height // 16) * (width // 16)
    f16, f32, fp8 = torch.float16, torch.float32, torch.float8_e4m3fn
    x = torch.empty(s, d, dtype=f16, device=meta)
    mods = torch.empty(1, d, dtype=f32, device=meta)
    qkv = torch.empty(s, 3 * d, dtype=f16, device=meta)
    q, k, v = qkv.chunk(3, dim=1)
    w = torch.empty(d, dtype=f16, device=meta)
    cos = torch.empty(s, d // heads // 2, dtype=f32, device=meta)
    amax = torch.empty(1, dtype=f32, device=meta)
    centre = torch.empty(1, d, dtype=f32, device=meta)
    a8, sa = torch.empty(s, d, dtype=fp8, device=meta), torch.empty(s, 1, dtype=f32, device=meta)
    w8, sw = torch.empty(ffn, d, dtype=fp8, device=meta), torch.empty(1, ffn, dtype=f32, device=meta)
    bias = torch.empty(ffn, dtype=f16, device=meta)
    counter = torch.zeros(quant.centred_counter_size(s, d, 1), dtype=torch.int32, device=meta)
    adaln.adaln_modulate(x, mods, mods, s, 1e-6, fp8=True)
    for i in range(blocks):
        last = i == blocks - 1
        quant.quant_fp8_centred(v, s, fused_finalize=True, counter=counter)
        qk_norm_rope.qk_norm_rope(k, w, cos, cos, s, heads, 1e-6)  # K's centre (the first step)
        qk_norm_rope.qk_norm_rope(k, w, cos, cos, s, heads, 1e-6, fp8_amax=amax, centre=centre)
        qk_norm_rope.qk_norm_rope(q, w, cos, cos, s, heads, 1e-6, fp8_amax=amax)
        o = torch.empty(s, d, dtype=f16, device=meta)
        adaln.gate_residual_adaln(x, o, mods, mods, mods, s, 1e-6, fp8=True)
        gemm_fp8.gemm_fp8_gelu_quant(a8, sa, w8, sw, bias, amax)
        adaln.gate_residual_adaln(x, o, mods, mods, mods, s, 1e-6, fp8=not last)


def vae_launches(frames: int, height: int, width: int) -> None:
    """The fast VAE's Triton calls for one window: encode_removal_inputs of the frames and mask, decode of the
    latents (fp16, the engine's default options, CUDA choices forced)."""
    import torch

    from fastremover.fast.vae import conv as vae_conv
    from fastremover.fast.vae import model as vae_model
    from fastremover.fast.kernels import upsample_conv
    from fastremover.models.vae import WanVAE, WanVAEConfig

    meta = torch.device("meta")
    with torch.device(meta):
        vae = WanVAE(WanVAEConfig()).to(torch.float16)
    patches = [(vae_conv, "load_upconv", vae_conv.load_upconv), (vae_model, "load_upconv", vae_model.load_upconv),
               (vae_model.FastWanVAE, "pair_fits", vae_model.FastWanVAE.pair_fits),
               (vae_model.FastWanVAE, "frames_per_step", vae_model.FastWanVAE.frames_per_step)]
    orig_pair, orig_fps = vae_model.FastWanVAE.pair_fits, vae_model.FastWanVAE.frames_per_step

    def pair_fits(self, batch, f, h, w):  # CUDA "auto" with an H200's free memory: the 2 GiB budget decides
        if self.options.pair != "auto":
            return orig_pair(self, batch, f, h, w)
        return self.encode_bytes(2 * batch, h, w) <= float(self.options.pair_budget_gib) * 2**30

    def frames_per_step(self, op, h, w):
        if op == "decode" and self.options.decode_frames == "auto" and h * w <= vae_model.SMALL_FRAME_PIXELS:
            return None  # CUDA: small frames decode whole chunks
        return orig_fps(self, op, h, w)

    vae_conv.load_upconv = vae_model.load_upconv = lambda device, dtype: upsample_conv
    vae_model.FastWanVAE.pair_fits, vae_model.FastWanVAE.frames_per_step = pair_fits, frames_per_step
    try:
        from fastremover.config import FastVAEOptions
        from fastremover.fast.vae.convert import PAD_CHANNELS

        # what _resolve and the conv dispatch choose on CUDA (fp16): padded RGB and 96 -> 128 channels, the convs'
        # own bias adds by the row kernel
        options = FastVAEOptions(pad_rgb=True, pad_channels=PAD_CHANNELS)
        fast = vae_model.FastWanVAE(vae, device=meta, dtype=torch.float16, kernels="triton", options=options)
        fast.convs.bias_kernel = True
        clip = torch.empty(1, 3, frames, height, width, dtype=torch.float16, device=meta)
        za, _ = fast.encode_removal_inputs(clip, clip)
        for _ in fast.decode_iter(za):
            pass
    finally:
        for obj, name, old in patches:
            setattr(obj, name, old)


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        f, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be FRAMESxHEIGHTxWIDTH, got {text!r}") from None
    return f, h, w


def count(shapes, parts=("transformer", "vae")) -> dict:
    """{"per_shape": {shape: {kernel: variants}}, "union": {kernel: variants}, "new_per_shape": {shape: {kernel:
    variants not needed by an earlier shape}}} for the shapes run in order in one process."""
    seen: dict[str, set] = defaultdict(set)
    per_shape, new_per_shape = {}, {}
    for shape in shapes:
        with recording() as launches:
            if "transformer" in parts:
                transformer_launches(*shape)
            if "vae" in parts:
                vae_launches(*shape)
        keys: dict[str, set] = defaultdict(set)
        for name, key in launches:
            keys[name].add(key)
        label = "x".join(map(str, shape))
        per_shape[label] = {k: len(v) for k, v in sorted(keys.items())}
        new_per_shape[label] = {k: len(v - seen[k]) for k, v in sorted(keys.items()) if v - seen[k]}
        for k, v in keys.items():
            seen[k] |= v
    return {"per_shape": per_shape, "new_per_shape": new_per_shape,
            "union": {k: len(v) for k, v in sorted(seen.items())}, "total": sum(len(v) for v in seen.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", type=parse_shape, help="FRAMESxHEIGHTxWIDTH (repeatable)")
    ap.add_argument("--part", choices=("transformer", "vae", "all"), default="all")
    ap.add_argument("--json", help="write the counts here")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the counts are of the compiled kernels", file=sys.stderr)
        return 2
    shapes = a.shape or [parse_shape(s) for s in DEFAULT_SHAPES]
    parts = ("transformer", "vae") if a.part == "all" else (a.part,)
    result = count(shapes, parts)
    kernels = sorted(result["union"])
    labels = list(result["per_shape"])
    print(f"{'kernel':32s} " + " ".join(f"{s:>12s}" for s in labels) + "   union")
    for k in kernels:
        row = [f"{result['per_shape'][s].get(k, 0):>5d} (+{result['new_per_shape'][s].get(k, 0):>2d})" for s in labels]
        print(f"{k:32s} " + " ".join(f"{r:>12s}" for r in row) + f"   {result['union'][k]:5d}")
    print(f"{'total':32s} " + " ".join(f"{sum(result['new_per_shape'][s].values()):>12d}" for s in labels)
          + f"   {result['total']:5d}   (per shape: new compiles)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
