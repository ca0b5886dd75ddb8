"""Test-only attention backends: registered through the public registry exactly as a real backend module does, so
the fast transformer runs its 8-bit paths on the CPU with a library kernel replaced by its dequantized math."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from fastremover.ops.attention import AttentionBackend, register, unregister
from fastremover.ops.attention.sdpa import sdpa


def dequantized_attention(q8, k8, v8, sq, sk, sv) -> torch.Tensor:
    """fp32 attention on the dequantized codes, [B, S, H, D]."""
    q, k, v = (c.float() * s for c, s in ((q8, sq), (k8, sk), (v8, sv)))
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def fake_cudnn_codes(q8, k8, v8, sq, sk, sv, out_dtype=None) -> torch.Tensor:
    """cuDNN's FP8 kernel's contract: e4m3 codes of o / sv."""
    return (dequantized_attention(q8, k8, v8, sq, sk, sv) / sv).to(torch.float8_e4m3fn).contiguous()


def fake_flash3_codes(q8, k8, v8, sq, sk, sv, out_dtype=None) -> torch.Tensor:
    """FlashAttention-3's FP8 kernel's contract: bf16 output."""
    return dequantized_attention(q8, k8, v8, sq, sk, sv).to(torch.bfloat16)


@contextlib.contextmanager
def registered(name: str, *, codes_call=None, output: str = "16bit", row_split_block_m: int | None = None,
               priority: dict | None = None, call=sdpa, reasons=()):
    """Register a backend for the duration of a `with` block (it validates everywhere unless `reasons` is given)."""
    backend = register(AttentionBackend(
        name=name, label=f"test backend {name}", call=call, validate=lambda device, dtype=None, shape=None: list(reasons),
        priority=priority if priority is not None else {"exact": -1, "fast": -1},
        precision="8bit" if codes_call is not None else "16bit", takes_codes=codes_call is not None,
        codes_call=codes_call, output=output, row_split_block_m=row_split_block_m,
    ))
    try:
        yield backend
    finally:
        unregister(name)
