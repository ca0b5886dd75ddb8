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
               priority: dict | None = None, call=sdpa, reasons=(), token_layout=None, code_rows=None):
    """Register a backend for the duration of a `with` block (it validates everywhere unless `reasons` is given)."""
    backend = register(AttentionBackend(
        name=name, label=f"test backend {name}", call=call, validate=lambda device, dtype=None, shape=None: list(reasons),
        priority=priority if priority is not None else {"exact": -1, "fast": -1},
        precision="8bit" if codes_call is not None else "16bit", takes_codes=codes_call is not None,
        codes_call=codes_call, output=output, row_split_block_m=row_split_block_m, token_layout=token_layout,
        code_rows=code_rows,
    ))
    try:
        yield backend
    finally:
        unregister(name)


def emulate_paged(q, k, v, page, seq_q, seq_kv, offsets, tile: int, scales=(1.0, 1.0, 1.0)) -> torch.Tensor:
    """cuDNN's paged SDPA read as fastremover/ops/attention/cudnn_sparse.py addresses it, in fp32 on the CPU: entry b
    has its queries at offsets[b] + t * H * D (t < seq_q[b]) and its keys / values at page[b, p // tile] * D +
    (p % tile) * H * D, in the flat storage of the token-major [1, S, H, D] inputs (times their `scales`), which
    must hold whole tiles (as_strided refuses a shorter storage). Keys p >= seq_kv[b] of its last page get P = 0
    but their V rows are still multiplied (as a tensor-core P @ V over whole pages does: a NaN there is a NaN out).
    Tables as page_tables and seq_q_and_offsets return them. -> o [1, S, H, D] fp32 (NaN where no entry wrote)."""
    from fastremover.ops.attention.cudnn_sparse import padded_rows

    _, S, H, D = q.shape
    n = padded_rows(S, tile) * H * D

    def flat(t, scale):
        return t.as_strided((n,), (1,), t.storage_offset()).float() * scale

    qf, kf, vf = (flat(t, sc) for t, sc in zip((q, k, v), scales))
    page, seq_q, seq_kv, offsets = page[:, 0, :, 0].long(), seq_q.view(-1), seq_kv.view(-1), offsets.view(-1)
    out = torch.full((n,), float("nan"))
    d = torch.arange(D)
    for b in range(page.shape[0]):
        start, nq, nkv = int(offsets[b]), int(seq_q[b]), int(seq_kv[b])
        qi = start + torch.arange(nq)[:, None] * (H * D) + d
        p = torch.arange(-(-nkv // tile) * tile)  # whole pages
        ki = page[b, p // tile][:, None] * D + (p % tile)[:, None] * (H * D) + d
        logits = (qf[qi] @ kf[ki].T * D ** -0.5).masked_fill(p >= nkv, float("-inf"))
        w = torch.softmax(logits, dim=-1)
        out[qi] = w @ vf[ki]
    return out[: S * H * D].view(1, S, H, D)


def fake_paged_codes(q8, k8, v8, sq, sk, sv, out_dtype=None, *, layout=None) -> torch.Tensor:
    """The `sparse-*-cudnn` backends' contract on the CPU: the layout's lists through cudnn_sparse's tables and the
    paged read (`emulate_paged`) of the dequantized codes -> e4m3 codes of o / sv [1, S, H, D]."""
    from fastremover.ops.attention.cudnn_sparse import page_tables, seq_q_and_offsets

    _, S, H, D = q8.shape
    idx, cnt = layout.lists(q8, k8)
    page, seq_kv = page_tables(idx, cnt, S, layout.tile)
    seq_q, offsets = seq_q_and_offsets(S, H, D, layout.tile, q8.device)
    o = emulate_paged(q8, k8, v8, page, seq_q, seq_kv, offsets, layout.tile,
                      scales=tuple(float(t) for t in (sq, sk, sv)))
    return (o / float(sv)).to(torch.float8_e4m3fn)
