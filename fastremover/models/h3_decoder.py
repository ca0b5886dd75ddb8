"""The MiniMax-H3 video VAE decoder: a ViT that turns latents into video, in temporal clips and spatial tiles.

Eager math only (fp32, like the released decoder). Public structure: FastVideo's `AutoencoderKLMiniMaxH3` decoder
(`fastvideo/models/vaes/minimax_h3_video.py`, Apache-2.0), re-implemented here. Module and parameter names are the
checkpoint's (`post_quant_conv.weight`, `decoder.proj_in.weight`, `decoder.register_tokens`,
`decoder.transformer_blocks.{i}.attn.to_q.weight`, `...ff.net.0.proj.weight`, `decoder.norm_out.weight`, ...), so a
safetensors file of the whole VAE loads with a strict check on every decoder key (encoder keys are ignored).

Data path of one clip tile, latents z [B, C=24, t, h, w] (raw latents, i.e. what the encoder produces):
    post_quant_conv (1x1x1 conv) -> tokens [B, t*h*w, C] -> proj_in -> [B, N, D=2048]
    append 4 register tokens and one zero "cls" token              -> S = N + 5 tokens
    RoPE: each token's (t, y, x) position on [-1, 1] (pixel centres), suffix tokens at 0; theta 100 on the first
          0.75 * 64 = 48 dims of every head (8 frequencies per axis, rotate-half layout)
    36 blocks:  h += attn(rms_norm(h)) * scale1 ;  h += ffn(rms_norm(h)) * scale2
                attn: q/k/v linears (with bias), q/k RMSNorm per head (no affine), RoPE, SDPA, to_out
                ffn:  SwiGLU, one projection D -> 2F packed value first ([value | gate]), value * silu(gate), F -> D
    norm_out (LayerNorm) -> proj_out -> drop the 5 suffix tokens -> unpatchify 4 x 16 x 16 -> [B, 3, 4t, 16h, 16w]
Pixels: sample * ImageNet std + ImageNet mean, clamped to [0, 1].

Temporal clips: the encoder saw clips of 17 frames = 5 latent tokens each (the first token stands for 1 frame + 3
pre-padding frames) and dropped the last 3 tokens of the video. The decoder runs windows of 5 + 2 tokens (the 2 extra
tokens overlap the next window), keeps frames [3, 20) of each window, and cross-fades the 5 frames the overlap
decodes into the next window's first 5 (linear weights). `temporal_plan` gives the exact frame count.

Spatial tiles: tiles of 256 x 256 pixels (16 x 16 latents) with at least 64 pixels of overlap; overlaps grow in
steps of 16 pixels until the tiles cover the frame exactly; neighbouring tiles are blended linearly over the overlap.
All tiles of a frame have one size, so `tiles_per_call` tiles can be stacked on the batch axis and decoded in one call
(attention stays per tile).

Tiers: `tier_blocks(num_layers, "8L")` picks 8 evenly spaced blocks (0, 5, 10, ..., 35 of 36) and the decoder skips the
others - a faster approximation, not the released model; "36L" is all 36 blocks.

The block loop is the seam for the fast path: `H3ViTDecoder.forward(x, blocks=...)` takes any callable
`blocks(h [B, S, D] fp32, rope (cos, sin) [S, R] fp32) -> h` (fastremover/fast/h3_nvfp4.py builds NVFP4 ones).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.errors import FastRemoverError

PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
TIERS = ("36L", "8L")
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
BlockStack = Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class H3DecoderConfig:
    """The decoder half of FastVideo's `MiniMaxH3VideoVAEArchConfig` + its tile settings (defaults: the release)."""

    latent_channels: int = 24
    out_channels: int = 3
    patch_size: int = 16  # spatial compression
    patch_size_t: int = 4  # temporal compression
    num_layers: int = 36
    num_heads: int = 32
    head_dim: int = 64
    num_register_tokens: int = 4
    ffn_mult: int = 4
    rope_theta: float = 100.0
    rope_dim_ratio: float = 0.75
    norm_eps: float = 1e-5
    clip_length: int = 17
    token_drop: int = 3
    latents_mean: tuple[float, ...] = (0.0,) * 24
    latents_std: tuple[float, ...] = (1.0,) * 24
    tile_size: int = 256  # pixels per tile side
    tile_overlap: int = 64  # least overlap of neighbouring tiles, pixels

    def __post_init__(self):
        for name in ("latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            raise ValueError("latents_mean and latents_std need one entry per latent channel")
        if any(s <= 0 for s in self.latents_std):
            raise ValueError("latents_std must be positive")
        if self.rotary_dim % 6 or self.rotary_dim > self.head_dim:
            raise ValueError(f"the rotary dims ({self.rotary_dim}) must be a multiple of 6 within a head")
        if self.tile_size % self.patch_size or self.tile_overlap % self.patch_size:
            raise ValueError("tile_size and tile_overlap must be multiples of patch_size")
        if not 0 <= self.tile_overlap < self.tile_size:
            raise ValueError("tile_overlap must be in [0, tile_size)")
        if self.clip_length < 1 or self.token_drop < 0:
            raise ValueError("clip_length must be >= 1 and token_drop >= 0")

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        return self.dim * self.ffn_mult

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_dim_ratio)

    @property
    def chunk_tokens(self) -> int:
        """Latent tokens per encoder clip (5 for 17 frames at 4x)."""
        return -(-self.clip_length // self.patch_size_t)

    @property
    def pre_padding(self) -> int:
        """Frames the first token of a clip decodes in front of the clip ((-17) % 4 = 3)."""
        return (-self.clip_length) % self.patch_size_t

    @property
    def overlap_tokens(self) -> int:
        """Extra tokens each decode window reads from the next clip ((-3) % 5 = 2)."""
        return (-self.token_drop) % self.chunk_tokens

    @property
    def overlap_frames(self) -> int:
        """Frames cross-faded between consecutive windows (2 * 4 - 3 = 5)."""
        return max(self.overlap_tokens * self.patch_size_t - self.pre_padding, 0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "H3DecoderConfig":
        """From our own dict or a diffusers/FastVideo VAE config.json (decoder_* names); unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        aliases = {"decoder_num_layers": "num_layers", "decoder_num_attention_heads": "num_heads",
                   "decoder_attention_head_dim": "head_dim", "decoder_num_register_tokens": "num_register_tokens",
                   "decoder_ffn_mult": "ffn_mult", "decoder_rope_theta": "rope_theta",
                   "decoder_rope_dim_ratio": "rope_dim_ratio", "decoder_norm_eps": "norm_eps"}
        kw = {}
        for k, v in d.items():
            k = aliases.get(k, k)
            if k in names:
                kw[k] = tuple(v) if isinstance(v, list) else v
        if "spatial_downsample_factors" in d:
            kw["patch_size"] = math.prod(d["spatial_downsample_factors"])
        if "temporal_downsample_factors" in d:
            kw["patch_size_t"] = math.prod(d["temporal_downsample_factors"])
        return cls(**kw)


PRESETS = {
    "full": H3DecoderConfig(),
    # every structural feature of the release (36 blocks, 4 registers, 17-frame clips with 3 dropped tokens, partial
    # RoPE, value-first SwiGLU, overlapping tiles) at a width and patch size a CPU decodes in seconds
    "tiny": H3DecoderConfig(latent_channels=4, patch_size=4, num_heads=2, head_dim=16, latents_mean=(0.0,) * 4,
                            latents_std=(1.0,) * 4, tile_size=16, tile_overlap=8),
}


def preset(name: str) -> H3DecoderConfig:
    if name not in PRESETS:
        raise FastRemoverError(f"unknown H3 preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def tier_blocks(num_layers: int, tier: str | None) -> list[int]:
    """The blocks a tier runs. None: every block; "<N>L": N evenly spaced ones, round(i (L-1) / (N-1)), first and last
    included ("36L" of 36 = all; "8L" of 36 = 0, 5, 10, 15, 20, 25, 30, 35)."""
    if tier is None:
        return list(range(num_layers))
    if not (isinstance(tier, str) and tier.endswith("L") and tier[:-1].isdigit() and int(tier[:-1]) >= 1):
        raise FastRemoverError(f"unknown tier {tier!r}; use one of {TIERS}")
    n = int(tier[:-1])
    if n > num_layers:
        raise FastRemoverError(f"tier {tier} needs {n} blocks but the decoder has {num_layers}")
    if n == 1:
        return [num_layers - 1]
    return sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)})


# ----------------------------------------------------------------------------------------------------------------------
# Modules (names as in the checkpoint)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotate-half RoPE on the first R = cos.shape[-1] dims of x [..., Dh]: x_r * cos + [-x2, x1] * sin."""
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    x1, x2 = xr.chunk(2, dim=-1)
    return torch.cat([xr * cos + torch.cat([-x2, x1], dim=-1) * sin, rest], dim=-1)


def rope_tables(cfg: H3DecoderConfig, t: int, h: int, w: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) fp32 [S, R] for t*h*w patch tokens then num_register_tokens + 1 suffix tokens at position 0.

    Positions are the patch centres mapped to [-1, 1]: 2 (i + 0.5) / n - 1 per axis; frequencies
    theta^-(6j/R), j < R/6, per axis; angle = 2 pi pos f; the R/2 angles (t freqs, y freqs, x freqs) appear twice."""
    r = cfg.rotary_dim
    inv_freq = 1.0 / cfg.rope_theta ** torch.arange(0, 1, 6 / r, dtype=torch.float32, device=device)
    axes = [2.0 * (torch.arange(0.5, n, dtype=torch.float32, device=device) / n) - 1.0 for n in (t, h, w)]
    pos = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    pos = torch.cat([pos, pos.new_zeros(cfg.num_register_tokens + 1, 3)])
    angles = (2.0 * math.pi * pos[:, :, None] * inv_freq[None, None, :]).flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class H3Attention(nn.Module):
    def __init__(self, cfg: H3DecoderConfig):
        super().__init__()
        d = cfg.dim
        self.heads, self.eps = cfg.num_heads, cfg.norm_eps
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.to_out = nn.ModuleList([nn.Linear(d, d)])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, s, self.heads, -1) for lin in (self.to_q, self.to_k, self.to_v))
        dh = q.shape[-1]
        q, k = F.rms_norm(q, (dh,), eps=self.eps), F.rms_norm(k, (dh,), eps=self.eps)
        cos, sin = (t[:, None, :] for t in rope)  # [S, 1, R] against [B, S, H, Dh]
        q, k = rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.to_out[0](o.transpose(1, 2).reshape(b, s, -1))


class H3SwiGLU(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.proj = nn.Linear(d, 2 * f)  # value first: output [value | gate]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        return value * F.silu(gate)


class H3FeedForward(nn.Module):
    def __init__(self, cfg: H3DecoderConfig):
        super().__init__()
        # indices as in the checkpoint: net.0 = SwiGLU, net.1 = dropout (no weights), net.2 = the down projection
        self.net = nn.ModuleList([H3SwiGLU(cfg.dim, cfg.ffn_dim), nn.Identity(), nn.Linear(cfg.ffn_dim, cfg.dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class H3Block(nn.Module):
    def __init__(self, cfg: H3DecoderConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = H3Attention(cfg)
        self.scale1 = nn.Parameter(torch.zeros(cfg.dim))
        self.norm2 = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ff = H3FeedForward(cfg)
        self.scale2 = nn.Parameter(torch.zeros(cfg.dim))

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), rope) * self.scale1
        return h + self.ff(self.norm2(h)) * self.scale2


class H3ViTDecoder(nn.Module):
    """Latent tokens of one clip tile -> pixels (normalized), see the module docstring."""

    def __init__(self, cfg: H3DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.proj_in = nn.Linear(cfg.latent_channels, cfg.dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.num_register_tokens, cfg.dim))
        self.transformer_blocks = nn.ModuleList([H3Block(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.proj_out = nn.Linear(cfg.dim, cfg.out_channels * cfg.patch_size_t * cfg.patch_size ** 2)

    def eager_blocks(self, indices: list[int]) -> BlockStack:
        def run(h, rope):
            for i in indices:
                h = self.transformer_blocks[i](h, rope)
            return h
        return run

    def forward(self, x: torch.Tensor, blocks: BlockStack | None = None) -> torch.Tensor:
        """x [B, C, t, h, w] (after post_quant_conv) -> [B, out, t*pt, h*p, w*p]; blocks: the block loop (default:
        every block, eager)."""
        cfg = self.cfg
        b, c, t, hh, ww = x.shape
        n = t * hh * ww
        # proj_in / proj_out run one batch entry (tile) at a time: a BLAS picks its blocking by the row count, and a
        # tile's pixels must not depend on the other tiles decoded in the same call (tile batching is bit-identical)
        tokens = torch.cat([self.proj_in(xi) for xi in x.permute(0, 2, 3, 4, 1).reshape(b, n, c).split(1)])
        suffix = torch.cat([self.register_tokens.expand(b, -1, -1), tokens.new_zeros(b, 1, cfg.dim)], dim=1)
        h = torch.cat([tokens, suffix.to(tokens.dtype)], dim=1)
        rope = rope_tables(cfg, t, hh, ww, device=x.device)
        h = (blocks or self.eager_blocks(list(range(cfg.num_layers))))(h, rope)
        out = torch.cat([self.proj_out(self.norm_out(hi))[:, :n] for hi in h.float().split(1)])
        p, pt = cfg.patch_size, cfg.patch_size_t
        out = out.view(b, t, hh, ww, cfg.out_channels, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(b, cfg.out_channels, t * pt, hh * p, ww * p)


# ----------------------------------------------------------------------------------------------------------------------
# Temporal clips and spatial tiles


def temporal_plan(cfg: H3DecoderConfig, latent_frames: int) -> tuple[int, int, int]:
    """(pad_tokens, windows, output_frames) for `latent_frames` latent tokens (FastVideo's decode plan).

    The video's tokens plus the token_drop dropped ones are padded (repeating the last token) up to whole clips;
    a dropped tail means the last clip is decoded only through the previous window's overlap. Padding frames are
    taken off the count: a padding token stands for patch_size_t frames, or for clip_length % patch_size_t frames
    when it is the first token of a clip."""
    if latent_frames < 1:
        raise FastRemoverError(f"the latents need at least one frame, got {latent_frames}")
    ct, pt, drop = cfg.chunk_tokens, cfg.patch_size_t, cfg.token_drop
    tokens = latent_frames + drop
    pad = (-tokens) % ct
    windows = (tokens + pad) // ct - int(drop > 0)
    if windows < 1:
        pad, windows = pad + ct, 1
    frames = windows * (ct * pt - cfg.pre_padding) + (cfg.overlap_frames if drop > 0 else 0)
    tail = cfg.clip_length % pt
    frames -= sum(tail if tail and (latent_frames + i) % ct == 0 else pt for i in range(pad))
    if frames <= 0:
        raise FastRemoverError(f"the clip settings give {frames} frames for {latent_frames} latent frames")
    return pad, windows, frames


def blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """b with its first `extent` entries along dim cross-faded from a's last ones: a (1 - i/e) + b (i/e)."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent == 0:
        return b
    shape = [1] * b.dim()
    shape[dim] = extent
    wgt = (torch.arange(extent, device=b.device, dtype=b.dtype) / extent).view(shape)
    mixed = a.narrow(dim, a.shape[dim] - extent, extent) * (1 - wgt) + b.narrow(dim, 0, extent) * wgt
    return torch.cat([mixed, b.narrow(dim, extent, b.shape[dim] - extent)], dim=dim)


def split_tiles(length: int, tile: int, min_overlap: int, step: int) -> tuple[list[int], int, list[int]]:
    """(starts, tile_length, overlaps) of tiles covering [0, length) exactly: as few tiles of `tile` as fit with at
    least `min_overlap` overlap, the surplus spread over the overlaps in units of `step`, round robin."""
    if tile >= length:
        return [0], length, []
    n = -(-length // tile)
    while tile * n - min_overlap * (n - 1) < length:
        n += 1
    overlaps = [min_overlap] * (n - 1)
    for i in range((tile * n - sum(overlaps) - length) // step):
        overlaps[i % (n - 1)] += step
    starts = [0]
    for o in overlaps:
        starts.append(starts[-1] + tile - o)
    return starts, tile, overlaps


def stitch_tiles(rows: list[list[torch.Tensor]], y_overlaps: list[int], x_overlaps: list[int]) -> torch.Tensor:
    """Blend each tile with its (unblended) upper and left neighbours, drop the overlaps it hands on, concatenate."""
    out_rows = []
    for r, row in enumerate(rows):
        parts = []
        for c, tile in enumerate(row):
            if r > 0:
                tile = blend(rows[r - 1][c], tile, y_overlaps[r - 1], -2)
            if c > 0:
                tile = blend(row[c - 1], tile, x_overlaps[c - 1], -1)
            if r < len(rows) - 1:
                tile = tile[..., : tile.shape[-2] - y_overlaps[r], :]
            if c < len(row) - 1:
                tile = tile[..., : tile.shape[-1] - x_overlaps[c]]
            parts.append(tile)
        out_rows.append(torch.cat(parts, dim=-1))
    return torch.cat(out_rows, dim=-2)


class H3VideoDecoder(nn.Module):
    """post_quant_conv + the ViT decoder, with the temporal windows, spatial tiles, tiers and tile batching."""

    def __init__(self, cfg: H3DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.post_quant_conv = nn.Conv3d(cfg.latent_channels, cfg.latent_channels, kernel_size=1)
        self.decoder = H3ViTDecoder(cfg)
        self.register_buffer("latents_mean", torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("latents_std", torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("pixel_mean", torch.tensor(PIXEL_MEAN).view(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(PIXEL_STD).view(1, -1, 1, 1, 1), persistent=False)

    # -- latents and pixels
    def denormalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        """The DiT's normalized latents -> raw VAE latents: z * std + mean (per channel, from the config)."""
        return z * self.latents_std + self.latents_mean

    def normalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.latents_mean) / self.latents_std

    def to_pixels(self, sample: torch.Tensor) -> torch.Tensor:
        """Decoder output -> [0, 1] pixels: sample * ImageNet std + mean, clamped."""
        return (sample.float() * self.pixel_std + self.pixel_mean).clamp_(0, 1)

    # -- one window
    def decode_window(self, z: torch.Tensor, tiles_per_call: int = 1, blocks: BlockStack | None = None
                      ) -> torch.Tensor:
        """One temporal window z [B, C, t, h, w] -> [B, 3, t*pt, h*p, w*p], tiled; `tiles_per_call` equal tiles per
        decoder call (stacked on the batch axis)."""
        cfg, p = self.cfg, self.cfg.patch_size
        height, width = z.shape[-2] * p, z.shape[-1] * p
        ys, th, y_ov = split_tiles(height, cfg.tile_size, cfg.tile_overlap, p)
        xs, tw, x_ov = split_tiles(width, cfg.tile_size, cfg.tile_overlap, p)
        views = [z[..., y // p:(y + th) // p, x // p:(x + tw) // p] for y in ys for x in xs]
        b = z.shape[0]
        decoded: list[torch.Tensor] = []
        for i in range(0, len(views), tiles_per_call):
            group = torch.cat([self.post_quant_conv(v) for v in views[i:i + tiles_per_call]], dim=0)
            out = self.decoder(group, blocks)
            decoded.extend(out.split(b, dim=0))
        rows = [decoded[r * len(xs):(r + 1) * len(xs)] for r in range(len(ys))]
        return stitch_tiles(rows, y_ov, x_ov)

    # -- whole videos
    def decode_chunks(self, z: torch.Tensor, *, tier: str | None = None, tiles_per_call: int = 1,
                      blocks: BlockStack | None = None) -> Iterator[torch.Tensor]:
        """Raw latents z [B, C, T, h, w] -> finished frame chunks [B, 3, f, H, W] (decoder output space), in order.
        tier: None = every block, or "36L" / "8L" (tier_blocks). blocks overrides the block loop (then `tier` is the
        caller's business)."""
        cfg = self.cfg
        if z.dim() != 5 or z.shape[1] != cfg.latent_channels:
            raise FastRemoverError(f"latents must be [B, {cfg.latent_channels}, T, h, w], got {list(z.shape)}")
        if not isinstance(tiles_per_call, int) or tiles_per_call < 1:
            raise FastRemoverError(f"tiles_per_call must be a positive integer, got {tiles_per_call!r}")
        if blocks is None:
            blocks = self.decoder.eager_blocks(tier_blocks(cfg.num_layers, tier))
        ct, pt = cfg.chunk_tokens, cfg.patch_size_t
        pad, windows, total = temporal_plan(cfg, z.shape[2])
        if pad:
            z = torch.cat([z, z[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        done, overlap = 0, None
        for w in range(windows):
            clip = self.decode_window(z[:, :, w * ct:w * ct + ct + cfg.overlap_tokens], tiles_per_call, blocks)
            chunk = clip[:, :, cfg.pre_padding:ct * pt]
            if overlap is not None:
                chunk = blend(overlap, chunk, cfg.overlap_frames, dim=2)
            chunk = chunk[:, :, :total - done]
            overlap = clip[:, :, ct * pt + cfg.pre_padding:] if cfg.token_drop > 0 else None
            if chunk.shape[2]:
                done += chunk.shape[2]
                yield chunk
        if overlap is not None and done < total:
            yield overlap[:, :, :total - done]

    @torch.no_grad()
    def decode(self, z: torch.Tensor, **kw) -> torch.Tensor:
        """Raw latents [B, C, T, h, w] -> decoder output [B, 3, F, 16h, 16w], F = temporal_plan(...)[2]."""
        return torch.cat(list(self.decode_chunks(z, **kw)), dim=2)


# ----------------------------------------------------------------------------------------------------------------------
# Weights


def random_decoder(cfg: H3DecoderConfig, seed: int = 0, scale_init: float = 0.1, device=None) -> H3VideoDecoder:
    """Deterministic random weights (for tests and timing): linears/convs as torch initializes them from `seed`, norm
    weights 1 +- 0.1, register tokens N(0, 1), and the layer scales scale1/scale2 uniform in [0, scale_init] (the
    checkpoint's are learned; zeros would make every block a no-op). device: build there (the linears' values then
    come from that device's generator: deterministic per device, not across devices)."""
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device or "cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        model = H3VideoDecoder(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("scale1", "scale2")):
                p.copy_(torch.rand(p.shape, generator=gen) * scale_init)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * (torch.rand(p.shape, generator=gen) * 2 - 1))
            elif name.endswith("register_tokens"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model.eval()


def checkpoint_config(path: str | os.PathLike) -> H3DecoderConfig:
    """The config of a checkpoint: config.json in the folder (or beside the file), else the release's."""
    path = Path(path)
    conf = (path if path.is_dir() else path.parent) / "config.json"
    if not conf.is_file():
        return H3DecoderConfig()
    try:
        return H3DecoderConfig.from_dict(json.loads(conf.read_text()))
    except (ValueError, TypeError) as e:
        raise FastRemoverError(f"{conf}: not a usable H3 VAE config ({e})") from None


def load_decoder(path: str | os.PathLike, cfg: H3DecoderConfig | None = None) -> H3VideoDecoder:
    """A VAE checkpoint (a .safetensors file, or a folder with diffusion_pytorch_model.safetensors and optionally
    config.json) -> H3VideoDecoder. Every decoder key must be present with the right shape; encoder keys are ignored."""
    from safetensors.torch import load_file

    path = Path(path)
    file = path / WEIGHTS_NAME if path.is_dir() else path
    if not file.is_file():
        raise FastRemoverError(f"no H3 VAE weights at {file}")
    if cfg is None:
        cfg = checkpoint_config(path)
    try:
        state = load_file(os.fspath(file))
    except Exception as e:  # a corrupt or non-safetensors file
        raise FastRemoverError(f"cannot read {file} as safetensors: {e}") from None
    model = H3VideoDecoder(cfg)
    want = model.state_dict()
    missing = [k for k in want if k not in state]
    if missing:
        raise FastRemoverError(f"{file} lacks {len(missing)} decoder tensors, e.g. {missing[:3]}")
    bad = [k for k in want if tuple(state[k].shape) != tuple(want[k].shape)]
    if bad:
        k = bad[0]
        raise FastRemoverError(f"{file}: {k} has shape {list(state[k].shape)}, the config needs {list(want[k].shape)}")
    model.load_state_dict({k: state[k].float() for k in want}, strict=True)
    return model.eval()


def with_layers(cfg: H3DecoderConfig, num_layers: int) -> H3DecoderConfig:
    return replace(cfg, num_layers=num_layers)


__all__ = ["H3DecoderConfig", "H3VideoDecoder", "H3ViTDecoder", "H3Block", "PRESETS", "TIERS", "preset",
           "tier_blocks", "temporal_plan", "split_tiles", "stitch_tiles", "blend", "rope_tables", "random_decoder",
           "load_decoder", "with_layers"]
