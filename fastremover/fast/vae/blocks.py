"""The fast VAE's blocks shared by encoder and decoder: residual, attention, mid and resample blocks (`Blocks`).

Each method runs the eager module's math (fastremover/models/vae.py) on channels-last activations through a
`ConvDispatch`, with the fused RMS norm + SiLU (`vae_norm`) writing a causal conv's input buffer directly and the
residual adds in place (`residual.add_frames`), deferred conv biases added by those kernels (`fuse_bias`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.fast.vae.conv import CL3, ConvDispatch, Fill, Stream, copy_fill, empty_cl3, frames_2d, frames_5d
from fastremover.fast.vae.convert import VAEWeights
from fastremover.models.vae import AttentionBlock, CausalConv3d, MidBlock, Resample, ResidualBlock, UpBlock


class Blocks:
    """The VAE's blocks on `convs`. norm_fn: `vae_rms_norm` or its reference; add_fn: `add_frames` or its reference
    (y += shortcut on channels-last views, where torch's add takes its slow strided path); precise_norm: the norm
    kernel's precise mode (the keyword is passed only then)."""

    def __init__(self, weights: VAEWeights, convs: ConvDispatch, norm_fn: Callable, add_fn: Callable,
                 precise_norm: bool = False):
        self.weights, self.convs = weights, convs
        self.norm_fn, self.add_fn, self.precise_norm = norm_fn, add_fn, precise_norm

    def norm(self, x: torch.Tensor, norm: nn.Module, silu: bool, out=None, tail=None, bias=None,
             quant_scale=None) -> torch.Tensor:
        """bias: a bias deferred from the conv that produced x (`ConvDispatch.deferred`): normalize x + bias. The
        norm runs in its default fast-math mode unless precise_norm (the keyword is only passed then, like bias).
        quant_scale: write e4m3 codes of that scale (out and tail e4m3)."""
        kw = {"precise": True} if self.precise_norm else {}
        if bias is not None:
            kw["bias"] = bias
        if quant_scale is not None:
            kw["quant_scale"] = quant_scale
        if norm in self.weights.norm_channels:
            kw["channels"] = self.weights.norm_channels[norm]
        return self.norm_fn(x, self.weights.gamma[norm], silu=silu, out=out, tail=tail, **kw)

    def norm_fill(self, x: torch.Tensor, norm: nn.Module, bias: torch.Tensor | None = None) -> Fill:
        return Fill(x, lambda src, view, tail, **kw: self.norm(src, norm, True, out=view, tail=tail, bias=bias, **kw),
                    norm=norm)

    def add(self, y: torch.Tensor, s: torch.Tensor, out=None, bias=None) -> torch.Tensor:
        """y + s (in place, or into out); bias: deferred from the conv that produced y, added to y first."""
        return self.add_fn(y, s, out=out, **({} if bias is None else {"bias": bias}))

    def resblock(self, m: ResidualBlock, x: torch.Tensor, st: Stream, padded_out: bool = False) -> torch.Tensor:
        """x + conv2(silu(norm2(conv1(silu(norm1(x)))))). padded_out: return a [B, C, T, H+1, W+1] tensor whose last
        row and column are zero and whose interior holds the result (the input of a downsample's stride-2 conv).
        fuse_bias: conv1's output is read by norm2 only and conv2's by the residual add only, so both biases are
        added there (`ConvDispatch.deferred`)."""
        convs = self.convs
        b, c, t, h, w = x.shape
        shortcut = x if isinstance(m.conv_shortcut, nn.Identity) else convs.pointwise(m.conv_shortcut, x)
        hid = convs.causal(m.conv1, st, t, (b, c, h, w), self.norm_fill(x, m.norm1), defer=True)
        c2 = hid.shape[1]
        fill = self.norm_fill(hid, m.norm2, bias=convs.deferred(m.conv1))
        del hid  # freed once the norm has read it, before conv2 allocates its output
        if (not padded_out and convs[m.conv2].act_scale is not None and shortcut.dtype == convs.dtype
                and shortcut.is_contiguous(memory_format=CL3) and shortcut.data_ptr() % 16 == 0):
            # the FP8 kernel adds the shortcut in its epilogue: the bits of the conv followed by the add below
            return convs.causal(m.conv2, st, t, (b, c2, h, w), fill, residual=shortcut)
        y = convs.causal(m.conv2, st, t, (b, c2, h, w), fill, defer=True)
        y_bias = convs.deferred(m.conv2)
        if not padded_out:
            return self.add(y, shortcut, bias=y_bias)
        out = empty_cl3(y, (b, c2, t, h + 1, w + 1))
        out[:, :, :, h].zero_()
        out[:, :, :, :h, w].zero_()
        self.add(y, shortcut, out=out[:, :, :, :h, :w], bias=y_bias)
        return out

    def mid(self, m: MidBlock, x: torch.Tensor, st: Stream) -> torch.Tensor:
        x = self.resblock(m.resnets[0], x, st)
        x = self.attention(m.attentions[0], x)
        return self.resblock(m.resnets[1], x, st)

    def attention(self, m: AttentionBlock, x: torch.Tensor) -> torch.Tensor:
        convs = self.convs
        b, c, t, h, w = x.shape
        n = frames_2d(self.norm(x, m.norm, silu=False))
        qkv_conv = convs[m.to_qkv]
        qkv = convs.conv_b(F.conv2d, n, qkv_conv.weight, qkv_conv.bias)  # [bt, 3c, h, w] = [bt, h*w, 3c] memory
        del n
        qkv = qkv.permute(0, 2, 3, 1).reshape(b * t, 1, h * w, 3 * c)  # the eager layout (a view here)
        q, k, v = qkv.chunk(3, dim=-1)
        real = m.to_qkv.in_channels  # a padded input (pad_channels) keeps the real channel count's softmax scale
        a = F.scaled_dot_product_attention(q, k, v, **({} if real == c else {"scale": real**-0.5}))  # [bt, 1, h*w, c]
        del qkv, q, k, v
        a = a.view(b * t, h, w, c).permute(0, 3, 1, 2)  # channels-last view, as eager's transpose+reshape
        proj = convs[m.proj]
        proj_bias = convs.deferred(m.proj)  # fuse_bias: the residual add adds it (y has no other reader)
        y = convs.conv_b(F.conv2d, a, proj.weight, proj.bias if proj_bias is None else None)
        return self.add(frames_5d(y, b), x, bias=proj_bias)

    def up_block(self, m: UpBlock, x: torch.Tensor, st: Stream) -> torch.Tensor:
        for r in m.resnets:
            x = self.resblock(r, x, st)
        if m.upsamplers is not None:
            x = self.resample(m.upsamplers[0], x, st)
        return x

    def resample(self, m: Resample, x: torch.Tensor, st: Stream, padded: bool = False) -> torch.Tensor:
        """padded: x is [B, C, T, H+1, W+1] with a zero last row and column (from resblock(padded_out=True))."""
        x = self.resample_up_time(m, x, st)
        x = self.resample_space(m, x, padded)
        return self.resample_down_time(m, x, st)

    def resample_up_time(self, m: Resample, x: torch.Tensor, st: Stream) -> torch.Tensor:
        """upsample3d's temporal part: frames x2 (not on the first chunk, as eager)."""
        if m.mode != "upsample3d" or st.first_visit(m):
            return x
        b, c, t, h, w = x.shape
        y = self.convs.causal(m.time_conv, st, t, (b, c, h, w), copy_fill(x))  # [b, 2c, t, h, w]
        del x
        # channels [frame 2i | frame 2i+1] -> frames: memory [b, t, h, w, (2, c)] -> [b, t, 2, h, w, c]
        x = empty_cl3(y, (b, c, 2 * t, h, w))
        x.permute(0, 2, 3, 4, 1).view(b, t, 2, h, w, c).copy_(
            y.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, 2, c).permute(0, 1, 4, 2, 3, 5))
        return x

    def resample_space(self, m: Resample, x: torch.Tensor, padded: bool = False) -> torch.Tensor:
        """The per-frame 2-D part: nearest 2x + 3x3 conv, or zero pad right/bottom + 3x3 stride-2 conv."""
        if m.mode.startswith("up"):
            return self.convs.upsample2x(m.resample[1], x)
        b = x.shape[0]
        conv = self.convs[m.resample[1]]
        if not padded:  # ZeroPad2d((0, 1, 0, 1))
            _, c, t, h, w = x.shape
            xp = empty_cl3(x, (b, c, t, h + 1, w + 1)).zero_()
            xp[:, :, :, :h, :w].copy_(x)
            x = xp
            del xp
        return frames_5d(self.convs.conv_b(F.conv2d, frames_2d(x), conv.weight, conv.bias, conv.stride, conv.padding),
                         b)

    def resample_down_time(self, m: Resample, y: torch.Tensor, st: Stream) -> torch.Tensor:
        """downsample3d's temporal part: the first chunk passes through (frame 0 -> latent frame 0); later chunks:
        stride-2 conv over [last frame of the previous chunk, this chunk]."""
        if m.mode != "downsample3d":
            return y
        prev = st.cache.get(m)
        if prev is None:
            st.cache[m] = y[:, :, -1:].clone(memory_format=CL3)
            return y
        b, c, t, h, w = y.shape
        buf = empty_cl3(y, (b, c, 1 + t, h, w))
        buf[:, :, :1].copy_(prev)
        buf[:, :, 1:].copy_(y)
        prev.copy_(y[:, :, -1:])
        del y
        return self.convs.conv3d(buf, self.convs[m.time_conv])

    def head(self, norm: nn.Module, conv: CausalConv3d, x: torch.Tensor, st: Stream) -> torch.Tensor:
        """conv(silu(norm(x))) for a causal conv (the encoder's conv_out, the decoder's without the tap head)."""
        b, c, t, h, w = x.shape
        return self.convs.causal(conv, st, t, (b, c, h, w), self.norm_fill(x, norm))
