"""The parallel Wan VAE: the two encodes on two ranks, the decode split over the ranks by rows.

Encode. The pipeline encodes two videos (the masked frames and 2 * mask - 1); rank 0 encodes the first and rank 1
the second at the same time, with the same module and the same inputs as one process, so each latent is the serial
one bit for bit; rank 1's latents then go to rank 0. Any VAE with `encode(x)` works (eager or fast).

Decode (the eager `models.vae.WanVAE`, walked from outside: this file only reads its submodules). The latent rows
are split over the ranks (contiguous, balanced: context.split_sizes); each rank runs the decoder on its slab of rows
for every latent frame, with its own causal cache. What crosses rank borders:

    every spatial conv (3x3x3 CausalConv3d, the upsamplers' 3x3 Conv2d)   a halo of `padding` rows from each
        neighbour, exchanged just before the conv (zeros at the image's top and bottom: the conv's own padding); the
        conv then runs without row padding, so each output row sees exactly the rows it sees in one process
    the middle block's attention (one head over the whole frame)         the frame's rows are gathered, the block
        runs on the whole frame (the same call as one process) and each rank keeps its rows
    nothing else: the Wan VAE's RMS norms are per pixel over channels, SiLU and the 1x1x1 / (3,1,1) convs never
        look at other rows, nearest upsampling copies pixels, and the causal caches hold each rank's own slab (with
        its halo rows, which are the neighbours' rows of the earlier frames)

The decoded slabs are gathered on rank 0. Exactness (CPU, fp32): the convs are exact - each runs without row padding
on its halo-extended slab, with the CPU kernel chosen as one process chooses it (`models.vae.conv3d`'s rule at the
whole frame's height) and the slab kept in the frame's memory layout - and so is the gathered attention. The RMS
norms are not, in the last bit: `models.vae.RMSNorm` sums squares over the channel dim of an NCDHW tensor, and
ATen's CPU sum groups those additions differently for different plane sizes (h * w), so a slab's per-pixel sums
can round differently from the whole frame's. tests/parallel/test_parallel.py bounds the decoded video at 1e-5 (max relative
difference) and shows the channel-sum effect alone. On GPUs cuDNN may also pick other conv algorithms for a
slab's shape (unchecked).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fastremover.models import vae as eager_vae
from fastremover.parallel.context import ParallelContext, split_sizes


# ----------------------------------------------------------------------------------------------------------------------
# Row exchange


def _layout(x: torch.Tensor) -> list[int]:
    """x's dimension order in memory, outermost first (the CPU norms' channel sums and oneDNN's kernel choice depend
    on the layout, so a slab is kept in the layout its whole frame has in one process)."""
    return sorted(range(x.ndim), key=lambda d: (-x.stride(d), -d))


def _as_layout(y: torch.Tensor, order: list[int]) -> torch.Tensor:
    """A dense copy of y (or y itself) laid out in memory in `order`."""
    inverse = [order.index(d) for d in range(y.ndim)]
    return y.permute(order).contiguous().permute(inverse)


def halo(ctx: ParallelContext, x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., h_r, W] (this rank's rows) -> [..., h_r + 2 rows, W]: `rows` rows of each neighbour above and below,
    zeros beyond the image's first and last rows."""
    import torch.distributed as dist

    if rows == 0:
        return x
    if x.shape[-2] < rows:
        raise RuntimeError(f"rank {ctx.rank} holds {x.shape[-2]} rows, fewer than a halo of {rows}")
    order = _layout(x)
    top = x.new_zeros((*x.shape[:-2], rows, x.shape[-1]))
    bottom = torch.zeros_like(top)
    ops = []
    if ctx.rank > 0:
        ops += [dist.P2POp(dist.isend, x[..., :rows, :].contiguous(), ctx.rank - 1, ctx.group),
                dist.P2POp(dist.irecv, top, ctx.rank - 1, ctx.group)]
    if ctx.rank < ctx.world_size - 1:
        ops += [dist.P2POp(dist.isend, x[..., -rows:, :].contiguous(), ctx.rank + 1, ctx.group),
                dist.P2POp(dist.irecv, bottom, ctx.rank + 1, ctx.group)]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return _as_layout(torch.cat([top, x, bottom], dim=-2), order)


