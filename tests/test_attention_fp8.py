"""The 8-bit (FP8 e4m3) attention kernel and its quantization pass (fastremover/fast/kernels/attention_fp8.py).

Without a GPU the Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1, set here and in conftest.py before
any kernel import), at tiny shapes: B=1, S in {37, 64, 130} (one partial key block; an exact multiple of the block;
full blocks plus a 2-row tail), H=2, D in {64, 128}. fp8 x fp8 dots work in the interpreter (exact products, fp32
sums), so no emulation is needed there; the fp32 -> e4m3 cast of P uses _common's bit-exact emulation.

Bounds:
  * quantize_qkv_fp8: scales and codes bit-identical to the eager reference given the kernel's own K mean (amax is a
    max; y * inv_scale one rounded product; RNE both sides). The K mean itself agrees with torch's to fp32 rounding
    (different summation order): |diff| <= 1e-6 * (max|mean| + 1).
  * attention_fp8 vs attention_fp8_reference(block_n=BLOCK_N) (float64 emulation of the same P quantization against
    the same running max): what differs is fp32 rounding (logit sums, exp2, the FMA in x = qk * c - m) and the rare
    e4m3 rounding flip of a p it causes, plus the output's own rounding. Asserted (interpreter): rel. L2 error
    <= 1e-3 and |o - ref| <= 2^-8 * max|ref| elementwise (= 4 fp16 ulps at the top binade); measured ~1e-5 and
    1 fp16 ulp. Compiled (GPU): rel. L2 <= 2e-2, |o - ref| <= 2^-3 * max|ref| (REF_BOUNDS: the tensor cores round
    the fp8 logit sums, flipping more e4m3 roundings of p; values printed).
  * Smoothing K is exact under softmax: float64 attention of (q, k) and (q, k - mean_k) agree to 1e-12.
  * Fidelity (end to end vs float64 attention of the unquantized inputs, S = 130): cos >= 0.997 at this tiny S
    (measured 0.9986-0.9988 over seeds; e4m3's 3 mantissa bits on q, k, v and P set this floor), and with a
    per-channel K offset smoothing beats no smoothing by a clear margin (measured 0.9987 vs 0.9955).
  * Strided inputs (views into one [B, S, 3, H, D] buffer, heads-major views, the S-contiguous v) give bit-identical
    outputs to contiguous copies (same kernel, only the addressing differs).
GPU tests (`pytest -m gpu tests/test_attention_fp8.py -s` on the H200): the real shape S = 32760, H = 12, D = 128,
cosine vs fp16 torch SDPA >= 0.998 (printed), every autotune config vs the emulating reference (rel. L2 <= 2e-2:
the emulation cannot model the tensor cores' rounding of the logit sums), quantizer bit-exactness at the real shape.
On the GPU the tiny-shape tests above run compiled too (with mma.sync for the 32-row blocks).
"""

import math
import os
from pathlib import Path

import pytest
import torch

from fastremover.bench.metrics import cosine

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
FP8 = torch.float8_e4m3fn
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

gpu_real = pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1: the real-shape tests need compiled kernels")


def mod():
    from fastremover.fast.kernels import attention_fp8

    return attention_fp8


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def packed_qkv(seed, b, s, h, d, *, dtype=F32, k_bias=0.0, device=DEV):
    """q, k, v as views into one [B, S, 3, H, D] buffer (what a fused QKV projection produces)."""
    g = gen(seed)
    qkv = torch.randn(b, s, 3, h, d, generator=g)
    if k_bias:
        qkv[:, :, 1] += k_bias * torch.randn(h, d, generator=g)
    qkv = qkv.to(device=device, dtype=dtype)
    return qkv.unbind(2)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# kernel vs emulating reference: (rel. L2, elementwise |diff| / max|ref|). Interpreter: fp32 rounding only. Compiled:
