"""NVFP4 on the CPU: the format (fastremover.fast.nvfp4) against an independent scalar reference written here and
torchao's NVFP4 quantizer, the Triton kernels (interpreter) bit-equal to the torch reference, the Nvfp4Linear layer
and the DiT replacement with its memory figures. GPU checks (FlashInfer equality, real shapes): test_nvfp4_gpu.py."""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn

from fastremover.errors import FastRemoverError
from fastremover.fast import nvfp4 as n
from fastremover.ops.linear.nvfp4 import (
    Nvfp4Linear,
    nvfp4_memory_estimate,
    quantize_linears_nvfp4,
    resident_bytes,
)
from fastremover.models.loading import PRESETS, random_init_
from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig

NAN, INF = float("nan"), float("inf")
# the interpreter evaluates both sides of tl.where: 1/0 in padding lanes, exp2 overflow in the GELU's far tail
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning")


# ----------------------------------------------------------------------------------------------------------------------
# An independent scalar reference: numpy float32 scalars for every rounding point, nearest-value searches for the two
# small formats (no thresholds, no torch casts)

E4M3_POS = [(code, float(v)) for code, v in enumerate(torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn)
                                                       .float().tolist()) if code != 0x7F]  # finite >= 0


def e4m3_nearest(s: np.float32) -> tuple[int, float]:
    """Round s >= 0 (or NaN/inf) to e4m3 by search: nearest value, ties to the even code; saturating."""
    if math.isnan(s):
        return 0x7F, NAN
    s = min(float(s), 448.0)
    best = min(E4M3_POS, key=lambda cv: (abs(cv[1] - s), cv[0] & 1))
    return best


def e2m1_nearest(y: np.float32) -> int:
    if math.isnan(y):
        return 7
    a = min(abs(float(y)), 6.0)
    idx = min(range(8), key=lambda i: (abs(n.E2M1_GRID[i] - a), i & 1))
    return idx | (8 if math.copysign(1.0, float(y)) < 0 else 0)


