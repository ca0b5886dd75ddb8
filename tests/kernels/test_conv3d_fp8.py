"""The FP8 implicit-GEMM causal conv3d (fastremover/fast/kernels/conv3d_fp8.py) against its eager reference.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 set here and in conftest.py before the
kernel module is imported; the module is only imported inside the tests). On a GPU machine the small-shape tests run
the compiled kernels, and the tests marked `gpu` check the VAE's real shapes:
    pytest -m gpu tests/kernels/test_conv3d_fp8.py -s

Bounds (derivations in the module docstring); S = conv(|xd|, |wd|) over the dequantized operands, |b| the bias:
  * weight quantization, activation scale, activation codes: bit-exact (torch.equal) against eager formulas.
  * conv vs reference, IEEE fp32 accumulation (interpreter):  |y - y_ref| <= (K + 8) 2^-24 (S + |b|) + ulp_dtype
  * conv vs reference, Hopper fp8 wgmma with fp32 promotion:   |y - y_ref| <= 2^-9 (S + |b|) + ulp_dtype
    with ulp_dtype the output dtype's spacing at |y_ref| + the fp32 term (the two final roundings).
  * quantize="pass" and "fused" give the same codes and the same dot: bit-identical in the interpreter; within the
    GPU bound of each other on the GPU.
  * against vae.CausalConv3d + CausalCache (fp32, dequantized weights, activations exactly on the fp8 grid): the
    interpreter bound, chunk by chunk (prev of 0, 1 and 2 frames).
"""

import os

import pytest
import torch

from fastremover.bench.metrics import cosine

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
F16, BF16, F32, FP8 = torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn
CL = torch.channels_last_3d
MANT = {F16: 10, BF16: 7}
MIN_EXP = {F16: -14, BF16: -126}

gpu_real = pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1: the real-shape tests need compiled kernels")


def mod():
    from fastremover.fast.kernels import conv3d_fp8

    return conv3d_fp8


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def act(g, b, c, t, h, w, dtype=F16, scale=1.0, device=DEV):
    return (torch.randn(b, c, t, h, w, generator=g) * scale).to(device=device, dtype=dtype).contiguous(memory_format=CL)


def conv_weights(g, cout, cin, device=DEV, bias=True):
    w = torch.randn(cout, cin, 3, 3, 3, generator=g) / (27 * cin) ** 0.5
    b = torch.randn(cout, generator=g) * 0.2 if bias else None
    return w.to(device), (b.to(device) if b is not None else None)


def ulp(v: torch.Tensor, dtype) -> torch.Tensor:
    """Spacing of `dtype` at |v| (fp32 tensor), subnormals included."""
    _, e = torch.frexp(v.abs())  # |v| = m 2^e, m in [0.5, 1)
    return torch.exp2((e - 1).clamp_min(MIN_EXP[dtype]).float() - MANT[dtype])


def assert_within(y, y_ref, s_abs, bias, rel: float, what: str = "") -> float:
    """|y - y_ref| <= rel (S + |b|) + ulp_dtype(|y_ref| + that + ulp): returns max(|diff|) / max(bound) per element."""
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype, (y.shape, y_ref.shape, y.dtype, y_ref.dtype)
    assert not torch.isnan(y.float()).any(), f"{what}: NaN in the output (unwritten elements?)"
    scale = s_abs.float() + (bias.float().abs().view(1, -1, 1, 1, 1) if bias is not None else 0.0)
    e32 = rel * scale
    yr = y_ref.float()
    bound = e32 + ulp(yr.abs() + e32 + ulp(yr, y.dtype), y.dtype)
    diff = (y.float() - yr).abs()
    bad = diff > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {diff.numel()} elements outside the bound; worst "
                           f"diff {diff[bad].max().item():.3e} vs bound {bound[bad].min().item():.3e}")
    return float((diff / bound).max())


def interp_rel(cin: int) -> float:
    return (27 * cin + 8) * 2.0**-24


GPU_REL = 2.0**-9


def reference_by_frame(c, prev, x, w_q, w_s, bias, sa):
    """causal_conv3d_fp8_reference one output frame at a time (bounded memory at 480x832): (y_ref, S)."""
    ys, ss = [], []
    for j in range(x.shape[2]):
        hist = [v for v in (prev, x[:, :, :j]) if v is not None and v.shape[2]]
        p = torch.cat(hist, 2)[:, :, -2:] if hist else None
        y, s_abs = c.causal_conv3d_fp8_reference(p, x[:, :, j:j + 1], w_q, w_s, bias, sa, return_abs_sum=True)
        ys.append(y)
        ss.append(s_abs)
    return torch.cat(ys, 2), torch.cat(ss, 2)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV).contiguous(memory_format=CL)


