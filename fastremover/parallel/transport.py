"""What q/k/v look like on the wire of the Ulysses all-to-all.

    fp16  the activations as they are (the model dtype: fp16/bf16 on GPUs, fp32 in the CPU tests): exact
    fp8   e4m3 codes with one fp32 scale per (row, head): scale = amax / 448 over the row's head_dim values,
          codes = RNE_e4m3(x * (448 / amax)) (quant.py's rule: a true division for the reciprocal, fp32 math), packed
          as [..., head_dim code bytes | 4 scale bytes] so one all-to-all moves both; the receiver multiplies back
          (codes.float() * scale, rounded once to the model dtype)

Round-trip bound (fp8), per element of a (row, head) with scale s: |x - x'| <= 2^-4 |x| + 2^-10 s, plus the final
rounding to the model dtype. e4m3 keeps 3 mantissa bits (half an ulp = 2^-4 relative) down to 2^-6, below which the
subnormal spacing is 2^-9 (half: 2^-10) in units of s; the codes never saturate because |x / s| <= 448 by
construction. tests/parallel/test_parallel.py checks this bound element by element.

Values that already are 8-bit codes (the fast mode's q/k/v for an 8-bit attention, per-tensor scales) travel as
their bytes under either setting: nothing is quantized twice.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def is_codes(t: torch.Tensor) -> bool:
    return t.dtype.itemsize == 1


def to_wire(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte tensor as uint8 (collectives do not all take float8 dtypes); others unchanged."""
    return t.view(torch.uint8) if is_codes(t) and t.dtype != torch.uint8 else t


def from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if t.dtype != dtype else t


def pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (one row of one head per last-dim vector) -> uint8 [..., D + 4]: e4m3 codes, then the fp32 scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    inv = amax.new_full((), FP8_MAX) / amax
    codes = (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = amax / amax.new_full((), FP8_MAX)
    return torch.cat([codes.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def unpack_fp8(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., D + 4] -> x' [..., D] in `dtype` (codes * scale in fp32, one rounding)."""
    d = packed.shape[-1] - 4
    codes = packed[..., :d].contiguous().view(torch.float8_e4m3fn)
    scale = packed[..., d:].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)


def fp8_round_trip_bound(x: torch.Tensor) -> torch.Tensor:
    """The per-element bound above for x [..., D] (without the final rounding to the model dtype)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return 2.0**-4 * xf.abs() + 2.0**-10 * scale


def encode(x: torch.Tensor, transport: str) -> torch.Tensor:
    """The wire form of x [..., D] (16-bit values under "fp8": packed codes; codes: their bytes)."""
    if is_codes(x):
        return to_wire(x)
    if transport == "fp8":
        return pack_fp8(x)
    return x


def decode(wire: torch.Tensor, like: torch.Tensor, transport: str) -> torch.Tensor:
    """Back from `encode`'s form to the dtype of `like`."""
    if is_codes(like):
        return from_wire(wire, like.dtype)
    if transport == "fp8":
        return unpack_fp8(wire, like.dtype)
    return wire
