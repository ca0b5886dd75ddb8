"""The sub-pixel nearest-2x + 3x3 conv kernel (fastremover/fast/kernels/upsample_conv.py) against its references.

CPU: the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set here and in conftest.py before the module is
imported) at small shapes; the GPU tests (`gpu` marker) run the compiled kernel at the W2 decoder's shapes.

Claims:
  * phase_weights: each phase weight is the exact fp32 sum of the 3x3 weights its tap covers (module doc), one rounding;
  * the kernel vs the exact (float64) eager composition F.interpolate(nearest-exact) + F.conv2d(padding=1):
    |y - y_ref| <= (u + (4 Cin + 2) 2^-24) (S + |b|) + ulp_dtype, u = 2^-11 (fp16) / 2^-8 (bf16);
  * the fast VAE's decoder upsamplers use it ("subpixel") and stay within that kind of bound of the eager pair.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from fastremover.config import FastVAEOptions

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
F16, BF16 = torch.float16, torch.bfloat16
CL = torch.channels_last
U = {F16: 2.0**-11, BF16: 2.0**-8}
MANT = {F16: 10, BF16: 7}


def mod():
    from fastremover.fast.kernels import upsample_conv

    return upsample_conv


def gen(seed):
    return torch.Generator().manual_seed(seed)


def frames(g, n, c, h, w, dtype, device=DEV):
    return torch.randn(n, c, h, w, generator=g).to(device=device, dtype=dtype).contiguous(memory_format=CL)


def weights(g, cout, cin, dtype, device=DEV, bias=True):
    w = (torch.randn(cout, cin, 3, 3, generator=g) / (9 * cin) ** 0.5).to(device=device, dtype=dtype)
    b = (torch.randn(cout, generator=g) * 0.1).to(device) if bias else None
    return w, b


def assert_within(y, y_ref, s_abs, cin, dtype, what=""):
    """|y - y_ref| <= (u + (4 Cin + 2) 2^-24) S + ulp_dtype(|y_ref| + that); returns max diff / bound."""
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert not torch.isnan(y.float()).any(), f"{what}: NaN (unwritten output?)"
    e32 = (U[dtype] + (4 * cin + 2) * 2.0**-24) * s_abs
    mag = y_ref.float().abs() + e32
    _, ex = torch.frexp(mag)
    ulp = torch.exp2((ex - 1).clamp_min(-14 if dtype == F16 else -126).float() - MANT[dtype])
    bound = e32 + ulp
    diff = (y.float() - y_ref.float()).abs()
    bad = diff > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} of {diff.numel()} outside the bound"
    return float((diff / bound).max())


def test_phase_weights_are_the_exact_tap_sums():
    u = mod()
    g = gen(1)
    w = torch.randn(6, 4, 3, 3, generator=g)
    wp = u.phase_weights(w, torch.float32).view(2, 2, 6, 2, 2, 4)  # [py, px, o, a, b, c]
    assert torch.equal(wp[0, 0, :, 0, 0], w[:, :, 0, 0])  # R(0, 0) x R(0, 0): one weight, copied
    assert torch.equal(wp[1, 1, :, 1, 1], w[:, :, 2, 2])
    assert torch.equal(wp[0, 0, :, 0, 1], w[:, :, 0, 1] + w[:, :, 0, 2])  # row 0, columns 1 + 2
    assert torch.allclose(wp[0, 1, :, 1, 0], w[:, :, 1:, :2].sum(dim=(2, 3)), rtol=0, atol=1e-6)  # rows 1-2, cols 0-1
    assert torch.allclose(wp[0, 0, :, 1, 1], w[:, :, 1:, 1:].sum(dim=(2, 3)), rtol=0, atol=1e-6)
    assert torch.allclose(wp[1, 0, :, 0, 1], w[:, :, :2, 1:].sum(dim=(2, 3)), rtol=0, atol=1e-6)
    # every 3x3 weight is counted once per phase: the 4 taps of a phase sum to the whole kernel
    whole = w.sum(dim=(2, 3))
    for py in (0, 1):
        for px in (0, 1):
            assert torch.allclose(wp[py, px].sum(dim=(1, 2)), whole, atol=1e-5)
    h16 = u.phase_weights(w.half())
    assert h16.dtype == F16 and h16.shape == (24, 16) and h16.is_contiguous()


CASES = [
    # dtype, N, Cin, Cout, h, w, bias
    (F16, 2, 32, 48, 5, 7, True),  # Cout 48 = 32 + 16: the two-block N split; patches overhang both edges
    (BF16, 1, 64, 96, 4, 9, False),  # 96 = 64 + 32, no bias
    (F16, 1, 16, 16, 3, 3, True),
    (BF16, 3, 32, 32, 6, 17, True),
]


@pytest.mark.parametrize("dtype,n,cin,cout,h,w,has_bias", CASES)
def test_kernel_within_bound_of_exact_reference(dtype, n, cin, cout, h, w, has_bias):
    u = mod()
    g = gen(10 + cin + cout)
    x = frames(g, n, cin, h, w, dtype)
    wt, b = weights(g, cout, cin, dtype, bias=has_bias)
    out = torch.full((n, cout, 2 * h, 2 * w), float("nan"), dtype=dtype, device=DEV).contiguous(memory_format=CL)
    y = u.upsample_conv2x(x, u.phase_weights(wt, dtype), b, out=out)
    assert y is out and y.is_contiguous(memory_format=CL)
    y_ref, s_abs = u.upsample_conv2x_reference(x, wt, b)
    r = assert_within(y, y_ref, s_abs, cin, dtype, f"{dtype} {cin}->{cout} {h}x{w}")
    assert r > 0  # the phase weights' rounding shows up somewhere: the kernel did not just copy a reference
    y_eager = u.upsample_conv2x_eager(x.float(), wt.float(), b).to(dtype)
    assert (y.float() - y_eager.float()).abs().max() <= 4 * U[dtype] * y_eager.float().abs().max() + 1e-3


def test_rejects_bad_arguments(raise_value_errors):
    u = mod()
    g = gen(2)
    x = frames(g, 1, 16, 3, 4, F16)
    wt, b = weights(g, 16, 16, F16)
    wp = u.phase_weights(wt)
    raise_value_errors([
        (lambda: u.upsample_conv2x(x.contiguous(), wp, b), "channels_last"),
        (lambda: u.upsample_conv2x(x.float().contiguous(memory_format=CL), wp, b), "dtype"),
        (lambda: u.upsample_conv2x(x, wp.float(), b), "w_phase"),
        (lambda: u.upsample_conv2x(x, wp[:, :32].contiguous(), b), "w_phase"),
        (lambda: u.upsample_conv2x(x, wp, b[:3]), "bias"),
        (lambda: u.upsample_conv2x(frames(g, 1, 8, 3, 4, F16), u.phase_weights(wt[:, :8]), b), "multiples of 16"),
        (lambda: u.upsample_conv2x(x, wp, b, out=torch.empty(1, 16, 6, 8, dtype=F16, device=DEV)), "out must"),
        (lambda: u.phase_weights(torch.randn(4, 4, 3, 1)), "[Cout, Cin, 3, 3]"),
        # a column block that does not divide Cout would write into the other phase's channels: refused
        (lambda: u.upsample_conv2x(frames(g, 1, 16, 3, 4, F16), u.phase_weights(torch.randn(48, 16, 3, 3).half()),
                                   None, config=u.UpConvConfig(8, 8, 32, 0, 4, 3)), "does not fit"),
        (lambda: u.upsample_conv2x(x, wp, b, config=u.UpConvConfig(8, 8, 24, 0, 4, 3)), "does not fit"),
    ])
    for cin, cout, w in ((384, 192, 104), (192, 96, 416), (32, 32, 9), (16, 48, 7)):
        cands = u.candidate_configs(cin, cout, w, 10**6, limit=None)
        assert cands and len(set(cands)) == len(cands)
        assert all(cout % (c.block_n0 + c.block_n1) == 0 for c in cands)


def test_fast_vae_decoder_uses_the_subpixel_conv(monkeypatch):
    """FastWanVAE's upsamplers with upsample_conv on (forced here on the CPU through the interpreter, fp16): the
    decode matches the eager-upsample decode of the same VAE to fp16 precision, and the kernel ran."""
    if not INTERPRET:
        pytest.skip("the GPU path runs in the bench and test_gpu_* below")
    from fastremover.fast.vae import FastWanVAE
    from fastremover.fast.vae import model as vae_model
    from fastremover.models.loading import random_init_
    from fastremover.models.vae import WanVAE, WanVAEConfig

    u = mod()
    calls = {"n": 0}
    real = u.upsample_conv2x

    class Up:
        supported = staticmethod(u.supported)
        phase_weights = staticmethod(u.phase_weights)

        @staticmethod
        def upsample_conv2x(*a, **k):
            calls["n"] += 1
            return real(*a, **k)

    monkeypatch.setattr(vae_model, "load_upconv", lambda device, dtype: Up)
    vae = random_init_(WanVAE(WanVAEConfig(base_dim=16, num_res_blocks=1)), 5).eval().half()
    sub = FastWanVAE(vae, device="cpu", dtype=F16, kernels="torch")
    eager = FastWanVAE(vae, device="cpu", dtype=F16, kernels="torch",
                       options=FastVAEOptions(upsample_conv="eager"))
    assert sub.options.upsample_conv == "subpixel" and eager.options.upsample_conv == "eager"
    z = torch.randn(1, 16, 2, 3, 4, generator=gen(6)).half()
    a, b = sub.decode(z), eager.decode(z)
    assert calls["n"] > 0
    err = (a.float() - b.float()).abs().max().item()
    assert err <= 0.02 * b.float().abs().max().item() and not torch.equal(a, b), err


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs the compiled kernel")
@pytest.mark.parametrize("n,cin,cout,h,w", [(2, 384, 192, 60, 104), (1, 384, 192, 120, 208), (1, 192, 96, 240, 416),
                                           (2, 192, 128, 240, 416)])
def test_gpu_real_shapes(n, cin, cout, h, w):
    u = mod()
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    x = frames(g, n, cin, h, w, F16, device="cuda")
    wt, b = weights(g, cout, cin, F16, device="cuda")
    y = u.upsample_conv2x(x, u.phase_weights(wt), b)
    y_ref, s_abs = u.upsample_conv2x_reference(x[:1], wt, b)
    r = assert_within(y[:1], y_ref, s_abs, cin, F16, f"seed {seed}")
    ye = u.upsample_conv2x_eager(x, wt, b)
    from fastremover.bench.metrics import cosine

    cos = cosine(y, ye)
    print(f"[seed {seed}] {cin}->{cout} {h}x{w}: max diff/bound {r:.3f}, cos vs eager {cos:.7f}")
    assert cos >= 0.99999
    assert torch.equal(y, u.upsample_conv2x(x, u.phase_weights(wt), b)), "not deterministic"
