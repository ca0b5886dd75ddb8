"""FlashAttention-3's own Hopper FP8 forward kernel (Dao-AILab flash-attention, `hopper/`), behind our backend API.

Optional and built from source: FA3 has no wheel on the package index. `tools/build_flash3.sh` compiles the forward
kernels only (head dim 128, e4m3 and bf16 inputs, sm_90a) without a GPU against a given torch version and writes
`flash_attn_interface.py` + `flash_attn_3/_C.abi3.so` to put on PYTHONPATH.

- `flash3_fp8(q, k, v)`: our per-tensor e4m3 quantization (ops/attention/quantize.py's `quantize_qkv`: K mean-smoothed, V
  centred, both exact under softmax), FA3's FP8 kernel (per-(batch, head) fp32 descale factors, bf16 output), then
  V's mean added back in the input dtype. V is centred for the same reason as with cuDNN: Hopper's FP8 MMA
  accumulates P @ V in reduced precision (flash-attention PR 2250).
q, k, v are [B, S, H, D] with a unit stride in D (strided column views of the fused QKV projection work); torch is
imported on first use.

The registry entry at the end: `flashattn3-fp8` (alias `fp8-flash3`): K and V centred, bf16 (o - c) out; the
transformer may split the partial last wave of its 128-row query tiles into a second call (`row_split_block_m`).
"""

from __future__ import annotations

import functools
import math

from fastremover.ops.attention.quantize import add_v_mean, quantize_qkv
from fastremover.ops.attention.registry import AttentionBackend, register

BLOCK_M = 128  # the kernel's query tile (rows) at head dim 128


@functools.lru_cache(maxsize=None)
def import_error() -> str | None:
    try:
        import flash_attn_interface  # noqa: F401, PLC0415 - optional, built from source
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def unavailable_reason(device: torch.device) -> str | None:
    import torch

    if device.type != "cuda":
        return "FlashAttention-3 needs a CUDA GPU"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "FlashAttention-3's kernels need a Hopper GPU (sm_90)"
    why = import_error()
    return None if why is None else (f"flash_attn_interface does not import ({why}); build it with "
                                     "tools/build_flash3.sh and put its output on PYTHONPATH")


def _descale(scale: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """Our per-tensor factor (a 1-element device tensor) as the [B, H] fp32 tensor FA3 reads: a stride-0 view (FA3
    takes the descale tensors' strides as given), so no copy kernel per call (three per layer otherwise)."""
    return scale.reshape(1, 1).float().expand(b, h)


def flash3_fp8_codes(q8, k8, v8, sq, sk, sv) -> torch.Tensor:
    """The kernel alone: e4m3 codes [B, S, H, D] and per-tensor dequantization factors in, bf16 out."""
    from flash_attn_interface import flash_attn_func  # noqa: PLC0415

    b, _, h, d = q8.shape
    return flash_attn_func(q8, k8, v8, softmax_scale=1.0 / math.sqrt(d), causal=False,
                           q_descale=_descale(sq, b, h), k_descale=_descale(sk, b, h), v_descale=_descale(sv, b, h))


def flash3_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
               smooth_v: bool = True) -> torch.Tensor:
    q8, k8, v8, sq, sk, sv, *v_mean = quantize_qkv(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    o = flash3_fp8_codes(q8, k8, v8, sq, sk, sv).to(q.dtype)
    return add_v_mean(o, v_mean[0] if v_mean else None)


# ----------------------------------------------------------------------------------------------------------------------
# The backend


def validate(device, dtype=None, shape=None) -> list[str]:
    why = unavailable_reason(device)
    return [] if why is None else [why]


def codes(q8, k8, v8, sq, sk, sv, out_dtype=None):
    return flash3_fp8_codes(q8, k8, v8, sq, sk, sv)  # bf16 whatever out_dtype


BACKEND = register(AttentionBackend(
    name="flashattn3-fp8", label="FlashAttention-3's FP8 attention", aliases=("fp8-flash3",), call=flash3_fp8,
    validate=validate, priority={"exact": 3, "fast": 40}, precision="8bit", takes_codes=True, codes_call=codes,
    output="centred-16bit", row_split_block_m=BLOCK_M,
    announce_if_skipped=False,  # built from source: its absence is the normal case, not worth a note
))
