"""NVFP4 H3 blocks: the fused Triton kernels (TRITON_INTERPRET=1 on the CPU) equal the eager NVFP4 path bit for bit;
tiers, tile batching, freeze and the CUDA-graph gate."""

import numpy as np
import pytest
import torch

from fastremover.fast import h3_nvfp4 as H
from fastremover.fast import nvfp4 as ref
from fastremover.fast.kernels import h3_fused as K
from fastremover.models import h3_decoder as h3


def _np_exp(x: torch.Tensor) -> torch.Tensor:
    """The interpreter's exponential (numpy's fp32 exp)."""
    return torch.from_numpy(np.exp(x.numpy()))


def _same_nvfp4(a: ref.Nvfp4Tensor, b: ref.Nvfp4Tensor) -> None:
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(a.global_scale, b.global_scale)


def test_rsqrt_ieee_is_the_ieee_one_on_cpu():
    v = torch.rand(100000, generator=torch.Generator().manual_seed(0)) * 1e4 + 1e-6
    want = (np.float32(1) / np.sqrt(v.numpy())).astype(np.float32)
    assert np.array_equal(H.rsqrt_ieee(v).numpy(), want)


def test_sumsq_order():
    """sumsq_reference follows the documented lane order (checked in float64-free integer-exact data: sums of small
    integers are exact, so the order-free value must come out), and its lane layout is the one documented."""
    x = torch.randint(-8, 9, (3, 2048)).float()
    assert torch.equal(H.sumsq_reference(x), (x * x).sum(-1))
    assert K.norm_lanes(2048) == 128 and K.norm_lanes(64) == 16 and K.norm_lanes(32) == 8
    # the order is observable: lane 0 sums 2^24 + 1 -> 2^24 (a tie, to even); lane 1's 1 joins at the tree's last
    # step, 2^24 + 1 -> 2^24 again. Adding the two ones first would give 2^24 + 2.
    y = torch.zeros(1, 64)
    y[0, 0], y[0, 1], y[0, 4] = 2.0 ** 12, 1.0, 1.0
    assert H.sumsq_reference(y).item() == 2.0 ** 24
    assert (y.double() ** 2).sum().item() == 2.0 ** 24 + 2


