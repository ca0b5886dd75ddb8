"""ops/linear/cublaslt.py: the FP8 linears' workspace-free cuBLASLt GEMM against torch._scaled_mm (its eager reference).

CPU: argument checks, the availability gate and Fp8Linear's choice. GPU: torch.equal with torch._scaled_mm at the
DiT's real shapes on fresh random inputs, inside a CUDA graph too, and the profiler showing the point of the path
(no memset before the GEMM where torch._scaled_mm has one).
"""

from __future__ import annotations

import os

import pytest
import torch

from fastremover.config import TransformerOptions
from fastremover.ops.linear import cublaslt
from fastremover.ops.linear.fp8_rowwise import Fp8Linear
from helpers import TOOLS, tiny_transformer

FP8 = torch.float8_e4m3fn


def _codes(*shape, device="cpu", g=None):
    return (torch.randn(*shape, device=device, generator=g) * 64).clamp(-448, 448).to(FP8)


def test_unavailable_on_cpu_with_a_reason():
    assert "CUDA" in cublaslt.unavailable_reason("cpu", None)


@pytest.mark.parametrize("case", [
    "a dtype", "k mismatch", "k not multiple of 16", "out dtype", "a_scale numel", "w_scale dtype", "bias dtype",
    "out shape", "not contiguous",
])
def test_scaled_mm_rejects_bad_arguments(case):
    m, n, k = 8, 32, 64
    args = dict(a=_codes(m, k), w=_codes(n, k), a_scale=torch.ones(m, 1), w_scale=torch.ones(1, n),
                bias=torch.zeros(n, dtype=torch.float16), out_dtype=torch.float16)
    words = {"a dtype": "a must be", "k mismatch": "disagree on K", "k not multiple of 16": "multiples of 16",
             "out dtype": "out_dtype", "a_scale numel": "a_scale", "w_scale dtype": "w_scale", "bias dtype": "bias",
             "out shape": "out must", "not contiguous": "w must be"}[case]
    if case == "a dtype":
        args["a"] = torch.zeros(m, k)
    elif case == "k mismatch":
        args["w"] = _codes(n, k + 16)
    elif case == "k not multiple of 16":
        args["a"], args["w"] = _codes(m, 40), _codes(n, 40)
    elif case == "out dtype":
        args["out_dtype"] = torch.float32
    elif case == "a_scale numel":
        args["a_scale"] = torch.ones(m + 1, 1)
    elif case == "w_scale dtype":
        args["w_scale"] = torch.ones(1, n, dtype=torch.float16)
    elif case == "bias dtype":
        args["bias"] = torch.zeros(n, dtype=torch.bfloat16)
    elif case == "out shape":
        args["out"] = torch.empty(m, n + 1, dtype=torch.float16)
    elif case == "not contiguous":
        args["w"] = _codes(k, n).t()
    with pytest.raises(ValueError, match=words):
        cublaslt.scaled_mm(**args)


def test_scaled_mm_on_cpu_raises_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA GPU.*torch._scaled_mm"):
        cublaslt.scaled_mm(_codes(8, 64), _codes(32, 64), torch.ones(8, 1), torch.ones(1, 32), None, torch.float16)


def test_fp8_linear_gemm_choice_on_cpu():
    lin = torch.nn.Linear(64, 32)
    assert Fp8Linear(lin, torch.float32).gemm == "torch"  # auto: cuBLASLt cannot run on the CPU
    assert Fp8Linear(lin, torch.float32, "torch").gemm == "torch"
    with pytest.raises(ValueError, match="cannot run here"):
        Fp8Linear(lin, torch.float32, "cublaslt")
    with pytest.raises(ValueError, match="gemm must be"):
        Fp8Linear(lin, torch.float32, "cutlass")


# --- GPU -------------------------------------------------------------------------------------------------------------

# (M, K, N): W1 / W2 qkv, O projection and FF2 with their main-chunk and last-wave row counts, FF1, a ragged M
REAL_SHAPES = [(7290, 1536, 4608), (7040, 1536, 1536), (250, 1536, 1536), (7040, 8960, 1536), (250, 8960, 1536),
               (7290, 1536, 8960), (32760, 1536, 4608), (32384, 1536, 1536), (32384, 8960, 1536), (376, 8960, 1536),
               (1000, 1536, 1536)]


def _fresh(device="cuda"):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[seed {seed}]", end=" ")
    return torch.Generator(device=device).manual_seed(seed), seed