# the tensor cores also round the fp8 logit sums (reduced-precision accumulation), which flips the e4m3 rounding of
# some p; a flipped p moves its weight by up to 2^-4, hence the looser compiled bounds (a broken kernel is off by
# far more: a wrong tile, mask or layout gives errors of order 1).
REF_BOUNDS = (1e-3, 2.0**-8) if INTERPRET else (2e-2, 2.0**-3)


def assert_close_to_reference(o, ref, what=""):
    assert o.shape == ref.shape and o.dtype == ref.dtype
    od, rd = o.double(), ref.double()
    assert torch.isfinite(od).all(), f"{what}: non-finite output (unwritten rows?)"
    rel = float((od - rd).norm() / rd.norm())
    mx = float((od - rd).abs().max())
    top = float(rd.abs().max())
    if not INTERPRET:
        print(f"{what}: rel L2 {rel:.2e}, max |diff| / max|ref| {mx / top:.2e}")
    assert rel <= REF_BOUNDS[0], f"{what}: rel L2 error {rel:.3g}"
    assert mx <= REF_BOUNDS[1] * top, f"{what}: max |diff| {mx:.3g} vs max|ref| {top:.3g}"
    return rel, mx


# ----------------------------------------------------------------------------------------------------------------------
# interpreter plumbing


@pytest.mark.skipif(not INTERPRET, reason="compiled kernels on this machine")
def test_kernels_run_in_the_interpreter():
    from triton.runtime.interpreter import InterpretedFunction

    A = mod()
    for k in (A._attn_fp8_kernel, A._qkv_stats_kernel, A._qkv_quant_kernel):
        assert isinstance(k, InterpretedFunction), f"{k} was compiled: TRITON_INTERPRET=1 was set too late"


def test_configs():
    A = mod()
    names = [c.name for c in A.AUTOTUNE_CONFIGS]
    assert 1 <= len(names) <= 6 and len(set(names)) == len(names)
    assert not any(c.warp_spec for c in A.AUTOTUNE_CONFIGS)  # out of tuning until the S=130 crash is understood
    for c in (*A.AUTOTUNE_CONFIGS, *A.WARP_SPEC_CONFIGS, A.POINTER_CONFIG, A.INTERPRET_CONFIG):
        assert A.AttnConfig.parse(c.name) == c
        assert c.block_m in (64, 128) or c is A.INTERPRET_CONFIG
        if c.warp_spec:  # Triton's Hopper warp specialization needs TMA loads and 4 warps
            assert c.tma in (1, 2) and c.num_warps == 4
    with pytest.raises(ValueError):
        A.AttnConfig.parse("m128n128")


# ----------------------------------------------------------------------------------------------------------------------
# quantization pass


