"""VSA's top-k tile selection in one pass per row (fastremover/ops/attention/sparse_layout.vsa_lists):

    kv_idx = select_tiles(scores, forced, counts, width)

    scores [B, H, NQ, NK] fp32 (contiguous), forced [NQ, NK] bool, counts [NQ] int32 (1 <= counts[i] <= width <= NK)
    -> kv_idx [B, H, NQ, width] int32: row i's counts[i] key tiles of highest score, forced tiles first, ascending,
       then NK in the unused entries.

The torch path (`sparse_layout.select_tiles_torch`) takes five kernels over the [B, H, NQ, NK] scores: the forced tiles'
+inf, the order-preserving int64 keys, torch's top-k of `width`, the cut to counts[i] and an ascending sort. Here one
program holds a whole row in registers: the same keys, a bitonic sort of them (`tl.sort`), the counts[i]-th largest as
the threshold, and the kept tiles' indices written in ascending order at their running count (`tl.cumsum`).

Exactness (equal to the torch path, `torch.equal`): the keys are distinct (the tie-break index is in the low 32 bits),
so "the counts[i] largest keys" is one set, and both paths return it in ascending order; nothing is rounded (integer
compares only; a NaN score ranks above +inf in both, by its bits).

Interpreter (TRITON_INTERPRET=1): the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastremover.fast.kernels._common import check_device, check_tensor, interpreting, launch_options

MAX_TILES = 4096  # the widest row one program sorts in registers (W3 at 64-token tiles: 1182 key tiles)


@triton.jit
def _select_tiles_kernel(S, F, C, Out, NQ, NK, width, NKP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (b * H + h) * NQ + i
    i = row % NQ
    cols = tl.arange(0, NKP)
    inside = cols < NK
    s = tl.load(S + row * NK + cols, mask=inside, other=0.0)  # (contiguous scores)
    forced = tl.load(F + i * NK + cols, mask=inside, other=0) != 0
    s = tl.where(forced, float("inf"), s)
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)  # the fp32 order as int32 order
    key = ordered * 4294967296 + (NK - 1 - cols).to(tl.int64)  # distinct: the lower index wins a tie
    key = tl.where(inside, key, -9223372036854775807 - 1)  # padding: below every real key
    count = tl.load(C + i)
    ranked = tl.sort(key, descending=True)
    kth = tl.max(tl.where(cols == count - 1, ranked, -9223372036854775807 - 1), axis=0)
    keep = inside & (key >= kth)  # exactly `count` tiles (distinct keys)
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    out = Out + row * width
    tl.store(out + slot, cols, mask=keep)
    tl.store(out + cols, NK, mask=(cols >= count) & (cols < width))


def _refusal(scores: torch.Tensor, width: int) -> str | None:
    """Why `select_tiles` does not take these scores and width, or None."""
    if not scores.is_contiguous():
        return "select_tiles: scores must be contiguous"
    nk = scores.shape[-1]
    if nk > MAX_TILES:
        return f"select_tiles: at most {MAX_TILES} key tiles per row, got {nk}"
    if not 1 <= width <= nk:
        return f"select_tiles: width must be in [1, {nk}], got {width}"
    return None


def select_tiles(scores: torch.Tensor, forced: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """scores [B, H, NQ, NK] fp32 contiguous, forced [NQ, NK] bool, counts [NQ] int32 (each in [1, width]) ->
    kv_idx [B, H, NQ, width] int32: each row's counts[i] best key tiles ascending, then NK (module docstring)."""
    check_tensor("scores", scores, ndim=4, dtypes=(torch.float32,), dims=" [B, H, NQ, NK]", contiguous=False)
    B, H, NQ, NK = scores.shape
    check_tensor("forced", forced, ndim=2, dtypes=(torch.bool,), shape=(NQ, NK))
    check_tensor("counts", counts, ndim=1, dtypes=(torch.int32,), shape=(NQ,))
    why = _refusal(scores, width)
    if why:
        raise ValueError(why)
    check_device(_select_tiles_kernel, scores=scores, forced=forced, counts=counts)
    out = torch.empty((B, H, NQ, width), dtype=torch.int32, device=scores.device)
    if out.numel() == 0:
        return out
    nkp = triton.next_power_of_2(NK)
    opts = launch_options(_select_tiles_kernel)
    if not interpreting(_select_tiles_kernel):
        opts["num_warps"] = 4 if nkp <= 1024 else 8
    _select_tiles_kernel[(B * H * NQ,)](scores, forced.view(torch.uint8), counts, out, NQ, NK, width, NKP=nkp, **opts)
    return out


def available(scores: torch.Tensor, width: int) -> bool:
    """Whether `select_tiles` runs for these scores here (a CUDA tensor or the interpreter, the limits above)."""
    if scores.dtype != torch.float32 or scores.dim() != 4 or _refusal(scores, width):
        return False
    return scores.is_cuda or interpreting(_select_tiles_kernel)
