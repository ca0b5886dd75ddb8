"""`triton-fp8` (alias `fp8-triton`): our Triton FP8 flash-attention kernel (fastremover/fast/kernels/attention_fp8.py),
quantizing q/k/v itself (K centred); the fast mode's fallback where cuDNN's FP8 attention cannot run."""

from __future__ import annotations

from fastremover.config import kernel_tuning
from fastremover.ops.attention.quantize import add_v_mean, needs_cuda, quantize_qkv
from fastremover.ops.attention.registry import AttentionBackend, register


def fp8_triton(q, k, v, *, smooth_k: bool = True, smooth_v: bool = False):
    from fastremover.fast.kernels.attention_fp8 import AUTOTUNE_CONFIGS, attention_fp8

    q8, k8, v8, sq, sk, sv, *v_mean = quantize_qkv(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    # One pinned kernel config, not the autotuner's pick: configs differ in key-block size, which changes where P is
    # quantized, so a timing-based choice could change output bits from one process to the next.
    config = kernel_tuning().fp8_attention_config or AUTOTUNE_CONFIGS[0]  # FASTREMOVER_FP8_ATTN_CONFIG
    o = attention_fp8(q8, k8, v8, sq, sk, sv, out_dtype=q.dtype, config=config)
    return add_v_mean(o, v_mean[0] if v_mean else None)


def validate(device, dtype=None, shape=None) -> list[str]:
    if device.type != "cuda":
        return needs_cuda(device, "attention backend triton-fp8")
    import torch

    if torch.cuda.get_device_capability(device) < (8, 9):
        return ["FP8 tensor cores need sm_89 or newer"]
    try:
        import fastremover.fast.kernels.attention_fp8  # noqa: F401
    except ImportError as exc:
        return [f"the Triton FP8 attention kernel is not importable: {exc}"]
    return []


BACKEND = register(AttentionBackend(
    name="triton-fp8", label="our Triton FP8 kernel", aliases=("fp8-triton",), call=fp8_triton, validate=validate,
    priority={"exact": 0, "fast": 20}, precision="8bit",
))