@pytest.mark.parametrize("s,d,dtype,smooth,gran", [
    (37, 64, F16, True, "head"),
    (130, 128, BF16, True, "head"),
    (64, 128, F32, True, "tensor"),
    (130, 64, F16, False, "head"),
    (37, 128, F32, False, "tensor"),
])
def test_quantizer_bit_exact(s, d, dtype, smooth, gran):
    A = mod()
    q, k, v = packed_qkv(s * 7 + d, 1, s, 2, d, dtype=dtype, k_bias=2.0)
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v, smooth_k=smooth, granularity=gran)
    # layouts: q8/k8 [B, S, H, D] views of [B, H, S, D]; v8 a view of [B, H, D, S_pad] with stride 1 along S
    assert q8.shape == k8.shape == v8.shape == q.shape and q8.dtype == k8.dtype == v8.dtype == FP8
    assert q8.stride() == (2 * s * d, d, s * d, 1) and k8.stride() == q8.stride()
    s_pad = -(-s // 16) * 16
    assert v8.stride() == (2 * d * s_pad, 1, d * s_pad, s_pad)
    assert sc.q.shape == sc.k.shape == sc.v.shape == ((1, 2) if gran == "head" else ())
    if smooth:
        eager_mean = k.float().permute(0, 2, 1, 3).mean(dim=2)
        assert sc.k_mean.shape == (1, 2, d)
        assert (sc.k_mean - eager_mean).abs().max() <= 1e-6 * (eager_mean.abs().max() + 1)
    else:
        assert sc.k_mean is None
    rq8, rk8, rv8, rsc = A.quantize_qkv_fp8_reference(q, k, v, smooth_k=smooth, granularity=gran, k_mean=sc.k_mean)
    for name, a, b in (("q", sc.q, rsc.q), ("k", sc.k, rsc.k), ("v", sc.v, rsc.v)):
        assert torch.equal(a, b), f"{name} scale {a} vs eager {b}"
    for name, a, b in (("q8", q8, rq8), ("k8", k8, rk8), ("v8", v8, rv8)):
        assert a.stride() == b.stride()
        assert torch.equal(bits(a), bits(b)), f"{name}: {int((bits(a) != bits(b)).sum())} codes differ"
    # the padding of the transposed V is zero, and the codes use the range: some |code| == 448 per scale group
    vt = v8.permute(0, 2, 3, 1)  # [B, H, D, S] view; its storage holds S_pad columns
    pad = torch.as_strided(vt, (1, 2, d, s_pad - s), vt.stride(), vt.storage_offset() + s)
    assert not bits(pad).any()
    assert float(q8.float().abs().max()) == 448.0 and float(k8.float().abs().max()) == 448.0


def test_quantizer_nan_propagates_and_zero_input():
    A = mod()
    q, k, v = packed_qkv(3, 1, 37, 2, 64)
    q = q.clone()
    q[0, 5, 1, 3] = float("nan")
    _, _, _, sc = A.quantize_qkv_fp8(q, k, v)
    assert torch.isnan(sc.q[0, 1]) and torch.isfinite(sc.q[0, 0]), sc.q
    assert torch.isfinite(sc.k).all() and torch.isfinite(sc.v).all()  # a NaN in q stays in q's scale
    k = k.clone()
    k[0, 7, 0, 9] = float("nan")
    _, _, _, sc = A.quantize_qkv_fp8(q.nan_to_num(), k, v)
    assert torch.isnan(sc.k[0, 0]) and torch.isfinite(sc.k[0, 1]) and torch.isfinite(sc.q).all(), sc.k
    z = torch.zeros(1, 37, 2, 64, device=DEV)
    q8, k8, v8, sc = A.quantize_qkv_fp8(z, z, z)
    assert torch.equal(sc.q, torch.full_like(sc.q, 1e-12) / torch.tensor(448.0, device=DEV))
    assert not bits(q8).any() and not bits(k8).any()


# ----------------------------------------------------------------------------------------------------------------------
# smoothing


def test_smoothing_is_exact_under_softmax():
    A = mod()
    q, k, v = packed_qkv(11, 1, 130, 2, 64, k_bias=3.0, device="cpu")
    mean = k.double().mean(dim=1, keepdim=True)
    a = A.attention_exact(q, k, v)
    b = A.attention_exact(q.double(), k.double() - mean, v.double())
    assert float((a - b).abs().max()) <= 1e-12


def test_smoothing_improves_fidelity_with_a_k_offset():
    A = mod()
    q, k, v = packed_qkv(5, 1, 130, 2, 128, k_bias=3.0)
    exact = A.attention_exact(q, k, v)
    cos = {}
    for smooth in (True, False):
        o = A.attention_fp8_qkv(q, k, v, smooth_k=smooth, out_dtype=F32)
        cos[smooth] = cosine(o, exact)
    assert cos[True] >= 0.997, cos
    assert 1 - cos[True] <= 0.5 * (1 - cos[False]), cos  # measured 1.3e-3 vs 4.5e-3


# ----------------------------------------------------------------------------------------------------------------------
# attention kernel vs the emulating reference


KERNEL_CASES = [
    # S, D, config name, quantizer granularity, out dtype
    (37, 64, "m32n32w4s1t0ws0a1", "head", F16),      # one partial key block, pointer loads
    (64, 128, "m64n64w4s1t1ws0a1", "head", F16),     # S a multiple of the block, host TMA descriptors
    (130, 128, "m32n64w4s1t2ws0a1", "tensor", BF16),  # two full key blocks + a 2-key tail, device descriptors
    (130, 64, "m64n32w4s1t1ws0a0", "head", F32),     # chained P @ V accumulation
    (130, 128, "m64n64w4s1t1ws0a2", "head", F16),    # max_num_imprecise_acc (a no-op here)
]


@pytest.mark.parametrize("s,d,cfg,gran,out_dtype", KERNEL_CASES)
def test_kernel_matches_reference(s, d, cfg, gran, out_dtype):
    A = mod()
    config = A.AttnConfig.parse(cfg)
    q, k, v = packed_qkv(s + d, 1, s, 2, d, dtype=F16)
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v, granularity=gran)
    o = A.attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v, out_dtype=out_dtype, config=config)
    assert o.shape == q.shape and o.dtype == out_dtype and o.is_contiguous()
    ref = A.attention_fp8_reference(q8, k8, v8, sc.q, sc.k, sc.v, out_dtype=out_dtype, block_n=config.block_n)
    assert_close_to_reference(o, ref, f"S={s} D={d} {cfg}")


