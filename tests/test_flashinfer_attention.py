"""FlashInfer's FA3 attention backends (fastremover/fast/flashinfer_attention.py): `fa3` (fp16) and `fp8-fa3`.

CPU: both are refused off the GPU with a clear error (never a silent fp16 SDPA run); the availability check names the
missing piece (package, or a compiler / prebuilt modules). GPU (H200, with flashinfer-python installed as
bench/gpu_session.sh's `flashinfer` phase does): at the W2 shape (S = 32760, 12 heads x 128) fa3 agrees with fp16
SDPA to fp16 rounding (not bit-equal: another kernel's reduction order), fp8-fa3 has cosine >= 0.998 and is really
8-bit; batch > 1 equals per-item calls; both capture into a CUDA graph whose replay reads new inputs.
"""

import pytest
import torch

from fastremover.errors import FastRemoverError


def cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def qkv_views(s, heads=12, dim=128, k_bias=1.0, v_bias=0.0, seed=0, batch=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, s, 3, heads, dim, device="cuda", generator=g, dtype=torch.float16)
    qkv[:, :, 1] += (k_bias * torch.randn(heads, dim, device="cuda", generator=g)).half()
    qkv[:, :, 2] += (v_bias * torch.randn(heads, dim, device="cuda", generator=g)).half()
    return qkv.unbind(2)  # strided views, as the fused QKV projection produces them


@pytest.mark.parametrize("name", ["fa3", "fp8-fa3"])
def test_refused_off_the_gpu_with_a_clear_error(name):
    from fastremover.fast.attention import get_backend, unavailable_reason
    from fastremover.fast.engine import resolve_attention

    cpu = torch.device("cpu")
    why = unavailable_reason(name, cpu)
    assert why is not None and "CUDA GPU" in why
    with pytest.raises(FastRemoverError, match=name):
        get_backend(name, cpu)
    with pytest.raises(FastRemoverError, match=name):
        resolve_attention(name, "exact", cpu)
    assert resolve_attention("auto", "exact", cpu) == ("sdpa", [])  # auto never picks it where it cannot run


def test_availability_names_the_missing_package(monkeypatch):
    """On a GPU without flashinfer the reason says what to install (import error faked: no GPU needed)."""
    from fastremover.fast import flashinfer_attention as fi

    monkeypatch.setattr(fi, "import_error", lambda: "ModuleNotFoundError: No module named 'flashinfer'")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    why = fi.unavailable_reason(torch.device("cuda", 0))
    assert "pip install flashinfer-python" in why and "No module named" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "Hopper" in fi.unavailable_reason(torch.device("cuda", 0))


def _needs(name):
    from fastremover.fast.attention import unavailable_reason

    why = unavailable_reason(name, torch.device("cuda"))
    if why is not None:
        pytest.skip(f"attention backend {name} cannot run here: {why}")


@pytest.mark.gpu
def test_gpu_fa3_fp16_matches_sdpa_at_w2_shape():
    _needs("fa3")
    from fastremover.fast.attention import fa3, sdpa

    q, k, v = qkv_views(32760, seed=11)
    ref, got = sdpa(q, k, v), fa3(q, k, v)
    err = float((got.float() - ref.float()).abs().max())
    c = cos(got, ref)
    print(f"fa3 fp16 vs SDPA at S = 32760: cos {c:.8f}, max|diff| {err:.2e}")
    assert got.dtype == torch.float16 and got.shape == ref.shape
    assert c >= 0.99999 and err < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("k_bias,v_bias", [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0)])
def test_gpu_fp8_fa3_cosine_at_w2_shape(k_bias, v_bias):
    _needs("fp8-fa3")
    from fastremover.fast.attention import fp8_fa3, sdpa

    q, k, v = qkv_views(32760, k_bias=k_bias, v_bias=v_bias, seed=13)
    ref = sdpa(q, k, v)
    got = fp8_fa3(q, k, v)
    c = cos(got, ref)
    print(f"fp8-fa3, K offset {k_bias}, V offset {v_bias}: cos {c:.6f}")
    assert got.dtype == torch.float16 and got.shape == ref.shape
    assert c >= 0.998
    assert not torch.equal(got, ref)  # the 8-bit kernel ran


@pytest.mark.gpu
def test_gpu_batch_of_two_equals_per_item_calls():
    """B > 1 runs one kernel call per item: bit-equal to calling each item alone on the same inputs (for fp8-fa3 the
    same codes and scales: a separate quantization of one item would pick other per-tensor scales)."""
    _needs("fa3")
    _needs("fp8-fa3")
    from fastremover.fast.attention import fa3, fp8_fa3, quantize_qkv, sdpa
    from fastremover.fast.flashinfer_attention import fa3_fp8_codes

    q, k, v = qkv_views(2000, heads=4, seed=17, batch=2)
    both = fa3(q, k, v)
    q8, k8, v8, sq, sk, sv = quantize_qkv(q, k, v)
    both8 = fa3_fp8_codes(q8, k8, v8, sq, sk, sv)
    full = fp8_fa3(q, k, v)
    for i in range(2):
        item = slice(i, i + 1)
        assert torch.equal(both[item], fa3(q[item], k[item], v[item]))
        assert torch.equal(both8[item], fa3_fp8_codes(q8[item], k8[item], v8[item], sq, sk, sv))
        assert cos(full[i], sdpa(q[item], k[item], v[item])[0]) >= 0.998


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fa3", "fp8-fa3"])
def test_gpu_in_a_cuda_graph(name):
    _needs(name)
    from fastremover.fast.attention import BACKENDS

    fn = BACKENDS[name]
    q, k, v = qkv_views(1000, heads=4, seed=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = fn(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    q.mul_(-1)  # new inputs in the same buffers: the replay must see them
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, first)
    assert torch.equal(out, fn(q, k, v))
