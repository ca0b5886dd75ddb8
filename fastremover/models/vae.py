"""The Wan 2.1 video VAE (diffusers `AutoencoderKLWan`, `is_residual=False`): a causal 3D conv autoencoder.

Eager math only. Module and parameter names are the checkpoint's (`encoder.down_blocks.{i}.conv1.weight`,
`decoder.up_blocks.{i}.upsamplers.0.time_conv.weight`, `quant_conv.weight`, ...), so a diffusers-layout safetensors
file loads into `WanVAE` and into diffusers' `AutoencoderKLWan` with a strict key check.

Shapes for the released model (base_dim 96, dim_mult [1, 2, 4, 4], z_dim 16):
    encode  x [B, 3, F, H, W] in [-1, 1], F = 4k+1  ->  mu [B, 16, T, H/8, W/8],  T = (F-1)//4 + 1
            channels 96 -> 96 -> 192 -> 384 -> 384; space halves after levels 0-2, time halves after levels 1 and 2
    decode  z [B, 16, T, H/8, W/8]  ->  x [B, 3, 4(T-1)+1, H, W], clamped to [-1, 1]

Video is processed in causal temporal chunks, exactly as diffusers does it:
    encode: frame 0 alone, then chunks of 4 frames  (each chunk -> 1 latent frame)
    decode: one latent frame at a time               (latent frame 0 -> 1 frame, every later one -> 4 frames)
Every causal conv sees its input as one continuous stream: the frames it needs from earlier chunks come from a
`CausalCache`, an explicit object created by `encode`/`decode` and passed down the forward calls. Each module that
needs memory across chunks keys its own entry by itself (`cache.push(self, x)`), so there is no global slot index to
keep in step (diffusers threads a mutable list and a counter through every forward).

Precision follows diffusers: RMS norms normalize in fp32 for fp16/bf16 activations, everything else runs in the
activation dtype. The one deliberate difference: diffusers upsamples in fp32 (`x.float()` and back); nearest-neighbour
upsampling only copies values, so we skip the round trip (bit-identical, less memory).

CPU speed: PyTorch runs a batch-1 fp32 conv3d on CPU through a slow reference kernel whenever N*C*T*H <= 20480 (its
oneDNN heuristic), which is every conv of a small model. `conv3d` below computes exactly those convs as one conv2d per
temporal tap on channels-last frames instead (10-15x faster per conv at 8-16 channels); everything else is F.conv3d.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.errors import FastRemoverError
from fastremover.models.config_types import check_config_types

# A 3-tap causal conv needs the 2 frames before the current chunk.
CACHE_T = 2

# Encode chunking (diffusers' `_encode`): frame 0 alone, then chunks of this many frames.
ENCODE_CHUNK_FRAMES = 4

_WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
_WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip

# Keys older diffusers versions wrote into the VAE config and current diffusers ignores.
_DEPRECATED_KEYS = ("clip_output",)


@dataclass(frozen=True)
class WanVAEConfig:
    """`vae/config.json` of a Wan 2.1 checkpoint (diffusers `AutoencoderKLWan` keys)."""

    base_dim: int = 96
    decoder_base_dim: int | None = None  # Wan 2.2 only; must be None or base_dim
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()  # must be empty (see validate)
    temperal_downsample: tuple[bool, ...] = (False, True, True)  # sic, diffusers' spelling
    dropout: float = 0.0  # accepted; this is an inference-only model, dropout is never applied
    latents_mean: tuple[float, ...] = _WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = _WAN21_LATENTS_STD
    is_residual: bool = False  # Wan 2.2 residual variant: not supported
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None  # Wan 2.2 only: not supported
    scale_factor_temporal: int | None = 4  # informational (pipelines read it); see temporal_compression
    scale_factor_spatial: int | None = 8  # informational; see spatial_compression

    def __post_init__(self):
        # JSON gives lists; keep tuples so the config is hashable and immutable.
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    @property
    def temporal_compression(self) -> int:
        return 2 ** sum(bool(t) for t in self.temperal_downsample)

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @classmethod
    def from_dict(cls, d: dict) -> "WanVAEConfig":
        """Build from a diffusers `config.json` dict; keys starting with "_" (`_class_name`, ...) are ignored."""
        if not isinstance(d, dict):
            raise FastRemoverError(f"VAE config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        given = {k: v for k, v in d.items() if not k.startswith("_")}
        for key in _DEPRECATED_KEYS:
            if key in given:
                value = given.pop(key)
                if key == "clip_output" and value is not True:
                    raise FastRemoverError(
                        f"unsupported VAE config: clip_output={value!r} "
                        "(decode always clamps to [-1, 1], as diffusers does)"
                    )
        unknown = sorted(set(given) - known)
        if unknown:
            raise FastRemoverError(
                f"VAE config has unknown keys {unknown}; expected a diffusers AutoencoderKLWan config "
                f"(keys: {sorted(known)})"
            )
        check_config_types(cls, given, "vae")
        return cls(**given)

    def to_dict(self) -> dict:
        """diffusers-compatible `config.json` content: `AutoencoderKLWan(**cfg.to_dict())` builds the same model."""
        d = asdict(self)
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            d[name] = list(d[name])
        # diffusers' register_to_config drops "_"-prefixed kwargs, so this stays constructor-compatible.
        return {"_class_name": "AutoencoderKLWan", **d}

    def validate(self) -> None:
        problems = []

        def positive_int(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r} (must be a positive integer)")
                return False
            return True

        ok = all([positive_int(n) for n in ("base_dim", "z_dim", "num_res_blocks", "in_channels", "out_channels")])
        if self.is_residual:
            problems.append("is_residual=True (the Wan 2.2 residual VAE is not supported; only Wan 2.1)")
        if self.patch_size is not None:
            problems.append(f"patch_size={self.patch_size!r} (the Wan 2.2 patchified VAE is not supported; use null)")
        if self.decoder_base_dim is not None and self.decoder_base_dim != self.base_dim:
            problems.append(f"decoder_base_dim={self.decoder_base_dim!r} (must be null or base_dim={self.base_dim})")
        if self.attn_scales:
            # diffusers' encoder would call those attention blocks with cache arguments they do not take (TypeError),
            # and its decoder never builds them: no released Wan VAE uses them.
            problems.append(f"attn_scales={list(self.attn_scales)} (must be empty)")
        if not isinstance(self.dim_mult, tuple) or not self.dim_mult or not all(
            isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in self.dim_mult
        ):
            problems.append(f"dim_mult={self.dim_mult!r} (must be a non-empty list of positive integers)")
        elif not isinstance(self.temperal_downsample, tuple) or len(self.temperal_downsample) != len(self.dim_mult) - 1:
            problems.append(
                f"temperal_downsample={self.temperal_downsample!r} "
                f"(must have len(dim_mult)-1 = {len(self.dim_mult) - 1} entries)"
            )
        elif sum(bool(t) for t in self.temperal_downsample) > 2:
            # The 4-frame encode chunks shrink to zero frames at a third temporal downsample.
            problems.append(f"temperal_downsample={list(self.temperal_downsample)} (at most 2 temporal downsamples)")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout!r} (must be in [0, 1))")
        if ok:
            for name in ("latents_mean", "latents_std"):
                value = getattr(self, name)
                if not isinstance(value, tuple) or len(value) != self.z_dim:
                    problems.append(f"{name} (must be a list of z_dim={self.z_dim} numbers)")
            if isinstance(self.latents_std, tuple) and any(s == 0 for s in self.latents_std):
                problems.append("latents_std (must not contain 0)")
        if problems:
            raise FastRemoverError("unsupported VAE config: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------------------------
# The convolution and the causal cache


# ATen runs an fp32 CPU conv3d with batch 1 (and a kernel of at most 3x3 in space) on its slow reference kernel
# unless N*C*T*H exceeds this (`use_mkldnn` in aten/src/ATen/native/Convolution.cpp); tests/parity/test_vae.py checks it.
_ATEN_MKLDNN_MIN_NCTH = 20480


def conv3d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: tuple[int, int, int] = (1, 1, 1),
    padding: tuple[int, int, int] = (0, 0, 0),
) -> torch.Tensor:
    """`F.conv3d(x, weight, bias, stride, padding)`, computed per temporal tap where PyTorch's own CPU conv3d is slow.

    PyTorch sends small fp32 CPU conv3ds (batch 1, N*C*T*H <= 20480: every conv of a small model) to a reference
    kernel that is 10-15x slower than oneDNN's conv2d; there we use `conv3d_per_tap`. Larger CPU convs go to oneDNN,
    which is as fast as or faster than the per-tap form, and GPU / half precision is plain F.conv3d.
    """
    stride, padding = tuple(stride), tuple(padding)
    slow_in_aten = (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.shape[0] == 1
        and x.shape[1] * x.shape[2] * x.shape[3] <= _ATEN_MKLDNN_MIN_NCTH
    )
    if slow_in_aten and stride[1:] == (1, 1) and padding[0] == 0:
        return conv3d_per_tap(x, weight, bias, stride, padding)
    if x.device.type == "cpu" and x.dtype == torch.float32:
        # oneDNN's conv3d is 1.5-2.5x faster on channels-last input than on NCDHW (measured at 8-16 channels, 480x864).
        x = x.contiguous(memory_format=torch.channels_last_3d)
    return F.conv3d(x, weight, bias, stride, padding)


def conv3d_per_tap(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: tuple[int, int, int] = (1, 1, 1),
    padding: tuple[int, int, int] = (0, 0, 0),
) -> torch.Tensor:
    """A conv3d without temporal padding and with spatial stride 1, as one conv2d per temporal tap.

    Output frame t is the sum over taps k of conv2d(input frame t*stride_t + k, weight[:, :, k]). The frames seen by
    tap k are folded into the batch in channels-last layout (a free view when x is channels_last_3d, which every
    output of this function is), which oneDNN's conv2d handles fast. The sum order differs from conv3d's, so results
    agree to fp32 rounding, not bit for bit.
    """
    if padding[0] != 0 or tuple(stride[1:]) != (1, 1):
        raise ValueError("conv3d_per_tap: temporal padding and spatial stride are not supported")
    b, c, t, h, w = x.shape
    taps, step = weight.shape[2], stride[0]
    t_out = (t - taps) // step + 1
    if t_out < 1:
        raise ValueError(f"conv3d: {t} input frames are fewer than the kernel's {taps} temporal taps")
    frames = x.permute(0, 2, 3, 4, 1).contiguous()  # [b, t, h, w, c]
    out = None
    for k in range(taps):
        seen = frames[:, k : k + step * (t_out - 1) + 1 : step]  # the frame each output frame sees through tap k
        seen = seen.reshape(b * t_out, h, w, c).permute(0, 3, 1, 2)  # [b*t_out, c, h, w], channels-last memory
        y = F.conv2d(seen, weight[:, :, k], bias if k == 0 else None, padding=tuple(padding[1:]))
        out = y if out is None else out.add_(y)
    h_out, w_out = out.shape[-2:]
    return out.permute(0, 2, 3, 1).reshape(b, t_out, h_out, w_out, -1).permute(0, 4, 1, 2, 3)


class CausalCache:
    """What each module remembers from earlier temporal chunks of one encode or decode call.

    An entry belongs to one module and is keyed by it. `push(module, x)` returns the frames the module kept from its
    earlier inputs (None on its first chunk) and then keeps the last `keep` frames of (those ++ x): the tail of the
    module's whole input stream so far. Kept frames are copies, so they never pin a chunk's activations in memory.
    """

    def __init__(self):
        self._tails: dict[nn.Module, torch.Tensor] = {}
        self._visited: set[nn.Module] = set()

    def push(self, module: nn.Module, x: torch.Tensor, keep: int = CACHE_T) -> torch.Tensor | None:
        prev = self._tails.get(module)
        n = x.shape[2]
        if n >= keep or prev is None:
            tail = x[:, :, -keep:].clone()
        else:  # a chunk shorter than `keep` (decode's 1-frame chunks): keep older frames too
            tail = torch.cat([prev[:, :, n - keep :], x], dim=2)
        self._tails[module] = tail
        return prev

    def first_visit(self, module: nn.Module) -> bool:
        """True the first time `module` asks, False afterwards."""
        if module in self._visited:
            return False
        self._visited.add(module)
        return True


class CausalConv3d(nn.Conv3d):
    """Conv3d that is causal in time: frame t sees input frames t-2..t (for 3 taps), never later ones.

    Time is padded only in front, with 2*pad_t frames; space symmetrically with the spatial padding. With a cache, the
    front frames are the last input frames of the previous chunk (zeros before the first frame), so chunked
    processing gives exactly the result of one causal conv over the whole video.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding)
        self.front_frames = 2 * self.padding[0]
        self.space_padding = (0, self.padding[1], self.padding[2])

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        if self.front_frames:
            prev = cache.push(self, x) if cache is not None else None
            if prev is not None:
                x = torch.cat([prev, x], dim=2)
            missing = self.front_frames - (prev.shape[2] if prev is not None else 0)
            if missing > 0:  # before the first frame: zeros
                x = F.pad(x, (0, 0, 0, 0, missing, 0))
        return conv3d(x, self.weight, self.bias, self.stride, self.space_padding)