# ----------------------------------------------------------------------------------------------------------------------
# interpreter / configs


@pytest.mark.skipif(not INTERPRET, reason="compiled kernels on this machine")
def test_kernels_run_in_the_interpreter():
    from triton.runtime.interpreter import InterpretedFunction

    c = mod()
    ks = [c._conv3d_fp8_kernel, c._amax_partial_kernel, c._amax_finalize_kernel, c._quant_act_kernel,
          c._conv3d_fp8_tma_kernel, c._quant_stream_kernel]
    bad = [k for k in ks if not isinstance(k, InterpretedFunction)]
    assert not bad, f"{bad} were compiled as GPU kernels: TRITON_INTERPRET=1 was set too late"


def test_config_candidates():
    c = mod()
    assert (c.block_k_for(96), c.block_k_for(192), c.block_k_for(384), c.block_k_for(16), c.block_k_for(48)) == (
        32, 64, 128, 32, 32)
    for cin, cout, m in ((96, 96, 4 * 480 * 832), (192, 192, 4 * 240 * 416), (384, 384, 4 * 120 * 208),
                         (384, 384, 60 * 104), (16, 48, 100)):
        for in_fp8 in (True, False):
            cands = c.candidate_configs(cin, cout, m, in_fp8)
            assert 1 <= len(cands) <= 3 and len(set(cands)) == len(cands)
            for cfg in cands:
                width = cfg.block_n0 + cfg.block_n1
                assert cout % width == 0, (cin, cout, cfg)  # exact N blocks: no masked MMA columns
                for n in (cfg.block_n0, cfg.block_n1):
                    assert n == 0 or (n >= 16 and n & (n - 1) == 0), cfg
                assert cfg.block_m * width <= c.ACC_REGS_MAX * 32 * cfg.num_warps, cfg
            assert c.default_config(cin, cout, m, in_fp8) == cands[0]
    assert c.candidate_configs(96, 96, 10**6)[0].block_n0 + c.candidate_configs(96, 96, 10**6)[0].block_n1 == 96
    assert c.supported(96, 384) and c.supported(16, 16)
    assert not c.supported(3, 96) and not c.supported(96, 3) and not c.supported(96, 24) and not c.supported(0, 16)


