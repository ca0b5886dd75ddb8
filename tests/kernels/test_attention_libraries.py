"""Attention backends on optional libraries' kernels: FlashInfer's FA3 (`fa3` fp16, `fp8-fa3`;
fastremover/ops/attention/flashinfer_fa3.py) and FlashAttention-3's own FP8 kernel (`fp8-flash3`;
fastremover/ops/attention/flashattn3_fp8.py).

CPU: each is refused off the GPU with a clear error (never a silent fp16 SDPA run); the availability check names the
missing piece (package or build script, Hopper). GPU (H200, with flashinfer-python installed and FlashAttention-3
built as tools/gpu_session.sh's `flashinfer` / `flash3` phases do): at the W2 shape (S = 32760, 12 heads x 128) fa3
agrees with fp16 SDPA to fp16 rounding (not bit-equal: another kernel's reduction order), the FP8 backends have cosine
>= 0.998 and are really 8-bit; batch > 1 equals per-item calls; each captures into a CUDA graph whose replay reads new
inputs.
"""

import pytest
import torch

from fastremover.errors import FastRemoverError

LIBRARY_BACKENDS = ["fa3", "fp8-fa3", "fp8-flash3"]


def cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def qkv_views(s, heads=12, dim=128, k_bias=1.0, v_bias=0.0, seed=0, batch=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, s, 3, heads, dim, device="cuda", generator=g, dtype=torch.float16)
    qkv[:, :, 1] += (k_bias * torch.randn(heads, dim, device="cuda", generator=g)).half()
    qkv[:, :, 2] += (v_bias * torch.randn(heads, dim, device="cuda", generator=g)).half()
    return qkv.unbind(2)  # strided views, as the fused QKV projection produces them


@pytest.mark.parametrize("name", LIBRARY_BACKENDS)
def test_refused_off_the_gpu_with_a_clear_error(name):
    from fastremover.engine.build import resolve_attention
    from fastremover.ops.attention import runnable as get_backend
    from fastremover.ops.attention import unavailable_reason

    cpu = torch.device("cpu")
    why = unavailable_reason(name, cpu)
    assert why is not None and "CUDA GPU" in why
    with pytest.raises(FastRemoverError, match=name):
        get_backend(name, cpu)
    with pytest.raises(FastRemoverError, match=name):
        resolve_attention(name, "exact", cpu)
    assert resolve_attention("auto", "exact", cpu) == ("sdpa", [])  # auto never picks one where it cannot run


@pytest.mark.parametrize("module,missing,remedy", [
    ("flashinfer_fa3", "flashinfer", "pip install flashinfer-python"),
    ("flashattn3_fp8", "flash_attn_interface", "tools/build_flash3.sh"),
])
def test_availability_names_the_missing_piece(monkeypatch, module, missing, remedy):
    """On a GPU without the library the reason says what to do; off Hopper it says Hopper (import error and device
    capability faked: no GPU needed)."""
    import importlib

    mod = importlib.import_module(f"fastremover.ops.attention.{module}")
    monkeypatch.setattr(mod, "import_error", lambda: f"ModuleNotFoundError: No module named '{missing}'")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    why = mod.unavailable_reason(torch.device("cuda", 0))
    assert remedy in why and "No module named" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "Hopper" in mod.unavailable_reason(torch.device("cuda", 0))


def _needs(name):
    from fastremover.ops.attention import unavailable_reason

    why = unavailable_reason(name, torch.device("cuda"))
    if why is not None:
        pytest.skip(f"attention backend {name} cannot run here: {why}")


@pytest.mark.gpu
def test_gpu_fa3_fp16_matches_sdpa_at_w2_shape():
    _needs("fa3")
    from fastremover.ops.attention.flashinfer_fa3 import fa3
    from fastremover.ops.attention.sdpa import sdpa

    q, k, v = qkv_views(32760, seed=11)
    ref, got = sdpa(q, k, v), fa3(q, k, v)
    err = float((got.float() - ref.float()).abs().max())
    c = cos(got, ref)
    print(f"fa3 fp16 vs SDPA at S = 32760: cos {c:.8f}, max|diff| {err:.2e}")
    assert got.dtype == torch.float16 and got.shape == ref.shape
    assert c >= 0.99999 and err < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8-fa3", "fp8-flash3"])
@pytest.mark.parametrize("k_bias,v_bias", [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0)])
def test_gpu_fp8_cosine_at_w2_shape(name, k_bias, v_bias):
    _needs(name)
    from fastremover.ops.attention import get
    from fastremover.ops.attention.sdpa import sdpa

    q, k, v = qkv_views(32760, k_bias=k_bias, v_bias=v_bias, seed=13)
    ref = sdpa(q, k, v)
    got = get(name).call(q, k, v)
    c = cos(got, ref)
    print(f"{name}, K offset {k_bias}, V offset {v_bias}: cos {c:.6f}")
    assert got.dtype == torch.float16 and got.shape == ref.shape
    assert c >= 0.998
    assert not torch.equal(got, ref)  # the 8-bit kernel ran


@pytest.mark.gpu
def test_gpu_batch_of_two_equals_per_item_calls():
    """B > 1 runs one kernel call per item: bit-equal to calling each item alone on the same inputs (for fp8-fa3 the
    same codes and scales: a separate quantization of one item would pick other per-tensor scales)."""
    _needs("fa3")
    _needs("fp8-fa3")
    from fastremover.ops.attention.flashinfer_fa3 import fa3_fp8_codes
    from fastremover.ops.attention.flashinfer_fa3 import fa3, fa3_fp8 as fp8_fa3
    from fastremover.ops.attention.quantize import quantize_qkv
    from fastremover.ops.attention.sdpa import sdpa

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
@pytest.mark.parametrize("name", LIBRARY_BACKENDS)
def test_gpu_in_a_cuda_graph(name, graph_replays_new_inputs):
    _needs(name)
    from fastremover.ops.attention import get

    fn = get(name).call
    q, k, v = qkv_views(1000, heads=4, seed=5)
    out = graph_replays_new_inputs(fn, q, k, v)
    assert torch.equal(out, fn(q, k, v))