def gather_rows(ctx: ParallelContext, x: torch.Tensor, sizes: list[int], dst: int | None = None):
    """Every rank's rows of x [..., h_r, W] (sizes[r] rows on rank r) -> the whole [..., sum(sizes), W]: on every
    rank (dst None) or on rank dst only (others get None)."""
    import torch.distributed as dist

    order = _layout(x)
    pad = max(sizes) - x.shape[-2]
    xp = F.pad(x, (0, 0, 0, pad)).contiguous() if pad else x.contiguous()
    if dst is None:
        parts = [torch.empty_like(xp) for _ in range(ctx.world_size)]
        dist.all_gather(parts, xp, group=ctx.group)
    else:
        parts = [torch.empty_like(xp) for _ in range(ctx.world_size)] if ctx.rank == dst else None
        dist.gather(xp, parts, dst=dst, group=ctx.group)
        if ctx.rank != dst:
            return None
    return _as_layout(torch.cat([p[..., :n, :] for p, n in zip(parts, sizes)], dim=-2), order)


# ----------------------------------------------------------------------------------------------------------------------
# Encode: two videos, two ranks


def encode_pair(ctx: ParallelContext, vae, first: torch.Tensor | None, second: torch.Tensor | None,
                progress: Callable[[int, int], None] | None = None):
    """Rank 0 encodes `first`, rank 1 `second` (each rank passes the video it encodes; others None) -> on rank 0
    (latents of first, latents of second); None elsewhere. One process: both, in order."""
    import torch.distributed as dist

    if ctx.world_size == 1:
        return vae.encode(first, progress=progress), vae.encode(second, progress=progress)
    if ctx.rank == 0:
        a = vae.encode(first, progress=progress)
        b = torch.empty_like(a)
        dist.recv(b, src=1, group=ctx.group)
        return a, b
    if ctx.rank == 1:
        dist.send(vae.encode(second).contiguous(), dst=0, group=ctx.group)
    return None


# ----------------------------------------------------------------------------------------------------------------------
# Decode: rows over ranks


