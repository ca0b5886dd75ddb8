"""How many of a real run's lazy Triton compiles fastremover/fast/precompile.py would have compiled ahead (issue 45).

Records, WITHOUT a GPU, what the engine's precompile records for run shapes (the fast VAE's encode + decode on a
meta twin, one fast-transformer step through `FastTransformer.launch_kernels`), as an H200 fast-mode engine makes
its choices (fp16 VAE with padded channels, the sub-pixel upsampler, the bias row kernel, the batch-2 encode within
its 2 GiB budget, whole-chunk decodes of small frames; cuDNN FP8 attention codes, fused FFN1 and V statistics, 132
SMs), keyed by Triton's own binder for sm_90. Then reads a `-v` log of a real run (lines "triton compile: KERNEL
[specialization]{options}", fastremover/timing.py) and counts the logged compiles whose kernel + specialization +
options the recording holds. Logged keys from before the kernels' `do_not_specialize` change are normalized: an int
argument the current kernel does not specialize counts as its unspecialized form.

    python tools/precompile_coverage.py --log first-compiles.log          # the cold real-clip windows (default)
    python tools/precompile_coverage.py --log LOG --shape 81x256x320 --shape 41x320x640 [--misses]
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections import Counter

DEFAULT_SHAPES = ("81x320x640", "81x320x512", "41x256x320")  # bench --cold real: its windows (padded crops, in order)
LINE = re.compile(r"triton (?:pre)?compile: (\w+) (\[.*\])(\{.*\})\s*$")
IGNORED_OPTIONS = ("debug", "instrumentation_mode", "fpsan_homomorphic_casts")


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        f, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be FRAMESxHEIGHTxWIDTH, got {text!r}") from None
    return f, h, w


_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8e4nv": "fp8e4nv"}


def _literal(text: str):
    """A logged key as Python values; Triton 3.6 writes a dtype constexpr as triton.language.float16, 3.9 as fp16."""
    return ast.literal_eval(re.sub(r"triton\.language\.(\w+)",
                                   lambda m: repr("tl." + _DTYPE_NAMES.get(m.group(1), m.group(1))), text))


def _norm_spec(spec, fn=None) -> tuple:
    """A specialization list as comparable tuples; with `fn` (the current JITFunction), every int argument it does
    not specialize in its unspecialized form (an old key's 'D' / '' / constexpr 1 becomes (type, None))."""
    out = []
    for i, (ty, val) in enumerate(spec):
        val = f"tl.{val.name}" if hasattr(val, "name") and not isinstance(val, (int, str)) else val
        if fn is not None and i < len(fn.params) and fn.params[i].do_not_specialize and not fn.params[i].is_constexpr:
            ty = "i32" if ty == "constexpr" else ty
            val = None
        out.append((str(ty), val if isinstance(val, (int, str, type(None), bool)) else str(val)))
    return tuple(out)


def _norm_options(options: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in options.items() if k not in IGNORED_OPTIONS))


