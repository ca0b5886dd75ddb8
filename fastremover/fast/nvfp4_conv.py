"""NVFP4 weights for the Wan VAE's wide 3x3x3 causal convs (`--weights nvfp4`, issue #29), weight-only.

FlashRT stores the VAE's 3x3x3 convs with at least 192 input channels in NVFP4. On Hopper there is no FP4 conv, so
here it buys resident memory only: the conv's weight is kept as packed e2m1 codes + swizzled e4m3 block scales + an
fp32 global scale (fast/nvfp4.py's format) and dequantized for each call; the full-precision master is dropped.

Weight layout. A conv weight [O, I, 3, 3, 3] is quantized as the matrix [O, 27 * I] in tap-major order
(`conv_weight_matrix`: [O, kt, kh, kw, I] flattened, channels innermost), so each block of 16 elements is 16 input
channels of one tap - what an implicit-GEMM conv reads per K step (one tap's channel slice at a time). It needs
I % 16 == 0 (the released VAE's 192 and 384 are).

Numerics (exact by construction): forward = the eager CausalConv3d's forward (same causal padding, same
`models.vae.conv3d`) on the dequantized weight `dequantize(codes, scales, global_scale)` = fl(W_unit * alpha) in fp32
(fast/nvfp4.py, rounding points there), then cast to the module's dtype. So the output is bit-equal to the dense
conv run on that dequantized weight; the only approximation is the 4-bit weight itself. The dequantized weight is
a per-call temporary (one conv's weight at a time), never cached.

    Nvfp4CausalConv3d(conv)                 a CausalConv3d whose `weight` is dequantized on read
    quantize_vae_convs_nvfp4(vae, min_in_channels=192) -> Nvfp4ConvReport
                                            replaces every qualifying CausalConv3d of a WanVAE in place
    vae_conv_memory_estimate(config)        the same byte figures from a WanVAEConfig alone (meta device)

dtype changes (`vae.to(torch.float16)`) leave the packed format intact: the e4m3 scales and the fp32 global scale
are stored as uint8 / int32 bit patterns (a float buffer would be cast), and a zero-size probe buffer follows the
module's dtype so the dequantized weight comes out in it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from fastremover.errors import FastRemoverError
from fastremover.fast import nvfp4 as ref
from fastremover.ops.linear.nvfp4 import resident_bytes
from fastremover.models.vae import CausalConv3d

MIN_IN_CHANNELS = 192  # FlashRT's threshold
KERNEL = (3, 3, 3)
_CONV_ATTRS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "transposed",
               "output_padding", "groups", "padding_mode", "_reversed_padding_repeated_twice", "front_frames",
               "space_padding")


def conv_weight_matrix(weight: torch.Tensor) -> torch.Tensor:
    """[O, I, kt, kh, kw] -> [O, kt*kh*kw*I], tap-major (channels innermost)."""
    return weight.permute(0, 2, 3, 4, 1).reshape(weight.shape[0], -1)


def conv_weight_from_matrix(matrix: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The inverse of conv_weight_matrix for a weight of `shape` [O, I, kt, kh, kw] (a contiguous tensor)."""
    o, i, kt, kh, kw = shape
    return matrix.reshape(o, kt, kh, kw, i).permute(0, 4, 1, 2, 3).contiguous()


def qualifies(module: nn.Module, min_in_channels: int = MIN_IN_CHANNELS) -> bool:
    """A dense CausalConv3d with a 3x3x3 kernel, one group and at least min_in_channels inputs."""
    return (isinstance(module, CausalConv3d) and not isinstance(module, Nvfp4CausalConv3d)
            and tuple(module.kernel_size) == KERNEL and module.groups == 1 and module.in_channels >= min_in_channels)


