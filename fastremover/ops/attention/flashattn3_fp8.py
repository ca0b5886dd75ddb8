"""`flashattn3-fp8` (alias `fp8-flash3`): FlashAttention-3's own Hopper FP8 forward kernel
(fastremover/fast/flash3_attention.py; built from source by tools/build_flash3.sh). K and V centred; bf16 (o - c) out;
the transformer may split the partial last wave of its 128-row query tiles into a second call."""

from __future__ import annotations

from fastremover.ops.attention.registry import AttentionBackend, register

BLOCK_M = 128  # the kernel's query tile (rows) at head dim 128


def validate(device, dtype=None, shape=None) -> list[str]:
    from fastremover.fast.flash3_attention import unavailable_reason

    why = unavailable_reason(device)
    return [] if why is None else [why]


def flash3_fp8(q, k, v, *, smooth_k: bool = True, smooth_v: bool = True):
    from fastremover.fast.flash3_attention import flash3_fp8 as call

    return call(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)


def codes(q8, k8, v8, sq, sk, sv, out_dtype=None):
    from fastremover.fast.flash3_attention import flash3_fp8_codes

    return flash3_fp8_codes(q8, k8, v8, sq, sk, sv)  # bf16 whatever out_dtype


BACKEND = register(AttentionBackend(
    name="flashattn3-fp8", label="FlashAttention-3's FP8 attention", aliases=("fp8-flash3",), call=flash3_fp8,
    validate=validate, priority={"exact": 3, "fast": 40}, precision="8bit", takes_codes=True, codes_call=codes,
    output="centred-16bit", row_split_block_m=BLOCK_M,
    announce_if_skipped=False,  # built from source: its absence is the normal case, not worth a note
))
