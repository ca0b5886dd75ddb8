"""The fast VAE's weights: a `WanVAE`'s convs and norms converted once to the fast layout (`convert` -> VAEWeights).

Every conv weight is copied channels-last to the target device / dtype; then, in this order:
* the 3-channel ends (encoder conv_in, decoder conv_out) zero-padded to RGB_PAD channels (`pad_rgb`);
* activations of c > pad_channels channels, c not a multiple of it, stored zero-padded to the next multiple: conv
  weights get zero rows / columns (an attention block's q | k | v and an upsampler's two time halves padded group by
  group), norms a zero gamma and their real C (`VAEWeights.norm_channels`); the video and latent ends keep their
  widths. The padding channels then hold exact zeros everywhere (see the package docstring);
* the decoder's conv_out as one conv2d giving its three temporal taps' partial outputs (`tap_head`);
* quant_conv cut to mu (the only half ever used);
* FP8 (`fp8=` the conv3d_fp8 module): the 3x3x3 causal convs where `fp8_pays` quantized by its
  `quantize_conv_weight`, those fed by a residual block's norm + SiLU with a static activation scale
  (`static_act_scale`) when `fp8_static`;
* the sub-pixel phase weights of the decoder's upsampling convs (`upconv=` the upsample_conv module).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fastremover.config import FastVAEOptions
from fastremover.models.vae import CACHE_T, AttentionBlock, CausalConv3d, Resample, ResidualBlock, WanVAE

CL3 = torch.channels_last_3d
CL2 = torch.channels_last
FP8 = torch.float8_e4m3fn
RGB_PAD = 8  # conv_in / conv_out channel padding on CUDA
PAD_CHANNELS = 64  # default pad_channels on CUDA: activations of 96 channels are stored as 128
FP8_MAX_CHANNELS = FastVAEOptions().fp8_max_channels  # the decoder's 96-channel full-resolution level (fp8_pays)
FP8_ENCODER_MAX_CHANNELS = 384  # default fp8_encoder_max_channels: every level of the encoder (see fp8_pays)


def fp8_pays(cin: int, cout: int, max_channels: int = FP8_MAX_CHANNELS) -> bool:
    """Which 3x3x3 causal convs the FP8 kernel runs: both channel counts in [64, max_channels]. The lower end keeps
    the latent-facing convs (the decoder's conv_in from 16 channels, the encoder's conv_out to 32) in fp16. The
    defaults (FP8_MAX_CHANNELS for the decoder, FP8_ENCODER_MAX_CHANNELS for the encoder) come from one H200 bench
    run at W2 (bench/results/vae-w2-fp8-levels-*-fbd9551.json, where the limit applied to encoder and decoder alike;
    PSNR of the decoded video against the reference VAE's, both decoding the reference latents):
        levels on FP8      96 ch: 43.3 dB, decode 0.77 s    up to 192: 39.5 dB, 0.80 s    all: 32.6 dB, 0.81 s
    the deeper decoder levels put many more convs in series and were no faster (the 1-frame steps of the small
    levels), so the decoder keeps only its full-resolution level in FP8; the total's gain there (1.61 -> 1.60 ->
    1.54 s) came from the encoder. The encoder's error shows in the round trip (its own latents through its own
    decoder): 34.4 dB with its 96-channel level in FP8, 32.0 dB with all of it, for 0.12 s (1.51 -> 1.39 s;
    bench/results/vae-w2-fp8-roundtrip-*-4a9689c.json)."""
    return 64 <= min(cin, cout) and max(cin, cout) <= max_channels


def static_act_scale(gamma: torch.Tensor, channels: int) -> float:
    """A static e4m3 activation scale for the output of the VAE's channel RMS norm + SiLU, which is bounded:
    |F.normalize(x)_c| <= 1, so |norm_c| <= sqrt(C) |gamma_c| and |silu(v)| <= max(v, 0.2785) (SiLU's minimum is
    -0.2785). bound = max(sqrt(C) max|gamma| (1 + 2^-5), 0.28): the margin covers the norm kernel's four roundings
    to the dtype (each at most 2^-8 relative in bf16, 2^-11 in fp16); the scale is bound / 448, so no code can
    overflow (the conversion saturates anyway). Against a per-chunk amax scale it only costs precision below the e4m3 normal
    range (|v| < bound 2^-6 / 448, about 3.5e-4 at bound 10), where the codes' absolute error stays below
    bound 2^-9 / 448 (subnormal spacing)."""
    g = float(gamma.detach().float().abs().max())
    bound = max(channels**0.5 * g * (1 + 2.0**-5), 0.28)
    return bound / 448.0


@dataclass
class ConvWeights:
    """A conv's weights in the fast layout, and how to call it."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: tuple
    padding: tuple  # the conv's own (spatial) padding; causal time padding comes from the cache
    front: int = 0  # cached frames in front of each chunk (2 for the 3-tap causal convs, 0 otherwise)
    fp8: tuple | None = None  # (weight_q, weight_scale) for the FP8 conv kernel
    # FP8 convs fed by a norm + SiLU: its static activation scale (see `static_act_scale`) and that norm module
    act_scale: torch.Tensor | None = None
    act_norm: nn.Module | None = None
    phase: torch.Tensor | None = None  # an upsampler's conv: its sub-pixel phase weights (upsample_conv.phase_weights)