# ----------------------------------------------------------------------------------------------------------------------
# quantization pieces: bit-exact


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_quantize_conv_weight_bit_exact(dtype):
    c = mod()
    cout, cin = 32, 16
    w = (torch.randn(cout, cin, 3, 3, 3, generator=gen(1)) * 0.05).to(DEV, dtype)
    w[5] = 0  # all-zero channel: scale 1e-12 / 448, codes 0
    w[7, 3, 1, 2, 0] = 3.0  # an outlier sets channel 7's scale
    q, s = c.quantize_conv_weight(w)
    assert q.dtype == FP8 and q.shape == (cout, 27 * cin) and q.is_contiguous()
    assert s.dtype == F32 and s.shape == (cout,)
    wf = w.float()
    s_ref = wf.abs().amax(dim=(1, 2, 3, 4)).clamp_min(1e-12) / torch.tensor(448.0, device=DEV)
    assert torch.equal(s, s_ref)
    q_ref = (wf / s_ref.view(-1, 1, 1, 1, 1)).to(FP8)  # [Cout, Cin, kt, kh, kw]
    # layout: q[o, ((kt*3 + kh)*3 + kw)*Cin + ci] is the code of w[o, ci, kt, kh, kw]
    for o, ci, kt, kh, kw in ((0, 0, 0, 0, 0), (7, 3, 1, 2, 0), (31, 15, 2, 2, 2), (12, 9, 2, 0, 1)):
        k = ((kt * 3 + kh) * 3 + kw) * cin + ci
        assert q[o, k].view(torch.uint8) == q_ref[o, ci, kt, kh, kw].view(torch.uint8)
    full = q_ref.permute(0, 2, 3, 4, 1).reshape(cout, 27 * cin)
    assert torch.equal(q.view(torch.uint8), full.view(torch.uint8))
    assert q[7].float().abs().max() == 448 and not q[5].float().any()
    deq = c.dequantize_conv_weight(q, s, cin)
    assert deq.shape == w.shape
    assert ((deq - wf).abs() <= 2.0**-4 * wf.abs() + 2.0**-10 * s.view(-1, 1, 1, 1, 1)).all()


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("n_prev", [0, 1, 2])
def test_activation_scale_bit_exact(dtype, n_prev):
    c = mod()
    g = gen(10 + n_prev)
    x = act(g, 1, 16, 3, 20, 30, dtype)  # 28800 elements: 8 blocks of 4096 over a capped grid (grid-strided loops)
    prev = act(g, 1, 16, n_prev, 20, 30, dtype) if n_prev else None
    if prev is not None:
        prev[0, 3, -1, 7, 11] = -250.0  # the largest magnitude sits in the cache: prev must be read
    s = c.activation_scale(prev, x)
    assert s.shape == (1,) and s.dtype == F32 and s.device == x.device
    amax = x.float().abs().max()
    if prev is not None:
        amax = torch.maximum(amax, prev.float().abs().max())
        assert amax == 250.0
    assert torch.equal(s, (amax.clamp_min(1e-12) / torch.tensor(448.0, device=DEV)).reshape(1))
    assert torch.equal(s, c.activation_scale_reference(prev, x))
    out = torch.empty(1, device=DEV)
    assert c.activation_scale(prev, x, out=out) is out and torch.equal(out, s)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_activation_scale_nan_and_zero():
    c = mod()
    g = gen(3)
    x = act(g, 1, 16, 2, 6, 7)
    prev = act(g, 1, 16, 2, 6, 7)
    prev[0, 1, 0, 2, 3] = float("nan")
    assert torch.isnan(c.activation_scale(prev, x)).all() and torch.isnan(c.activation_scale_reference(prev, x)).all()
    z = torch.zeros_like(x)
    assert torch.equal(c.activation_scale(None, z), torch.full((1,), 1e-12, device=DEV) / torch.tensor(448.0,
                                                                                                       device=DEV))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_quantize_activation_bit_exact(dtype):
    c = mod()
    g = gen(4)
    x = act(g, 2, 32, 2, 9, 11, dtype, scale=3.0)
    prev = act(g, 2, 32, 2, 9, 11, dtype, scale=3.0)
    s = c.activation_scale(prev, x)
    pq, xq = c.quantize_activation(prev, x, s)
    for v, q in ((prev, pq), (x, xq)):
        assert q.dtype == FP8 and q.shape == v.shape and q.is_contiguous(memory_format=CL)
        inv = torch.ones_like(s) / s
        q_ref = (v.float() * inv).to(FP8)  # no clamp needed: |v| <= amax
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(q.view(torch.uint8), c.quantize_activation_reference(v, s).view(torch.uint8))
    assert xq.float().abs().max() == 448 or pq.float().abs().max() == 448  # amax maps to the top code
    # a caller-given scale that is too small saturates to +-448 (torch's own cast would give NaN past 464)
    small = s / 8
    _, xq8 = c.quantize_activation(None, x, small)
    assert not torch.isnan(xq8.float()).any() and xq8.float().abs().max() == 448
    assert torch.equal(xq8.view(torch.uint8), c.quantize_activation_reference(x, small).view(torch.uint8))


# ----------------------------------------------------------------------------------------------------------------------
# the conv vs its eager reference (small shapes; the interpreter on CPU)

CASES = [
    # dtype, B, Cin, Cout, T, H, W, cached frames, bias, quantize, BLOCK_M (None: default config)
    (F16, 1, 16, 16, 1, 6, 7, 0, True, "pass", None),
    (F16, 1, 16, 16, 3, 8, 9, 2, True, "pass", 64),  # 216 pixels: 4 tiles, the last partial
    (BF16, 1, 16, 48, 2, 7, 10, 1, True, "fused", 64),  # Cout 48 = 32 + 16: the two-block N split
    (F16, 2, 32, 16, 2, 6, 6, 2, False, "fused", 64),  # batch 2 (pixel -> (b, t) decomposition), no bias
    (BF16, 1, 48, 32, 1, 5, 11, 2, True, "pass", None),  # Cin 48: 32-channel chunks with a masked tail
]