# ----------------------------------------------------------------------------------------------------------------------
# Blocks


class RMSNorm(nn.Module):
    """Channel RMS norm: x / ||x||_2 over channels * sqrt(dim) * gamma (diffusers `WanRMS_norm`, bias=False).

    `images=False` is for [B, C, T, H, W] (gamma [C, 1, 1, 1]), `images=True` for [N, C, H, W] (gamma [C, 1, 1]).
    """

    def __init__(self, dim: int, images: bool = True):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1) if images else torch.ones(dim, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.normalize divides by max(||x||, 1e-12); fp16/bf16 are normalized in fp32 and rounded back, as diffusers.
        low_precision = x.dtype in (torch.float16, torch.bfloat16)
        xf = x.float() if low_precision else x
        if x.device.type == "cpu":
            # ATen's CPU vector norm over the strided channel dim is ~7x slower than a plain sum of squares; this is
            # the same function (x / max(||x||, 1e-12)) up to fp32 rounding. GPUs keep F.normalize, bit-equal to diffusers.
            normalized = xf * torch.rsqrt(xf.square().sum(1, keepdim=True).clamp_min(1e-24))
        else:
            normalized = F.normalize(xf, dim=1)
        return normalized.to(x.dtype) * self.scale * self.gamma


class ResidualBlock(nn.Module):
    """x + conv2(silu(norm2(conv1(silu(norm1(x)))))), with a 1x1x1 conv on the skip path when channels change."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.norm1 = RMSNorm(in_dim, images=False)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim, images=False)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        shortcut = self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)), cache)
        x = self.conv2(F.silu(self.norm2(x)), cache)  # (diffusers' dropout sits here; identity at inference)
        return x + shortcut


class AttentionBlock(nn.Module):
    """Single-head spatial self-attention within each frame (the frames of a chunk attend independently)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        identity = x
        x = self.norm(x.transpose(1, 2).reshape(b * t, c, h, w))
        # [b*t, 1 head, h*w, 3c], channels [q | k | v]; contiguous so q, k, v have unit stride in c, as SDPA kernels
        # want (and as diffusers lays them out; other strides change bf16 results by an ulp the decoder grows)
        qkv = self.to_qkv(x).flatten(2).transpose(1, 2).unsqueeze(1).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)  # each [b*t, 1, h*w, c]
        x = F.scaled_dot_product_attention(q, k, v)
        x = self.proj(x.squeeze(1).transpose(1, 2).reshape(b * t, c, h, w))
        return x.view(b, t, c, h, w).transpose(1, 2) + identity


