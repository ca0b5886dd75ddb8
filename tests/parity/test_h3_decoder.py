"""The MiniMax-H3 ViT decoder (fastremover/models/h3_decoder.py) against an independent functional reference."""

import math

import pytest
import torch
from safetensors.torch import save_file

from fastremover.errors import FastRemoverError
from fastremover.models import h3_decoder as h3

TINY2 = h3.with_layers(h3.preset("tiny"), 2)


# ----------------------------------------------------------------------------------------------------------------------
# An independent reference, written from the published structure: plain loops and explicit formulas, no module code


def _rms(x, w, eps):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _ref_rope(cfg, t, hh, ww):
    r = cfg.rotary_dim
    nf = r // 6
    rows = []
    for ti in range(t):
        for yi in range(hh):
            for xi in range(ww):
                rows.append([(2 * ti + 1) / t - 1, (2 * yi + 1) / hh - 1, (2 * xi + 1) / ww - 1])
    rows += [[0.0, 0.0, 0.0]] * (cfg.num_register_tokens + 1)
    pos = torch.tensor(rows, dtype=torch.float64)
    freqs = torch.tensor([cfg.rope_theta ** (-6 * j / r) for j in range(nf)], dtype=torch.float64)
    ang = torch.cat([2 * math.pi * pos[:, a:a + 1] * freqs for a in range(3)], dim=1)
    ang = torch.cat([ang, ang], dim=1)
    return ang.cos().float(), ang.sin().float()


def _ref_decoder(sd, cfg, x):
    """x [B, C, t, h, w] (after post_quant_conv) -> pixels, from the state dict."""
    b, c, t, hh, ww = x.shape
    p, pt, d, H = cfg.patch_size, cfg.patch_size_t, cfg.dim, cfg.num_heads
    dh = d // H
    tok = torch.einsum("bcthw->bthwc", x).reshape(b, -1, c)
    n = tok.shape[1]
    hs = tok @ sd["decoder.proj_in.weight"].T + sd["decoder.proj_in.bias"]
    hs = torch.cat([hs, sd["decoder.register_tokens"].expand(b, -1, -1), torch.zeros(b, 1, d)], dim=1)
    cos, sin = _ref_rope(cfg, t, hh, ww)
    r = cfg.rotary_dim

    def rope(v):  # v [B, S, H, dh]
        out = v.clone()
        half = r // 2
        for j in range(half):
            a, bb = v[..., j], v[..., j + half]
            out[..., j] = a * cos[:, None, j] - bb * sin[:, None, j]
            out[..., j + half] = bb * cos[:, None, j + half] + a * sin[:, None, j + half]
        return out

    for i in range(cfg.num_layers):
        pre = f"decoder.transformer_blocks.{i}."
        lin = lambda v, name: v @ sd[pre + name + ".weight"].T + sd[pre + name + ".bias"]  # noqa: E731
        y = _rms(hs, sd[pre + "norm1.weight"], cfg.norm_eps)
        q, k, v = (lin(y, "attn." + nm).view(b, -1, H, dh) for nm in ("to_q", "to_k", "to_v"))
        q, k = rope(_rms(q, None, cfg.norm_eps)), rope(_rms(k, None, cfg.norm_eps))
        att = torch.softmax(torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(dh), dim=-1)
        o = torch.einsum("bhst,bthd->bshd", att, v).reshape(b, -1, d)
        hs = hs + lin(o, "attn.to_out.0") * sd[pre + "scale1"]
        y = _rms(hs, sd[pre + "norm2.weight"], cfg.norm_eps)
        u = lin(y, "ff.net.0.proj")
        f = cfg.ffn_dim
        g = u[..., f:]
        hs = hs + lin(u[..., :f] * g * torch.sigmoid(g), "ff.net.2") * sd[pre + "scale2"]
    mu, var = hs.mean(-1, keepdim=True), hs.var(-1, unbiased=False, keepdim=True)
    y = (hs - mu) / torch.sqrt(var + cfg.norm_eps) * sd["decoder.norm_out.weight"] + sd["decoder.norm_out.bias"]
    y = (y @ sd["decoder.proj_out.weight"].T + sd["decoder.proj_out.bias"])[:, :n]
    y = y.view(b, t, hh, ww, cfg.out_channels, pt, p, p)
    out = torch.zeros(b, cfg.out_channels, t * pt, hh * p, ww * p)
    for ti in range(t):
        for yi in range(hh):
            for xi in range(ww):
                out[:, :, ti * pt:(ti + 1) * pt, yi * p:(yi + 1) * p, xi * p:(xi + 1) * p] = y[:, ti, yi, xi]
    return out