@pytest.mark.parametrize("dtype,b,cin,cout,t,h,w,n_prev,has_bias,quantize,bm", CASES)
def test_conv_matches_reference(dtype, b, cin, cout, t, h, w, n_prev, has_bias, quantize, bm):
    c = mod()
    g = gen(100 + cin + cout + t)
    x = act(g, b, cin, t, h, w, dtype)
    prev = act(g, b, cin, n_prev, h, w, dtype, scale=2.0) if n_prev else None  # cache holds the largest values
    weight, bias = conv_weights(g, cout, cin, bias=has_bias)
    w_q, w_s = c.quantize_conv_weight(weight)
    cfg = None
    if bm is not None:
        d = c.default_config(cin, cout, b * t * h * w, quantize == "pass")
        cfg = c.ConvConfig(bm, d.block_n0, d.block_n1, 4, 2)
    out = poisoned((b, cout, t, h, w), dtype)
    y = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, out=out, quantize=quantize, config=cfg)
    assert y is out and y.is_contiguous(memory_format=CL)
    y_ref, s_abs = c.causal_conv3d_fp8_reference(prev, x, w_q, w_s, bias, return_abs_sum=True)
    rel = interp_rel(cin) if INTERPRET else GPU_REL
    assert_within(y, y_ref, s_abs, bias, rel, f"{quantize} vs reference")
    sa = c.activation_scale(prev, x)
    if quantize == "fused":  # the pass gives the same codes and the same dot (a caller-given scale here)
        y2 = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, sa, quantize="pass", config=cfg)
        if INTERPRET:
            assert torch.equal(y2, y), "pass differs from fused"
        else:
            assert_within(y2, y_ref, s_abs, bias, rel, "pass vs reference")
    else:  # already-quantized inputs (the pass's own output) take exactly the pass's path
        pq, xq = c.quantize_activation(prev, x, sa)
        y3 = c.causal_conv3d_fp8(pq, xq, w_q, w_s, bias, sa, out_dtype=dtype, config=cfg)
        assert torch.equal(y3, y)


@pytest.mark.parametrize("dtype,b,cin,cout,t,h,w,n_prev,has_bias,quantize,bm", CASES)
def test_tma_kernel_matches_reference_and_pointer_kernel(dtype, b, cin, cout, t, h, w, n_prev, has_bias, quantize, bm):
    """The TMA kernel (one box load per tap, the TMA unit's zero fill as the conv's padding) on the same cases: within
    the bound of the reference, and in the interpreter bit-identical to the pointer kernel (both sum each BLOCK_K chunk
    with numpy's fp32 matmul and the chunks in the same order). Also through quantize_stream + conv3d_fp8_stream, and
    with a residual added in the epilogue (the bits of torch.add after the conv)."""
    c = mod()
    g = gen(300 + cin + cout + t)
    x = act(g, b, cin, t, h, w, dtype)
    prev = act(g, b, cin, n_prev, h, w, dtype, scale=2.0) if n_prev else None
    weight, bias = conv_weights(g, cout, cin, bias=has_bias)
    w_q, w_s = c.quantize_conv_weight(weight)
    out = poisoned((b, cout, t, h, w), dtype)
    y = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, out=out, kernel="tma")
    assert y is out
    y_ref, s_abs = c.causal_conv3d_fp8_reference(prev, x, w_q, w_s, bias, return_abs_sum=True)
    assert_within(y, y_ref, s_abs, bias, interp_rel(cin) if INTERPRET else GPU_REL, "tma vs reference")
    sa = c.activation_scale(prev, x)
    stream = c.quantize_stream(prev, x, sa)
    pq, xq = c.quantize_activation(prev, x, sa)
    expect = torch.cat([pq, xq], dim=2) if prev is not None else xq
    assert stream.shape == (b, cin, n_prev + t, h, w) and stream.is_contiguous(memory_format=CL)
    assert torch.equal(stream.view(torch.uint8), expect.view(torch.uint8)), "stream codes"
    y2 = c.conv3d_fp8_stream(stream, n_prev, w_q, w_s, bias, sa, dtype)
    assert torch.equal(y2, y)
    r = act(g, b, cout, t, h, w, dtype)
    y3 = c.conv3d_fp8_stream(stream, n_prev, w_q, w_s, bias, sa, dtype, residual=r)
    assert torch.equal(y3, torch.add(y, r))
    if INTERPRET:
        assert torch.equal(y, c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, kernel="pointer")), "tma != pointer"


