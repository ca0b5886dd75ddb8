"""FlashAttention-3's own Hopper FP8 forward kernel (Dao-AILab flash-attention, `hopper/`), behind our backend API.

Optional and built from source: FA3 has no wheel on the package index. `bench/build_flash3.sh` compiles the forward
kernels only (head dim 128, e4m3 and bf16 inputs, sm_90a) without a GPU against a given torch version and writes
`flash_attn_interface.py` + `flash_attn_3/_C.abi3.so` to put on PYTHONPATH.

- `flash3_fp8(q, k, v)`: our per-tensor e4m3 quantization (fast/attention.py's `quantize_qkv`: K mean-smoothed, V
  centred, both exact under softmax), FA3's FP8 kernel (per-(batch, head) fp32 descale factors, bf16 output), then
  V's mean added back in the input dtype. V is centred for the same reason as with cuDNN: Hopper's FP8 MMA
  accumulates P @ V in reduced precision (flash-attention PR 2250).
q, k, v are [B, S, H, D] with a unit stride in D (strided column views of the fused QKV projection work).

- `flash3_fp8_e4m3_out(q8, k8, v8, sq, sk, out_descale)`: e4m3 output codes straight from the kernel's epilogue, for a
  build patched by bench/flash3_fp8_out_patch.py (build_flash3.sh applies it; `e4m3_out_unavailable_reason` says
  whether the loaded build has it). FA3 scales its fp32 accumulator by v_descale / rowsum before the epilogue converts
  it (`cvt.rn.satfinite` to e4m3), and the accumulator holds P @ V in V's code units, so passing `out_descale` as
  v_descale writes codes of attn(v) / sv * out_descale: the fast transformer's O projection reads them with the
  row scale sv / out_descale, and no 16-bit output is written or read back.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=None)
def import_error() -> str | None:
    try:
        import flash_attn_interface  # noqa: F401, PLC0415 - optional, built from source
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "FlashAttention-3 needs a CUDA GPU"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "FlashAttention-3's kernels need a Hopper GPU (sm_90)"
    why = import_error()
    return None if why is None else (f"flash_attn_interface does not import ({why}); build it with "
                                     "bench/build_flash3.sh and put its output on PYTHONPATH")


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


def flash3_fp8_e4m3_out(q8, k8, v8, sq, sk, out_descale, out: torch.Tensor | None = None) -> torch.Tensor:
    """e4m3 codes [B, S, H, D] of attn(q, k, v) / sv * out_descale (module docstring): q8/k8/v8 e4m3 [B, S, H, D],
    sq/sk/out_descale 1-element fp32 device tensors. Needs the patched build (`e4m3_out_unavailable_reason`)."""
    b, s, h, d = q8.shape
    if out is None:
        out = torch.empty((b, s, h, d), dtype=torch.float8_e4m3fn, device=q8.device)
    torch.ops.flash_attn_3.fwd(q8, k8, v8, out=out, q_descale=_descale(sq, b, h), k_descale=_descale(sk, b, h),
                               v_descale=_descale(out_descale, b, h), softmax_scale=1.0 / math.sqrt(d),
                               is_causal=False)
    return out


def e4m3_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps apart two code tensors are, elementwise (int32; the magnitude bits of e4m3 count up one
    code at a time, and the sign bit splits the two halves)."""
    ai, bi = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    signed = lambda c: torch.where(c >= 128, -(c - 128), c)  # noqa: E731  (-0 and +0 both map to 0)
    return (signed(ai) - signed(bi)).abs()


@functools.lru_cache(maxsize=None)
def e4m3_out_unavailable_reason(device: torch.device) -> str | None:
    """None where the loaded FlashAttention-3 writes e4m3 output codes (the patched build) and they agree with its
    bf16 output quantized the same way at a small shape (at most one e4m3 step apart), else why not."""
    why = unavailable_reason(device)
    if why is not None:
        return why
    g = torch.Generator(device=device).manual_seed(0)
    q8, k8, v8 = (torch.randn(1, 300, 2, 128, device=device, generator=g).mul(100).to(torch.float8_e4m3fn)
                  for _ in range(3))
    one = torch.ones(1, device=device)
    sq = torch.full((1,), 0.01, device=device)
    try:
        codes = flash3_fp8_e4m3_out(q8, k8, v8, sq, sq, one)
    except RuntimeError as exc:
        return f"this FlashAttention-3 build writes no e4m3 output ({str(exc).splitlines()[0][:160]}); rebuild it with bench/build_flash3.sh"
    ref = flash3_fp8_codes(q8, k8, v8, sq, sq, one).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    if int(e4m3_steps_apart(codes, ref).max()) > 1:
        return "this FlashAttention-3 build's e4m3 output disagrees with its bf16 output (a broken patch?)"
    return None


def flash3_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
               smooth_v: bool = True) -> torch.Tensor:
    from fastremover.fast.attention import _add_v_mean, quantize_qkv  # noqa: PLC0415 - avoids an import cycle

    q8, k8, v8, sq, sk, sv, *v_mean = quantize_qkv(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    o = flash3_fp8_codes(q8, k8, v8, sq, sk, sv).to(q.dtype)
    return _add_v_mean(o, v_mean[0] if v_mean else None)