class MidBlock(nn.Module):
    """resnet -> attention -> resnet, at the lowest resolution."""

    def __init__(self, dim: int):
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        x = self.attentions[0](x)
        return self.resnets[1](x, cache)


class Upsample2x(nn.Module):
    """Nearest-neighbour 2x spatial upsampling of [N, C, H, W] ("nearest-exact" at scale 2 = repeat each pixel 2x2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="nearest-exact")


class Resample(nn.Module):
    """Spatial 2x down/upsampling (per frame, conv2d) with optional 2x temporal down/upsampling (causal time_conv).

    `resample` is an nn.Sequential so its conv is `resample.1`, as in the checkpoint:
        downsample: pad right/bottom by 1, 3x3 conv stride 2          (dim -> dim)
        upsample:   nearest 2x, 3x3 conv                              (dim -> dim // 2)
    Temporal parts (see forward): `downsample3d` runs time_conv (3 taps, stride 2) after the spatial part,
    `upsample3d` runs time_conv (dim -> 2*dim, two output frames per input frame) before it.
    """

    def __init__(self, dim: int, mode: str):
        super().__init__()
        self.mode = mode
        if mode in ("upsample2d", "upsample3d"):
            self.resample = nn.Sequential(Upsample2x(), nn.Conv2d(dim, dim // 2, 3, padding=1))
            if mode == "upsample3d":
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode in ("downsample2d", "downsample3d"):
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
            if mode == "downsample3d":
                # No padding of its own: forward() puts the previous chunk's last frame in front.
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))
        else:
            raise ValueError(f"unknown resample mode {mode!r}")

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        if self.mode == "upsample3d":
            # diffusers marks the first chunk "Rep" and does not upsample it in time (latent frame 0 -> 1 frame);
            # time_conv's stream starts with the second chunk, zero-padded in front like any causal conv.
            if not cache.first_visit(self):
                b, c, t, h, w = x.shape
                x = self.time_conv(x, cache)  # [b, 2c, t, h, w]: channels [frame 2i | frame 2i+1]
                x = x.view(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)

        b, c, t, h, w = x.shape
        x = self.resample(x.transpose(1, 2).reshape(b * t, c, h, w))  # frames folded into the batch
        x = x.view(b, t, *x.shape[1:]).transpose(1, 2)

        if self.mode == "downsample3d":
            # The first chunk passes through unchanged (frame 0 -> latent frame 0). Later chunks: stride-2 conv over
            # [last frame of the previous chunk, this chunk], so 4 frames -> 2 and 2 -> 1.
            prev = cache.push(self, x, keep=1)
            if prev is not None:
                x = self.time_conv(torch.cat([prev, x], dim=2))
        return x


class UpBlock(nn.Module):
    """num_res_blocks + 1 residual blocks, then an optional Resample (in `upsamplers.0`)."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, upsample_mode: str | None):
        super().__init__()
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = nn.ModuleList([ResidualBlock(i, o) for i, o in zip(dims[:-1], dims[1:])])
        self.upsamplers = nn.ModuleList([Resample(out_dim, upsample_mode)]) if upsample_mode else None

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, cache)
        return x