def stand_in_engine():
    """(FastWanVAE, FastTransformer) on the CPU / meta device making an H200 fast-mode engine's Triton choices."""
    import torch

    from fastremover.config import FastVAEOptions
    from fastremover.fast.kernels import upsample_conv
    from fastremover.fast.transformer_fast import FastTransformer
    from fastremover.fast.vae import conv as vae_conv
    from fastremover.fast.vae import model as vae_model
    from fastremover.fast.vae.convert import PAD_CHANNELS
    from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig
    from fastremover.models.vae import WanVAE, WanVAEConfig
    from fastremover.ops.attention import AttentionBackend, register
    from fastremover.ops.attention.sdpa import sdpa

    old = vae_conv.load_upconv, vae_model.load_upconv
    vae_conv.load_upconv = vae_model.load_upconv = lambda d, dt: upsample_conv
    try:
        vae = vae_model.FastWanVAE(WanVAE(WanVAEConfig()).to(torch.float16), device="cpu", dtype=torch.float16,
                                   kernels="triton", options=FastVAEOptions(pad_rgb=True, pad_channels=PAD_CHANNELS,
                                                                            conv_plans=False))
    finally:
        vae_conv.load_upconv, vae_model.load_upconv = old
    vae.convs.bias_kernel = True
    fps = vae.frames_per_step
    vae.pair_fits = lambda b, f, h, w: vae.encode_bytes(2 * b, h, w) <= float(vae.options.pair_budget_gib) * 2**30
    vae.frames_per_step = lambda op, h, w: (None if op == "decode" and h * w <= vae_model.SMALL_FRAME_PIXELS
                                            else fps(op, h, w))
    # the transformer: the released config on the meta device, an attention backend that takes e4m3 codes and
    # returns codes (cuDNN's FP8 SDPA contract)
    register(AttentionBackend(name="coverage-cudnn-like", label="cuDNN FP8 stand-in", call=sdpa,
                              validate=lambda device, dtype=None, shape=None: [], priority={"exact": -1, "fast": -1},
                              precision="8bit", takes_codes=True, codes_call=lambda *a, **k: None,
                              output="fp8-codes", row_split_block_m=None))
    with torch.device("meta"):
        model = RemoverTransformer(RemoverTransformerConfig()).to(torch.float16)
    fast = FastTransformer(model, linear_method="fp8-rowwise", attention="coverage-cudnn-like", use_triton=True)
    fast.fused_ffn1 = fast.fused_v_stats = True
    fast.sm_count = 132
    return vae, fast


def predicted(shapes) -> dict:
    """{kernel name: {(specialization, options)}} the precompile records for `shapes`, keyed as Triton's binder does
    for sm_90."""
    import torch
    from triton.backends.compiler import GPUTarget

    from fastremover.fast import precompile

    vae, fast = stand_in_engine()
    backend = precompile.make_backend(GPUTarget("cuda", 90, 32))
    keys: dict[str, set] = {}
    with precompile.recording(torch.device("cpu"), sm_count=132) as rec:
        for shape in shapes:
            precompile.record_vae(vae, *shape)
            precompile.record_transformer(fast, *shape)
    for launch in rec.launches:
        spec, options = precompile.specialization(launch, backend)
        keys.setdefault(launch.name, set()).add((_norm_spec(spec), _norm_options(options)))
    return keys, {launch.name: launch.fn for launch in rec.launches}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", required=True, help="a -v log of a real run (its 'triton compile:' lines)")
    ap.add_argument("--shape", action="append", type=parse_shape, help="FRAMESxHEIGHTxWIDTH (repeatable)")
    ap.add_argument("--misses", action="store_true", help="print every logged compile the recording misses")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the keys are of the compiled kernels", file=sys.stderr)
        return 2
    shapes = a.shape or [parse_shape(s) for s in DEFAULT_SHAPES]
    keys, fns = predicted(shapes)
    from fastremover.fast.kernels import adaln, gemm_fp8, qk_norm_rope, quant, residual, upsample_conv, vae_norm

    for mod in (adaln, gemm_fp8, qk_norm_rope, quant, residual, upsample_conv, vae_norm):  # kernels not recorded
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("_") and name.endswith("_kernel") and hasattr(obj, "params"):
                fns.setdefault(name, obj)
    logged, covered, misses = Counter(), Counter(), []
    with open(a.log) as f:
        for line in f:
            m = LINE.search(line)
            if not m:
                continue
            name, spec, options = m.group(1), _literal(m.group(2)), _literal(m.group(3))
            key = (_norm_spec(spec, fns.get(name)), _norm_options(options))
            logged[name] += 1
            if key in keys.get(name, ()):
                covered[name] += 1
            else:
                misses.append((name, key))
    total = sum(logged.values())
    print(f"{'kernel':32s} {'logged':>7s} {'covered':>8s} {'recorded':>9s}")
    for name in sorted(set(logged) | set(keys)):
        print(f"{name:32s} {logged[name]:7d} {covered[name]:8d} {len(keys.get(name, ())):9d}")
    print(f"{'total':32s} {total:7d} {sum(covered.values()):8d} {sum(len(v) for v in keys.values()):9d}   "
          f"(shapes {' '.join('x'.join(map(str, s)) for s in shapes)})")
    if a.misses:
        for name, (spec, options) in misses:
            print(f"MISS {name} {list(spec)} {dict(options)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
