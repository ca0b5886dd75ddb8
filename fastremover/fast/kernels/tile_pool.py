"""Tile means of e4m3 codes in one pass: VSA's coarse pooling (fastremover/ops/attention/sparse_layout.tile_means).

    means = tile_means_fp8(x, tile)        x [B, S, H, D] float8_e4m3fn -> [B, NT, H, D] float32, NT = cdiv(S, tile)

Each run of `tile` consecutive tokens (the last one may be short) is averaged per (batch, head, channel). The torch
path converts the codes to fp16 (a copy of the whole tensor), sums in fp32 and divides; this kernel reads each code
once and writes only the means.

Exactness (equal bits to the torch path, tile <= 128): an e4m3 value is a multiple of 2^-9 with magnitude <= 448,
so 512 x value is an integer below 2^18 (exact in fp32 and in int32), and the kernel sums those integers in int32:
at most 128 of them stay below 2^25, so the sum is exact in any order. It is converted to fp32 once
(round-to-nearest-even; exact below 2^24, i.e. always for tiles of <= 64 tokens), times 2^-9 (exact), and divided by
the tile's token count with one IEEE round-to-nearest division (`div_rn`; exact for a power of two). The torch path
(`sparse_layout.tile_means_torch`) sums codes in fp64 (exact) and rounds to fp32 once: the same bits. A NaN code
becomes an undefined integer in the int32 path, so it gives a wrong finite mean instead of NaN (codes from our
quantizers are never NaN).

Interpreter (TRITON_INTERPRET=1): the same code; e4m3 -> fp32 is exact there for every finite code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastremover.fast.kernels._common import check_device, check_tensor, interpreting, launch_options

FP8 = torch.float8_e4m3fn
MAX_TILE = 128  # the exactness argument above holds up to 128 tokens per tile (int32 sums below 2^25)


@triton.jit
def _tile_mean_fp8_kernel(X, Y, S, H, sxb, sxs, sxh, syb, syt, syh,
                          TILE: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr):
    t = tl.program_id(0)  # the tile
    bh = tl.program_id(1)  # batch * H + head
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = t * TILE + tl.arange(0, TILE)
    cols = tl.arange(0, D)
    inside = rows < S
    x = tl.load(X + b * sxb + h * sxh + rows.to(tl.int64)[:, None] * sxs + cols[None, :], mask=inside[:, None],
                other=0.0)
    units = (x.to(tl.float32) * 512.0).to(tl.int32)  # exact: e4m3 values are multiples of 2^-9
    total = tl.sum(units, axis=0).to(tl.float32) * (1.0 / 512.0)  # an exact int32 sum, one rounding to fp32
    count = tl.minimum(S - t * TILE, TILE).to(tl.float32)
    if INTERPRET:
        mean = total / count  # numpy: IEEE division
    else:
        mean = tl.math.div_rn(total, count)
    tl.store(Y + b * syb + t.to(tl.int64) * syt + h * syh + cols, mean)


def _refusal(x: torch.Tensor, tile: int) -> str | None:
    """Why `tile_means_fp8` does not take this [B, S, H, D] x and tile, or None."""
    if x.stride(3) != 1:
        return "tile_means_fp8: x needs unit stride along D"
    if x.shape[3] not in (16, 32, 64, 128, 256):
        return f"tile_means_fp8: D must be a power of two 16..256, got {x.shape[3]}"
    if not 1 <= tile <= MAX_TILE or tile & (tile - 1):
        return f"tile_means_fp8: tile must be a power of two <= {MAX_TILE}, got {tile}"
    return None


def tile_means_fp8(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x [B, S, H, D] e4m3 codes (unit stride along D, D a power of two 16..256) -> fp32 means of each run of
    `tile` tokens (<= 128), [B, cdiv(S, tile), H, D]; equal to the torch path's bits (module docstring)."""
    check_tensor("x", x, ndim=4, dtypes=(FP8,), contiguous=False)
    why = _refusal(x, tile)
    if why:
        raise ValueError(why)
    check_device(_tile_mean_fp8_kernel, x=x)
    B, S, H, D = x.shape
    n_tiles = -(-S // tile)
    y = torch.empty((B, n_tiles, H, D), dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return y
    _tile_mean_fp8_kernel[(n_tiles, B * H)](
        x, y, S, H, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        TILE=tile, D=D, INTERPRET=interpreting(_tile_mean_fp8_kernel), **launch_options(_tile_mean_fp8_kernel))
    return y


def available(x: torch.Tensor, tile: int) -> bool:
    """Whether `tile_means_fp8` runs for x and tile here (a CUDA tensor or the interpreter, the shapes above)."""
    if x.dtype != FP8 or x.dim() != 4 or _refusal(x, tile):
        return False
    return x.is_cuda or interpreting(_tile_mean_fp8_kernel)
