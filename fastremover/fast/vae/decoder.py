"""The fast VAE's decoder (`Decoder`): one latent frame at a time as the eager WanVAE, its last two levels and head
`step` frames at a time (split inside the last upsampler before them, between its temporal and spatial part, so
the frames waiting are small ones), the head's conv_out as per-tap partial sums (`head`, `tap_head`)."""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from fastremover.fast.vae.blocks import Blocks
from fastremover.fast.vae.conv import CL3, Stream, copy_fill, frames_2d, frames_5d
from fastremover.models.vae import WanVAE

Progress = Callable[[int, int], None]


class Decoder:
    """The decoder of `vae` (after its post_quant_conv) on `blocks`; head_taps: the tap head's weights
    (`convert._tap_head`) or None (conv_out as a causal conv)."""

    def __init__(self, vae: WanVAE, blocks: Blocks, head_taps: tuple | None = None):
        self.vae, self.blocks, self.convs, self.head_taps = vae, blocks, blocks.convs, head_taps

    def decode(self, z: torch.Tensor, step: int | None, progress: Progress | None,
               out: torch.Tensor | None) -> Iterator[torch.Tensor]:
        """Decode z (on device, in dtype) one latent frame at a time, yielding each latent frame's pixels: views of
        `out` (the whole video, written in place) or, with out=None, new tensors. step: frames per step of the last
        two levels and the head (None: whole chunks)."""
        vae, blocks = self.vae, self.blocks
        dec = vae.decoder
        z = self.convs.pointwise(vae.post_quant_conv, z.contiguous(memory_format=CL3))
        st = Stream()
        b, _, t_lat, h, w = z.shape
        c_out = vae.config.out_channels
        total = 1 + (t_lat - 1) * vae.config.temporal_compression
        ups = list(dec.up_blocks)
        # The last two levels and the head run `step` frames at a time. The split is made inside the last upsampler
        # before them, between its temporal and its spatial part, so the frames waiting are the small ones.
        split_at = max(0, len(ups) - 2)
        pre = ups[split_at - 1] if split_at else None
        pending = pre.upsamplers[0] if pre is not None and pre.upsamplers is not None else None
        frame = 0
        for i in range(t_lat):
            zi = z[:, :, i : i + 1]
            x = self.convs.causal(dec.conv_in, st, 1, (b, zi.shape[1], h, w), copy_fill(zi))
            del zi
            x = blocks.mid(dec.mid_block, x, st)
            for block in ups[: max(0, split_at - 1)]:
                x = blocks.up_block(block, x, st)
            if pre is not None:
                for r in pre.resnets:
                    x = blocks.resblock(r, x, st)
                if pending is not None:
                    x = blocks.resample_up_time(pending, x, st)
            n = x.shape[2]
            k_step = min(step or n, n)
            pieces = [x[:, :, s0 : s0 + k_step] for s0 in range(0, n, k_step)] if k_step < n else [x]
            del x
            first = frame
            parts = []
            while pieces:
                y = pieces.pop(0)
                if pending is not None:
                    y = blocks.resample_space(pending, y)
                for block in ups[split_at:]:
                    y = blocks.up_block(block, y, st)
                k = y.shape[2]
                dst = out[:, :, frame : frame + k] if out is not None else y.new_empty(b, c_out, k, *y.shape[3:])
                self.head(y, st, dst)
                parts.append(dst)
                frame += k
                del y, dst
            if out is not None:
                yield out[:, :, first:frame]
            else:
                yield parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
            del parts
            if progress:
                progress(i + 1, t_lat)
        assert frame == total, (frame, total)

    def head(self, x: torch.Tensor, st: Stream, out: torch.Tensor) -> None:
        """silu(norm_out(x)) -> conv_out -> clamp into `out` (the output video's frames).

        conv_out has only out_channels (3) outputs, so instead of caching 2 frames of its wide input it runs as one
        conv2d per frame giving all three temporal taps' partial outputs P_k (tap-major channels), and keeps two
        small fp32 sums: before frame t, A = P_0(t-2) + P_1(t-1) and B = P_0(t-1) (zeros before the first frame);
        then out(t) = A + P_2(t) + bias, A <- B + P_1(t), B <- P_0(t). The same sum as the causal conv3d, with the
        three partials rounded to the model dtype (the final output is rounded once more, from fp32)."""
        dec = self.vae.decoder
        taps = self.head_taps
        if taps is None:  # plain causal conv path
            y = self.blocks.head(dec.norm_out, dec.conv_out, x, st)
            torch.clamp(y[:, : out.shape[1]], -1.0, 1.0, out=out)
            return
        weight, bias, cp = taps
        b, c, t, h, w = x.shape
        xn = self.blocks.norm(x, dec.norm_out, silu=True)
        del x
        p = frames_5d(F.conv2d(frames_2d(xn), weight, None, padding=1), b)  # [b, 3*cp, t, h, w]
        del xn
        c_out = out.shape[1]
        state = st.cache.get(dec.conv_out)
        if state is None:
            zeros = torch.zeros((b, c_out, 1, h, w), device=self.convs.device, dtype=torch.float32)
            state = st.cache[dec.conv_out] = [zeros, zeros.clone()]
        for j in range(t):
            a_sum, b_sum = state
            pj = p[:, :, j : j + 1]
            o = a_sum + pj[:, 2 * cp : 2 * cp + c_out]
            o += bias
            out[:, :, j : j + 1].copy_(o.clamp_(-1.0, 1.0))  # clamp then round = round then clamp (+-1 exact)
            del o
            state[0] = b_sum.add_(pj[:, cp : cp + c_out])  # A <- B + P_1(t)   (B's storage is reused)
            state[1] = a_sum.copy_(pj[:, :c_out])  # B <- P_0(t)            (A's old storage is reused)
