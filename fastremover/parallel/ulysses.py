"""Ulysses sequence parallelism around any attention backend.

Each of the N ranks holds a contiguous range of s_r tokens (context.split_sizes) with all H heads through the
adaLN, the norms and every GEMM. Attention needs all tokens, so around it one all-to-all turns

    (s_r tokens, H heads) -> (S tokens, H/N heads)      rank j gets heads [j H/N, (j+1) H/N) of every rank's tokens

and a second one turns the attention output back. The backend itself is not touched: it sees a [B, S, H/N, D]
problem, and each head's attention is the same computation as in one process (heads are independent), so with the
"fp16" transport the result equals the single-process attention up to the backend's own dependence on the head
count (none for torch SDPA on the CPU: tests/parallel/test_parallel.py checks torch.equal).

q, k and v travel in one all-to-all (stacked), since the engine projects them with one fused GEMM; the output
travels in a second one. With head_groups G > 1, each rank's H/N heads go in G groups: group g+1's exchange is
started (async) before group g's attention runs, and group g's output is sent back while group g+1 computes, so the
transfers can hide behind the attention on a GPU (NCCL runs them on its own stream). On gloo the result is the
same as G = 1 (the same per-head work in another order).

The degree must divide H (check_heads); the sequence need not divide N (uneven all-to-all splits).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import torch

from fastremover.errors import FastRemoverError
from fastremover.parallel import transport


class UlyssesGroup(Protocol):
    """What the all-to-all reads and updates of the ranks' context (fastremover.parallel.context.ParallelContext,
    which calls it; named here as a protocol so this module does not import that one)."""

    world_size: int
    head_groups: int
    transport: str
    group: Any
    comm_seconds: float

    def token_sizes(self, local: int) -> list[int]: ...


def check_heads(heads: int, world_size: int) -> None:
    """Ulysses gives each rank heads / N whole heads: the degree must divide the head count."""
    if world_size > 1 and heads % world_size:
        divisors = [d for d in range(2, heads + 1) if heads % d == 0]
        raise FastRemoverError(
            f"--parallel ulysses over {world_size} ranks needs a head count divisible by {world_size}; this model has "
            f"{heads} attention heads (usable degrees: {divisors})"
        )


def _send_qkv(ctx: UlyssesGroup, qkv: torch.Tensor, groups: int, g: int) -> torch.Tensor:
    """qkv [3, B, s_r, H, D] -> group g's send buffer [N, B, s_r, 3, hg, W] on the wire (W = D, or D + 4 for fp8)."""
    n = ctx.world_size
    three, b, s_r, h, d = qkv.shape
    hg = h // n // groups
    x = qkv.view(3, b, s_r, n, groups, hg, d)[:, :, :, :, g]  # [3, B, s_r, N, hg, D]
    x = x.permute(3, 1, 2, 0, 4, 5)  # [N, B, s_r, 3, hg, D]
    return transport.encode(x.contiguous(), ctx.transport).contiguous()


def _exchange(ctx: UlyssesGroup, send: torch.Tensor, in_rows: list[int], out_rows: list[int], row_elems: int,
              async_op: bool):
    """all_to_all_single of a flat buffer: in_rows[i] token rows (of row_elems values) go to rank i, out_rows[i]
    come from rank i. Returns (receive buffer, work or None)."""
    import torch.distributed as dist

    recv = send.new_empty(sum(out_rows) * row_elems)
    work = dist.all_to_all_single(recv, send.reshape(-1), [r * row_elems for r in out_rows],
                                  [r * row_elems for r in in_rows], group=ctx.group, async_op=async_op)
    return recv, work


def ulysses_attention(ctx: UlyssesGroup, fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """fn over the whole sequence; q/k/v [B, s_r, H, D] (this rank's tokens) -> [B, s_r, H, D] (module docstring)."""
    n, groups = ctx.world_size, ctx.head_groups
    b, s_r, h, d = q.shape
    check_heads(h, n)
    hn = h // n
    if hn % groups:
        groups = 1  # fewer heads per rank than groups asked: no pipelining (same result)
    hg = hn // groups
    # every rank's token count: the balanced split of the sequence shard_tokens recorded
    sizes = ctx.token_sizes(s_r)
    qkv = torch.stack([q, k, v])  # [3, B, s_r, H, D]
    if qkv.dtype.itemsize == 1:
        qkv = qkv.view(torch.uint8)
    in_rows = [b * s_r] * n  # rows here = (batch, token) pairs; each of 3 * hg * W values
    out_rows = [b * s for s in sizes]

    def start(g):
        send = _send_qkv(ctx, qkv, groups, g)
        row = send[0, 0, 0].numel()  # 3 * hg * W
        recv, work = _exchange(ctx, send, in_rows, out_rows, row, async_op=True)
        return recv, work, send.shape[-1]

    def arrange(recv, width):
        # pieces [B, s_i, 3, hg, W] from rank i, in rank (= token) order -> [3, B, S, hg, D]
        pieces = recv.split([r * 3 * hg * width for r in out_rows])
        full = torch.cat([p.view(b, s, 3, hg, width) for p, s in zip(pieces, sizes)], dim=1)
        full = full.view(q.dtype) if transport.is_codes(q) else transport.decode(full, q, ctx.transport)
        return full.permute(2, 0, 1, 3, 4)

    out_dtype = None
    back = []
    pending = start(0)
    for g in range(groups):
        recv, work, width = pending
        t = time.perf_counter()
        work.wait()
        ctx.comm_seconds += time.perf_counter() - t
        if g + 1 < groups:
            pending = start(g + 1)
        gq, gk, gv = arrange(recv, width)
        o = fn(gq, gk, gv)  # [B, S, hg, D]
        wire = transport.to_wire(o)
        out_dtype = o.dtype
        send = torch.cat([wire[:, lo:lo + s].reshape(-1) for lo, s in zip(_starts(sizes), sizes)])
        recv_o, work_o = _exchange(ctx, send, out_rows, in_rows, hg * d, async_op=True)
        back.append((g, recv_o, work_o))
    result = torch.empty((b, s_r, n, groups, hg, d), dtype=out_dtype, device=q.device)
    t = time.perf_counter()
    for g, recv_o, work_o in back:
        work_o.wait()
        part = transport.from_wire(recv_o, out_dtype).view(n, b, s_r, hg, d)
        result[:, :, :, g] = part.permute(1, 2, 0, 3, 4)
    ctx.comm_seconds += time.perf_counter() - t
    return result.view(b, s_r, h, d)


def _starts(sizes: list[int]) -> list[int]:
    out, lo = [], 0
    for s in sizes:
        out.append(lo)
        lo += s
    return out


