"""Bounded-memory Wan VAE calls: spatial tiling with overlap blending, and a memory model that picks the tiles.

    encode_tiled(encode_fn, x, tile, overlap)            video [B,3,F,H,W] -> latents [B,16,T,H//8,W//8]
    decode_tiled(decode_fn, z, tile_latent, overlap_latent)  latents -> video [B,3,F,8h,8w]
    choose_tiling(frames, height, width, dtype, budget_bytes, config) -> TilePlan | None
    encode_auto / decode_auto                            choose_tiling + the tiled (or untiled) call

`encode_fn` / `decode_fn` are callables with `WanVAE.encode` / `WanVAE.decode`'s signature (`fn(x)` or
`fn(x, progress=...)`); each tile goes through one whole call, so it streams through time with its own causal cache,
exactly as an untiled call does (the VAE's temporal chunking is untouched; tiles only split the frame plane).

Tiling (all positions in latent units, i.e. multiples of the 8-pixel spatial compression, so a tile's latent grid is
a sub-grid of the whole frame's one: the encoder's stride-2 convs stay aligned):
  * along each axis the tiles have one size and are spread evenly from border to border; the first starts at 0, the
    last ends at the border, and consecutive tiles overlap by at least `overlap`. A frame smaller than the tile is one
    tile of the frame's size. When H or W is not a multiple of 8, the last tile takes the leftover pixels (the untiled
    encoder sees them too: its latent size is H // 8).
  * one tile in total -> the untiled function is called unchanged (bit-identical result).
  * blending: each tile's output is weighted by w_y(y) * w_x(x). The 1-D weights of a tile ramp linearly across its
    overlap with each neighbour ((p + 0.5) / overlap, so the tile's own border gets ~0) and are 1 elsewhere; they are
    then divided by their sum over the tiles, so they form a partition of unity along each axis, and the products do
    in 2-D. Where two ramps meet over one overlap the division changes nothing (the ramps already sum to 1); it only
    matters if overlaps ever reach each other. Pixels seen by one tile get weight exactly 1 (bit-exact copies).
  * the output is accumulated in place, one block of frames at a time (fp32 arithmetic, rounded once per tile to the
    output dtype), so blending needs no second full-size buffer.

Memory (tiled call) = activations of one tile (its causal caches + one temporal chunk's working set)
                    + the tile's own output (the whole temporal extent of one tile)
                    + the full output tensor (needed anyway)
                    + blending temporaries for one block of frames of one tile (fp32, small).
Tiles are processed one after the other; nothing else of a finished tile is kept. Inputs are read through views.

The memory model (`estimate_call_bytes`) counts the tensor bytes the eager `WanVAE` (fastremover.models.vae) keeps
alive at its peak, derived from its code (see `_cache_elements`, `_WORKING_SET_UNITS`):
  peak = causal caches (every CausalConv3d keeps 2 input frames; each downsample3d 1 frame; steady state)
       + working set at the full-resolution level, K * C * n * H * W, C = base_dim, n = 4 frames per chunk
       + outputs (encode: the per-chunk latents and their concatenation; decode: the output video, the previous
         chunk, the post-quant latents).
It was validated by counting live tensor storage bytes inside real calls (a TorchDispatchMode that adds each new
storage's size and subtracts it when the storage is freed; `LiveTensorBytes` in tools/vae_tiling_check.py): on the
meta device, which runs the CUDA code path of `WanVAE` (F.conv3d, F.normalize) without computing, decode matches the
measurement to the byte
(>= 9 frames; fewer frames never reach the steady state, the model then overestimates) and encode within +0.3 %,
for the real config and the tiny preset, fp16 and fp32 (tests/parity/test_vae_tiling.py); a tiled 81 x 1088 x 1920 run on
meta (2 x 1 tiles of 624 x 1920) measured 10.03 GiB encode / 14.52 GiB decode against 10.06 / 14.68 modelled.
What it does not see: cuDNN workspaces, caching-allocator rounding and fragmentation, and SDPA internals (the
mid-block attention runs at 1/64 of the pixels, between the full-resolution peaks); `choose_tiling` multiplies by
`margin` (1.15) for those, and tools/vae_tiling_check.py's `gpu_check` reports the allocator's measured / modelled
ratio. On the CPU, `WanVAE`'s conv3d adds layout copies (channels-last / per-tap): measured 1.24x (encode) and 1.16x
(decode) the model at the tiny preset in fp32. This model is the eager one; another implementation passes its own to
`choose_tiling` / `estimate_tiled_bytes` (`call_bytes`: the fast VAE's `FastWanVAE.memory_bytes`; see fastremover.engine.vae).
Real config (base_dim 96), per full-resolution pixel, fp16: encode 9009 B (1404 cached + 8 * 384 working elements),
decode 11720 B at 9 frames (2364.5 cached + 9 * 384 working + outputs). Untiled 81 x 1088 x 1920 therefore needs
17.5 GiB to encode and 23.7 GiB to decode (1.0 GiB of it the output video), plus inputs and weights: 1080p needs tiles
under a 24 GiB cap.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from fastremover.errors import FastRemoverError
from fastremover.models.vae import ENCODE_CHUNK_FRAMES, WanVAEConfig

Progress = Callable[[int, int], None]

# Frames per block when blending a tile into the output (bounds the fp32 temporaries).
BLEND_FRAMES = 4

# ----------------------------------------------------------------------------------------------------------------------
# Tile layout and blending weights


def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{name} must be an int or (height, width), got {v!r}")
        a, b = v
    else:
        a = b = v
    for u in (a, b):
        if not isinstance(u, int) or isinstance(u, bool):
            raise ValueError(f"{name} must be integers, got {v!r}")
    return int(a), int(b)


def axis_tiles(length: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """(start, size) of the tiles covering [0, length) along one axis (units: latent pixels).

    One tile of size `length` if it fits in `tile`; otherwise n = ceil((length - overlap) / (tile - overlap)) tiles
    of size `tile`, starts spread evenly from 0 to length - tile, so every overlap is >= `overlap`.
    """
    if tile < 1 or overlap < 0 or overlap >= tile:
        raise ValueError(f"need tile >= 1 and 0 <= overlap < tile, got tile={tile}, overlap={overlap}")
    if length <= tile:
        return [(0, length)]
    n = -(-(length - overlap) // (tile - overlap))
    return [(i * (length - tile) // (n - 1), tile) for i in range(n)]


def axis_weights(tiles: list[tuple[int, int]], scale: int = 1) -> list[torch.Tensor]:
    """Blending weights (fp32, one 1-D tensor per tile, in output units = latent units * scale) that sum to 1.

    Raw weight of a tile: linear ramps (p + 0.5) / o across its overlap o with each neighbour, 1 elsewhere (the
    product of both ramps where they would meet); then divided by the sum over tiles (computed in float64).
    """
    spans = [(s * scale, (s + n) * scale) for s, n in tiles]
    length = spans[-1][1]
    raw = []
    for i, (s, e) in enumerate(spans):
        p = torch.arange(e - s, dtype=torch.float64) + 0.5
        w = torch.ones(e - s, dtype=torch.float64)
        if i > 0 and spans[i - 1][1] > s:
            w *= (p / (spans[i - 1][1] - s)).clamp(max=1.0)
        if i + 1 < len(spans) and e > spans[i + 1][0]:
            w *= (((e - s) - p) / (e - spans[i + 1][0])).clamp(max=1.0)
        raw.append(w)
    total = torch.zeros(length, dtype=torch.float64)
    for (s, e), w in zip(spans, raw):
        total[s:e] += w
    return [(w / total[s:e]).float() for (s, e), w in zip(spans, raw)]


def _accumulate(out: torch.Tensor, tile_out: torch.Tensor, ys: slice, xs: slice, w2d: torch.Tensor) -> None:
    """out[..., ys, xs] += w2d * tile_out, in fp32, BLEND_FRAMES frames at a time."""
    w2d = w2d.to(tile_out.device)
    for f0 in range(0, tile_out.shape[2], BLEND_FRAMES):
        dst = out[:, :, f0 : f0 + BLEND_FRAMES, ys, xs]
        src = tile_out[:, :, f0 : f0 + BLEND_FRAMES]
        dst.copy_(torch.addcmul(dst.float(), src.float(), w2d))


def _sub_progress(progress: Progress | None, index: int, count: int) -> Progress | None:
    if progress is None:
        return None
    return lambda done, total: progress(index * total + done, count * total)


def _call(fn, x, progress):
    return fn(x, progress=progress) if progress is not None else fn(x)


# ----------------------------------------------------------------------------------------------------------------------
# Tiled encode / decode


@torch.no_grad()
def encode_tiled(
    encode_fn: Callable,
    x: torch.Tensor,
    tile: int | tuple[int, int],
    overlap: int | tuple[int, int],
    progress: Progress | None = None,
    spatial_compression: int = 8,
) -> torch.Tensor:
    """`encode_fn(x)` computed on overlapping spatial tiles of x [B, C, F, H, W]; same output shape.

    tile / overlap: pixels (int or (h, w)), multiples of `spatial_compression`; overlap < tile. Each tile is encoded
    over the whole temporal extent (its own causal cache), and its latents are blended into the output with linear
    ramps across the overlaps. One tile in all -> `encode_fn(x)` unchanged. progress(done, total) over all tiles.
    """
    if x.ndim != 5:
        raise ValueError(f"encode_tiled expects [B, C, F, H, W], got {list(x.shape)}")
    s = spatial_compression
    (tile_h, tile_w), (ov_h, ov_w) = _pair(tile, "tile"), _pair(overlap, "overlap")
    if any(v % s for v in (tile_h, tile_w, ov_h, ov_w)):
        raise ValueError(f"tile {tile!r} and overlap {overlap!r} must be multiples of {s} pixels")
    height, width = x.shape[-2:]
    lat_h, lat_w = height // s, width // s
    if lat_h < 1 or lat_w < 1:
        return _call(encode_fn, x, progress)
    ty = axis_tiles(lat_h, tile_h // s, ov_h // s)
    tx = axis_tiles(lat_w, tile_w // s, ov_w // s)
    if len(ty) == 1 and len(tx) == 1:
        return _call(encode_fn, x, progress)
    wy, wx = axis_weights(ty), axis_weights(tx)
    out = None
    count = len(ty) * len(tx)
    for i, ((y0, nh), w_y) in enumerate(zip(ty, wy)):
        py = slice(y0 * s, height if y0 + nh == lat_h else (y0 + nh) * s)
        for j, ((x0, nw), w_x) in enumerate(zip(tx, wx)):
            px = slice(x0 * s, width if x0 + nw == lat_w else (x0 + nw) * s)
            z = _call(encode_fn, x[:, :, :, py, px], _sub_progress(progress, i * len(tx) + j, count))
            if z.shape[-2:] != (nh, nw):
                raise ValueError(
                    f"encode_fn gave latents {list(z.shape)} for a {nh * s}x{nw * s} tile; expected {nh}x{nw}"
                )
            if out is None:
                out = z.new_zeros(*z.shape[:3], lat_h, lat_w)
            _accumulate(out, z, slice(y0, y0 + nh), slice(x0, x0 + nw), w_y[:, None] * w_x[None, :])
            del z
    return out


@torch.no_grad()
def decode_tiled(
    decode_fn: Callable,
    z: torch.Tensor,
    tile_latent: int | tuple[int, int],
    overlap_latent: int | tuple[int, int],
    progress: Progress | None = None,
) -> torch.Tensor:
    """`decode_fn(z)` computed on overlapping spatial tiles of the latents z [B, C, T, h, w]; same output shape.

    tile_latent / overlap_latent: latent pixels (int or (h, w)); overlap < tile. Each latent tile is decoded over the
    whole temporal extent (its own causal cache); its pixels are blended into the output with linear ramps across the
    pixel overlaps (upsampling factor read from the first tile's output). One tile in all -> `decode_fn(z)`.
    """
    if z.ndim != 5:
        raise ValueError(f"decode_tiled expects [B, C, T, h, w], got {list(z.shape)}")
    (tile_h, tile_w), (ov_h, ov_w) = _pair(tile_latent, "tile_latent"), _pair(overlap_latent, "overlap_latent")
    lat_h, lat_w = z.shape[-2:]
    ty, tx = axis_tiles(lat_h, tile_h, ov_h), axis_tiles(lat_w, tile_w, ov_w)
    if len(ty) == 1 and len(tx) == 1:
        return _call(decode_fn, z, progress)
    out = wy = wx = None
    scale = 0
    count = len(ty) * len(tx)
    for i, (y0, nh) in enumerate(ty):
        for j, (x0, nw) in enumerate(tx):
            tile_z = z[:, :, :, y0 : y0 + nh, x0 : x0 + nw]
            pixels = _call(decode_fn, tile_z, _sub_progress(progress, i * len(tx) + j, count))
            if out is None:
                scale = pixels.shape[-1] // nw
                wy, wx = axis_weights(ty, scale), axis_weights(tx, scale)
                out = pixels.new_zeros(*pixels.shape[:3], lat_h * scale, lat_w * scale)
            if scale < 1 or pixels.shape[-2:] != (nh * scale, nw * scale) or pixels.shape[:3] != out.shape[:3]:
                raise ValueError(f"decode_fn gave {list(pixels.shape)} for a {nh}x{nw} latent tile (scale {scale})")
            ys, xs = slice(y0 * scale, (y0 + nh) * scale), slice(x0 * scale, (x0 + nw) * scale)
            _accumulate(out, pixels, ys, xs, wy[i][:, None] * wx[j][None, :])
            del pixels
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Memory model of the eager WanVAE


# Working set at the peak, in units of one activation-dtype tensor [C = base_dim, n = 4 frames, H, W] at full res.
# Read off the code (the peak sits in the full-resolution residual blocks):
#   decode, fp16/bf16, at up_blocks[-1].resnets[1].norm2 (`normalized.to(dtype) * scale * gamma`):
#       Decoder.forward's x (this UpBlock's input) 1 + resnet input (= shortcut) 1 + conv1 output 1
#       + RMSNorm's fp32 upcast 2 + fp32 normalized 2 + `* scale` 1 + `* gamma` 1                          = 9
#   decode, fp32, at that block's conv2: the 3 above + silu output 1 + cat(cache, x) 1.5 + the old cache tail 0.5
#       + conv output 1 (RMSNorm in fp32: normalized 1, *scale 1, *gamma 1 -> 6 at norm2)                 = 7
#   encode, fp16/bf16, at down_blocks[0].norm2: conv_in output (= resnet input = shortcut) 1 + conv1 output 1
#       + fp32 upcast 2 + fp32 normalized 2 + 1 + 1                                                         = 8
#   encode, fp32, at down_blocks[0].conv2: 1 + 1 + silu 1 + cat 1.5 + old tail 0.5 + conv output 1         = 6
_WORKING_SET_UNITS = {("encode", True): 8.0, ("encode", False): 6.0, ("decode", True): 9.0, ("decode", False): 7.0}


def _level_areas(h: int, w: int, levels: int, up: bool) -> list[int]:
    """Pixel count at each level: encoder from full res down (floor halving), decoder from latent res up."""
    if up:
        return [(h << l) * (w << l) for l in range(levels)]
    return [(h >> l) * (w >> l) for l in range(levels)]


def _cache_elements(cfg: WanVAEConfig, op: str, h: int, w: int) -> float:
    """Elements held by the CausalCache in steady state (2 input frames per 3-tap causal conv, 1 per downsample3d).

    h, w: pixels for encode, latent pixels for decode.
    """
    levels = len(cfg.dim_mult)
    nrb = cfg.num_res_blocks
    if op == "encode":
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        a = _level_areas(h, w, levels, up=False)
        total = 2 * cfg.in_channels * a[0]  # conv_in
        for l in range(levels):
            c_in, c_out = dims[l], dims[l + 1]
            total += 2 * (c_in + (2 * nrb - 1) * c_out) * a[l]
            if l != levels - 1 and cfg.temperal_downsample[l]:
                total += c_out * a[l + 1]  # downsample3d keeps 1 (spatially downsampled) frame
        total += 2 * 4 * dims[-1] * a[-1]  # mid block: 2 resnets x 2 convs
        total += 2 * dims[-1] * a[-1]  # conv_out
        return float(total)
    dims = [cfg.base_dim * m for m in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
    up3d = cfg.temperal_downsample[::-1]
    a = _level_areas(h, w, levels, up=True)
    total = 2 * cfg.z_dim * a[0] + 2 * 4 * dims[0] * a[0]  # conv_in, mid block
    for l in range(levels):
        c_in = dims[l] // 2 if l > 0 else dims[l]
        c_out = dims[l + 1]
        total += 2 * (c_in + (2 * (nrb + 1) - 1) * c_out) * a[l]
        if l != levels - 1 and up3d[l]:
            total += 2 * c_out * a[l]  # upsample3d's time_conv
    total += 2 * dims[-1] * a[-1]  # conv_out
    return float(total)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of tensors alive at the peak of one (untiled) eager WanVAE call, by kind."""

    caches: int
    working: int
    outputs: int

    @property
    def total(self) -> int:
        return self.caches + self.working + self.outputs


def estimate_call_bytes(
    op: str, frames: int, height: int, width: int, dtype: torch.dtype, config: WanVAEConfig | None = None
) -> MemoryEstimate:
    """Peak tensor bytes of `WanVAE.encode` / `.decode` on a [frames, height, width] video (pixels, both ops).

    Steady-state model (a conservative bound for 1-frame videos). Batch 1; multiply by the batch for more.
    """
    cfg = config or WanVAEConfig()
    if op not in ("encode", "decode"):
        raise ValueError(f"op must be 'encode' or 'decode', got {op!r}")
    es = torch.empty((), dtype=dtype).element_size()
    low = dtype in (torch.float16, torch.bfloat16)
    sc, tc = cfg.spatial_compression, cfg.temporal_compression
    lat_frames = (frames - 1) // tc + 1
    out_frames = 1 + (lat_frames - 1) * tc
    if op == "encode":
        full = height * width
        lat_area = (height // sc) * (width // sc)
        caches = _cache_elements(cfg, "encode", height, width)
        working = _WORKING_SET_UNITS[(op, low)] * cfg.base_dim * cfg.dim_mult[0] * ENCODE_CHUNK_FRAMES * full
        # per-chunk quant_conv outputs (mu is a view of [mu | log_var]) + their concatenation
        outputs = 3 * cfg.z_dim * lat_frames * lat_area
    else:
        lh, lw = height // sc, width // sc
        full = (lh * sc) * (lw * sc)
        caches = _cache_elements(cfg, "decode", lh, lw)
        working = _WORKING_SET_UNITS[(op, low)] * cfg.base_dim * cfg.dim_mult[0] * tc * full
        # output video + the previous chunk (still referenced by the loop) + post_quant_conv(z)
        outputs = cfg.out_channels * (out_frames + tc) * full + cfg.z_dim * lat_frames * lh * lw
    return MemoryEstimate(int(caches * es), int(working * es), int(outputs * es))


@dataclass(frozen=True)
class TilePlan:
    """Tile and overlap sizes in pixels (multiples of 8); `grid` = tiles per axis at the planned frame size."""

    tile: tuple[int, int]
    overlap: tuple[int, int]
    grid: tuple[int, int]
    estimated_bytes: int  # the plan's modelled peak (before the margin)

    @property
    def tile_latent(self) -> tuple[int, int]:
        return self.tile[0] // 8, self.tile[1] // 8

    @property
    def overlap_latent(self) -> tuple[int, int]:
        return self.overlap[0] // 8, self.overlap[1] // 8

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1]


CallBytes = Callable[[str, int, int, int], int]  # (op, frames, height, width) -> peak bytes of one untiled call


def estimate_tiled_bytes(
    op: str, frames: int, height: int, width: int, dtype: torch.dtype, config: WanVAEConfig | None,
    tile: tuple[int, int], overlap: tuple[int, int], call_bytes: CallBytes | None = None,
) -> int:
    """Modelled peak bytes of encode_tiled / decode_tiled: one tile's call + the full output + blend temporaries.

    call_bytes: the memory model of one untiled call of the VAE that runs (`VideoVAE.memory_bytes`); default: the
    eager WanVAE's (`estimate_call_bytes`)."""
    cfg = config or WanVAEConfig()
    if call_bytes is None:
        def call_bytes(o, f, h, w):
            return estimate_call_bytes(o, f, h, w, dtype, cfg).total
    sc, tc = cfg.spatial_compression, cfg.temporal_compression
    lh, lw = height // sc, width // sc
    ty = axis_tiles(lh, tile[0] // sc, overlap[0] // sc)
    tx = axis_tiles(lw, tile[1] // sc, overlap[1] // sc)
    # the largest tile in pixels (the border tile of an encode also takes the leftover pixels)
    th = ty[0][1] * sc + (height - lh * sc if op == "encode" else 0)
    tw = tx[0][1] * sc + (width - lw * sc if op == "encode" else 0)
    one = call_bytes(op, frames, th, tw)
    if len(ty) * len(tx) == 1:
        return call_bytes(op, frames, height, width)
    es = torch.empty((), dtype=dtype).element_size()
    lat_frames = (frames - 1) // tc + 1
    if op == "encode":
        full_out = cfg.z_dim * lat_frames * lh * lw * es
        blend = 3 * 4 * cfg.z_dim * min(BLEND_FRAMES, lat_frames) * (th // sc) * (tw // sc)
    else:
        out_frames = 1 + (lat_frames - 1) * tc
        full_out = cfg.out_channels * out_frames * (lh * sc) * (lw * sc) * es
        blend = 3 * 4 * cfg.out_channels * min(BLEND_FRAMES, out_frames) * th * tw
    return one + full_out + blend


def default_budget_bytes(device: torch.device | str | None = None, fraction: float = 0.9) -> int:
    """`fraction` of the memory a new allocation can still get on `device`.

    CUDA: min(free device memory + this process's cached-but-unused blocks, per-process cap - allocated), where the cap
    is torch.cuda.set_per_process_memory_fraction's (if this torch can read it back) times total memory.
    CPU: MemAvailable (Linux) or physical memory.
    """
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda" and device.index is None:  # torch's memory queries want an explicit index
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        avail = free + (reserved - allocated)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if get_fraction is not None:
            avail = min(avail, int(get_fraction(device) * total) - allocated)
        return max(0, int(fraction * avail))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(fraction * int(line.split()[1]) * 1024)
    except OSError:
        pass
    return int(fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def choose_tiling(
    frames: int,
    height: int,
    width: int,
    dtype: torch.dtype,
    budget_bytes: int | None = None,
    config: WanVAEConfig | None = None,
    *,
    op: str = "both",
    overlap_fraction: float = 0.25,
    min_overlap: int = 64,
    align: int = 16,
    margin: float = 1.15,
    max_tiles_per_axis: int = 32,
    batch: int = 1,
    call_bytes: CallBytes | None = None,
) -> TilePlan | None:
    """None if the untiled call fits the budget, else the tiling with the least total tile area that fits.

    op: "encode", "decode" or "both" (one plan that fits either call). height/width: pixels.
    budget_bytes: what the call may allocate beyond what is already allocated (inputs, weights); default
    `default_budget_bytes()`. A plan fits when margin * modelled peak <= budget. Tiles are multiples of `align` pixels
    (and of 8), overlaps max(min_overlap, overlap_fraction * tile) rounded up to 8 pixels. All bytes scale with
    `batch` (the model is per video). call_bytes: the memory model of one untiled batch-1 call of the VAE that
    runs (`VideoVAE.memory_bytes`; default: the eager WanVAE's, `estimate_call_bytes`).
    Raises FastRemoverError when even the smallest tiles do not fit.
    """
    cfg = config or WanVAEConfig()
    sc = cfg.spatial_compression
    if budget_bytes is None:
        budget_bytes = default_budget_bytes()
    ops = ("encode", "decode") if op == "both" else (op,)
    for o in ops:
        if o not in ("encode", "decode"):
            raise ValueError(f"op must be 'encode', 'decode' or 'both', got {op!r}")

    if call_bytes is None:
        def call_bytes(o, f, h, w):
            return estimate_call_bytes(o, f, h, w, dtype, cfg).total

    def cost(tile, overlap):
        return batch * max(estimate_tiled_bytes(o, frames, height, width, dtype, cfg, tile, overlap, call_bytes)
                           for o in ops)

    untiled = batch * max(call_bytes(o, frames, height, width) for o in ops)
    if margin * untiled <= budget_bytes:
        return None
    lat = (height // sc, width // sc)
    step = max(1, -(-align // sc))  # tile sizes: multiples of this many latent pixels

    def axis_choice(length: int, n: int):
        """Tile and overlap (latent units) that cover `length` in n tiles."""
        if n == 1:
            return length, 0
        t_guess = length / (n - (n - 1) * overlap_fraction)
        ov = max(-(-min_overlap // sc), math.ceil(overlap_fraction * t_guess))
        t = -(-(length + (n - 1) * ov) // n)
        t = min(length, -(-t // step) * step)
        if t - ov < 1 or len(axis_tiles(length, t, ov)) != n:
            return None
        return t, ov

    best = None
    for ny in range(1, max_tiles_per_axis + 1):
        for nx in range(1, max_tiles_per_axis + 1):
            cy, cx = axis_choice(lat[0], ny), axis_choice(lat[1], nx)
            if cy is None or cx is None or ny * nx == 1:
                continue
            tile, overlap = (cy[0] * sc, cx[0] * sc), (cy[1] * sc, cx[1] * sc)
            peak = cost(tile, overlap)
            if margin * peak > budget_bytes:
                continue
            key = (ny * nx * tile[0] * tile[1], ny * nx)
            if best is None or key < best[0]:
                best = (key, TilePlan(tile, overlap, (ny, nx), peak))
    if best is None:
        raise FastRemoverError(
            f"VAE {op} of {frames} frames at {width}x{height} does not fit a {budget_bytes / 2**30:.2f} GiB budget "
            f"even with {max_tiles_per_axis}x{max_tiles_per_axis} tiles; free GPU memory or lower the resolution"
        )
    return best[1]


def encode_auto(encode_fn, x, config=None, budget_bytes=None, progress=None, plan: TilePlan | None = None, **kw):
    """encode_fn(x), tiled when `plan` (default: choose_tiling for this call) says so."""
    if plan is None:
        plan = choose_tiling(
            x.shape[2], x.shape[3], x.shape[4], x.dtype, budget_bytes, config, op="encode", batch=x.shape[0], **kw
        )
    if plan is None:
        return _call(encode_fn, x, progress)
    return encode_tiled(encode_fn, x, plan.tile, plan.overlap, progress)


def decode_auto(decode_fn, z, config=None, budget_bytes=None, progress=None, plan: TilePlan | None = None, **kw):
    """decode_fn(z), tiled when `plan` (default: choose_tiling for this call) says so."""
    cfg = config or WanVAEConfig()
    if plan is None:
        frames = 1 + (z.shape[2] - 1) * cfg.temporal_compression
        sc = cfg.spatial_compression
        plan = choose_tiling(
            frames, z.shape[3] * sc, z.shape[4] * sc, z.dtype, budget_bytes, cfg, op="decode", batch=z.shape[0], **kw
        )
    if plan is None:
        return _call(decode_fn, z, progress)
    return decode_tiled(decode_fn, z, plan.tile_latent, plan.overlap_latent, progress)
