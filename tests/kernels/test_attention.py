"""Attention backends (fastremover/ops/attention/, ops/attention/cudnn_fp8.py): the 8-bit path against fp16 SDPA.

CPU: the q/k/v quantizer against its eager reference (Triton interpreter) and K smoothing's exactness under softmax.
GPU (H200): cuDNN FP8 SDPA at the W2 shape (S = 32760, 12 heads x 128), cosine vs fp16 SDPA >= 0.998 on inputs with a
shared per-channel K offset (what smoothing is for), output really 8-bit (not equal to fp16), CUDA-graph capturable.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def qkv_views(s, heads=2, dim=64, k_bias=2.0, seed=0, dtype=torch.float32, device=DEV, v_bias=0.0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, s, 3, heads, dim, generator=g)
    qkv[:, :, 1] += k_bias * torch.randn(heads, dim, generator=g)
    if v_bias:
        qkv[:, :, 2] += v_bias * torch.randn(heads, dim, generator=g)
    return qkv.to(device, dtype).unbind(2)


def test_quantize_qkv_matches_reference_and_reads_strided_views():
    from fastremover.ops.attention.quantize import quantize_qkv, quantize_qkv_reference

    q, k, v = qkv_views(40)
    got = quantize_qkv(q, k, v)
    ref = quantize_qkv_reference(q.contiguous(), k.contiguous(), v.contiguous())
    for a, b in zip(got, ref):
        a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a, b)
        assert torch.equal(a, b)


def test_k_smoothing_is_exact_under_softmax_and_shrinks_the_k_range():
    q, k, v = (t.double() for t in qkv_views(50, k_bias=4.0))
    smoothed = k - k.mean(dim=1, keepdim=True)
    attn = lambda kk: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, kk, v)))  # noqa: E731
    assert torch.allclose(attn(k), attn(smoothed), rtol=0, atol=1e-12)
    assert smoothed.abs().max() < 0.5 * k.abs().max()


def test_quantize_qkv_smooth_v_centres_v_and_returns_its_mean():
    from fastremover.ops.attention.quantize import quantize_qkv
    from fastremover.fast.kernels.quant import quant_fp8_tensorwise_reference

    from fastremover.ops.attention.quantize import quantize_qkv_reference

    q, k, v = qkv_views(40, v_bias=3.0, seed=4)
    plain = quantize_qkv(q, k, v)
    *got, v_mean = quantize_qkv(q, k, v, smooth_v=True)
    assert torch.equal(v_mean, v.reshape(1, 40, -1).mean(dim=1, dtype=torch.float32))
    v8, sv = quant_fp8_tensorwise_reference(v.reshape(40, -1), v_mean, 40)
    assert torch.equal(got[2].view(torch.uint8).flatten(), v8.view(torch.uint8).flatten())
    assert torch.equal(got[5], sv) and sv < plain[5]  # centring shrank V's range
    ref = quantize_qkv_reference(q.contiguous(), k.contiguous(), v.contiguous(), smooth_v=True)
    for a, b in zip((*got, v_mean), ref):  # the whole tuple against the eager reference
        a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a, b)
        assert torch.equal(a, b)
    for a, b in zip(got[:2] + got[3:5], plain[:2] + plain[3:5]):  # q, k and their scales are untouched
        a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a, b)
        assert torch.equal(a, b)


def test_v_centring_is_exact_under_softmax():
    q, k, v = (t.double() for t in qkv_views(50, v_bias=4.0, seed=6))
    m = v.mean(dim=1, keepdim=True)
    attn = lambda vv: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, vv))).transpose(1, 2)  # noqa: E731
    assert torch.allclose(attn(v), attn(v - m) + m, rtol=0, atol=1e-12)


def test_add_v_mean_puts_the_centred_v_mean_back():
    """The 8-bit backends' stand-alone form with smooth_v (cudnn-fp8's default): attention on the centred codes, then
    add_v_mean: on V with a large shared offset the mean comes back (the output is not centred), and centring does
    not cost fidelity (the codes' attention is done in fp32 here, so it cannot gain much)."""
    from fastremover.ops.attention.quantize import add_v_mean, quantize_qkv
    from fastremover.ops.attention.sdpa import sdpa

    def on_codes(q8, k8, v8, sq, sk, sv, *v_mean):
        deq = [c.float() * s for c, s in ((q8, sq), (k8, sk), (v8, sv))]
        return add_v_mean(sdpa(*deq), v_mean[0] if v_mean else None)

    q, k, v = qkv_views(70, v_bias=5.0, seed=8)
    ref = sdpa(q, k, v)
    centred, plain = on_codes(*quantize_qkv(q, k, v, smooth_v=True)), on_codes(*quantize_qkv(q, k, v))
    assert centred.shape == ref.shape and centred.dtype == ref.dtype
    assert cos(centred, ref) >= 0.9995 and cos(centred, ref) >= cos(plain, ref) - 1e-4
    resid = lambda o: float((o - ref).norm() / (ref - v.mean(dim=1, keepdim=True)).norm())  # noqa: E731
    assert resid(centred) < 0.1, resid(centred)


@pytest.mark.gpu
def test_gpu_cudnn_fp8_v_centring_recovers_fidelity_with_a_v_offset():
    """cuDNN's FP8 P @ V loses precision over 32760 keys when V has a shared offset (Hopper's FP8 MMA accumulator;
    H200: cos 0.9964 at offset 1); centring V (the backend's default) restores it (1.00000)."""
    from fastremover.ops.attention.cudnn_fp8 import fp8_cudnn
    from fastremover.ops.attention.sdpa import sdpa

    q, k, v = qkv_views(32760, heads=12, dim=128, k_bias=1.0, v_bias=1.0, seed=9, dtype=torch.float16)
    ref = sdpa(q, k, v)
    c_centred, c_plain = cos(fp8_cudnn(q, k, v), ref), cos(fp8_cudnn(q, k, v, smooth_v=False), ref)
    print(f"cuDNN fp8 attention, V offset 1: cos {c_centred:.6f} (centred V), {c_plain:.6f} (plain)")
    assert c_centred >= 0.9995 and 1 - c_centred <= 0.5 * (1 - c_plain)


@pytest.mark.gpu
def test_gpu_cudnn_fp8_attention_cosine_at_w2_shape():
    from fastremover.ops.attention import unavailable_reason
    from fastremover.ops.attention.cudnn_fp8 import fp8_cudnn
    from fastremover.ops.attention.sdpa import sdpa

    why = unavailable_reason("fp8", torch.device("cuda"))
    assert why is None, why
    for k_bias in (0.0, 1.0):
        q, k, v = qkv_views(32760, heads=12, dim=128, k_bias=k_bias, seed=3, dtype=torch.float16)
        ref = sdpa(q, k, v)
        got = fp8_cudnn(q, k, v)
        plain = fp8_cudnn(q, k, v, smooth_k=False)
        c, c_plain = cos(got, ref), cos(plain, ref)
        print(f"cuDNN fp8 attention, K offset {k_bias}: cos {c:.5f} (smoothed K), {c_plain:.5f} (plain)")
        assert c >= 0.998 and not torch.equal(got, ref)
        assert got.dtype == torch.float16 and got.shape == ref.shape


@pytest.mark.gpu
def test_gpu_cudnn_fp8_attention_in_a_cuda_graph(graph_replays_new_inputs):
    from fastremover.ops.attention.cudnn_fp8 import fp8_cudnn

    q, k, v = qkv_views(1000, heads=4, dim=128, seed=5, dtype=torch.float16)
    out = graph_replays_new_inputs(fp8_cudnn, q, k, v)
    assert math.isclose(cos(out, fp8_cudnn(q, k, v)), 1.0, abs_tol=1e-6)