def test_tma_configs_and_kernel_choice(raise_value_errors):
    c = mod()
    assert [c.tma_tile_width(v) for v in (832, 416, 208, 104, 70, 7)] == [64, 32, 16, 8, 8, 8]
    for cin, cout, h, w in ((96, 96, 480, 832), (192, 192, 240, 416), (384, 384, 120, 208), (384, 384, 60, 104),
                            (384, 32, 60, 104), (16, 48, 7, 10)):
        for t in (1, 4):
            cands = c.tma_candidate_configs(cin, cout, h, w, t * h * w)
            assert 1 <= len(cands) <= 6 and len(set(cands)) == len(cands)
            for cfg in cands:
                width = cfg.block_n0 + cfg.block_n1
                assert cout % width == 0 and cfg.bw == c.tma_tile_width(w)
                assert all(n == 0 or (n >= 16 and n & (n - 1) == 0) for n in (cfg.block_n0, cfg.block_n1))
                assert cfg.bh * cfg.bw * width <= c.TMA_ACC_REGS_MAX * 32 * cfg.num_warps
                assert 2 <= cfg.num_stages <= c.TMA_MAX_STAGES
    # the tuning key holds w's patch width, not w: crops of widths with one patch width have the same candidates
    # (with M in one power of two and on the same side of the few-tiles line), so one tuning serves them all
    for cin, cout in ((96, 96), (192, 192), (384, 384), (384, 32)):
        for h, widths in ((40, (320, 512, 640, 832)), (33, (296, 424)), (20, (200, 232))):
            for m_of in (lambda w: 4 * h * w, lambda w: 1 << 20):
                same = {tuple(c.tma_candidate_configs(cin, cout, h, w, m_of(w))) for w in widths
                        if c.tma_tile_width(w) == c.tma_tile_width(widths[0])
                        and (m_of(w) < 128 * 132 * 2) == (m_of(widths[0]) < 128 * 132 * 2)}
                assert len(same) == 1, (cin, cout, h, widths)
    g = gen(8)
    x, prev = act(g, 1, 16, 2, 5, 6), act(g, 1, 16, 2, 5, 6)
    weight, bias = conv_weights(g, 16, 16)
    w_q, w_s = c.quantize_conv_weight(weight)
    sa = c.activation_scale(prev, x)
    stream = c.quantize_stream(prev, x, sa)
    base = torch.zeros(stream.numel() + 16, dtype=FP8, device=DEV)
    misaligned = base[1:1 + stream.numel()].as_strided(stream.shape, stream.stride())
    assert misaligned.is_contiguous(memory_format=CL) and misaligned.data_ptr() % 16
    # under "auto" a given config's type picks the kernel (in the interpreter "auto" alone picks the pointer kernel)
    tcfg = c.tma_candidate_configs(16, 16, 5, 6, 60)[0]
    assert torch.equal(c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, sa, config=tcfg),
                       c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, sa, kernel="tma", config=tcfg))
    for promote in (False, True):  # precise accumulation keeps the accumulator registers lower
        for cfg in c.tma_candidate_configs(384, 384, 120, 208, 10**5, promote=promote):
            limit = c.TMA_ACC_REGS_MAX_PROMOTE if promote else c.TMA_ACC_REGS_MAX
            assert cfg.bh * cfg.bw * (cfg.block_n0 + cfg.block_n1) <= limit * 32 * cfg.num_warps
    raise_value_errors([
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, kernel="tma", quantize="fused"), "quantize='pass'"),
        (lambda: c.conv3d_fp8_stream(misaligned, 2, w_q, w_s, bias, sa, F16), "16-byte aligned"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, kernel="bogus"), "kernel must be"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, kernel="pointer",
                                     config=c.tma_candidate_configs(16, 16, 5, 6, 60)[0]), "TmaConfig"),
        (lambda: c.conv3d_fp8_stream(stream, 3, w_q, w_s, bias, sa, F16), "n_prev"),
        (lambda: c.conv3d_fp8_stream(stream.float(), 2, w_q, w_s, bias, sa, F16), "dtype"),
        (lambda: c.conv3d_fp8_stream(stream, 2, w_q, w_s, bias, sa, F32), "out_dtype"),
        (lambda: c.conv3d_fp8_stream(stream, 2, w_q, w_s, bias, sa, F16, residual=x[:, :, :1]), "residual"),
        (lambda: c.conv3d_fp8_stream(stream, 2, w_q, w_s, bias, sa, F16, residual=x.contiguous()), "residual"),
    ])


def test_reference_reads_prev_and_pads_with_zeros():
    """The cached frames matter (changing them changes output frames 0-1 only) and a missing cache is zeros."""
    c = mod()
    g = gen(7)
    x = act(g, 1, 16, 3, 5, 6)
    prev = act(g, 1, 16, 2, 5, 6)
    weight, bias = conv_weights(g, 16, 16)
    w_q, w_s = c.quantize_conv_weight(weight)
    sa = c.activation_scale(prev, x)
    y = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, sa)
    y0 = c.causal_conv3d_fp8(torch.zeros_like(prev), x, w_q, w_s, bias, sa)
    y_none = c.causal_conv3d_fp8(None, x, w_q, w_s, bias, sa)
    assert torch.equal(y0, y_none)  # zeros(2) == no cache
    assert torch.equal(y[:, :, 2:], y_none[:, :, 2:])  # frame 2 on sees only x
    assert not torch.equal(y[:, :, :1], y_none[:, :, :1]) and not torch.equal(y[:, :, 1:2], y_none[:, :, 1:2])
    # one cached frame == two cached frames whose older one is zero
    y1 = c.causal_conv3d_fp8(prev[:, :, 1:].contiguous(memory_format=CL), x, w_q, w_s, bias, sa)
    prev_z = prev.clone()
    prev_z[:, :, 0] = 0
    assert torch.equal(y1, c.causal_conv3d_fp8(prev_z, x, w_q, w_s, bias, sa))


