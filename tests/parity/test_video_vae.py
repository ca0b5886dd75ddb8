"""The VideoVAE interface (fastremover/engine/vae.py): both VAEs implement it, each with its own memory model, decode
chunk by chunk equals the whole decode bit for bit, and the pipeline reaches its VAE only through it."""

import inspect

import pytest
import torch

from fastremover.config import FastVAEOptions
from fastremover.engine import tiling as vt
from fastremover.fast.vae import FastWanVAE, build_vae
from fastremover.models.loading import PRESETS, random_init_
from fastremover.models.vae import WanVAE, WanVAEConfig
from fastremover.engine.vae import EagerVideoVAE, VideoVAE
from helpers import load_tool

lab = load_tool("vae_tiling_check")  # the live-tensor-byte counter and the GPU check (lab code, tools/)

TINY = WanVAEConfig.from_dict(PRESETS["tiny"]["vae"])
REAL = WanVAEConfig()
F32 = torch.float32


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    return random_init_(WanVAE(TINY), 3).eval()


def _video(frames, h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, frames, h, w, generator=g) * 2 - 1


def _mask(frames, h, w, seed=1):
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(1, 1, frames, h // 8, w // 8, generator=g) > 0.6).float()
    return torch.nn.functional.interpolate(m, size=(frames, h, w)).expand(1, 3, -1, -1, -1).contiguous()


def test_both_vaes_are_video_vaes(tiny):
    eager, name = build_vae(tiny, "eager", torch.device("cpu"), F32)
    assert isinstance(eager, EagerVideoVAE) and isinstance(eager, VideoVAE) and name == "eager"
    assert eager.module is tiny and eager.device.type == "cpu" and eager.dtype == F32
    fast = FastWanVAE(tiny, device="cpu", dtype=F32, kernels="torch")
    assert isinstance(fast, VideoVAE)
    assert eager.memory_budget() is None  # host memory is not planned: CPU calls never tile (as before)


def test_decode_iter_equals_decode_bitwise(tiny):
    z = torch.randn(1, TINY.z_dim, 3, 4, 6, generator=torch.Generator().manual_seed(5))
    chunks = list(tiny.decode_iter(z))
    assert [c.shape[2] for c in chunks] == [1, 4, 4]
    assert torch.equal(torch.cat(chunks, dim=2), tiny.decode(z))
    for kw in ({}, {"decode_frames": None}, {"decode_frames": 2, "tap_head": False}):
        fast = FastWanVAE(tiny, device="cpu", dtype=F32, kernels="torch", options=FastVAEOptions(**kw))
        parts = list(fast.decode_iter(z))
        assert [c.shape[2] for c in parts] == [1, 4, 4], kw
        assert all(c.is_contiguous() for c in parts)
        assert torch.equal(torch.cat(parts, dim=2), fast.decode(z)), kw
    eager = EagerVideoVAE(tiny)
    lat = eager.normalize(tiny.encode(_video(9, 32, 48)))
    assert torch.equal(eager.decode_latents(lat), tiny.decode(tiny.denormalize(lat)))


def test_encode_removal_is_the_pipelines_two_encodes(tiny):
    """Untiled: exactly normalize(encode(frames * (1 - mask))), normalize(encode(2 * mask - 1)) of the eager module
    (the pipeline's order before the interface); the fast VAE's batched pair agrees to fp32 rounding."""
    frames, mask = _video(9, 32, 48), _mask(9, 32, 48)
    eager = EagerVideoVAE(tiny)
    za, zb = eager.encode_removal(frames, mask)
    assert torch.equal(za, tiny.normalize(tiny.encode(frames * (1 - mask))))
    assert torch.equal(zb, tiny.normalize(tiny.encode(2 * mask - 1.0)))
    for pair in (True, False):
        fast = FastWanVAE(tiny, device="cpu", dtype=F32, kernels="torch", options=FastVAEOptions(pair=pair))
        fa, fb = fast.encode_removal(frames, mask)
        torch.testing.assert_close(fa, za, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fb, zb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_normalize_is_wanvaes(tiny, dtype):
    z = torch.randn(1, TINY.z_dim, 2, 3, 4, generator=torch.Generator().manual_seed(2)).to(dtype)
    for vae in (EagerVideoVAE(tiny), FastWanVAE(tiny, device="cpu", dtype=F32, kernels="torch")):
        assert torch.equal(vae.normalize(z), tiny.normalize(z))
        assert torch.equal(vae.denormalize(z), tiny.denormalize(z))
    other = WanVAEConfig(base_dim=8, num_res_blocks=1, latents_mean=tuple(range(16)), latents_std=(3.0,) * 16)
    module = WanVAE(other)
    assert torch.equal(EagerVideoVAE(module).normalize(z), module.normalize(z))


def test_tiled_calls_follow_the_vaes_memory_budget(tiny, monkeypatch):
    """A budget too small for one call: encode_removal and decode_latents_iter run in tiles (the same tiles and
    numbers as engine/tiling.py's functions), and the tiled decode still comes as one chunk per latent frame."""
    eager = EagerVideoVAE(tiny)
    frames, mask = _video(9, 144, 208), _mask(9, 144, 208)
    untiled = eager.memory_bytes("encode", 9, 144, 208)
    monkeypatch.setattr(eager, "memory_budget", lambda: int(0.8 * untiled))
    plan = eager.tile_plan("encode", 9, 144, 208)
    assert plan is not None and plan.tiles > 1
    za, zb = eager.encode_removal(frames, mask)
    assert torch.equal(za, tiny.normalize(vt.encode_tiled(tiny.encode, frames * (1 - mask), plan.tile, plan.overlap)))
    assert torch.equal(zb, tiny.normalize(vt.encode_tiled(tiny.encode, 2 * mask - 1.0, plan.tile, plan.overlap)))
    dplan = eager.tile_plan("decode", 9, 144, 208)
    assert dplan is not None and dplan.tiles > 1
    chunks = list(eager.decode_latents_iter(za))
    assert [c.shape[2] for c in chunks] == [1, 4, 4]
    whole = vt.decode_tiled(tiny.decode, tiny.denormalize(za), dplan.tile_latent, dplan.overlap_latent)
    assert torch.equal(torch.cat(chunks, dim=2), whole)


def _fast_on_meta(cfg, dtype, **kw):
    with torch.device("meta"):
        module = WanVAE(cfg).to(dtype)
    return module, FastWanVAE(module, device="meta", dtype=dtype, kernels="torch", options=FastVAEOptions(**kw))


def _live_peak(module, fast, op, frames, h, w, dtype):
    if op == "encode":
        x = torch.zeros(1, cfg_in(fast), frames, h, w, dtype=dtype, device="meta")
        fn = fast.encode
    else:
        x = torch.zeros(1, fast.config.z_dim, (frames - 1) // 4 + 1, h // 8, w // 8, dtype=dtype, device="meta")
        fn = fast.decode
    held = [x, *module.parameters(), *fast.weights.gamma.values()]
    for c in fast.weights.conv.values():
        held += [t for t in (c.weight, c.bias) if t is not None]
    meter = lab.LiveTensorBytes(held)
    with meter:
        fn(x)
    return meter.peak


def cfg_in(fast):
    return fast.config.in_channels


# The fast VAE's settings that change its memory: frames per step (auto: 2 / 1; whole chunks, the CUDA default for
# small frames), channel padding and the padded RGB ends (CUDA defaults), the tap head.
SETTINGS = [
    {"pad_channels": 0},
    {"pad_channels": 64, "pad_rgb": True},
    {"pad_channels": 64, "pad_rgb": True, "encode_frames": None, "decode_frames": None},
    {"pad_channels": 0, "encode_frames": 1, "decode_frames": 2, "tap_head": False},
]


@pytest.mark.parametrize("cfg", [REAL, TINY], ids=["real", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("kw", SETTINGS, ids=["auto", "cuda-pads", "whole-chunks", "small-steps"])
def test_fast_memory_model_bounds_live_bytes(cfg, dtype, kw):
    """FastWanVAE.memory_bytes against the live tensor bytes of real calls (meta device: the same allocations,
    nothing computed): an upper bound within 40 % (encode) / 30 % (decode), at two frame sizes."""
    module, fast = _fast_on_meta(cfg, dtype, **kw)
    for op, slack in (("encode", 1.40), ("decode", 1.30)):
        for frames, h, w in ((9, 72, 136), (13, 96, 64)):
            measured = _live_peak(module, fast, op, frames, h, w, dtype)
            model = fast.memory_bytes(op, frames, h, w)
            assert measured <= model <= slack * measured, (op, frames, h, w, measured, model, model / measured)
            assert fast.memory_bytes(op, frames, h, w, batch=2) == pytest.approx(2 * model, abs=2)


def test_each_vae_plans_tiles_with_its_own_model():
    """At 1080p the eager and the fast VAE's models differ, and so do their plans under the same budget: each
    plan fits its own model (choose_tiling with call_bytes), not the other's."""
    module, fast = _fast_on_meta(REAL, torch.float16)
    eager = EagerVideoVAE(module)
    frames, h, w = 81, 1088, 1920
    fast_b, eager_b = fast.memory_bytes("decode", frames, h, w), eager.memory_bytes("decode", frames, h, w)
    assert fast_b != eager_b
    budget = int(1.2 * min(fast_b, eager_b))  # the smaller model's call fits untiled, the larger one's does not
    for vae in (fast, eager):
        vae.memory_budget = lambda: budget
    small, large = (fast, eager) if fast_b < eager_b else (eager, fast)
    assert small.tile_plan("decode", frames, h, w) is None
    plan = large.tile_plan("decode", frames, h, w)
    assert plan is not None and plan.tiles > 1
    assert 1.15 * vt.estimate_tiled_bytes("decode", frames, h, w, torch.float16, REAL, plan.tile, plan.overlap,
                                          large.memory_bytes) <= budget


def test_pipeline_reaches_the_vae_only_through_the_interface():
    """No device-type, attribute or tiling branches for the VAE in the pipeline's stages."""
    from fastremover.pipeline import RemovalPipeline

    for name in ("encode", "decode", "decode_iter", "finish_chunk", "_fill_window", "_run_window"):
        source = inspect.getsource(getattr(RemovalPipeline, name))
        for banned in ("hasattr(", "device.type", "tiling", "encode_tiled", "decode_auto", "FastWanVAE"):
            assert banned not in source, (name, banned)