@pytest.mark.skipif(not INTERPRET, reason="compiled: the tensor cores' logit rounding adds noise of the same order")
def test_block_reference_is_the_ideal_quantization_up_to_noise():
    """P quantized against the running max (what the kernel does) vs against the final row max: the same up to
    e4m3 rounding noise, and the kernel is far closer to the former (the test above pins it to that)."""
    A = mod()
    q, k, v = packed_qkv(2, 1, 130, 2, 128)
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v)
    o = A.attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v, out_dtype=F32, config="m32n32w4s1t0ws0a1")
    blk = A.attention_fp8_reference(q8, k8, v8, sc.q, sc.k, sc.v, out_dtype=F32, block_n=32)
    glb = A.attention_fp8_reference(q8, k8, v8, sc.q, sc.k, sc.v, out_dtype=F32)
    assert cosine(blk, glb) >= 0.9995
    err_blk = float((o.double() - blk.double()).norm())
    err_glb = float((o.double() - glb.double()).norm())
    assert err_blk < 0.1 * err_glb, (err_blk, err_glb)


def test_sm_scale_and_scale_tensors():
    A = mod()
    q, k, v = packed_qkv(9, 1, 64, 2, 64)
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v, granularity="head")
    cfg = "m32n32w4s1t0ws0a1"
    # per-head scales given as a [B, H] tensor or (all equal) as a 1-element one give the same result
    one = torch.full((1,), 0.01, device=DEV)
    o1 = A.attention_fp8(q8, k8, v8, one, one, one, sm_scale=0.3, config=cfg)
    o2 = A.attention_fp8(q8, k8, v8, one.expand(1, 2), one.expand(1, 2).contiguous(), one.view(()), sm_scale=0.3,
                         config=cfg)
    assert torch.equal(o1, o2)
    ref = A.attention_fp8_reference(q8, k8, v8, one, one, one, sm_scale=0.3, block_n=32)
    assert_close_to_reference(o1, ref, "sm_scale=0.3")
    # v_scale only scales the output
    o3 = A.attention_fp8(q8, k8, v8, one, one, one * 2, sm_scale=0.3, out_dtype=F32, config=cfg)
    o4 = A.attention_fp8(q8, k8, v8, one, one, one, sm_scale=0.3, out_dtype=F32, config=cfg)
    assert torch.allclose(o3, 2 * o4, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------------------------------
# strided inputs


@pytest.mark.parametrize("cfg", ["m32n64w4s1t0ws0a1", "m64n64w4s1t1ws0a1"])
def test_strided_views_are_bit_identical(cfg):
    A = mod()
    b, s, h, d = 1, 130, 2, 64
    q, k, v = packed_qkv(4, b, s, h, d)
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v)
    # the same codes in a packed [B, S, 3, H, D] fp8 buffer (v with stride 1 along D: transposed internally)
    buf = torch.stack([q8, k8, v8], dim=2).contiguous()
    pq, pk, pv = buf.unbind(2)
    assert pq.stride() == (s * 3 * h * d, 3 * h * d, d, 1)
    # and as plain contiguous [B, S, H, D] tensors
    cq, ck, cv = q8.contiguous(), k8.contiguous(), v8.contiguous()
    outs = [A.attention_fp8(*x, sc.q, sc.k, sc.v, config=cfg) for x in ((q8, k8, v8), (pq, pk, pv), (cq, ck, cv))]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    assert_close_to_reference(outs[0], A.attention_fp8_reference(cq, ck, cv, sc.q, sc.k, sc.v,
                                                                  block_n=A.AttnConfig.parse(cfg).block_n), cfg)