class RowParallelDecoder:
    """Decode with `vae` (an eager WanVAE) over the ranks of ctx, split by rows (module docstring)."""

    def __init__(self, ctx: ParallelContext, vae: eager_vae.WanVAE):
        if not isinstance(vae, eager_vae.WanVAE):
            raise TypeError("RowParallelDecoder walks the eager WanVAE's modules; got " + type(vae).__name__)
        self.ctx, self.vae = ctx, vae

    # -- the ops that differ from one process ------------------------------------------------------------------------

    def _conv3d(self, x: torch.Tensor, weight, bias, stride, padding, full_h: int) -> torch.Tensor:
        """models.vae.conv3d with the CPU kernel chosen as one process would choose it (at the frame's height)."""
        stride, padding = tuple(stride), tuple(padding)
        slow_in_aten = (x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] == 1
                        and x.shape[1] * x.shape[2] * full_h <= eager_vae._ATEN_MKLDNN_MIN_NCTH)
        if slow_in_aten and stride[1:] == (1, 1) and padding[0] == 0:
            return eager_vae.conv3d_per_tap(x, weight, bias, stride, padding)
        if x.device.type == "cpu" and x.dtype == torch.float32:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        return F.conv3d(x, weight, bias, stride, padding)

    def conv(self, mod: eager_vae.CausalConv3d, x: torch.Tensor, cache, full_h: int) -> torch.Tensor:
        """CausalConv3d.forward on a slab: the halo of its row padding first, then the conv without row padding."""
        pad_h, pad_w = mod.padding[1], mod.padding[2]
        x = halo(self.ctx, x, pad_h)
        if mod.front_frames:
            prev = cache.push(mod, x) if cache is not None else None
            if prev is not None:
                x = torch.cat([prev, x], dim=2)
            missing = mod.front_frames - (prev.shape[2] if prev is not None else 0)
            if missing > 0:
                x = F.pad(x, (0, 0, 0, 0, missing, 0))
        return self._conv3d(x, mod.weight, mod.bias, mod.stride, (0, 0, pad_w), full_h)

    def residual(self, block: eager_vae.ResidualBlock, x, cache, full_h):
        shortcut = x if isinstance(block.conv_shortcut, torch.nn.Identity) else self.conv(block.conv_shortcut, x, None,
                                                                                             full_h)
        x = self.conv(block.conv1, F.silu(block.norm1(x)), cache, full_h)
        x = self.conv(block.conv2, F.silu(block.norm2(x)), cache, full_h)
        return x + shortcut

    def attention(self, block: eager_vae.AttentionBlock, x, sizes):
        """The whole frame's attention: gather the rows, run the block as one process does, keep this rank's rows."""
        full = gather_rows(self.ctx, x, sizes)
        lo = sum(sizes[: self.ctx.rank])
        y = block(full)
        return _as_layout(y[..., lo:lo + sizes[self.ctx.rank], :], _layout(y))

    def resample(self, mod: eager_vae.Resample, x, cache, full_h):
        if mod.mode not in ("upsample2d", "upsample3d"):
            raise ValueError(f"decoder resample mode {mod.mode!r}")
        if mod.mode == "upsample3d" and not cache.first_visit(mod):
            b, c, t, h, w = x.shape
            x = self.conv(mod.time_conv, x, cache, full_h)
            x = x.view(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        b, c, t, h, w = x.shape
        up, conv = mod.resample[0], mod.resample[1]
        frames = up(x.transpose(1, 2).reshape(b * t, c, h, w))  # nearest 2x: copies pixels, row-local
        frames = halo(self.ctx, frames, conv.padding[0])
        y = F.conv2d(frames, conv.weight, conv.bias, conv.stride, (0, conv.padding[1]))
        return y.view(b, t, *y.shape[1:]).transpose(1, 2)

    # -- the decoder, in Decoder.forward's order ---------------------------------------------------------------------

    def decoder(self, x, cache, sizes):
        dec = self.vae.decoder
        full_h = sum(sizes)
        x = self.conv(dec.conv_in, x, cache, full_h)
        mid = dec.mid_block
        x = self.residual(mid.resnets[0], x, cache, full_h)
        x = self.attention(mid.attentions[0], x, sizes)
        x = self.residual(mid.resnets[1], x, cache, full_h)
        for block in dec.up_blocks:
            for resnet in block.resnets:
                x = self.residual(resnet, x, cache, full_h)
            if block.upsamplers is not None:
                x = self.resample(block.upsamplers[0], x, cache, full_h)
                sizes = [2 * s for s in sizes]
                full_h *= 2
        return self.conv(dec.conv_out, F.silu(dec.norm_out(x)), cache, full_h), sizes

    def decode_iter(self, z: torch.Tensor, progress: Callable[[int, int], None] | None = None):
        """WanVAE.decode_iter over the ranks: every rank passes the same latents z [B, z_dim, T, h, w] (not
        normalized) and iterates; rank 0 gets each latent frame's clamped pixels [B, 3, k, 8h, 8w] (k = 1, then 4),
        gathered from the ranks' rows, the others None per chunk."""
        ctx, vae = self.ctx, self.vae
        if z.ndim != 5 or z.shape[1] != vae.config.z_dim:
            raise ValueError(f"decode expects [B, {vae.config.z_dim}, T, h, w], got {list(z.shape)}")
        if z.shape[2] < 1:
            raise ValueError("decode needs at least one latent frame")
        rows = split_sizes(z.shape[3], ctx.world_size)
        if min(rows) < 1:
            raise ValueError(f"{z.shape[3]} latent rows cannot be split over {ctx.world_size} ranks")
        with torch.no_grad():
            z = vae.post_quant_conv(z)  # 1x1x1 on the whole latent (every rank the same), then this rank's rows
            lo = sum(rows[: ctx.rank])
            z = z[..., lo:lo + rows[ctx.rank], :]
            cache = eager_vae.CausalCache()
        for i in range(z.shape[2]):
            with torch.no_grad():
                chunk, sizes = self.decoder(z[:, :, i:i + 1], cache, rows)
                chunk = gather_rows(ctx, chunk.clamp_(-1.0, 1.0), sizes, dst=0)
            yield chunk
            if progress and ctx.is_root:
                progress(i + 1, z.shape[2])

    def decode(self, z: torch.Tensor, progress: Callable[[int, int], None] | None = None) -> torch.Tensor | None:
        """The whole video on rank 0 (decode_iter's chunks concatenated), None elsewhere."""
        chunks = list(self.decode_iter(z, progress))
        return torch.cat(chunks, dim=2) if self.ctx.is_root else None
