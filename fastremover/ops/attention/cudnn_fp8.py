"""`cudnn-fp8` (alias `fp8`): cuDNN's FP8 SDPA (fastremover/fast/cudnn_sdpa.py) on per-tensor e4m3 codes, K and V
centred. Its FP8 output (codes of (o - c) / sv) goes straight into the fast transformer's FP8 O projection."""

from __future__ import annotations

from fastremover.ops.attention.quantize import add_v_mean, needs_cuda, quantize_qkv
from fastremover.ops.attention.registry import AttentionBackend, register


def fp8_cudnn(q, k, v, *, smooth_k: bool = True, smooth_v: bool = True):
    from fastremover.fast.cudnn_sdpa import sdpa_fp8

    q8, k8, v8, sq, sk, sv, *v_mean = quantize_qkv(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    o8 = sdpa_fp8(q8, k8, v8, sq, sk, sv)  # codes of o / sv (Hopper writes FP8 output)
    return add_v_mean(o8.to(q.dtype).mul_(sv.view(())), v_mean[0] if v_mean else None)


def codes(q8, k8, v8, sq, sk, sv, out_dtype=None):
    from fastremover.fast.cudnn_sdpa import sdpa_fp8

    return sdpa_fp8(q8, k8, v8, sq, sk, sv)


def validate(device, dtype=None, shape=None) -> list[str]:
    if device.type != "cuda":
        return needs_cuda(device, "attention backend cudnn-fp8")
    import torch

    from fastremover.fast.cudnn_sdpa import supported

    why = supported(device.index if device.index is not None else torch.cuda.current_device())
    return [] if why is None else [f"cuDNN FP8 attention is not available: {why}"]


BACKEND = register(AttentionBackend(
    name="cudnn-fp8", label="cuDNN FP8 attention", aliases=("fp8",), call=fp8_cudnn, validate=validate,
    priority={"exact": 2, "fast": 30}, precision="8bit", takes_codes=True, codes_call=codes, output="fp8-codes",
))