def _on_triton_gpu(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    try:
        from fastremover.fast.kernels.nvfp4 import w4a16_available
    except ImportError:  # no Triton
        return False
    return w4a16_available(t.device)


class Nvfp4CausalConv3d(CausalConv3d):
    """A frozen CausalConv3d stored as NVFP4 (module docstring). `weight` is a read-only property: the dequantized
    [O, I, 3, 3, 3] weight in the module's dtype, computed on each read."""

    def __init__(self, conv: CausalConv3d):
        nn.Module.__init__(self)  # not CausalConv3d.__init__: it would allocate a dense weight Parameter
        for name in _CONV_ATTRS:
            setattr(self, name, getattr(conv, name))
        w = conv.weight.detach()
        if w.shape[1] % ref.BLOCK:
            raise ValueError(f"NVFP4 conv needs in_channels % {ref.BLOCK} == 0, got {w.shape[1]}")
        self.weight_shape = tuple(w.shape)
        matrix = conv_weight_matrix(w).contiguous()
        if _on_triton_gpu(matrix):
            from fastremover.fast.kernels.nvfp4 import quantize_nvfp4

            q = quantize_nvfp4(matrix)  # bit-equal to the torch reference (reciprocal="exact")
        else:
            q = ref.quantize_reference(matrix)
        self.register_buffer("packed", q.packed)
        self.register_buffer("scale_bits", q.scales.view(torch.uint8))
        self.register_buffer("global_scale_bits", q.global_scale.float().reshape(1).view(torch.int32))
        self.register_buffer("dtype_probe", torch.empty(0, dtype=w.dtype, device=w.device))
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone(), requires_grad=False)

    def weight_nvfp4(self) -> ref.Nvfp4Tensor:
        return ref.Nvfp4Tensor(self.packed, self.scale_bits.view(ref.FP8), self.global_scale_bits.view(torch.float32))

    @property
    def weight(self) -> torch.Tensor:  # noqa: D401 - read by CausalConv3d.forward and by the fast VAE's converter
        t = self.weight_nvfp4()
        if _on_triton_gpu(self.packed):
            from fastremover.fast.kernels.nvfp4 import dequantize_nvfp4

            w = dequantize_nvfp4(t, torch.float32)  # bit-equal to dequantize_reference
        else:
            w = ref.dequantize_reference(t, torch.float32)
        return conv_weight_from_matrix(w, self.weight_shape).to(self.dtype_probe.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", weights=nvfp4"


@dataclass(frozen=True)
class Nvfp4ConvReport:
    """What quantize_vae_convs_nvfp4 did: convs replaced (and qualifying ones left dense, with the reason), resident
    bytes of the replaced convs and of the whole VAE before and after."""

    layers: int
    skipped: tuple
    conv_bytes_before: int
    conv_bytes_after: int
    vae_bytes_before: int
    vae_bytes_after: int
    min_in_channels: int = MIN_IN_CHANNELS

    def describe(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        mib = 1 << 20
        return (f"NVFP4 VAE convs (3x3x3, >= {self.min_in_channels} input channels): {self.layers} convs, "
                f"{self.conv_bytes_before / mib:.1f} -> {self.conv_bytes_after / mib:.1f} MiB; VAE resident "
                f"{self.vae_bytes_before / mib:.1f} -> {self.vae_bytes_after / mib:.1f} MiB")


def _set(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, last = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    if last.isdigit():
        parent[int(last)] = new
    else:
        setattr(parent, last, new)


def quantize_vae_convs_nvfp4(vae: nn.Module, *, min_in_channels: int = MIN_IN_CHANNELS) -> Nvfp4ConvReport:
    """Replace every 3x3x3 CausalConv3d of `vae` with >= min_in_channels input channels by Nvfp4CausalConv3d (in
    place, one conv at a time, so at most one dense master is duplicated) and return the report. Convs whose input
    width is not a multiple of 16 stay dense (listed in `skipped`). Call it on the eager VAE before a fast VAE is
    built from it; calling it twice is an error."""
    if any(isinstance(m, Nvfp4CausalConv3d) for m in vae.modules()):
        raise ValueError("the VAE holds NVFP4 convs already: quantize_vae_convs_nvfp4 was called twice")
    targets, skipped = [], []
    for name, m in vae.named_modules():
        if not qualifies(m, min_in_channels):
            continue
        if m.in_channels % ref.BLOCK:
            skipped.append((name, f"in_channels {m.in_channels} is not a multiple of {ref.BLOCK}"))
            continue
        if not bool(torch.isfinite(m.weight).all()):
            raise FastRemoverError(f"the checkpoint's VAE {name}.weight holds NaN or inf values: the checkpoint is "
                                   "damaged; re-download it (or run with --weights dense)")
        targets.append((name, m))
    vae_before = resident_bytes(vae)
    conv_before = sum(resident_bytes(m) for _, m in targets)
    conv_after = 0
    for name, conv in targets:
        new = Nvfp4CausalConv3d(conv)
        _set(vae, name, new)
        conv_after += resident_bytes(new)
        del conv, new
    n = len(targets)
    targets.clear()
    return Nvfp4ConvReport(n, tuple(skipped), conv_before, conv_after, vae_before, resident_bytes(vae),
                           min_in_channels)


# ----------------------------------------------------------------------------------------------------------------------
# Memory at a config, without building the weights


def nvfp4_conv_bytes(out_channels: int, in_channels: int, taps: int = 27, bias_bytes: int = 2) -> int:
    """Resident bytes of one Nvfp4CausalConv3d: codes O*K/2, swizzled scales Mpad*Cpad, the global scale (4) and the
    bias, for K = taps * in_channels."""
    k = taps * in_channels
    mpad, cpad = ref.padded_scale_shape(out_channels, k)
    return out_channels * k // 2 + mpad * cpad + 4 + out_channels * bias_bytes


def vae_conv_memory_estimate(config, dtype_bytes: int = 2, min_in_channels: int = MIN_IN_CHANNELS) -> dict:
    """Resident VAE bytes at a WanVAEConfig in a 16-bit dtype: dense vs its qualifying convs in NVFP4. The module
    tree is built on the meta device (no memory), the bytes are arithmetic."""
    from fastremover.models.vae import WanVAE

    with torch.device("meta"):
        vae = WanVAE(config)
    dense_total = sum(p.numel() for p in vae.parameters()) * dtype_bytes
    dense_convs = nvfp4_convs = layers = 0
    for m in vae.modules():
        if qualifies(m, min_in_channels) and m.in_channels % ref.BLOCK == 0:
            layers += 1
            dense_convs += (m.weight.numel() + m.out_channels) * dtype_bytes
            nvfp4_convs += nvfp4_conv_bytes(m.out_channels, m.in_channels, bias_bytes=dtype_bytes)
    nvfp4_total = dense_total - dense_convs + nvfp4_convs
    return {
        "dtype_bytes": dtype_bytes,
        "min_in_channels": min_in_channels,
        "convs": layers,
        "dense_conv_bytes": dense_convs,
        "nvfp4_conv_bytes": nvfp4_convs,
        "dense_total_bytes": dense_total,
        "nvfp4_total_bytes": nvfp4_total,
        "saved_bytes": dense_total - nvfp4_total,
        "conv_ratio": dense_convs / nvfp4_convs if nvfp4_convs else 1.0,
        "total_ratio": dense_total / nvfp4_total,
    }


def format_vae_memory_estimate(est: dict) -> str:
    """One line for `fastremover info`."""
    gib = float(1 << 30)
    return (f"VAE weights, {8 * est['dtype_bytes']}-bit dense: {est['dense_total_bytes'] / gib:.3f} GiB; with "
            f"--weights nvfp4 ({est['convs']} 3x3x3 convs with >= {est['min_in_channels']} input channels in NVFP4): "
            f"{est['nvfp4_total_bytes'] / gib:.3f} GiB (those convs {est['dense_conv_bytes'] / gib:.3f} -> "
            f"{est['nvfp4_conv_bytes'] / gib:.3f} GiB, {est['conv_ratio']:.2f}x smaller)")