def test_v_without_transpose_matches():
    """v with stride 1 along D fed as is (transpose_v=False: Triton handles the non-K-major operand)."""
    A = mod()
    q, k, v = packed_qkv(6, 1, 64, 2, 64)
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v)
    cfg = "m32n32w4s1t0ws0a1"
    o1 = A.attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v, config=cfg)
    o2 = A.attention_fp8(q8, k8, v8.contiguous(), sc.q, sc.k, sc.v, config=cfg, transpose_v=False)
    if INTERPRET:
        assert torch.equal(o1, o2)
    else:  # same P; only the MMA's summation of P @ V may be ordered differently
        assert float((o1.float() - o2.float()).abs().max()) <= 2.0**-10 * float(o1.float().abs().max())


def test_end_to_end_fidelity_vs_exact():
    A = mod()
    q, k, v = packed_qkv(8, 1, 130, 2, 128, dtype=F16)
    o = A.attention_fp8_qkv(q, k, v)
    assert o.dtype == F16 and o.shape == q.shape
    c = cosine(o, A.attention_exact(q, k, v))
    print(f"fp8 attention vs float64 exact, S=130: cos {c:.5f}")
    assert c >= 0.997


# ----------------------------------------------------------------------------------------------------------------------
# argument checks


def test_argument_checks():
    A = mod()
    q, k, v = packed_qkv(1, 1, 37, 2, 64)
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v)
    cfg = "m32n32w4s1t0ws0a1"
    with pytest.raises(ValueError, match="dtype"):
        A.attention_fp8(q, k8, v8, sc.q, sc.k, sc.v, config=cfg)
    with pytest.raises(ValueError, match="one shape"):
        A.attention_fp8(q8[:, :30], k8, v8, sc.q, sc.k, sc.v, config=cfg)
    with pytest.raises(ValueError, match="stride 1 along D"):
        A.attention_fp8(q8.transpose(1, 3).contiguous().transpose(1, 3), k8, v8, sc.q, sc.k, sc.v, config=cfg)
    with pytest.raises(ValueError, match="q_scale"):
        A.attention_fp8(q8, k8, v8, sc.q.double(), sc.k, sc.v, config=cfg)
    with pytest.raises(ValueError, match="k_scale"):
        A.attention_fp8(q8, k8, v8, sc.q, torch.ones(3, device=DEV), sc.v, config=cfg)
    with pytest.raises(ValueError, match="out_dtype"):
        A.attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v, out_dtype=torch.int8, config=cfg)
    with pytest.raises(ValueError, match="sm_scale"):
        A.attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v, sm_scale=-1.0, config=cfg)
    with pytest.raises(ValueError, match="head dim"):
        z = torch.zeros(1, 8, 2, 48, device=DEV)
        A.quantize_qkv_fp8(z, z, z)
    with pytest.raises(ValueError, match="granularity"):
        A.quantize_qkv_fp8(q, k, v, granularity="row")
    with pytest.raises(ValueError, match="stride 1 along D"):
        A.quantize_qkv_fp8(q, k, v.transpose(1, 3).contiguous().transpose(1, 3))
    if INTERPRET:  # compiled kernels must refuse CPU tensors; interpreted ones take them
        return
    with pytest.raises(ValueError, match="CUDA"):
        A.attention_fp8(*(t.cpu() for t in (q8, k8, v8)), sc.q.cpu(), sc.k.cpu(), sc.v.cpu())


