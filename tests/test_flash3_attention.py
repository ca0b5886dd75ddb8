"""FlashAttention-3's FP8 forward kernel as the `fp8-flash3` attention backend (fastremover/fast/flash3_attention.py).

CPU: refused off the GPU, and without the built module the reason says how to build it. GPU (H200 with
bench/build_flash3.sh's output on PYTHONPATH, gpu_session.sh phase `flash3`): cosine >= 0.998 vs fp16 SDPA at the W2
shape with K and V offsets, really 8-bit, and CUDA-graph capturable with the replay reading new inputs.
"""

import pytest
import torch

from fastremover.errors import FastRemoverError


def cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def test_refused_off_the_gpu_and_says_how_to_build(monkeypatch):
    from fastremover.fast import flash3_attention as f3
    from fastremover.fast.attention import get_backend

    with pytest.raises(FastRemoverError, match="fp8-flash3"):
        get_backend("fp8-flash3", torch.device("cpu"))
    monkeypatch.setattr(f3, "import_error", lambda: "ModuleNotFoundError: No module named 'flash_attn_interface'")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    why = f3.unavailable_reason(torch.device("cuda", 0))
    assert "bench/build_flash3.sh" in why and "No module named" in why


def _qkv(s, heads=12, dim=128, k_bias=1.0, v_bias=0.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(1, s, 3, heads, dim, device="cuda", generator=g, dtype=torch.float16)
    qkv[:, :, 1] += (k_bias * torch.randn(heads, dim, device="cuda", generator=g)).half()
    qkv[:, :, 2] += (v_bias * torch.randn(heads, dim, device="cuda", generator=g)).half()
    return qkv.unbind(2)


def _needs():
    from fastremover.fast.attention import unavailable_reason

    why = unavailable_reason("fp8-flash3", torch.device("cuda"))
    if why is not None:
        pytest.skip(f"fp8-flash3 cannot run here: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("k_bias,v_bias", [(1.0, 0.0), (1.0, 1.0)])
def test_gpu_fp8_flash3_cosine_at_w2_shape(k_bias, v_bias):
    _needs()
    from fastremover.fast.attention import fp8_flash3, sdpa

    q, k, v = _qkv(32760, k_bias=k_bias, v_bias=v_bias, seed=21)
    ref, got = sdpa(q, k, v), fp8_flash3(q, k, v)
    c = cos(got, ref)
    print(f"fp8-flash3, K offset {k_bias}, V offset {v_bias}: cos {c:.6f}")
    assert got.dtype == torch.float16 and got.shape == ref.shape
    assert c >= 0.998 and not torch.equal(got, ref)


@pytest.mark.gpu
def test_gpu_fp8_flash3_in_a_cuda_graph():
    _needs()
    from fastremover.fast.attention import fp8_flash3

    q, k, v = _qkv(1000, heads=4, seed=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = fp8_flash3(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_flash3(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    q.mul_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, first) and torch.equal(out, fp8_flash3(q, k, v))