def scalar_quantize(x: torch.Tensor, g: float) -> tuple[np.ndarray, np.ndarray]:
    """(codes [M, K], scale codes [M, K/16]) by the docstring's rounding points (1)-(10), reciprocal="exact"."""
    f32 = np.float32
    xs = x.float().numpy()
    m, k = xs.shape
    codes = np.zeros((m, k), np.uint8)
    scales = np.zeros((m, k // 16), np.uint8)
    g32 = f32(g)
    with np.errstate(all="ignore"):
        r6 = f32(1) / f32(6)
        rg = f32(1) / g32
        for i in range(m):
            for b in range(k // 16):
                blk = xs[i, 16 * b: 16 * b + 16]
                finite_or_inf = [abs(v) for v in blk if not math.isnan(v)]
                amax = f32(max(finite_or_inf)) if finite_or_inf else f32(NAN)
                sc, sv = e4m3_nearest(f32(g32 * f32(amax * r6)))
                scales[i, b] = sc
                p = f32(f32(sv) * rg)
                out = f32(f32(1) / p) if amax != 0 else f32(0)
                for j, v in enumerate(blk):
                    codes[i, 16 * b + j] = e2m1_nearest(f32(f32(v) * out))
    return codes, scales


def special_matrix(dtype: torch.dtype, rows: int = 6, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """Random rows plus blocks that exercise every branch: all zero, a NaN, all NaN, +-inf, a tiny block whose scale
    underflows to 0, e2m1 ties at scale 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 2
    x[0, :16] = 0
    x[1, 3] = NAN
    x[2, 16:32] = NAN
    x[3, 5], x[3, 40] = INF, -INF
    x[4, 48:64] = 1e-6 * torch.randn(16, generator=g)
    x[5, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -2.5, -5, 0, -0.0, 0.1, -0.1])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_equals_independent_scalar_reference(dtype):
    x = special_matrix(dtype)
    g = n.global_scale_of(x)
    t = n.quantize_reference(x, g)
    codes, scales = scalar_quantize(x, float(g))
    assert np.array_equal(n.unpack_nibbles(t.packed).numpy(), codes)
    assert np.array_equal(n.linear_scales(t).view(torch.uint8).numpy(), scales)
    # and at global_sf = 448 the tie row sees out_scale ~= 1: its codes are the hand-rounded ones
    t448 = n.quantize_reference(x, torch.tensor([448.0]))
    c448, s448 = scalar_quantize(x, 448.0)
    assert np.array_equal(n.unpack_nibbles(t448.packed).numpy(), c448)
    assert np.array_equal(n.linear_scales(t448).view(torch.uint8).numpy(), s448)


def test_e2m1_rounding_table():
    cases = [(0.0, 0), (0.25, 0), (0.2500001, 1), (0.75, 2), (1.25, 2), (1.2500001, 3), (1.75, 4), (2.5, 4),
             (2.5000002, 5), (3.5, 6), (4.9999995, 6), (5.0, 6), (5.0000005, 7), (6.0, 7), (1e9, 7), (INF, 7),
             (-INF, 15), (-0.0, 8), (-0.1, 8), (-0.75, 10), (-3.0, 13), (NAN, 7)]
    y = torch.tensor([v for v, _ in cases], dtype=torch.float32)
    assert n.e2m1_codes(y).tolist() == [c for _, c in cases]
    codes = torch.arange(16, dtype=torch.uint8)
    vals = n.e2m1_values(codes)
    assert vals.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.equal(n.e2m1_codes(vals), codes)  # -0.0 keeps code 8


def test_e4m3_satfinite():
    s = torch.tensor([0.0, 448.0, 449.0, 464.0, 1e6, INF, NAN, 2.0 ** -10, 2.0 ** -9 * 1.5])
    out = n.e4m3_satfinite(s).float()
    assert out[:6].tolist() == [0.0, 448.0, 448.0, 448.0, 448.0, 448.0]
    assert math.isnan(out[6])
    assert out[7] == 0.0 and out[8] == 2.0 ** -8  # 2^-10 ties to 0 (even), 1.5 * 2^-9 ties up to 2 * 2^-9


def test_pack_low_nibble_first_and_roundtrip():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    assert n.pack_nibbles(codes).tolist() == [[0x21, 0x43, 0x0F]]
    c = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    assert torch.equal(n.unpack_nibbles(n.pack_nibbles(c)), c)


def test_swizzle_hand_built_example_and_zero_padding():
    m, c = 130, 5  # pads to 256 rows x 8 scale columns
    lin = (torch.arange(m * c).reshape(m, c) % 250 + 1).to(torch.uint8)
    sw = n.swizzle_scales(lin)
    assert sw.shape == (256, 8)
    flat = sw.flatten()
    # by hand: offset = (m//128)*Cpad*128 + (c//4)*512 + (m%32)*16 + ((m%128)//32)*4 + c%4
    hand = {(0, 0): 0, (0, 1): 1, (0, 3): 3, (1, 0): 16, (32, 0): 4, (96, 0): 12, (31, 0): 496, (127, 3): 511,
            (0, 4): 512, (33, 4): 532, (128, 0): 1024, (129, 2): 1042}
    for (mi, ci), off in hand.items():
        assert n.swizzled_offset(mi, ci, 8) == off
        assert flat[off] == lin[mi, ci], (mi, ci)
    for mi in range(m):
        for ci in range(c):
            assert flat[n.swizzled_offset(mi, ci, 8)] == lin[mi, ci]
    assert int((flat != 0).sum()) == m * c  # every padding byte (rows 130..255, scale columns 5..7) is zero
    assert torch.equal(n.unswizzle_scales(sw, m, c), lin)
    # e4m3 scales travel through the same permutation
    f8 = lin.view(torch.float8_e4m3fn)
    assert torch.equal(n.swizzle_scales(f8).view(torch.uint8), sw)


def test_roundtrip_error_bounds():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 1, 64)[:, None]
    t = n.quantize_reference(x)
    d = n.dequantize_reference(t)
    sf = n.linear_scales(t).float().repeat_interleave(16, dim=1)
    g = float(t.global_scale)
    # per element: at most half the widest e2m1 spacing (1.0, in [4, 6]) of the block's step sf/g, plus rounding
    assert bool(((d - x).abs() <= sf / g * (1 + 2 ** -6)).all())
    rel = ((d - x).norm() / x.norm()).item()
    assert rel < 0.12  # e2m1's ~1 significant bit: ~9-10 % rms on Gaussian data
    # the largest block of the tensor gets the largest scale: 448 (global_sf = 2688 / amax)
    assert float(n.linear_scales(t).float().max()) == 448.0


def test_special_blocks():
    x = special_matrix(torch.float32)
    t = n.quantize_reference(x)
    codes = n.unpack_nibbles(t.packed)
    sf = n.linear_scales(t).float()
    d = n.dequantize_reference(t)
    assert sf[0, 0] == 0 and bool((codes[0, :16] == 0).all()) and bool((d[0, :16] == 0).all())  # all-zero block
    assert codes[1, 3] == 7  # a NaN element -> +6; its block's other elements are quantized as without it
    x_clean = x[1:2].clone()
    x_clean[0, 3] = 0
    clean = n.unpack_nibbles(n.quantize_reference(x_clean, t.global_scale).packed)[0]
    assert torch.equal(torch.cat([codes[1, :3], codes[1, 4:16]]), torch.cat([clean[:3], clean[4:16]]))
    assert math.isnan(sf[2, 1]) and bool((codes[2, 16:32] == 7).all())  # a block of NaNs: NaN scale
    assert sf[3, 0] == 448 and codes[3, 5] == 7 and codes[3, 40] == 15  # +-inf saturate, their blocks at sf 448
    assert sf[4, 3] == 0 and bool((d[4, 48:64] == 0).all())  # scale underflow: codes saturate, dequantized 0
    assert torch.isfinite(t.global_scale).all()


def test_global_scale_rules():
    assert float(n.global_scale_of(torch.zeros(2, 16))) == 1.0
    x = torch.full((1, 16), 2.0)
    x[0, 0] = INF
    assert float(n.global_scale_of(x)) == 2688.0 / 2.0  # non-finite elements do not set the global scale
    with pytest.raises(ValueError, match="multiple of 16"):
        n.quantize_reference(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="reciprocal"):
        n.quantize_reference(torch.zeros(2, 16), reciprocal="approx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_nvfp4_oracle(dtype):
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor", reason="torchao is not installed")
    x = (torch.randn(128, 256, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    t = n.quantize_reference(x)
    # torchao's per-tensor scale is amax / (448 * 6), the inverse of ours, and it divides where FlashInfer multiplies
    # by reciprocals: equal almost everywhere, never more than one step apart
    ao_scale, ao_packed = nv.nvfp4_quantize(x, per_tensor_scale=nv.per_tensor_amax_to_scale(x.float().abs().max()))
    ours_sf = n.linear_scales(t).view(torch.uint8).int()
    ao_sf = ao_scale.view(torch.uint8).int()
    assert (ours_sf == ao_sf).float().mean() >= 0.999 and int((ours_sf - ao_sf).abs().max()) <= 1
    same_block = (ours_sf == ao_sf).repeat_interleave(16, dim=1)
    ours_c, ao_c = n.unpack_nibbles(t.packed), n.unpack_nibbles(ao_packed.view(torch.uint8))
    agree = (ours_c == ao_c)[same_block]
    assert agree.float().mean() >= 0.99  # measured: 100 % (fp32 input), 99.8 % (bf16)
    mag = lambda c: (c & 7).int()  # noqa: E731
    assert int((mag(ours_c) - mag(ao_c))[same_block].abs().max()) <= 1


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on the CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_quantize_dequantize_bit_equal(dtype):
    from fastremover.fast.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    x = torch.cat([special_matrix(dtype, cols=96, seed=3), torch.randn(124, 96).to(dtype)])  # 130 rows: padding
    g = n.global_scale_of(x)
    a, b = quantize_nvfp4(x, g), n.quantize_reference(x, g)
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))  # padding rows/columns zero too
    padded = n.unswizzle_scales(a.scales, *a.scales.shape).view(torch.uint8)  # [256, 8] in row order
    assert int((padded[130:] != 0).sum()) == 0 and int((padded[:, 6:] != 0).sum()) == 0
    ok = (x.shape[0], 96)
    for out in (torch.float32, torch.float16, torch.bfloat16):
        d1, d2 = dequantize_nvfp4(b, out), n.dequantize_reference(b, out)
        assert d1.shape == ok
        assert torch.equal(d1.float().nan_to_num(123.0), d2.float().nan_to_num(123.0))
        assert torch.equal(d1.isnan(), d2.isnan())


def test_triton_quantize_refusals(raise_value_errors):
    from fastremover.fast.kernels.nvfp4 import quantize_nvfp4

    x = torch.randn(4, 32)
    raise_value_errors([
        (lambda: quantize_nvfp4(x, reciprocal="approx"), "needs the GPU"),
        (lambda: quantize_nvfp4(x, reciprocal="fast"), "reciprocal must be"),
        (lambda: quantize_nvfp4(torch.randn(4, 40)), "multiple of 16"),
        (lambda: quantize_nvfp4(torch.randn(32)), "2-D"),
        (lambda: quantize_nvfp4(torch.randn(32, 4).t()), "contiguous rows"),
        (lambda: quantize_nvfp4(x, torch.tensor([1.0], dtype=torch.float64)), "fp32"),
    ])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_w4a16_gemm(dtype):
    from fastremover.fast.kernels.nvfp4 import w4a16_gemm

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 80, generator=gen)  # N = 40, K = 80: tails in M, N, K at the interpreter's 16 x 32 x 32 tiles
    t = n.quantize_reference(w)
    # exact data: quarter-integer activations, so every product and partial sum is exact in fp32 and any summation
    # order gives the same bits - the equality then checks the load path (unpacking, decoding, scale indexing)
    x = (torch.randint(-8, 9, (20, 80), generator=gen).float() / 4).to(dtype)
    bias = (torch.randint(-8, 9, (40,), generator=gen).float() / 8).to(dtype)
    exact64 = (x.double() @ n.unit_weight(t).double().t())
    assert torch.equal(exact64, (x.float() @ n.unit_weight(t).t()).double())  # the precondition holds
    y = w4a16_gemm(x, t, bias)
    assert torch.equal(y, n.w4a16_linear_reference(x, t, bias))
    # the swapped form (C^T = W X^T, the weight tile as the MMA's first operand) gives the same bits
    assert torch.equal(w4a16_gemm(x, t, bias, config=(32, 16, 32, 2, 1, 4, True)), y)
    # random data: the accumulation order differs from torch's, so a tolerance; GELU epilogue (sigmoid form)
    xr = torch.randn(20, 80, generator=gen).to(dtype)
    for gelu in (False, True):
        y = w4a16_gemm(xr, t, bias, gelu=gelu).float()
        r = n.w4a16_linear_reference(xr, t, bias, gelu=gelu).float()
        ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
        assert bool(((y - r).abs() <= ulp * (1 + r.abs())).all())
    y_none = w4a16_gemm(x, t)
    assert torch.equal(y_none, n.w4a16_linear_reference(x, t))


def test_triton_unit_gemm():
    """The unit GEMM (both operands already exact bf16 units, as the H3 blocks run it): on exact data the reference
    product bit for bit, and the W4A16 GEMM's result on the same units (the same K loop, the weight read instead of
    decoded); its errors are one line each."""
    from fastremover.fast.kernels.nvfp4 import unit_gemm, unit_weight_nvfp4, w4a16_gemm

    gen = torch.Generator().manual_seed(8)
    wq = n.quantize_reference(torch.randn(40, 80, generator=gen))
    xq = n.quantize_reference((torch.randint(-8, 9, (20, 80), generator=gen).float() / 4))
    xu, wu = unit_weight_nvfp4(xq, torch.bfloat16), unit_weight_nvfp4(wq, torch.bfloat16)
    alpha = n.alpha_of(xq.global_scale) * n.alpha_of(wq.global_scale)
    exact = (xu.double() @ wu.double().t())
    assert torch.equal(exact, (xu.float() @ wu.float().t()).double())  # every partial sum exact in fp32
    y = unit_gemm(xu, wu, alpha)
    assert y.dtype == torch.bfloat16 and y.shape == (20, 40)
    assert torch.equal(y, (exact.float() * alpha).bfloat16())
    assert torch.equal(y, w4a16_gemm(xu, wq, alpha=alpha))
    # the persistent TMA kernel (grid of 4 programs here: each loops over several of the 3 x 2 tiles; rows and
    # columns past the matrix come in as zeros) and the pointer kernel at the same tile shape give the same bits
    import fastremover.fast.kernels.nvfp4 as K

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "_unit_gemm_kernel", None)  # the TMA config must not fall back to the pointer kernel here
        assert torch.equal(unit_gemm(xu, wu, alpha, config=(16, 16, 32, 2, 1, 4, True)), y)
    assert torch.equal(unit_gemm(xu, wu, alpha, config=(16, 16, 32, 2, 1, 4, False)), y)
    assert torch.equal(unit_gemm(xu, wu, alpha, out_dtype=torch.float32), exact.float() * alpha)
    assert unit_gemm(xu[:0], wu, alpha).shape == (0, 40)
    for call, msg in [
        (lambda: unit_gemm(xu.float(), wu, alpha), "bf16"),
        (lambda: unit_gemm(xu, wu[:, :64], alpha), "columns"),
        (lambda: unit_gemm(xu, wu, torch.ones(2)), "one-element fp32"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call()


def test_triton_unit_weight_is_exact():
    from fastremover.fast.kernels.nvfp4 import unit_multiplier, unit_weight_nvfp4

    t = n.quantize_reference(special_matrix(torch.float32, cols=96, seed=6).nan_to_num(0.0, 1e4, -1e4))
    exact = n.unit_weight(t)
    w16 = unit_weight_nvfp4(t, torch.float16)
    assert torch.equal(w16.float(), exact * 2.0 ** -7)  # no rounding: the fp16 values are the exact products
    assert torch.equal(unit_weight_nvfp4(t, torch.bfloat16).float(), exact)
    alpha = float(n.alpha_of(t.global_scale))
    assert unit_multiplier(t.global_scale, torch.float16) == alpha * 128
    assert unit_multiplier(t.global_scale, torch.bfloat16) == alpha


# ----------------------------------------------------------------------------------------------------------------------
# Nvfp4Linear and the DiT replacement


def tiny_transformer(dtype=torch.float32, **over) -> RemoverTransformer:
    cfg = dict(PRESETS["tiny"]["transformer"])
    cfg.pop("_class_name")
    cfg.update(over)
    model = RemoverTransformer(RemoverTransformerConfig.from_dict(cfg))
    return random_init_(model, seed=0).to_inference_dtype(dtype).eval()


def test_nvfp4_linear_modes():
    lin = nn.Linear(32, 24)
    layer = Nvfp4Linear(lin)
    assert not any(p.requires_grad for p in layer.parameters()) and len(list(layer.parameters())) == 0
    x = torch.randn(2, 5, 32)
    t = n.quantize_reference(lin.weight.detach())
    y = layer(x)
    assert y.shape == (2, 5, 24)
    assert torch.equal(y.reshape(10, 24), n.w4a16_linear_reference(x.reshape(10, 32), t, lin.bias.detach()))
    rel = ((y - lin(x)).norm() / lin(x).norm()).item()
    assert 0 < rel < 0.15
    w4a4 = Nvfp4Linear(lin, mode="w4a4")
    y4 = w4a4(x)
    xq = n.fake_quantize(x.reshape(10, 32))
    assert torch.equal(y4.reshape(10, 24), n.w4a16_linear_reference(xq, t, lin.bias.detach()))
    assert not torch.equal(y4, y)
    with pytest.raises(ValueError, match="in_features"):
        Nvfp4Linear(nn.Linear(24, 8))
    with pytest.raises(ValueError, match="gemm must be"):
        Nvfp4Linear(lin, gemm="cutlass")


@pytest.mark.parametrize("gemm", ["dequant", "triton"])
def test_nvfp4_linear_gpu_branches_under_the_interpreter(monkeypatch, gemm):
    """The sm_90 branches of Nvfp4Linear.forward, run on the CPU: the interpreter executes the same Triton kernels,
    torch.addmm stands in for cuBLAS."""
    import fastremover.ops.linear.nvfp4 as nl

    monkeypatch.setattr(nl, "_on_triton_gpu", lambda t: True)
    lin = nn.Linear(32, 24).half()
    layer = Nvfp4Linear(lin, gemm=gemm)
    assert layer.gemm == gemm and (layer.multipliers != {}) == (gemm == "dequant")
    x = (torch.randint(-8, 9, (2, 3, 32)).float() / 4).half()
    y = layer(x)
    r = n.w4a16_linear_reference(x.reshape(6, 32), layer.weight_nvfp4(), layer.bias).reshape(2, 3, 24)
    if gemm == "triton":
        assert torch.equal(y, r)  # exact data: bit-equal
    else:  # cuBLAS-style fp16 GEMM: the weight is exact, the fp16 products/sums round differently
        assert (y.float() - r.float()).abs().max() <= 2 ** -9 * (1 + r.float().abs().max())


def test_quantize_linears_replaces_block_linears_drops_masters_and_reports_memory():
    model = tiny_transformer(torch.float16)
    master = weakref.ref(model.blocks[0].attn1.to_q.weight)
    est = nvfp4_memory_estimate(model.config)
    assert resident_bytes(model) == est["dense_total_bytes"]
    report = quantize_linears_nvfp4(model)
    gc.collect()
    assert master() is None  # the dense master is gone
    blk = model.blocks[0]
    replaced = [blk.attn1.to_q, blk.attn1.to_k, blk.attn1.to_v, blk.attn1.to_out[0], blk.ffn.net[0].proj,
                blk.ffn.net[2]]
    assert all(isinstance(m, Nvfp4Linear) for m in replaced) and report.layers == 6
    assert isinstance(model.proj_out, nn.Linear) and isinstance(model.condition_embedder.time_proj, nn.Linear)
    assert isinstance(model.patch_embedding, nn.Conv3d)
    assert report.model_bytes_before == est["dense_total_bytes"]
    assert report.model_bytes_after == est["nvfp4_total_bytes"] == resident_bytes(model)
    assert report.linear_bytes_before - report.linear_bytes_after == est["saved_bytes"] > 0
    # the forward (fp32 on the CPU: fp16 convolutions are not implemented there)
    model, dense = tiny_transformer(), tiny_transformer()
    quantize_linears_nvfp4(model)
    calls = []
    for m in model.modules():
        if isinstance(m, Nvfp4Linear):
            m.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(1, 48, 2, 8, 8, generator=torch.Generator().manual_seed(5))
    ts = torch.tensor([700.0])
    with torch.no_grad():
        y, y_dense = model(x, ts), dense(x, ts)
    assert len(calls) == 6  # the NVFP4 layers ran
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), y_dense.flatten().double(), dim=0)
    assert not torch.equal(y, y_dense) and cos > 0.99
    with pytest.raises(ValueError, match="called twice"):
        quantize_linears_nvfp4(model)


def test_quantize_linears_user_errors():
    with pytest.raises(FastRemoverError, match="multiple of 16"):
        quantize_linears_nvfp4(tiny_transformer(attention_head_dim=12))  # dim 24
    model = tiny_transformer()
    with torch.no_grad():
        model.blocks[0].ffn.net[2].weight[0, 0] = NAN
    with pytest.raises(FastRemoverError, match="NaN or inf"):
        quantize_linears_nvfp4(model)
    assert isinstance(model.blocks[0].attn1.to_q, nn.Linear)  # refused before anything was replaced


def test_w4a4_refused_on_full_frames_unless_forced():
    """The engine plan's per-window rule (fastremover/engine/build.py Plan.check_window)."""
    from fastremover.config import EngineConfig, LinearOptions
    from fastremover.engine.build import resolve

    plan = resolve(EngineConfig(device="cpu", linears=LinearOptions(weights="nvfp4-w4a4")))
    assert plan.linear_method == "nvfp4-w4a4"
    with pytest.raises(FastRemoverError, match="--crop on"):
        plan.check_window(full_frame=True)
    plan.check_window(full_frame=False)
    forced = resolve(EngineConfig(device="cpu", linears=LinearOptions(weights="nvfp4-w4a4", force_w4a4=True)))
    forced.check_window(full_frame=True)
    resolve(EngineConfig(device="cpu", linears=LinearOptions(weights="nvfp4"))).check_window(full_frame=True)


def test_memory_estimate_at_released_config():
    est = nvfp4_memory_estimate(RemoverTransformerConfig())
    # 30 blocks x (4 x 1536^2 + 2 x 1536 x 8960) weights: 2 bytes dense, 0.5 + 1/16 packed (no padding: 1536 and 8960
    # rows are multiples of 128, 96 and 560 scale columns multiples of 4)
    weights = 30 * (4 * 1536 * 1536 + 2 * 1536 * 8960)
    biases = 30 * (5 * 1536 + 8960)
    assert est["dense_linear_bytes"] == 2 * weights + 2 * biases
    assert est["nvfp4_linear_bytes"] == weights // 2 + weights // 16 + 2 * biases + 30 * 6 * 8
    assert 3.5 < est["linear_ratio"] < 3.6