@pytest.mark.parametrize("n_prev", [0, 1, 2])
def test_reference_by_frame_matches_full(n_prev):
    """The frame-by-frame reference the GPU tests use equals the whole-chunk reference (torch only)."""
    c = mod()
    g = gen(20 + n_prev)
    x = act(g, 1, 16, 3, 4, 5)
    prev = act(g, 1, 16, n_prev, 4, 5) if n_prev else None
    weight, bias = conv_weights(g, 16, 16)
    w_q, w_s = c.quantize_conv_weight(weight)
    sa = c.activation_scale_reference(prev, x)
    y, s_abs = c.causal_conv3d_fp8_reference(prev, x, w_q, w_s, bias, sa, return_abs_sum=True)
    y2, s2 = reference_by_frame(c, prev, x, w_q, w_s, bias, sa)
    assert torch.equal(y, y2) and torch.equal(s_abs, s2)


def test_matches_causal_conv3d_with_cache():
    """No-concatenation semantics == vae.CausalConv3d fed chunk by chunk through a CausalCache (fp32, dequantized
    weights; activations chosen on the fp8 grid of a power-of-two scale, so quantizing them is exact)."""
    from fastremover.models.vae import CausalCache, CausalConv3d

    c = mod()
    g = gen(11)
    cin, cout, h, w = 16, 32, 6, 7
    weight, bias = conv_weights(g, cout, cin)
    w_q, w_s = c.quantize_conv_weight(weight)
    conv = CausalConv3d(cin, cout, 3, padding=1).to(DEV)
    with torch.no_grad():
        conv.weight.copy_(c.dequantize_conv_weight(w_q, w_s, cin))
        conv.bias.copy_(bias)
    s_a = torch.full((1,), 2.0**-5, device=DEV)
    codes = (torch.randn(1, cin, 6, h, w, generator=g) * 120).clamp(-448, 448).to(FP8)
    video = (codes.float() * 2.0**-5).to(DEV, F16).contiguous(memory_format=CL)  # exact in fp16
    cache_mod, cache_ker = CausalCache(), CausalCache()
    key = torch.nn.Identity()  # the kernel's cache entry
    t0 = 0
    seen = []
    for n in (1, 3, 2):  # prev of 0, then 1 (after a 1-frame chunk), then 2 frames
        chunk = video[:, :, t0:t0 + n]
        t0 += n
        prev = cache_ker.push(key, chunk)
        prev = prev.contiguous(memory_format=CL) if prev is not None else None
        seen.append(0 if prev is None else prev.shape[2])
        y = c.causal_conv3d_fp8(prev, chunk.contiguous(memory_format=CL), w_q, w_s, bias, s_a)
        with torch.no_grad():
            y_mod = conv(chunk.float(), cache_mod)
        _, s_abs = c.causal_conv3d_fp8_reference(prev, chunk, w_q, w_s, bias, s_a, return_abs_sum=True)
        assert_within(y, y_mod.to(F16), s_abs, bias, interp_rel(cin) if INTERPRET else GPU_REL,
                      f"chunk of {n} frames after {seen[-1]} cached")
    assert seen == [0, 1, 2]


# ----------------------------------------------------------------------------------------------------------------------
# refusals (ValueError: the caller falls back to the fp16 cuDNN conv)