class Encoder(nn.Module):
    """conv_in -> per level: residual blocks (+ Resample except at the last level) -> mid_block -> norm, silu, conv_out.

    `down_blocks` is one flat list, as in the checkpoint: [res, res, resample, res, res, resample, ...].
    """

    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = CausalConv3d(cfg.in_channels, dims[0], 3, padding=1)
        blocks = []
        last = len(cfg.dim_mult) - 1
        for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if level != last:
                blocks.append(Resample(out_dim, "downsample3d" if cfg.temperal_downsample[level] else "downsample2d"))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], 2 * cfg.z_dim, 3, padding=1)  # [mu | log_var]

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.conv_in(x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x)), cache)


class Decoder(nn.Module):
    """conv_in -> mid_block -> up_blocks (levels in reverse) -> norm, silu, conv_out.

    Each Resample upsampler halves the channels, so every up block after the first starts at half the previous
    level's width (Wan 2.1).
    """

    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        dims = [cfg.base_dim * m for m in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        temperal_upsample = cfg.temperal_downsample[::-1]
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        blocks = []
        last = len(cfg.dim_mult) - 1
        for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if level > 0:
                in_dim //= 2
            mode = None if level == last else "upsample3d" if temperal_upsample[level] else "upsample2d"
            blocks.append(UpBlock(in_dim, out_dim, cfg.num_res_blocks, mode))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], cfg.out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.conv_in(x, cache)
        x = self.mid_block(x, cache)
        for block in self.up_blocks:
            x = block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x)), cache)


