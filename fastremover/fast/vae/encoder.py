"""The fast VAE's encoder (`Encoder`): chunk by chunk as the eager WanVAE (frame 0, then ENCODE_CHUNK_FRAMES frames),
its full-resolution level `step` frames at a time, the input frames written by a `FrameSource` straight into
conv_in's stream buffer (so the pipeline's two encode inputs are formed per chunk, never as full videos)."""

from __future__ import annotations

from typing import Callable

import torch

from fastremover.fast.vae.blocks import Blocks
from fastremover.fast.vae.conv import Fill, Stream, empty_cl3
from fastremover.models.vae import ENCODE_CHUNK_FRAMES, Resample, ResidualBlock, WanVAE

Progress = Callable[[int, int], None]
# write(start, stop, out): put input frames [start, stop) of the encoder's input stream(s) into out [B, 3, n, H, W]
FrameSource = Callable[[int, int, torch.Tensor], None]


def n_chunks(frames: int) -> int:
    """The encoder's chunks for `frames` input frames (= latent frames)."""
    return (frames - 1) // ENCODE_CHUNK_FRAMES + 1


class Encoder:
    """The encoder of `vae` (and its quant_conv, mu only) on `blocks`."""

    def __init__(self, vae: WanVAE, blocks: Blocks):
        self.vae, self.blocks, self.convs = vae, blocks, blocks.convs

    def encode(self, source: FrameSource, b: int, f: int, h: int, w: int, step: int | None,
               progress: Progress | None = None) -> torch.Tensor:
        """mu [b, z_dim, T, h/8, w/8] of the f frames `source` writes; step: frames per step of the
        full-resolution level (None: whole chunks)."""
        chunks = n_chunks(f)
        bounds = [(0, 1)] + [(1 + ENCODE_CHUNK_FRAMES * i, 1 + ENCODE_CHUNK_FRAMES * (i + 1))
                             for i in range(chunks - 1)]
        st = Stream()
        out = None
        for i, (s, e) in enumerate(bounds):
            mu = self._chunk(source, s, e, b, h, w, step, st)
            if out is None:
                out = mu.new_empty(b, mu.shape[1], chunks, *mu.shape[3:])  # NCDHW contiguous, like WanVAE
            out[:, :, i : i + 1].copy_(mu)
            del mu
            if progress:
                progress(i + 1, chunks)
        return out

    def _chunk(self, source, s, e, b, h, w, step, st):
        enc = self.vae.encoder
        blocks = list(enc.down_blocks)
        # Level 0 (full resolution, up to and including its Resample) runs `step` frames at a time when that Resample
        # is spatial only (Wan 2.1); its quarter-size outputs are gathered for level 1.
        first = next((i for i, m in enumerate(blocks) if isinstance(m, Resample)), None)
        split = first is not None and blocks[first].mode == "downsample2d" and step is not None
        if split and e - s > step:
            head, blocks = blocks[: first + 1], blocks[first + 1 :]
            x = None
            for s0 in range(s, e, step):
                s1 = min(e, s0 + step)
                y = self._blocks(head, self._conv_in(source, s0, s1, b, h, w, st), st)
                if x is None:
                    x = empty_cl3(y, (b, y.shape[1], e - s, *y.shape[3:]))
                x[:, :, s0 - s : s1 - s].copy_(y)
                del y
        else:
            x = self._conv_in(source, s, e, b, h, w, st)
        x = self._blocks(blocks, x, st)
        x = self.blocks.mid(enc.mid_block, x, st)
        x = self.blocks.head(enc.norm_out, enc.conv_out, x, st)
        return self.convs.pointwise(self.vae.quant_conv, x)

    def _blocks(self, blocks: list, x: torch.Tensor, st: Stream) -> torch.Tensor:
        """The encoder's flat list of residual blocks and Resamples. A residual block right before a downsample
        writes its result into the zero-padded input of the downsample's stride-2 conv."""
        padded = False
        for i, block in enumerate(blocks):
            if isinstance(block, ResidualBlock):
                nxt = blocks[i + 1] if i + 1 < len(blocks) else None
                padded = isinstance(nxt, Resample) and nxt.mode.startswith("down")
                x = self.blocks.resblock(block, x, st, padded_out=padded)
            elif isinstance(block, Resample):
                x = self.blocks.resample(block, x, st, padded=padded)
                padded = False
            else:
                raise TypeError(f"unexpected block {type(block).__name__}")
        return x

    def _conv_in(self, source: FrameSource, s: int, e: int, b: int, h: int, w: int, st: Stream) -> torch.Tensor:
        conv = self.vae.encoder.conv_in
        c_in = self.convs[conv].weight.shape[1]
        c_src = self.vae.config.in_channels

        def write(_src, view, tail):
            if c_in > c_src:
                view[:, c_src:].zero_()
            source(s, e, view[:, :c_src])
            if tail is not None:  # the cache may leave out the zero padding channels
                tail.copy_(view[:, : tail.shape[1], view.shape[2] - tail.shape[2] :])

        return self.convs.causal(conv, st, e - s, (b, c_in, h, w), Fill(None, write, rows_ok=False))
