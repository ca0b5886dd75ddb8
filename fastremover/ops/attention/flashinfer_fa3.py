"""FlashInfer's FA3-class Hopper attention kernels behind our backend API (optional: `pip install flashinfer-python`).

FlashInfer's SM90 prefill (`single_prefill_with_kv_cache(..., backend="fa3")`) is a FlashAttention-3-style kernel:
TMA loads, a producer warp and two consumer warpgroups (warp specialization), wgmma with the softmax of one tile
overlapped with the GEMMs of the next. Its FP8 variant takes e4m3 q/k/v with per-head fp32 dequantization factors
and transposes V's tiles in shared memory (FP8 wgmma needs a K-major B operand). Both are compiled on first use by
FlashInfer's JIT (nvcc, a few minutes, cached under FLASHINFER_WORKSPACE_BASE).

- `fa3_half(q, k, v)`: fp16/bf16 in and out, fp32 accumulation (no quantization: a candidate for the exact mode).
- `fa3_fp8(q, k, v)`: our per-tensor e4m3 quantization (ops/attention/quantize.py's `quantize_qkv`: K mean-smoothed, V
  centred, both exact under softmax) and FlashInfer's FP8 kernel, fp16 output, then V's mean added back. Hopper's FP8
  MMA accumulates P @ V in reduced precision like cuDNN's, so V is centred here too (see cudnn_fp8.py).

q, k, v are [B, S, H, D] with a unit stride in D (the fused QKV projection's strided column views work: the kernel
takes row and head strides). B > 1 runs one call per batch item. torch and flashinfer are imported on first use.

The registry entries at the end: `flashinfer-fa3` (alias `fa3`, fp16) and `flashinfer-fa3-fp8` (alias `fp8-fa3`; K and
V centred; 16-bit (o - c) out).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import time

from fastremover.ops.attention.quantize import add_v_mean, quantize_qkv
from fastremover.ops.attention.registry import AttentionBackend, register


@functools.lru_cache(maxsize=None)
def import_error() -> str | None:
    try:
        import flashinfer.prefill  # noqa: F401, PLC0415 - optional dependency
    except Exception as exc:  # ImportError, or a missing shared library of one of its dependencies
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def unavailable_reason(device: torch.device) -> str | None:
    import torch

    if device.type != "cuda":
        return "FlashInfer's FA3 kernels need a CUDA GPU"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "FlashInfer's FA3 kernels (backend fa3) need a Hopper GPU (sm_90)"
    why = import_error()
    if why is not None:
        return f"flashinfer does not import ({why}); pip install flashinfer-python"
    return build_unavailable_reason()


@functools.lru_cache(maxsize=None)
def build_unavailable_reason() -> str | None:
    """None when both modules are prebuilt (FlashInfer's AOT directory) or nvcc is there to compile them on first
    use; else why not."""
    try:
        if all(spec.aot_path.exists() for spec in jit_specs()):
            return None
    except Exception as exc:  # FlashInfer's spec generation refuses this setup (e.g. no CUDA arch to target)
        return f"FlashInfer cannot set up its FA3 modules here: {type(exc).__name__}: {str(exc)[:200]}"
    from fastremover.env import cuda_home as cuda_home_dir

    cuda_home = cuda_home_dir()
    if (cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))) or shutil.which("nvcc"):
        return None
    return ("FlashInfer's FA3 modules are not prebuilt and there is no nvcc to compile them (set CUDA_HOME, or "
            "prebuild: python -m fastremover.ops.attention.flashinfer_fa3 --build)")


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    import torch

    from flashinfer.prefill import single_prefill_with_kv_cache  # noqa: PLC0415

    outs = [single_prefill_with_kv_cache(q[i], k[i], v[i], kv_layout="NHD", backend="fa3",
                                         sm_scale=1.0 / math.sqrt(q.shape[-1]), **kwargs)
            for i in range(q.shape[0])]
    return outs[0].unsqueeze(0) if len(outs) == 1 else torch.stack(outs)


def fa3_half(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    import torch

    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"fa3_half takes fp16/bf16 q/k/v, got {q.dtype}")
    return _prefill(q, k, v)


def _per_head(scale: torch.Tensor, heads: int) -> torch.Tensor:
    """Our per-tensor factor (a 1-element device tensor) as the [H] fp32 vector the kernel indexes by head."""
    return scale.reshape(1).float().expand(heads).contiguous()


def fa3_fp8_codes(q8, k8, v8, sq, sk, sv, out_dtype=None) -> torch.Tensor:
    """The kernel alone: e4m3 codes [B, S, H, D] and per-tensor dequantization factors in; out_dtype (None:
    fp16) out."""
    import torch

    out_dtype = torch.float16 if out_dtype is None else out_dtype
    h = q8.shape[2]
    return _prefill(q8, k8, v8, scale_q=_per_head(sq, h), scale_k=_per_head(sk, h), scale_v=_per_head(sv, h),
                    o_dtype=out_dtype)


def fa3_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
            smooth_v: bool = True) -> torch.Tensor:
    q8, k8, v8, sq, sk, sv, *v_mean = quantize_qkv(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    o = fa3_fp8_codes(q8, k8, v8, sq, sk, sv, out_dtype=q.dtype)
    return add_v_mean(o, v_mean[0] if v_mean else None)


# ----------------------------------------------------------------------------------------------------------------------
# The backends


def validate(device, dtype=None, shape=None) -> list[str]:
    why = unavailable_reason(device)
    return [] if why is None else [why]


def codes(q8, k8, v8, sq, sk, sv, out_dtype=None):
    return fa3_fp8_codes(q8, k8, v8, sq, sk, sv, out_dtype=out_dtype)


HALF = register(AttentionBackend(
    name="flashinfer-fa3", label="FlashInfer's FA3 attention", aliases=("fa3",), call=fa3_half, validate=validate,
    priority={"exact": 20, "fast": 5},
))
FP8 = register(AttentionBackend(
    name="flashinfer-fa3-fp8", label="FlashInfer's FA3 FP8 attention", aliases=("fp8-fa3",), call=fa3_fp8,
    validate=validate, priority={"exact": 1, "fast": 4}, precision="8bit", takes_codes=True, codes_call=codes,
    output="centred-16bit",
))


# ----------------------------------------------------------------------------------------------------------------------
# Prebuilding (GPU machine with nvcc): python -m fastremover.ops.attention.flashinfer_fa3 --build --out-dir DIR
# compiles the two modules this backend uses (head dim 128, fp16 and e4m3 inputs, fp16 output) in one ninja run and
# copies each `<name>.so` to DIR. Placed at flashinfer/data/aot/<name>/<name>.so they load without a compiler.


def jit_specs():
    import torch

    from flashinfer.jit.attention.modules import gen_single_prefill_module  # noqa: PLC0415

    return [gen_single_prefill_module("fa3", dt, dt, torch.float16, 128, 128, 0, False, False, False)
            for dt in (torch.float16, torch.float8_e4m3fn)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="prebuild FlashInfer's FA3 modules used by the fa3 backends")
    parser.add_argument("--build", action="store_true")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    if not args.build:
        parser.error("nothing to do (use --build)")
    from flashinfer.jit.core import build_jit_specs  # noqa: PLC0415

    specs = jit_specs()
    t0 = time.perf_counter()
    build_jit_specs(specs, verbose=False)
    print(f"built {len(specs)} modules in {time.perf_counter() - t0:.1f} s")
    for spec in specs:
        so = spec.jit_library_path if hasattr(spec, "jit_library_path") else None
        print(spec.name, so, so.stat().st_size if so and so.exists() else "missing")
        if args.out_dir and so and so.exists():
            shutil.copy(so, f"{args.out_dir}/{spec.name}.so")


if __name__ == "__main__":
    main()