def test_wrappers_reject_bad_inputs(raise_value_errors):
    c = mod()
    g = gen(5)
    x = act(g, 1, 16, 2, 5, 6)
    prev = act(g, 1, 16, 2, 5, 6)
    weight, bias = conv_weights(g, 16, 16)
    w_q, w_s = c.quantize_conv_weight(weight)
    sa = c.activation_scale(prev, x)
    x3 = act(g, 1, 3, 2, 5, 6)
    cases = [
        (lambda: c.quantize_conv_weight(torch.randn(16, 3, 3, 3, 3, device=DEV)), "multiples of 16"),  # conv_in
        (lambda: c.quantize_conv_weight(torch.randn(3, 16, 3, 3, 3, device=DEV)), "multiples of 16"),  # conv_out
        (lambda: c.quantize_conv_weight(torch.randn(24, 16, 3, 3, 3, device=DEV)), "multiples of 16"),
        (lambda: c.quantize_conv_weight(torch.randn(16, 16, 1, 3, 3, device=DEV)), "[Cout, Cin, 3, 3, 3]"),
        (lambda: c.quantize_conv_weight(torch.randn(16, 16, 3, 3, 3, device=DEV).double()), "fp16/bf16/fp32"),
        (lambda: c.causal_conv3d_fp8(None, x3, w_q[:, :81].contiguous(), w_s, bias), "multiples of 16"),
        (lambda: c.causal_conv3d_fp8(None, x, w_q[:3].contiguous(), w_s[:3].contiguous(), None), "multiples of 16"),
        (lambda: c.causal_conv3d_fp8(prev, x.contiguous(), w_q, w_s, bias), "channels_last_3d"),
        (lambda: c.causal_conv3d_fp8(prev.contiguous(), x, w_q, w_s, bias), "channels_last_3d"),
        (lambda: c.causal_conv3d_fp8(torch.cat([prev, prev[:, :, :1]], 2).contiguous(memory_format=CL), x, w_q, w_s,
                                     bias), "1..2"),
        (lambda: c.causal_conv3d_fp8(act(g, 1, 16, 2, 5, 7), x, w_q, w_s, bias), "prev must be"),
        (lambda: c.causal_conv3d_fp8(prev.to(BF16), x, w_q, w_s, bias), "dtype"),
        (lambda: c.causal_conv3d_fp8(prev, x.float().contiguous(memory_format=CL), w_q, w_s, bias), "dtype"),
        (lambda: c.causal_conv3d_fp8(prev, x[0], w_q, w_s, bias), "5-D"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q.float(), w_s, bias), "float8_e4m3fn"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q[:, :27 * 8].contiguous(), w_s, bias), "[Cout, 27*Cin]"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s[:8].contiguous(), bias), "w_scale"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s.half(), bias), "w_scale"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias[:8]), "bias"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, sa.half()), "act_scale"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, torch.ones(2, device=DEV)), "act_scale"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, quantize="bogus"), "quantize"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, out=torch.empty(1, 16, 2, 5, 6, device=DEV,
                                                                               dtype=F16)), "channels_last_3d"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, out=poisoned((1, 16, 2, 5, 6), BF16)), "out must"),
        (lambda: c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, out_dtype=F32), "out_dtype"),
        (lambda: c.causal_conv3d_fp8(None, x.to(FP8), w_q, w_s, bias), "act_scale"),
        (lambda: c.causal_conv3d_fp8(None, x.to(FP8), w_q, w_s, bias, sa), "out_dtype"),
        (lambda: c.quantize_activation(prev, x, None), "act_scale"),
        (lambda: c.activation_scale(prev, x.to(BF16)), "dtype"),
    ]
    raise_value_errors(cases)
    if not INTERPRET:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            c.causal_conv3d_fp8(prev.cpu(), x.cpu(), w_q.cpu(), w_s.cpu(), bias.cpu())


# ----------------------------------------------------------------------------------------------------------------------
# GPU, real shapes (run on the device machine: pytest -m gpu tests/kernels/test_conv3d_fp8.py -s)

REAL = [
    # Cin, Cout, T, H, W, cached frames
    (96, 96, 4, 480, 832, 2),
    (192, 192, 1, 240, 416, 1),
    (384, 384, 4, 120, 208, 0),
    (384, 384, 4, 60, 104, 2),
]


def fresh_gen():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[seed {seed}]", end=" ")
    return torch.Generator(device="cuda").manual_seed(seed), seed