# ----------------------------------------------------------------------------------------------------------------------
# offline sm_90 codegen (no GPU needed)


def test_sm90_codegen():
    """Compile the default config for sm_90 with the bundled ptxas: fp8 wgmma (QGMMA) for both products, one
    MUFU.EX2 per logit, no register spills. Runs in a subprocess (this one imported the kernels interpreted)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tools = str(Path(__file__).resolve().parents[1] / "tools")  # the codegen report is lab code (not shipped)
    code = (f"import json, sys; sys.path.insert(0, {tools!r}); import bench_attention_fp8 as T; T._load(); "
            "from fastremover.fast.kernels import attention_fp8 as A; "
            "print(json.dumps(T.codegen_summary(T.compile_sm90(A.AUTOTUNE_CONFIGS[0]))))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas available for an offline sm_90 compile")
    assert r.returncode == 0, r.stderr[-4000:]
    st = json.loads(r.stdout.strip().splitlines()[-1])
    print(st)
    # 128x128 tile, 2 warpgroups: per key block 4 k-steps of 64x128x32 for QK^T and 4 for PV, in the loop and tail
    assert st["QGMMA"] == 16 and st["HGMMA"] == 0 and st["HMMA"] == 0, st
    assert st["LDL/STL"] == 0 and "LOCAL:0" in st["resources"], st
    assert st["MUFU.EX2"] >= 128 and st["UTMALDG"] > 0, st


# ----------------------------------------------------------------------------------------------------------------------
# GPU, real shapes (the device machine: pytest -m gpu tests/test_attention_fp8.py -s)


B_, S_, H_, D_ = 1, 32760, 12, 128


@pytest.fixture(autouse=True)
def _pinned_config_on_the_gpu(monkeypatch, request):
    """The engine runs this kernel with one pinned config (ops/attention/triton_fp8.py: autotuning by timing could change the
    output bits between processes); the real-shape GPU tests do the same, which also keeps them from autotuning six
    configs per shape (minutes of device time). Autotuning itself is exercised by the benchmark."""
    if "gpu" in request.keywords and not INTERPRET:
        monkeypatch.setenv("FASTREMOVER_FP8_ATTN_CONFIG", mod().AUTOTUNE_CONFIGS[0].name)


@pytest.mark.gpu
@gpu_real
@pytest.mark.parametrize("k_bias", [0.0, 4.0])
def test_gpu_real_shape_cosine_vs_sdpa(k_bias):
    A = mod()
    from fastremover.ops.attention.sdpa import sdpa

    q, k, v = packed_qkv(0, B_, S_, H_, D_, dtype=F16, k_bias=k_bias, device="cuda")
    ref = sdpa(q, k, v)
    o = A.attention_fp8_qkv(q, k, v)
    torch.cuda.synchronize()
    assert o.dtype == F16 and o.shape == q.shape and torch.isfinite(o).all()
    c = cosine(o, ref)
    c_tensor = cosine(A.attention_fp8_qkv(q, k, v, granularity="tensor"), ref)
    c_raw = cosine(A.attention_fp8_qkv(q, k, v, smooth_k=False), ref)
    print(f"\nS={S_} H={H_} D={D_} k_bias={k_bias}: cos vs fp16 SDPA {c:.5f} (per-head scales, smoothed K); "
          f"per-tensor {c_tensor:.5f}; unsmoothed {c_raw:.5f}; tuning {A.tuning_report()}")
    assert c >= 0.998
    assert c_tensor >= 0.998
    if k_bias:
        assert c > c_raw, (c, c_raw)


@pytest.mark.gpu
@gpu_real
def test_gpu_every_config_matches_reference():
    """Each autotune candidate (and the pointer fallback) on a smaller problem with a tail (S = 1000), B = 2, H = 3:
    rel. L2 error <= 2e-2 vs the emulating reference on sampled rows (the emulation cannot model the tensor cores'
    rounding of the fp8 logit sums, which flips the e4m3 rounding of some p: expected ~1e-3..5e-3, printed; a
    broken build is off by 1e-1 or more). A candidate that does not compile with this Triton is reported, not
    failed; the first (not warp-specialized) must run."""
    A = mod()
    b, s, h, d = 2, 1000, 3, 128
    q, k, v = packed_qkv(1, b, s, h, d, dtype=F16, device="cuda")
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v)
    results = {}
    for cfg in (*A.AUTOTUNE_CONFIGS, A.POINTER_CONFIG):
        try:
            o = A.attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v, config=cfg)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - compile failure of an optional variant
            results[cfg.name] = f"did not run: {type(e).__name__}: {str(e)[:200]}"
            continue
        p = A._prepare(q8, k8, v8, sc.q, sc.k, sc.v, None, F16, True)
        rel, cos = A._check_rows(p, o, cfg.block_n)
        results[cfg.name] = rel
        assert rel <= 2e-2, (cfg.name, rel, cos)
    print("\n", results)
    assert isinstance(results[A.AUTOTUNE_CONFIGS[0].name], float), results


@pytest.mark.gpu
@gpu_real
def test_gpu_quantizer_bit_exact_real_shape():
    A = mod()
    q, k, v = packed_qkv(2, B_, S_, H_, D_, dtype=F16, k_bias=1.0, device="cuda")
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v)
    r = A.quantize_qkv_fp8_reference(q, k, v, k_mean=sc.k_mean)
    for a, b in zip(sc[:3], r[3][:3]):
        assert torch.equal(a, b)
    for a, b in zip((q8, k8, v8), r[:3]):
        assert torch.equal(bits(a), bits(b))
    eager_mean = k.float().mean(dim=1)
    assert (sc.k_mean - eager_mean).abs().max() <= 1e-5 * (eager_mean.abs().max() + 1)


@pytest.mark.gpu
@gpu_real
def test_gpu_fp8_faster_than_sdpa_is_reported():
    """Not a pass/fail speed gate (the bench is): prints the times so the test log carries them; fails only if the
    fp8 path is slower than fp16 SDPA by more than 2x (a sign of a broken build, e.g. no wgmma)."""
    A = mod()
    from fastremover.ops.attention.sdpa import sdpa

    q, k, v = packed_qkv(0, B_, S_, H_, D_, dtype=F16, device="cuda")
    q8, k8, v8, sc = A.quantize_qkv_fp8(q, k, v)
    A.attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v)
    ms_sdpa = A._time_ms(lambda: sdpa(q, k, v))
    ms_fp8 = A._time_ms(lambda: A.attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v))
    flops = 4.0 * B_ * H_ * S_ * S_ * D_
    print(f"\nSDPA fp16 {ms_sdpa:.3f} ms ({flops / ms_sdpa * 1e-9:.0f} TFLOP/s), fp8 {ms_fp8:.3f} ms "
          f"({flops / ms_fp8 * 1e-9:.0f} TFLOP/s), x{ms_sdpa / ms_fp8:.2f}")
    assert ms_fp8 < 2 * ms_sdpa
    assert math.isfinite(ms_fp8)
