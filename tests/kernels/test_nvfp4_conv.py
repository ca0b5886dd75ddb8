"""NVFP4 weights for the VAE's wide 3x3x3 convs (fastremover/fast/nvfp4_conv.py): exact to the conv on the
dequantized weight, masters dropped, the tap-major block layout, resident bytes and the config-only estimate."""

import gc
import weakref

import pytest
import torch

from fastremover.errors import FastRemoverError
from fastremover.fast import nvfp4 as ref
from fastremover.fast.nvfp4_conv import (
    Nvfp4CausalConv3d,
    conv_weight_from_matrix,
    conv_weight_matrix,
    format_vae_memory_estimate,
    nvfp4_conv_bytes,
    quantize_vae_convs_nvfp4,
    vae_conv_memory_estimate,
)
from fastremover.ops.linear.nvfp4 import resident_bytes
from fastremover.models.loading import random_init_
from fastremover.models.vae import CausalCache, CausalConv3d, WanVAE, WanVAEConfig

TINY_VAE = WanVAEConfig(base_dim=8, num_res_blocks=1)  # the tiny preset's VAE: 8..32 channels


def dense_twin(q: Nvfp4CausalConv3d) -> CausalConv3d:
    """A dense CausalConv3d holding q's dequantized weight and bias."""
    c = CausalConv3d(q.in_channels, q.out_channels, q.kernel_size, stride=q.stride, padding=q.padding)
    with torch.no_grad():
        c.weight.copy_(q.weight)
        c.bias.copy_(q.bias)
    return c


def test_layout_is_tap_major_and_round_trips():
    w = torch.randn(5, 32, 3, 3, 3)
    m = conv_weight_matrix(w)
    assert m.shape == (5, 27 * 32)
    # element (o, tap (1, 2, 0), channel 7): column tap_index * I + channel, so a 16-block is one tap's channels
    assert m[3, (1 * 9 + 2 * 3 + 0) * 32 + 7] == w[3, 7, 1, 2, 0]
    assert torch.equal(conv_weight_from_matrix(m, tuple(w.shape)), w)


def test_conv_is_exact_to_the_dequantized_weight_conv_and_drops_the_master():
    torch.manual_seed(0)
    conv = CausalConv3d(32, 24, 3, padding=1)
    master = weakref.ref(conv.weight)
    q = Nvfp4CausalConv3d(conv)
    # the stored format is the torch reference quantizer's on the tap-major matrix
    expect = ref.quantize_reference(conv_weight_matrix(conv.weight.detach()).contiguous())
    assert torch.equal(q.packed, expect.packed) and torch.equal(q.weight_nvfp4().scales.view(torch.uint8),
                                                                expect.scales.view(torch.uint8))
    w = q.weight
    assert w.shape == conv.weight.shape and not any(p is conv.weight for p in q.parameters())
    assert torch.equal(w, conv_weight_from_matrix(ref.dequantize_reference(expect), tuple(conv.weight.shape)))
    rel = ((w - conv.weight).norm() / conv.weight.norm()).item()
    assert 0 < rel < 0.15
    twin = dense_twin(q)
    x = torch.randn(1, 32, 5, 6, 7)
    with torch.no_grad():
        assert torch.equal(q(x), twin(x))
        # chunked through a causal cache: the same front frames, the same result as the dense conv's
        cq, ct = CausalCache(), CausalCache()
        for chunk in x.split([1, 4], dim=2):
            assert torch.equal(q(chunk, cq), twin(chunk, ct))
    del conv
    gc.collect()
    assert master() is None
    # dtype casts keep the packed format (scales and the global scale are stored as integer bit patterns)
    packed, scales, g = q.packed.clone(), q.scale_bits.clone(), q.global_scale_bits.clone()
    q.to(torch.float16)
    assert torch.equal(q.packed, packed) and torch.equal(q.scale_bits, scales) and torch.equal(q.global_scale_bits, g)
    assert q.weight.dtype == torch.float16 and torch.equal(q.weight, w.half()) and q.bias.dtype == torch.float16
    assert resident_bytes(q) == nvfp4_conv_bytes(24, 32, bias_bytes=2)
    with pytest.raises(ValueError, match="in_channels % 16"):
        Nvfp4CausalConv3d(CausalConv3d(24, 8, 3, padding=1))


