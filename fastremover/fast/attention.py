"""Attention backends for the fast transformer, chosen by name, device and dtype.

Each backend takes q, k, v as [B, S, H, D] (the layout the projections produce) and returns [B, S, H, D].
- `sdpa`: torch's scaled_dot_product_attention with its own backend choice (cuDNN on Hopper in torch >= 2.5),
  numerically the eager path.
- `fp8`: 8-bit attention — not built yet; asking for it is an error rather than a silent fallback, so that a bench
  row labelled fp8 always ran fp8.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fastremover.errors import FastRemoverError

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


BACKENDS: dict[str, AttentionFn] = {"sdpa": sdpa}


def available_backends(device: torch.device) -> list[str]:
    return list(BACKENDS)


def get_backend(name: str, device: torch.device) -> AttentionFn:
    if name not in BACKENDS:
        raise FastRemoverError(
            f"attention backend {name!r} is not available here; available: {available_backends(device)}"
        )
    return BACKENDS[name]