@pytest.mark.gpu
@gpu_real
@pytest.mark.parametrize("cin,cout,t,h,w,n_prev", REAL)
def test_gpu_real_shapes(cin, cout, t, h, w, n_prev):
    c = mod()
    g, seed = fresh_gen()
    x = torch.randn(1, cin, t, h, w, device="cuda", generator=g).half().contiguous(memory_format=CL)
    prev = (torch.randn(1, cin, n_prev, h, w, device="cuda", generator=g).half().contiguous(memory_format=CL)
            if n_prev else None)
    weight = torch.randn(cout, cin, 3, 3, 3, device="cuda", generator=g) / (27 * cin) ** 0.5
    bias = torch.randn(cout, device="cuda", generator=g) * 0.1
    w_q, w_s = c.quantize_conv_weight(weight)
    out = poisoned((1, cout, t, h, w), F16)
    y = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, out=out)
    sa = c.activation_scale(prev, x)
    assert torch.equal(sa, c.activation_scale_reference(prev, x)), f"seed {seed}: activation scale"
    y_ref, s_abs = reference_by_frame(c, prev, x, w_q, w_s, bias, sa)
    r = assert_within(y, y_ref, s_abs, bias, GPU_REL, f"seed {seed} pass/precise")
    err = float(((y.float() - y_ref.float()).abs() / (s_abs + bias.abs().view(1, -1, 1, 1, 1))).max())
    y16 = c.fp16_conv_reference(prev, x, weight, bias)
    cos = cosine(y, y16)
    print(f"pass/precise: max|diff|/(S+|b|) = {err:.2e} (bound {GPU_REL:.1e}), max diff/bound {r:.3f}, "
          f"cos vs fp16 cuDNN {cos:.6f}")
    assert cos >= 0.999, f"seed {seed}: cosine vs fp16 F.conv3d {cos}"
    m = t * h * w
    cfg = c.tuned_config("tma", cin, cout, m, w, c.block_k_for(cin), True, x.device)
    assert isinstance(cfg, c.TmaConfig), "the default kernel on sm_90 is the TMA kernel"
    print(f"TMA config {cfg}")
    yp = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, sa, kernel="pointer")
    rp = assert_within(yp, y_ref, s_abs, bias, GPU_REL, f"seed {seed} pointer kernel")
    print(f"pointer kernel: max diff/bound {rp:.3f}")
    # the stream form with a residual added in the epilogue: the bits of the conv followed by torch.add
    stream = c.quantize_stream(prev, x, sa)
    r = torch.randn(y.shape, device="cuda", generator=g).half().contiguous(memory_format=CL)
    y_s = c.conv3d_fp8_stream(stream, n_prev, w_q, w_s, bias, sa, F16)
    assert torch.equal(y_s, y), f"seed {seed}: conv3d_fp8_stream differs from causal_conv3d_fp8"
    assert torch.equal(c.conv3d_fp8_stream(stream, n_prev, w_q, w_s, bias, sa, F16, residual=r), torch.add(y, r))
    cfg = c.tuned_config("pointer", cin, cout, m, w, c.block_k_for(cin), True, x.device)
    yf = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, sa, quantize="fused", config=cfg)
    rf = assert_within(yf, y_ref, s_abs, bias, GPU_REL, f"seed {seed} fused")
    yi = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias, sa, precise_acc=False)  # the TMA kernel, as the fast VAE
    erri = float(((yi.float() - y_ref.float()).abs() / (s_abs + bias.abs().view(1, -1, 1, 1, 1))).max())
    print(f"fused: max diff/bound {rf:.3f}; imprecise acc (no promotion): max|diff|/(S+|b|) = {erri:.2e}, "
          f"cos vs fp16 {cosine(yi, y16):.6f}")
    # The promotion is written out in the TMA kernel (Triton 3.6 drops max_num_imprecise_acc for K steps over 32):
    # if it ran, the precise kernel's error is well below the unpromoted one's (H200: 0.7-1.4e-4 vs 6-7e-4).
    assert err < 0.5 * erri, f"seed {seed}: fp32 promotion had no effect ({err:.2e} vs {erri:.2e} without it)"


@pytest.mark.gpu
@gpu_real
def test_gpu_no_host_sync_and_cuda_graph():
    """After the first (tuning) call: no host synchronization, and the call captures into a CUDA graph whose replay on
    new inputs matches an eager call bit for bit."""
    c = mod()
    g, seed = fresh_gen()
    cin, cout, t, h, w = 96, 96, 2, 120, 208
    x = torch.randn(1, cin, t, h, w, device="cuda", generator=g).half().contiguous(memory_format=CL)
    prev = torch.randn(1, cin, 2, h, w, device="cuda", generator=g).half().contiguous(memory_format=CL)
    weight = torch.randn(cout, cin, 3, 3, 3, device="cuda", generator=g) / (27 * cin) ** 0.5
    bias = torch.randn(cout, device="cuda", generator=g) * 0.1
    w_q, w_s = c.quantize_conv_weight(weight)
    c.causal_conv3d_fp8(prev, x, w_q, w_s, bias)  # tunes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        c.causal_conv3d_fp8(prev, x, w_q, w_s, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y), f"seed {seed}: graph replay differs"
    x.copy_(torch.randn(x.shape, device="cuda", generator=g).half() * 3)
    graph.replay()
    y_eager = c.causal_conv3d_fp8(prev, x, w_q, w_s, bias)
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y_eager), f"seed {seed}: graph replay on new inputs differs"
    assert not torch.equal(y_eager, y)