@pytest.mark.parametrize("m,d", [(70, 32), (5, 64), (130, 2048)])
@pytest.mark.parametrize("parts", ["residual", "norm", "both"])
def test_residual_norm_quantize_bitwise(m, d, parts):
    g = torch.Generator().manual_seed(m + d)
    h = torch.randn(m, d, generator=g) * 3
    o = (torch.randn(m, d, generator=g) * 2).bfloat16()
    bias = torch.randn(d, generator=g).bfloat16()
    scale = torch.rand(d, generator=g)
    gamma = 1 + 0.1 * torch.randn(d, generator=g)
    gsf = ref.global_scale_of(torch.randn(m, d, generator=g) * 2.5)
    h[1, :16] = 0  # an all-zero block (after the norm too when there is no residual)
    residual = (o, bias, scale) if parts in ("residual", "both") else None
    norm = (gamma, 1e-5, gsf) if parts in ("norm", "both") else None
    want_h, want_q = H.residual_norm_quantize_reference(h, residual, norm)
    got_h = h.clone()
    got_q = K.residual_norm_quantize(got_h, residual, norm)
    assert torch.equal(got_h, want_h)
    if norm is None:
        assert got_q is None
    else:
        _same_nvfp4(got_q, want_q)
        mpad, cpad = ref.padded_scale_shape(m, d)
        full = ref.unswizzle_scales(got_q.scales, mpad, cpad).view(torch.uint8)
        assert torch.all(full[m:] == 0) and torch.all(full[:, d // 16:] == 0)  # padding rows / columns zero


@pytest.mark.parametrize("m,heads,dh,rot,s", [(70, 2, 16, 12, 35), (12, 4, 64, 48, 6)])
def test_qkv_epilogue_bitwise(m, heads, dh, rot, s):
    g = torch.Generator().manual_seed(m)
    d = heads * dh
    q, k, v = ((torch.randn(m, d, generator=g) * 3).bfloat16() for _ in range(3))
    bq, bk, bv = (torch.randn(d, generator=g).bfloat16() for _ in range(3))
    ang = torch.rand(s, rot, generator=g) * 6
    cos, sin = ang.cos().bfloat16().contiguous(), ang.sin().bfloat16().contiguous()
    want = H.qkv_epilogue_reference(q, k, v, bq, bk, bv, cos, sin, heads, 1e-5)
    got = K.qkv_epilogue(q, k, v, bq, bk, bv, cos, sin, heads=heads, eps=1e-5)
    for a, b in zip(got, want):
        assert a.shape == (m, heads, dh)
        assert torch.equal(a, b)


@pytest.mark.parametrize("m,f", [(70, 128), (3, 48)])
def test_swiglu_quantize_bitwise(m, f):
    """Bitwise against the reference given the interpreter's exp (numpy's), which differs from torch's CPU exp in the
    last bit for some inputs; on the GPU both are CUDA's expf (tests/kernels/test_h3_gpu.py)."""
    g = torch.Generator().manual_seed(f)
    u = (torch.randn(m, 2 * f, generator=g) * 4).bfloat16()
    bias = torch.randn(2 * f, generator=g).bfloat16()
    gsf = ref.global_scale_of(torch.randn(m, f, generator=g) * 3)
    want = H.swiglu_quantize_reference(u, bias, gsf, exp=_np_exp)
    got = K.swiglu_quantize(u, bias, gsf)
    _same_nvfp4(got, want)
    mpad, cpad = ref.padded_scale_shape(m, f)
    full = ref.unswizzle_scales(got.scales, mpad, cpad).view(torch.uint8)
    assert torch.all(full[m:] == 0)  # padding rows: zero although the bias is not


def test_kernel_refusals(raise_value_errors):
    h = torch.zeros(4, 32)
    raise_value_errors([
        (lambda: K.residual_norm_quantize(h.double(), None, None), "fp32"),
        (lambda: K.residual_norm_quantize(h, (h, h, h), None), "bfloat16"),
        (lambda: K.residual_norm_quantize(h, None, (torch.ones(32), 1e-5, torch.ones(2))), "one-element"),
        (lambda: K.residual_norm_quantize(h, None, None, reciprocal="approx"), "GPU"),
        (lambda: K.swiglu_quantize(torch.zeros(4, 20).bfloat16(), torch.zeros(20).bfloat16(), torch.ones(1)), "F"),
    ])


# ----------------------------------------------------------------------------------------------------------------------
# Whole decodes


CFG = h3.with_layers(h3.preset("tiny"), 3)


@pytest.fixture(scope="module")
def model():
    return h3.random_decoder(CFG, seed=5)


def _z(t=2, hh=4, ww=4, seed=0):
    return torch.randn(1, CFG.latent_channels, t, hh, ww, generator=torch.Generator().manual_seed(seed))


def _stack(model, z, **kw):
    return H.build_nvfp4_stack(model, z[:, :, :7], freeze=False, **kw)


def test_fused_decode_equals_eager_nvfp4(model):
    z = _z()
    stack = _stack(model, z, tier="2L")  # two blocks: block 0's last residual is fused with block 2's norm1
    eager = model.decode(z, blocks=stack)
    stack.fused = True
    fused = model.decode(z, blocks=stack)
    assert torch.equal(fused, eager)
    dense = model.decode(z, tier="2L")
    assert not torch.equal(eager, dense)  # the NVFP4 blocks ran (and are lossy) ...
    mse = ((model.to_pixels(eager) - model.to_pixels(dense)) ** 2).mean()
    assert 10 * torch.log10(1 / mse) > 30  # ... but close to the fp32 decoder


def test_tile_batching_is_bit_identical(model):
    z = _z(t=2, hh=6, ww=5, seed=1)  # 24 x 20 pixels: 2 x 2 tiles
    stack = _stack(model, z, tier="2L")
    one = model.decode(z, blocks=stack, tiles_per_call=1)
    assert torch.equal(model.decode(z, blocks=stack, tiles_per_call=3), one)  # calls of 3 tiles and of 1


def test_fused_tile_batching_is_bit_identical(model):
    z = _z(t=1, hh=4, ww=6, seed=2)  # 16 x 24 pixels: 1 x 2 tiles, one window of 7 tokens (padded)
    stack = _stack(model, z, fused=True, tier="1L")
    assert torch.equal(model.decode(z, blocks=stack, tiles_per_call=2), model.decode(z, blocks=stack))


def test_tier_stack_runs_its_blocks(model):
    z = _z(seed=3)
    s2 = _stack(model, z, tier="2L")
    assert s2.indices == [0, 2] and len(s2.blocks) == 2
    full = _stack(model, z)
    assert not torch.equal(model.decode(z, blocks=s2), model.decode(z, blocks=full))
    # "2L" of 3 blocks is a 2-block decoder made of blocks 0 and 2
    small = h3.H3VideoDecoder(h3.with_layers(CFG, 2))
    sd = model.state_dict()
    for k in list(sd):
        for src, dst in (("transformer_blocks.0.", "transformer_blocks.0."), ("transformer_blocks.2.",
                                                                              "transformer_blocks.1.")):
            if src in k:
                sd[k.replace(src, dst)] = sd[k]
    small.load_state_dict({k: v for k, v in sd.items() if k in small.state_dict()})
    assert torch.equal(small.decode(z, blocks=_stack(small, z)), model.decode(z, blocks=s2))


def test_freeze_keeps_only_packed_weights():
    cfg = h3.with_layers(h3.preset("tiny"), 2)
    m = h3.random_decoder(cfg, seed=1)
    z = torch.randn(1, cfg.latent_channels, 2, 4, 4)
    before = H.resident_bytes(m)
    stack = H.build_nvfp4_stack(m, z, freeze=True)
    dense_blocks = sum(p.numel() * 4 for blk in h3.random_decoder(cfg, seed=1).decoder.transformer_blocks
                       for p in blk.parameters())
    assert H.resident_bytes(m) == before - dense_blocks  # the decoder's dense block weights are gone
    packed = sum(b.numel() for blk in stack.blocks for n, b in blk.named_buffers() if n.endswith(("packed", "scales")))
    est = H.block_linear_bytes(cfg)
    assert packed + 4 * 6 * cfg.num_layers == est["nvfp4_bytes"]
    assert est["dense_fp32_bytes"] == sum(4 * blk.ff1.in_features * blk.ff1.out_features + 4 * blk.ff2.in_features
                                          * blk.ff2.out_features + 16 * cfg.dim ** 2 for blk in stack.blocks)
    for blk in stack.blocks:
        for name, t in blk.named_buffers():
            assert t.dim() < 2 or t.dtype in (torch.uint8, torch.float8_e4m3fn), name  # no dense matrix left
    out = m.decode(z, blocks=stack)  # still decodes
    assert torch.isfinite(out).all()
    full = H.block_linear_bytes(h3.preset("full"))
    assert full["dense_fp32_bytes"] / 1e9 == pytest.approx(9.66, abs=0.01)  # 36 blocks, fp32: 9.66 GB (9.0 GiB)
    assert full["nvfp4_bytes"] / 1e9 == pytest.approx(1.36, abs=0.01)


def test_cuda_graphs_are_gated_to_cuda(model):
    z = _z(t=1, seed=4)
    stack = _stack(model, z, cuda_graphs=True, fused=True, tier="1L")
    plain = _stack(model, z, fused=True, tier="1L")
    assert torch.equal(model.decode(z, blocks=stack), model.decode(z, blocks=plain))
    assert stack.graph_replays == 0 and len(stack.graphs) == 0