def test_quantize_vae_convs_replaces_the_wide_3x3x3_convs_and_reports_memory():
    vae = random_init_(WanVAE(TINY_VAE), 3).eval().to(torch.float16)
    dense = random_init_(WanVAE(TINY_VAE), 3).eval()
    est = vae_conv_memory_estimate(TINY_VAE, min_in_channels=16)
    assert resident_bytes(vae) == est["dense_total_bytes"]
    wanted = [n for n, m in vae.named_modules() if isinstance(m, CausalConv3d) and tuple(m.kernel_size) == (3, 3, 3)
              and m.in_channels >= 16]
    others = {n: type(m) for n, m in vae.named_modules() if isinstance(m, CausalConv3d) and n not in wanted}
    assert wanted and any(m.kernel_size == (1, 1, 1) for m in vae.modules() if isinstance(m, CausalConv3d))
    report = quantize_vae_convs_nvfp4(vae, min_in_channels=16)
    mods = dict(vae.named_modules())
    assert report.layers == len(wanted) == est["convs"] and all(isinstance(mods[n], Nvfp4CausalConv3d) for n in wanted)
    assert all(type(mods[n]) is t for n, t in others.items())  # 1x1x1, (3,1,1) time convs, narrow convs: dense
    assert report.vae_bytes_before == est["dense_total_bytes"]
    assert report.vae_bytes_after == est["nvfp4_total_bytes"] == resident_bytes(vae)
    assert report.conv_bytes_before - report.conv_bytes_after == est["saved_bytes"] > 0
    assert "convs" in report.summary() and report.describe()["layers"] == report.layers
    with pytest.raises(ValueError, match="called twice"):
        quantize_vae_convs_nvfp4(vae)
    # the eager VAE runs with them (fp32 on the CPU) and stays close to dense
    quantize_vae_convs_nvfp4(q := random_init_(WanVAE(TINY_VAE), 3).eval(), min_in_channels=16)
    x = torch.rand(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        z, zd = q.encode(x), dense.encode(x)
        y, yd = q.decode(zd), dense.decode(zd)  # the decoder on the same latents
    cos = torch.nn.functional.cosine_similarity
    # random weights, 27 of the tiny VAE's convs replaced, errors compounding: measured 0.992 (encode), 0.965 (decode)
    assert not torch.equal(z, zd) and cos(z.flatten(), zd.flatten(), dim=0) > 0.95
    assert not torch.equal(y, yd) and cos(y.flatten(), yd.flatten(), dim=0) > 0.95


def test_damaged_checkpoint_and_released_config_estimate():
    vae = random_init_(WanVAE(TINY_VAE), 3).eval()
    target = next(m for m in vae.modules() if isinstance(m, CausalConv3d) and m.in_channels >= 16
                  and tuple(m.kernel_size) == (3, 3, 3))
    with torch.no_grad():
        target.weight[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(FastRemoverError, match="NaN or inf"):
        quantize_vae_convs_nvfp4(vae, min_in_channels=16)
    assert not any(isinstance(m, Nvfp4CausalConv3d) for m in vae.modules())  # refused before anything was replaced
    est = vae_conv_memory_estimate(WanVAEConfig())
    # every qualifying conv of the released VAE has 192 or 384 inputs (multiples of 16: nothing skipped), 0.5 byte
    # per weight + 1/16 of a byte of scale (no padding: 27 * 192 / 16 = 324 scale columns)
    assert est["convs"] > 0 and 3.5 < est["conv_ratio"] < 3.6 and est["nvfp4_total_bytes"] < est["dense_total_bytes"]
    line = format_vae_memory_estimate(est)
    print(line)
    assert "GiB" in line and f"{est['convs']} 3x3x3 convs" in line