def _problem(g, m, k, n, out_dtype=torch.float16):
    a, w = _codes(m, k, device="cuda", g=g), _codes(n, k, device="cuda", g=g)
    sa = torch.rand(m, 1, device="cuda", generator=g) * 1e-2 + 1e-4
    sw = torch.rand(1, n, device="cuda", generator=g) * 1e-2 + 1e-4
    bias = (torch.randn(n, device="cuda", generator=g)).to(out_dtype)
    return a, w, sa, sw, bias


def _reference(a, w, sa, sw, bias, out_dtype, fast_accum=True):
    return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


@pytest.mark.gpu
@pytest.mark.parametrize("mkn", REAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_scaled_mm_equals_torch_scaled_mm_at_real_shapes(mkn):
    assert cublaslt.unavailable_reason("cuda", torch.cuda.current_device()) is None
    g, seed = _fresh()
    m, k, n = mkn
    a, w, sa, sw, bias = _problem(g, m, k, n)
    want = _reference(a, w, sa, sw, bias, torch.float16)
    got = cublaslt.scaled_mm(a, w, sa, sw, bias, torch.float16)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want), f"seed {seed}: max |diff| {(got.float() - want.float()).abs().max().item()}"
    # no bias, bf16 output, accumulation with fp32 promotion: the other settings the GEMM accepts
    want = _reference(a, w, sa, sw, None, torch.bfloat16, fast_accum=False)
    got = cublaslt.scaled_mm(a, w, sa, sw, None, torch.bfloat16, fast_accum=False)
    assert torch.equal(got, want), f"seed {seed}: max |diff| {(got.float() - want.float()).abs().max().item()}"


@pytest.mark.gpu
def test_gpu_scaled_mm_on_row_slices_and_in_a_cuda_graph():
    """The fast transformer's calls: row slices of larger buffers (the last-wave chunk) written into `out`, and
    captured in a CUDA graph then replayed on new values (descriptors hold pointers, not values)."""
    import importlib.util

    tool = TOOLS / "profile_step.py"  # the lab's capture helper
    spec = importlib.util.spec_from_file_location("profile_step", tool)
    profile_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_step)
    capture = profile_step.capture  # side-stream warm-up, then the capture

    g, seed = _fresh()
    m, k, n, split = 7290, 1536, 1536, 7040
    a, w, sa, sw, bias = _problem(g, m, k, n)
    out = torch.empty(m, n, dtype=torch.float16, device="cuda")
    graph, _ = capture(lambda: [cublaslt.scaled_mm(a[lo:hi], w, sa[lo:hi], sw, bias, torch.float16, out=out[lo:hi])
                                for lo, hi in ((0, split), (split, m))])
    for _ in range(2):
        a.copy_(_codes(m, k, device="cuda", g=g))
        sa.copy_(torch.rand(m, 1, device="cuda", generator=g) * 1e-2 + 1e-4)
        out.zero_()
        graph.replay()
        want = torch.cat([_reference(a[lo:hi], w, sa[lo:hi], sw, bias, torch.float16)
                          for lo, hi in ((0, split), (split, m))])
        assert torch.equal(out, want), f"seed {seed}"


@pytest.mark.gpu
def test_gpu_scaled_mm_has_no_memset_where_torch_scaled_mm_has_one():
    """The reason for the module: at the W1 qkv shape ATen's call runs a memset + a dynamically scheduled kernel,
    ours a single kernel (if a cuBLAS update drops ATen's memset, this test says so and the module can go)."""
    from torch.profiler import ProfilerActivity, profile

    g, _ = _fresh()
    a, w, sa, sw, bias = _problem(g, 7290, 1536, 4608)

    def kernels(fn):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    ours = kernels(lambda: cublaslt.scaled_mm(a, w, sa, sw, bias, torch.float16))
    theirs = kernels(lambda: _reference(a, w, sa, sw, bias, torch.float16))
    print("cublaslt:", ours, "torch:", theirs)
    assert len(ours) == 1 and "memset" not in ours[0].lower(), ours
    assert any("memset" in name.lower() for name in theirs), theirs


def test_fast_transformer_gemm_option_on_cpu():
    from fastremover.fast.transformer_fast import FastTransformer

    model = tiny_transformer(3)
    fast = FastTransformer(model, linear_method="fp8-rowwise", use_triton=False)
    assert fast.describe()["fp8_gemm"] == "torch._scaled_mm"
    assert all(blk[name].gemm == "torch" for blk in fast.fp8_blocks for name in ("qkv", "o", "ff1", "ff2"))
    with pytest.raises(ValueError, match="gemm='cublaslt' cannot run here"):
        FastTransformer(model, linear_method="fp8-rowwise", use_triton=False,
                        options=TransformerOptions(gemm="cublaslt"))