@pytest.fixture(scope="module")
def tiny2():
    return h3.random_decoder(TINY2, seed=3)


def test_decoder_matches_independent_reference(tiny2):
    sd = {k: v.detach() for k, v in tiny2.state_dict().items()}
    x = torch.randn(2, TINY2.latent_channels, 3, 2, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = tiny2.decoder(x)
    want = _ref_decoder(sd, TINY2, x)
    assert got.shape == (2, 3, 12, 8, 12)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()
    # the layer scales matter (a reference that skipped the blocks would differ)
    sd0 = dict(sd)
    for i in range(TINY2.num_layers):
        sd0[f"decoder.transformer_blocks.{i}.scale1"] = torch.zeros(TINY2.dim)
    assert not torch.allclose(_ref_decoder(sd0, TINY2, x), want, atol=1e-3)


def test_public_config_and_checkpoint_names():
    full = h3.preset("full")
    assert (full.latent_channels, full.patch_size, full.patch_size_t, full.num_layers, full.num_heads,
            full.head_dim, full.num_register_tokens, full.ffn_mult, full.rope_theta, full.rotary_dim,
            full.norm_eps, full.clip_length, full.token_drop, full.tile_overlap) == \
        (24, 16, 4, 36, 32, 64, 4, 4, 100.0, 48, 1e-5, 17, 3, 64)
    assert (full.chunk_tokens, full.pre_padding, full.overlap_tokens, full.overlap_frames) == (5, 3, 2, 5)
    keys = set(h3.H3VideoDecoder(h3.with_layers(h3.preset("tiny"), 1)).state_dict())
    for k in ("post_quant_conv.weight", "decoder.proj_in.weight", "decoder.register_tokens",
              "decoder.transformer_blocks.0.attn.to_q.bias", "decoder.transformer_blocks.0.attn.to_out.0.weight",
              "decoder.transformer_blocks.0.ff.net.0.proj.weight", "decoder.transformer_blocks.0.ff.net.2.weight",
              "decoder.transformer_blocks.0.scale1", "decoder.transformer_blocks.0.norm2.weight",
              "decoder.norm_out.bias", "decoder.proj_out.weight"):
        assert k in keys, k
    cfg = h3.H3DecoderConfig.from_dict({"latent_channels": 24, "decoder_num_layers": 8,
                                        "spatial_downsample_factors": [2, 2, 2, 2, 1, 1],
                                        "temporal_downsample_factors": [1, 2, 2, 1, 1, 1], "block_out_channels": [1]})
    assert (cfg.num_layers, cfg.patch_size, cfg.patch_size_t) == (8, 16, 4)


def test_latent_statistics_from_config():
    cfg = h3.H3DecoderConfig(latent_channels=2, latents_mean=(1.0, -2.0), latents_std=(0.5, 3.0), num_layers=1,
                             num_heads=2, head_dim=16, patch_size=4, tile_size=16, tile_overlap=8)
    m = h3.H3VideoDecoder(cfg)
    z = torch.ones(1, 2, 1, 1, 1)
    assert m.denormalize_latents(z).flatten().tolist() == [1.5, 1.0]
    assert torch.equal(m.normalize_latents(m.denormalize_latents(z)), z)
    with pytest.raises(ValueError):
        h3.H3DecoderConfig(latent_channels=2, latents_mean=(0.0,), latents_std=(1.0, 1.0))


def test_tiers():
    assert h3.tier_blocks(36, "8L") == [0, 5, 10, 15, 20, 25, 30, 35]
    assert h3.tier_blocks(36, "36L") == list(range(36))
    assert h3.tier_blocks(5, None) == list(range(5))
    for bad in ("9", "0L", "L", "40L"):
        with pytest.raises(FastRemoverError):
            h3.tier_blocks(36, bad)


def test_tier_runs_only_its_blocks(tiny2):
    ran = []
    hooks = [blk.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
             for i, blk in enumerate(tiny2.decoder.transformer_blocks)]
    try:
        z = torch.randn(1, TINY2.latent_channels, 1, 2, 2)
        one = tiny2.decode(z, tier="1L")
        assert set(ran) == {1}
        ran.clear()
        both = tiny2.decode(z)
        assert set(ran) == {0, 1}
    finally:
        for hk in hooks:
            hk.remove()
    assert not torch.allclose(one, both)


def _ref_plan_frames(cfg, latent_frames):
    """Frames, counted token by token: every decoded window contributes its frames [pre, ct*pt) (the first token of a
    clip stands for clip_length % pt frames, the others for pt), the dropped tail's overlap adds overlap_frames, and
    padding tokens contribute nothing."""
    ct, pt, pre = cfg.chunk_tokens, cfg.patch_size_t, cfg.pre_padding
    tokens = latent_frames + cfg.token_drop
    clips = -(-tokens // ct)
    windows = max(clips - (cfg.token_drop > 0), 1)
    frames = 0
    for tok in range(windows * ct):
        if tok >= latent_frames:
            continue
        frames += pt - pre if tok % ct == 0 else pt
    real_after = latent_frames - windows * ct  # tokens the last overlap decodes
    if cfg.token_drop > 0 and real_after > 0:
        frames += min(cfg.overlap_frames, real_after * pt - pre)
    return frames


def test_temporal_plan_counts():
    cfg = h3.preset("tiny")
    for t in range(1, 30):
        _, windows, frames = h3.temporal_plan(cfg, t)
        assert frames == _ref_plan_frames(cfg, t), t
        assert windows >= 1
    with pytest.raises(FastRemoverError):
        h3.temporal_plan(cfg, 0)


def test_decode_windows_and_blend(tiny2):
    """A two-window decode equals the windows decoded by hand and cross-faded."""
    cfg = TINY2
    z = torch.randn(1, cfg.latent_channels, 8, 2, 2, generator=torch.Generator().manual_seed(1))
    pad, windows, frames = h3.temporal_plan(cfg, 8)
    assert windows == 2
    out = tiny2.decode(z)
    assert out.shape[2] == frames
    zp = torch.cat([z, z[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
    with torch.no_grad():
        w0 = tiny2.decoder(tiny2.post_quant_conv(zp[:, :, 0:7]))
        w1 = tiny2.decoder(tiny2.post_quant_conv(zp[:, :, 5:12]))
    first = w0[:, :, 3:20]
    ov = w0[:, :, 23:]
    second = w1[:, :, 3:20].clone()
    wgt = torch.arange(5) / 5
    second[:, :, :5] = ov[:, :, :5] * (1 - wgt.view(1, 1, 5, 1, 1)) + second[:, :, :5] * wgt.view(1, 1, 5, 1, 1)
    want = torch.cat([first, second], dim=2)[:, :, :frames]
    assert torch.allclose(out, want, atol=1e-6)


def test_split_and_stitch_tiles():
    for length in (16, 24, 40, 64, 100 * 4):
        starts, size, overlaps = h3.split_tiles(length, 16, 8, 4)
        assert starts[0] == 0 and starts[-1] + size == length
        assert all(o >= 8 and o % 4 == 0 for o in overlaps)
        assert all(b - a == size - o for a, b, o in zip(starts, starts[1:], overlaps))
    # stitching crops of one image gives back the image
    img = torch.randn(1, 3, 2, 24, 40, dtype=torch.float64)
    ys, th, yo = h3.split_tiles(24, 16, 8, 4)
    xs, tw, xo = h3.split_tiles(40, 16, 8, 4)
    rows = [[img[..., y:y + th, x:x + tw] for x in xs] for y in ys]
    assert torch.allclose(h3.stitch_tiles(rows, yo, xo), img, atol=1e-12)


def test_tiled_decode_equals_untiled_when_one_tile(tiny2):
    z = torch.randn(1, TINY2.latent_channels, 2, 4, 4)  # 16 x 16 pixels: exactly one tile
    with torch.no_grad():
        direct = tiny2.decoder(tiny2.post_quant_conv(z[:, :, :7].expand(-1, -1, -1, -1, -1)))
    assert tiny2.decode_window(z, 1).shape == direct.shape
    assert torch.equal(tiny2.decode_window(z, 1), direct)


def test_load_decoder_by_checkpoint_names(tmp_path, tiny2):
    sd = {k: v.contiguous() for k, v in tiny2.state_dict().items()}
    sd["encoder.conv_in.weight"] = torch.zeros(3)  # encoder keys are ignored
    save_file(sd, tmp_path / "vae.safetensors")
    loaded = h3.load_decoder(tmp_path / "vae.safetensors", TINY2)
    z = torch.randn(1, TINY2.latent_channels, 1, 2, 2)
    assert torch.equal(loaded.decode(z), tiny2.decode(z))
    del sd["decoder.norm_out.weight"]
    save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(FastRemoverError, match="lacks"):
        h3.load_decoder(tmp_path / "bad.safetensors", TINY2)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(FastRemoverError, match="cannot read"):
        h3.load_decoder(tmp_path / "junk.safetensors", TINY2)