@dataclass
class VAEWeights:
    """A WanVAE's weights in the fast layout, keyed by the eager modules."""

    pad_channels: int  # activations of c > pad_channels channels, not a multiple of it, stored padded (0: never)
    pad_encoder: bool  # pad the encoder's activations too
    encoder_modules: set = field(default_factory=set)  # the encoder's modules and quant_conv
    conv: dict[nn.Module, ConvWeights] = field(default_factory=dict)
    gamma: dict[nn.Module, torch.Tensor] = field(default_factory=dict)  # RMS norms: gamma at the stored width
    norm_channels: dict[nn.Module, int] = field(default_factory=dict)  # norms whose input carries padding: real C
    head_taps: tuple | None = None  # (weight, fp32 bias, padded out channels) of the decoder's tap head
    fp8_convs: int = 0

    def width(self, c: int, module: nn.Module | None = None) -> int:
        """The stored channel count of a c-channel activation (of `module`'s): c rounded up to a multiple of
        pad_channels when c is larger than pad_channels and not a multiple of it (96 -> 128 at the default 64), else c;
        always c in the encoder unless pad_encoder."""
        m = self.pad_channels
        if not m or c <= m or c % m == 0 or (module in self.encoder_modules and not self.pad_encoder):
            return c
        return -(-c // m) * m

    def pad_conv(self, module: nn.Module, parts: int = 1, keep_in: bool = False, keep_out: bool = False) -> None:
        """Zero-pad a conv's weight (output and input channels) and bias to the stored widths: the padding outputs
        are exact zeros, and the padding inputs (zeros) meet zero weights. parts: the output channels are that many
        equal groups (an attention block's q | k | v), each padded on its own. keep_in / keep_out: leave that side."""
        c = self.conv[module]
        w = c.weight
        out_c, in_c = w.shape[0] // parts, w.shape[1]
        po = out_c if keep_out else self.width(out_c, module)
        pi = in_c if keep_in else self.width(in_c, module)
        if (po, pi) == (out_c, in_c):
            return
        padded = w.new_zeros(parts * po, pi, *w.shape[2:])
        bias = c.bias.new_zeros(parts * po) if c.bias is not None else None
        for i in range(parts):
            padded[i * po : i * po + out_c, :in_c] = w[i * out_c : (i + 1) * out_c]
            if bias is not None:
                bias[i * po : i * po + out_c] = c.bias[i * out_c : (i + 1) * out_c]
        c.weight = padded.contiguous(memory_format=CL3 if w.dim() == 5 else CL2)
        c.bias = bias


@torch.no_grad()
def convert(vae: WanVAE, device: torch.device, dtype: torch.dtype, *, pad_rgb: bool, pad_channels: int,
            pad_encoder: bool, tap_head: bool, fp8=None, fp8_static: bool = False,
            fp8_max_channels: int = FP8_MAX_CHANNELS, fp8_encoder_max_channels: int = FP8_ENCODER_MAX_CHANNELS,
            upconv=None) -> VAEWeights:
    """`vae`'s weights in the fast layout on device / dtype (see the module docstring); `vae` is not changed."""

    def t(x: torch.Tensor | None, fmt=None) -> torch.Tensor | None:
        if x is None:
            return None
        x = x.detach().to(device=device, dtype=dtype)
        return x.contiguous(memory_format=fmt) if fmt is not None else x.contiguous()

    w = VAEWeights(pad_channels, pad_encoder, set(vae.encoder.modules()) | {vae.quant_conv})
    for m in vae.modules():
        if isinstance(m, CausalConv3d):
            w.conv[m] = ConvWeights(t(m.weight, CL3), t(m.bias), tuple(m.stride), m.space_padding, m.front_frames)
        elif isinstance(m, nn.Conv2d):
            w.conv[m] = ConvWeights(t(m.weight, CL2), t(m.bias), tuple(m.stride), tuple(m.padding))
        elif hasattr(m, "gamma") and hasattr(m, "scale"):  # RMSNorm
            gamma = t(m.gamma).reshape(-1)
            c, wide = gamma.numel(), w.width(gamma.numel(), m)
            if wide != c:  # zero gamma on the padding channels keeps them zero
                gamma = torch.cat([gamma, gamma.new_zeros(wide - c)])
                w.norm_channels[m] = c
            w.gamma[m] = gamma
    if pad_rgb:
        _pad_rgb_ends(vae, w)
    grouped = set()  # convs whose outputs are equal groups, each padded on its own (never again as one block)
    for m in vae.modules():
        if isinstance(m, AttentionBlock):  # q, k, v each padded: [3c, c] -> [3W, W], chunk i at rows i*W..
            w.pad_conv(m.to_qkv, parts=3)
            grouped.add(m.to_qkv)
        elif isinstance(m, Resample) and m.mode == "upsample3d":  # [frame 2i | frame 2i+1] channel halves
            w.pad_conv(m.time_conv, parts=2)
            grouped.add(m.time_conv)
    # the video and latent ends keep their channel counts (their tensors come from / go to the caller)
    keep_in = {vae.encoder.conv_in, vae.decoder.conv_in, vae.quant_conv, vae.post_quant_conv}
    keep_out = {vae.encoder.conv_out, vae.decoder.conv_out, vae.quant_conv, vae.post_quant_conv}
    for m in w.conv:
        if m not in grouped:
            w.pad_conv(m, keep_in=m in keep_in, keep_out=m in keep_out)
    if tap_head:
        w.head_taps = _tap_head(vae.decoder.conv_out, w, pad_rgb, device, dtype, t)
    # quant_conv: only mu (the first z_dim outputs) is ever used
    q = w.conv[vae.quant_conv]
    z = vae.config.z_dim
    q.weight, q.bias = q.weight[:z].contiguous(memory_format=CL3), q.bias[:z].contiguous()
    if fp8 is not None:
        _quantize_fp8(vae, w, fp8, fp8_static, fp8_max_channels, fp8_encoder_max_channels, device)
    if upconv is not None:
        for m in vae.modules():
            if isinstance(m, Resample) and m.mode.startswith("up"):
                c = w.conv[m.resample[1]]
                if upconv.supported(c.weight.shape[1], c.weight.shape[0]):
                    c.phase = upconv.phase_weights(c.weight, dtype)
    return w


def _pad_rgb_ends(vae: WanVAE, w: VAEWeights) -> None:
    """Zero-pad the encoder's conv_in inputs and the decoder's conv_out outputs to RGB_PAD channels."""
    conv_in = w.conv[vae.encoder.conv_in]
    if conv_in.weight.shape[1] < RGB_PAD:
        wt = conv_in.weight.new_zeros(conv_in.weight.shape[0], RGB_PAD, *conv_in.weight.shape[2:])
        wt[:, : conv_in.weight.shape[1]] = conv_in.weight
        conv_in.weight = wt.contiguous(memory_format=CL3)
    conv_out = w.conv[vae.decoder.conv_out]
    if conv_out.weight.shape[0] < RGB_PAD:
        wt = conv_out.weight.new_zeros(RGB_PAD, *conv_out.weight.shape[1:])
        wt[: conv_out.weight.shape[0]] = conv_out.weight
        b = conv_out.bias.new_zeros(RGB_PAD)
        b[: conv_out.bias.shape[0]] = conv_out.bias
        conv_out.weight, conv_out.bias = wt.contiguous(memory_format=CL3), b


def _tap_head(conv: CausalConv3d, w: VAEWeights, pad_rgb: bool, device, dtype, t) -> tuple:
    """The decoder's conv_out as one conv2d giving the three temporal taps' partial outputs (tap-major channels; see
    `Decoder.head`): (weight [3 * cp, C, 3, 3] channels-last, fp32 bias [1, c_out, 1, 1, 1], cp)."""
    c_out, c_in = conv.out_channels, w.width(conv.in_channels, conv)
    cp = RGB_PAD if pad_rgb and c_out < RGB_PAD else c_out
    wt = conv.weight.detach().new_zeros(3, cp, c_in, 3, 3)
    wt[:, :c_out, : conv.in_channels] = conv.weight.detach().permute(2, 0, 1, 3, 4)  # [tap, out, in, kh, kw]
    weight = wt.reshape(3 * cp, c_in, 3, 3).to(device, dtype)
    bias = t(conv.bias).float().view(1, c_out, 1, 1, 1)
    return weight.contiguous(memory_format=CL2), bias, cp


def _quantize_fp8(vae: WanVAE, w: VAEWeights, fp8, static: bool, max_channels: int, encoder_max_channels: int,
                  device) -> None:
    """FP8 weights (and static activation scales) for the 3x3x3 causal convs the FP8 kernel runs (`fp8_pays`)."""
    # a residual block's convs read norm + SiLU outputs: bounded, so a static scale (fp8_scales "static")
    feeds = {r.conv1: r.norm1 for r in vae.modules() if isinstance(r, ResidualBlock)}
    feeds.update({r.conv2: r.norm2 for r in vae.modules() if isinstance(r, ResidualBlock)})
    for m, c in w.conv.items():
        if (isinstance(m, CausalConv3d) and tuple(m.kernel_size) == (3, 3, 3) and tuple(m.stride) == (1, 1, 1)
                and m.front_frames == CACHE_T and c.weight.shape[1] == w.width(m.in_channels, m)
                and fp8.supported(*c.weight.shape[1::-1])
                and fp8_pays(*c.weight.shape[1::-1], encoder_max_channels
                             if m in w.encoder_modules else max_channels)):
            c.fp8 = tuple(fp8.quantize_conv_weight(c.weight))
            if static and m in feeds:
                norm = feeds[m]
                scale = static_act_scale(w.gamma[norm], w.norm_channels.get(norm, m.in_channels))
                c.act_scale = torch.full((1,), scale, dtype=torch.float32, device=device)
                c.act_norm = norm
    w.fp8_convs = sum(c.fp8 is not None for c in w.conv.values())