# ----------------------------------------------------------------------------------------------------------------------
# The model


class WanVAE(nn.Module):
    """Wan 2.1 VAE: `encode` video to the posterior mode, `decode` latents to video; see the module docstring."""

    def __init__(self, config: WanVAEConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, 1)
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.quant_conv.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.quant_conv.weight.device

    @property
    def latents_mean(self) -> torch.Tensor:
        """[1, z_dim, 1, 1, 1] fp32 on CPU (from the config; not part of the state dict)."""
        return torch.tensor(self.config.latents_mean, dtype=torch.float32).view(1, self.config.z_dim, 1, 1, 1)

    @property
    def latents_std(self) -> torch.Tensor:
        """[1, z_dim, 1, 1, 1] fp32 on CPU (from the config; not part of the state dict)."""
        return torch.tensor(self.config.latents_std, dtype=torch.float32).view(1, self.config.z_dim, 1, 1, 1)

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """(z - mean) / std, computed as upstream MiniMax-Remover does: (z - mean) * (1 / std), in z's dtype.

        Upstream casts mean and std to the latent dtype first and takes the reciprocal there, so in bf16/fp16 this
        rounds differently from a true division; we match upstream, not the formula.
        """
        mean = self.latents_mean.to(z.device, z.dtype)
        inv_std = 1.0 / self.latents_std.to(z.device, z.dtype)
        return (z - mean) * inv_std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """z * std + mean, computed as upstream MiniMax-Remover does: z / (1 / std) + mean, in z's dtype."""
        mean = self.latents_mean.to(z.device, z.dtype)
        inv_std = 1.0 / self.latents_std.to(z.device, z.dtype)
        return z / inv_std + mean

    @torch.no_grad()
    def encode(self, x: torch.Tensor, progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Video [B, in_channels, F, H, W] in [-1, 1] -> posterior mode (mu) [B, z_dim, T, H/8, W/8].

        Chunks as diffusers: frame 0, then 4 frames at a time; T = (F-1)//4 + 1. Like diffusers, trailing frames that
        do not fill a last 4-frame chunk are ignored, so pass F = 4k+1 frames. progress(done, total) after each chunk.
        """
        if x.ndim != 5 or x.shape[1] != self.config.in_channels:
            raise ValueError(f"encode expects [B, {self.config.in_channels}, F, H, W], got {list(x.shape)}")
        num_frames = x.shape[2]
        if num_frames < 1:
            raise ValueError("encode needs at least one frame")
        n_chunks = (num_frames - 1) // ENCODE_CHUNK_FRAMES + 1
        starts = [1 + ENCODE_CHUNK_FRAMES * i for i in range(n_chunks - 1)]
        bounds = [(0, 1)] + [(s, s + ENCODE_CHUNK_FRAMES) for s in starts]
        cache = CausalCache()
        latents = []
        for done, (start, end) in enumerate(bounds, 1):
            h = self.encoder(x[:, :, start:end], cache)
            # quant_conv is 1x1x1 (no memory across frames), so running it per chunk equals running it on the whole.
            mu, _log_var = self.quant_conv(h).chunk(2, dim=1)
            latents.append(mu)
            if progress:
                progress(done, len(bounds))
        return torch.cat(latents, dim=2).contiguous()

    @torch.no_grad()
    def decode(self, z: torch.Tensor, progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Latents [B, z_dim, T, h, w] -> video [B, out_channels, 1 + 4(T-1), 8h, 8w], clamped to [-1, 1].

        One latent frame at a time, as diffusers (`decode_iter`'s chunks). The output is allocated once, after the
        first frame shows its shape, and each chunk is written into it (no list of chunks to concatenate).
        progress(done, total) per latent frame.
        """
        out = None
        frame = 0
        for chunk in self.decode_iter(z, progress):
            if out is None:
                total = 1 + (z.shape[2] - 1) * self.config.temporal_compression
                out = chunk.new_empty(chunk.shape[0], chunk.shape[1], total, *chunk.shape[3:]).contiguous()
            out[:, :, frame : frame + chunk.shape[2]] = chunk
            frame += chunk.shape[2]
        assert frame == out.shape[2], (frame, out.shape)
        return out

    @torch.no_grad()
    def decode_iter(
        self, z: torch.Tensor, progress: Callable[[int, int], None] | None = None
    ) -> Iterator[torch.Tensor]:
        """`decode` chunk by chunk: yields the clamped pixels of each latent frame as soon as it is decoded
        ([B, out_channels, 1, 8h, 8w] for latent frame 0, then 4 frames each), the causal cache carried between
        them. The chunks concatenated are `decode(z)` bit for bit. progress(done, total) after each latent frame.
        """
        if z.ndim != 5 or z.shape[1] != self.config.z_dim:
            raise ValueError(f"decode expects [B, {self.config.z_dim}, T, h, w], got {list(z.shape)}")
        if z.shape[2] < 1:
            raise ValueError("decode needs at least one latent frame")
        z = self.post_quant_conv(z)
        cache = CausalCache()
        for i in range(z.shape[2]):
            yield self.decoder(z[:, :, i : i + 1], cache).clamp_(-1.0, 1.0)
            if progress:
                progress(i + 1, z.shape[2])
