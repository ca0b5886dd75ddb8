"""`flashinfer-fa3` (alias `fa3`) and `flashinfer-fa3-fp8` (alias `fp8-fa3`): FlashInfer's FA3-style Hopper kernels
(fastremover/fast/flashinfer_attention.py; optional package), fp16 and FP8 (K and V centred; 16-bit (o - c) out)."""

from __future__ import annotations

from fastremover.ops.attention.registry import AttentionBackend, register


def validate(device, dtype=None, shape=None) -> list[str]:
    from fastremover.fast.flashinfer_attention import unavailable_reason

    why = unavailable_reason(device)
    return [] if why is None else [why]


def fa3(q, k, v):
    from fastremover.fast.flashinfer_attention import fa3_half

    return fa3_half(q, k, v)


def fa3_fp8(q, k, v, *, smooth_k: bool = True, smooth_v: bool = True):
    from fastremover.fast.flashinfer_attention import fa3_fp8 as call

    return call(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)


def codes(q8, k8, v8, sq, sk, sv, out_dtype=None):
    import torch

    from fastremover.fast.flashinfer_attention import fa3_fp8_codes

    return fa3_fp8_codes(q8, k8, v8, sq, sk, sv, out_dtype=out_dtype or torch.float16)


HALF = register(AttentionBackend(
    name="flashinfer-fa3", label="FlashInfer's FA3 attention", aliases=("fa3",), call=fa3, validate=validate,
    priority={"exact": 20, "fast": 5},
))
FP8 = register(AttentionBackend(
    name="flashinfer-fa3-fp8", label="FlashInfer's FA3 FP8 attention", aliases=("fp8-fa3",), call=fa3_fp8,
    validate=validate, priority={"exact": 1, "fast": 4}, precision="8bit", takes_codes=True, codes_call=codes,
    output="centred-16bit",
))
