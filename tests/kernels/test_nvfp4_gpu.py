"""NVFP4 on the GPU (run with `pytest -m gpu` on the device machine): the Triton quantizer bit-equal to the torch
reference at the DiT's and the H3 decoder's shapes, FlashInfer's fp4_quantize as the oracle of reciprocal="approx"
(Blackwell only: see test_flashinfer_equality), the W4A16 GEMM against the fp32 reference and cuBLAS, Nvfp4Linear's
GPU path. Speed: tools/bench_nvfp4.py."""

from __future__ import annotations

import pytest
import torch

from fastremover.fast import nvfp4 as n

pytestmark = pytest.mark.gpu

# (rows, K): the DiT's token counts at W1 / W2 against its two reduction widths; the H3 ViT decoder's (32 heads x 64
# = 2048 hidden, SwiGLU ffn 4 x 2048 = 8192) at one 4096-token tile batch
DIT_SHAPES = [(7290, 1536), (7290, 8960), (32760, 1536), (32760, 8960)]
H3_SHAPES = [(4096, 2048), (4096, 8192)]
# (M, N, K) of the block GEMMs: qkv / O (N = K = 1536), FF1 (1536 -> 8960), FF2 (8960 -> 1536)
GEMM_SHAPES = [(m, nn, k) for m in (7290, 32760) for nn, k in ((1536, 1536), (8960, 1536), (1536, 8960))]


def _cuda_x(rows: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # a heavy-tailed spread of row magnitudes, so block scales use much of e4m3's range
    scale = torch.exp(torch.randn(rows, 1, device="cuda", generator=g) * 2)
    return (torch.randn(rows, k, device="cuda", generator=g) * scale).to(dtype)


def _quantize(x, g, reciprocal):
    from fastremover.fast.kernels.nvfp4 import quantize_nvfp4

    return quantize_nvfp4(x, g, reciprocal=reciprocal)


@pytest.mark.parametrize("rows,k", DIT_SHAPES + H3_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_quantize_exact_equals_reference(rows, k, dtype):
    x = _cuda_x(rows, k, dtype)
    g = n.global_scale_of(x)
    a = _quantize(x, g, "exact")
    b = n.quantize_reference(x, g)  # torch on the GPU: IEEE products and reciprocals
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    if rows == 7290 and k == 1536:  # and the CPU reference, for device independence
        c = n.quantize_reference(x.cpu(), g.cpu())
        assert torch.equal(a.packed.cpu(), c.packed)
        assert torch.equal(a.scales.view(torch.uint8).cpu(), c.scales.view(torch.uint8))


@pytest.mark.parametrize("rows,k", [(7290, 1536), (4096, 8192)])
def test_approx_reciprocal_differs_from_exact_only_at_roundings(rows, k):
    x = _cuda_x(rows, k, torch.bfloat16, seed=1)
    g = n.global_scale_of(x)
    a, e = _quantize(x, g, "approx"), _quantize(x, g, "exact")
    assert torch.equal(a.scales.view(torch.uint8), e.scales.view(torch.uint8))  # (2)-(5) round the same here
    ca, ce = n.unpack_nibbles(a.packed), n.unpack_nibbles(e.packed)
    agree = (ca == ce).float().mean().item()
    print(f"approx vs exact reciprocal: {100 * agree:.4f} % of codes equal at {rows} x {k}")
    assert agree > 0.999 and int(((ca & 7).int() - (ce & 7).int()).abs().max()) <= 1


@pytest.mark.parametrize("rows,k", DIT_SHAPES + H3_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_equality(rows, k, dtype):
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer is not installed on this machine")
    if torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("FlashInfer's fp4 quantize kernel body is compiled only for __CUDA_ARCH__ >= 1000 "
                    "(quantization.cuh): there is no FlashInfer NVFP4 oracle on this GPU")
    x = _cuda_x(rows, k, dtype, seed=2)
    g = n.global_scale_of(x)
    q, sf = flashinfer.fp4_quantize(x, g, 16, False, True)
    ours = _quantize(x, g, "approx")
    assert torch.equal(q.view(torch.uint8).reshape(ours.packed.shape), ours.packed)
    assert torch.equal(sf.view(torch.uint8).flatten(), ours.scales.view(torch.uint8).flatten())


@pytest.mark.parametrize("m,nn,k", GEMM_SHAPES)
def test_w4a16_gemm_against_reference_and_cublas(m, nn, k):
    from fastremover.fast.kernels.nvfp4 import w4a16_gemm

    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(nn, k, device="cuda", generator=g) * 0.02
    t = n.quantize_reference(w)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float16)
    bias = torch.randn(nn, device="cuda", generator=g, dtype=torch.float16) * 0.1
    y = w4a16_gemm(x, t, bias).float()
    r = n.w4a16_linear_reference(x, t, bias).float()
    cublas = torch.nn.functional.linear(x, n.dequantize_reference(t, torch.float16), bias).float()
    scale = r.abs().max().item()
    assert (y - r).abs().max().item() <= 2e-3 * scale
    assert (y - cublas).abs().max().item() <= 2e-3 * scale


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nvfp4_linear_gpu_paths_on_sm90(dtype):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the W4A16 GPU paths are gated to sm_90")
    from fastremover.fast.kernels.nvfp4 import w4a16_gemm
    from fastremover.ops.linear.nvfp4 import Nvfp4Linear

    lin = torch.nn.Linear(1536, 8960).cuda().to(dtype)
    fused, dequant = Nvfp4Linear(lin, gemm="triton"), Nvfp4Linear(lin)
    assert dequant.gemm == "dequant"
    assert torch.equal(fused.packed, n.quantize_reference(lin.weight.detach()).packed)  # the Triton quantizer's
    x = torch.randn(3, 1000, 1536, device="cuda", dtype=dtype)
    y = fused(x)
    assert torch.equal(y.reshape(3000, 8960), w4a16_gemm(x.reshape(3000, 1536), fused.weight_nvfp4(), fused.bias))
    r = n.w4a16_linear_reference(x.reshape(3000, 1536), fused.weight_nvfp4(), fused.bias).float()
    yd = dequant(x).reshape(3000, 8960).float()
    tol = (2e-3 if dtype == torch.float16 else 1e-2) * r.abs().max().item()
    assert (yd - r).abs().max().item() <= tol and (y.reshape(3000, 8960).float() - r).abs().max().item() <= tol
