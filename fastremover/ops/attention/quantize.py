"""q/k/v to per-tensor e4m3 codes for the 8-bit attention backends' stand-alone calls (the fast transformer quantizes
inside its own fused kernels instead).

K is centred on its mean over the sequence (exact under softmax: it subtracts q . mean_k from every logit of a query
row), V optionally too (each row of P sums to 1, so attn(V) = attn(V - m) + m: the mean is added back to the output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def rows(t: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] with rows of H*D contiguous -> the [B*S, H*D] row-strided view the quantizer reads."""
    b, s, h, d = t.shape
    sb, ss, sh, sd = t.stride()
    if sd != 1 or sh != d or (b > 1 and sb != s * ss):
        raise ValueError(f"attention: q/k/v need rows of H*D contiguous values, got strides {t.stride()}")
    return t.as_strided((b * s, h * d), (ss, 1))


def seq_mean(r: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """[B*S, N] rows -> fp32 mean over each batch's S rows, [B, N] contiguous."""
    import torch

    return torch.mean(r.unflatten(0, (b, s)), dim=1, dtype=torch.float32)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
                 smooth_v: bool = False):
    """Per-tensor e4m3 codes and scales of q, k (mean-smoothed over the sequence when smooth_k) and v, [B, S, H, D]
    each; all on the device, no host sync. smooth_v: v is centred the same way and its mean [B, H*D] fp32 is
    returned as a 7th value; the caller adds it back to the output (exact: each row of P sums to 1)."""
    from fastremover.fast.kernels.quant import quant_fp8_tensorwise

    b, s, h, d = q.shape
    q8, sq = quant_fp8_tensorwise(rows(q))
    k_rows = rows(k)
    mean = seq_mean(k_rows, b, s) if smooth_k else None
    k8, sk = quant_fp8_tensorwise(k_rows, mean, s)
    v_rows = rows(v)
    v_mean = seq_mean(v_rows, b, s) if smooth_v else None
    v8, sv = quant_fp8_tensorwise(v_rows, v_mean, s)
    shape = (b, s, h, d)
    out = (q8.view(shape), k8.view(shape), v8.view(shape), sq, sk, sv)
    return out + (v_mean,) if smooth_v else out


def quantize_qkv_reference(q, k, v, *, smooth_k: bool = True, smooth_v: bool = False):
    """quantize_qkv with the quantizer's torch reference (the kernels' tests compare against it)."""
    from fastremover.fast.kernels.quant import quant_fp8_tensorwise_reference

    b, s, h, d = q.shape
    q8, sq = quant_fp8_tensorwise_reference(q.reshape(b * s, h * d))
    kr = k.reshape(b * s, h * d)
    mean = seq_mean(kr, b, s) if smooth_k else None
    k8, sk = quant_fp8_tensorwise_reference(kr, mean, s)
    vr = v.reshape(b * s, h * d)
    v_mean = seq_mean(vr, b, s) if smooth_v else None
    v8, sv = quant_fp8_tensorwise_reference(vr, v_mean, s)
    shape = (b, s, h, d)
    out = (q8.view(shape), k8.view(shape), v8.view(shape), sq, sk, sv)
    return out + (v_mean,) if smooth_v else out


def add_v_mean(o: torch.Tensor, v_mean: torch.Tensor | None) -> torch.Tensor:
    if v_mean is None:
        return o
    b, s, h, d = o.shape
    return o.add_(v_mean.view(b, 1, h, d))  # fp32 add, one rounding to o's dtype


def needs_cuda(device, what: str) -> list[str]:
    return [] if device.type == "cuda" else [f"{what} needs a CUDA GPU"]
