"""GPU checks of the NVFP4 H3 decoder at the release's shapes (run with `pytest -m gpu` on an sm_90 GPU): the fused
kernels and whole fused decodes equal the eager NVFP4 path with torch.equal (36 and 8 blocks, 1 and 4 tiles per call,
CUDA graphs on and off), and tile batching is bit-identical."""

import pytest
import torch

from fastremover.fast import nvfp4 as ref
from fastremover.models import h3_decoder as h3

pytestmark = pytest.mark.gpu
FULL = h3.preset("full")


def _same_nvfp4(a, b):
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("parts", ["norm", "both", "residual"])
def test_residual_norm_quantize_real_shape(parts):
    from fastremover.fast import h3_nvfp4 as H
    from fastremover.fast.kernels import h3_fused as K

    g = torch.Generator(device="cuda").manual_seed(0)
    m, d = 1797 * 4, 2048
    h = torch.randn(m, d, device="cuda", generator=g) * 5
    o = (torch.randn(m, d, device="cuda", generator=g) * 2).bfloat16()
    bias = torch.randn(d, device="cuda", generator=g).bfloat16()
    scale = torch.rand(d, device="cuda", generator=g)
    gamma = 1 + 0.1 * torch.randn(d, device="cuda", generator=g)
    gsf = ref.global_scale_of(h)
    residual = (o, bias, scale) if parts != "norm" else None
    norm = (gamma, 1e-5, gsf) if parts != "residual" else None
    want_h, want_q = H.residual_norm_quantize_reference(h, residual, norm)
    got_h = h.clone()
    got_q = K.residual_norm_quantize(got_h, residual, norm)
    assert torch.equal(got_h, want_h)
    if norm is not None:
        _same_nvfp4(got_q, want_q)


def test_qkv_epilogue_and_swiglu_real_shape():
    from fastremover.fast import h3_nvfp4 as H
    from fastremover.fast.kernels import h3_fused as K

    g = torch.Generator(device="cuda").manual_seed(1)
    m, d = 1797 * 4, 2048
    q, k, v = ((torch.randn(m, d, device="cuda", generator=g) * 3).bfloat16() for _ in range(3))
    bq, bk, bv = (torch.randn(d, device="cuda", generator=g).bfloat16() for _ in range(3))
    cos, sin = h3.rope_tables(FULL, 7, 16, 16, device="cuda")
    cos, sin = cos.bfloat16().contiguous(), sin.bfloat16().contiguous()
    for a, b in zip(K.qkv_epilogue(q, k, v, bq, bk, bv, cos, sin, heads=32, eps=1e-5),
                    H.qkv_epilogue_reference(q, k, v, bq, bk, bv, cos, sin, 32, 1e-5)):
        assert torch.equal(a, b)
    u = (torch.randn(m, 2 * 8192, device="cuda", generator=g) * 4).bfloat16()
    bias = torch.randn(2 * 8192, device="cuda", generator=g).bfloat16()
    gsf = ref.global_scale_of(u[:, :8192].float() * 2)
    _same_nvfp4(K.swiglu_quantize(u, bias, gsf), H.swiglu_quantize_reference(u, bias, gsf))  # torch.exp on CUDA


@pytest.mark.parametrize("n, k", [(2048, 2048), (16384, 2048), (2048, 8192)])
def test_unit_gemm_equals_w4a16_and_is_row_independent(n, k):
    """The GEMM the H3 blocks run (both operands dequantized to bf16 units, kernels/nvfp4.unit_gemm) gives the W4A16
    GEMM's bits on the same units at the decoder's shapes, and a row's result does not depend on the other rows (1 and
    4 tiles per call: M = 1797 and 7188)."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU (the Triton GEMMs' launch configs are Hopper's)")
    from fastremover.fast.kernels import nvfp4 as K

    g = torch.Generator(device="cuda").manual_seed(n + k)
    xq = K.quantize_nvfp4(torch.randn(7188, k, device="cuda", generator=g))
    wq = K.quantize_nvfp4(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    alpha = ref.alpha_of(xq.global_scale) * ref.alpha_of(wq.global_scale)
    xu, wu = K.unit_weight_nvfp4(xq, torch.bfloat16), K.unit_weight_nvfp4(wq, torch.bfloat16)
    y = K.unit_gemm(xu, wu, alpha)
    assert torch.equal(y, K.w4a16_gemm(xu, wq, alpha=alpha, config=K.GEMM_CONFIGS[0]))
    assert torch.equal(K.unit_gemm(xu[:1797].contiguous(), wu, alpha), y[:1797])
    assert K.unit_gemm_config(7188, n, k) in K.UNIT_GEMM_CONFIGS
    for c in K.UNIT_GEMM_CONFIGS:  # the default above is one of them: each gives its bits
        assert torch.equal(K.unit_gemm(xu, wu, alpha, config=c), y), c
    # rows a TMA descriptor cannot address (row stride k + 4 bf16: 8 bytes past a multiple of 16) take
    # the pointer kernel at the default's tile shape: the same bits
    padded = torch.zeros(7188, k + 4, dtype=torch.bfloat16, device="cuda")
    padded[:, :k] = xu
    assert not K._tma_addressable(padded[:, :k])
    assert torch.equal(K.unit_gemm(padded[:, :k], wu, alpha), y)
    r = (xu.float() @ wu.float().t()) * alpha
    cos = torch.nn.functional.cosine_similarity(y.float().flatten(), r.flatten(), dim=0)
    assert cos > 0.99999, cos


@pytest.fixture(scope="module")
def full_model():
    if not _sm90():
        pytest.skip("needs an sm_90 GPU (the row-independent W4A16 GEMM)")
    return h3.random_decoder(FULL, seed=0, device="cuda")


@pytest.mark.parametrize("tier", ["36L", "8L"])
def test_fused_decode_equals_eager_real_shape(full_model, tier):
    from fastremover.fast import h3_nvfp4 as H

    z = torch.randn(1, 24, 2, 28, 28, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    stack = H.build_nvfp4_stack(full_model, z, tier=tier, freeze=False)
    with torch.no_grad():
        eager1 = full_model.decode(z, blocks=stack, tiles_per_call=1)
        eager4 = full_model.decode(z, blocks=stack, tiles_per_call=4)
        assert torch.equal(eager4, eager1)  # tile batching, eager
        stack.fused = True
        for tiles in (1, 4):
            for graphs in (False, True):
                stack.cuda_graphs = graphs
                before = stack.graph_replays
                out = full_model.decode(z, blocks=stack, tiles_per_call=tiles)
                assert torch.equal(out, eager1), (tiles, graphs)
                assert (stack.graph_replays > before) == graphs
        again = full_model.decode(z, blocks=stack, tiles_per_call=4)  # a replay without extra syncs in between
        assert torch.equal(again, eager1)
        dense = full_model.decode(z, tier=tier)
    mse = ((full_model.to_pixels(eager1) - full_model.to_pixels(dense)) ** 2).mean()
    print(f"{tier}: NVFP4 vs dense {10 * torch.log10(1 / mse).item():.1f} dB")
