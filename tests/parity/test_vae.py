"""The Wan 2.1 VAE against diffusers' `AutoencoderKLWan` (the oracle), plus its config and CPU conv path."""

import pytest
import torch
import torch.nn.functional as F

from fastremover.errors import FastRemoverError
from fastremover.models.vae import CausalCache, WanVAE, WanVAEConfig, conv3d, conv3d_per_tap

diffusers = pytest.importorskip("diffusers", reason="diffusers (the oracle; in the dev extra) is not installed")
from diffusers import AutoencoderKLWan  # noqa: E402

# vae/config.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (the VAE MiniMax-Remover ships), written out by hand.
WAN21_VAE_CONFIG_JSON = {
    "_class_name": "AutoencoderKLWan",
    "_diffusers_version": "0.33.0.dev0",
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": [
        -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
    ],
    "latents_std": [
        2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916,
    ],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}  # fmt: skip


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def make_pair(cfg: WanVAEConfig, seed: int):
    """diffusers' model with random weights (RMS gammas moved away from 1) and ours loading its state dict strictly."""
    torch.manual_seed(seed)
    ref = AutoencoderKLWan(**cfg.to_dict()).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".gamma"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    ours = WanVAE(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


# ----------------------------------------------------------------------------------------------------------------------
# Parity with diffusers


PARITY_CASES = [
    # (base_dim, num_res_blocks, batch, frames, height, width)
    (8, 1, 1, 1, 16, 16),
    (8, 1, 1, 5, 32, 48),
    (8, 1, 1, 9, 32, 48),
    (8, 1, 1, 13, 16, 16),
    (16, 2, 1, 9, 16, 16),
    (8, 1, 2, 5, 16, 16),  # batch 2: every conv takes the F.conv3d path instead of conv3d_per_tap
    (8, 1, 1, 7, 16, 16),  # not 4k+1: diffusers ignores the 2 frames after the last full chunk, and so do we
]


@pytest.mark.parametrize("base_dim,num_res_blocks,batch,frames,height,width", PARITY_CASES)
def test_encode_decode_match_diffusers(base_dim, num_res_blocks, batch, frames, height, width):
    cfg = WanVAEConfig(base_dim=base_dim, num_res_blocks=num_res_blocks)
    seed = hash((base_dim, num_res_blocks, batch, frames, height, width)) % 2**31
    ref, ours = make_pair(cfg, seed)
    torch.manual_seed(seed + 1)
    x = torch.rand(batch, 3, frames, height, width) * 2 - 1

    with torch.no_grad():
        z_ref = ref.encode(x).latent_dist.mode()
        x_ref = ref.decode(z_ref).sample
    z = ours.encode(x)
    x_dec = ours.decode(z_ref)

    t = (frames - 1) // 4 + 1
    assert z.shape == (batch, 16, t, height // 8, width // 8) == z_ref.shape
    assert x_dec.shape == (batch, 3, 4 * (t - 1) + 1, height, width) == x_ref.shape
    assert x_dec.is_contiguous() and z.is_contiguous()
    assert rel_err(z, z_ref) <= 1e-4
    assert rel_err(x_dec, x_ref) <= 1e-4
    assert x_dec.abs().max() <= 1.0  # decode clamps, as diffusers does


def test_history_matters():
    """Guards the parity test's power: decoding without the earlier latent frames gives visibly different frames."""
    ref, ours = make_pair(WanVAEConfig(base_dim=8, num_res_blocks=1), seed=7)
    z = torch.randn(1, 16, 3, 2, 2)
    full = ours.decode(z)
    alone = ours.decode(z[:, :, 2:])  # the last latent frame decoded as if it were the first
    assert rel_err(alone, full[:, :, 8:9]) > 1e-2


def test_bf16_close_to_diffusers():
    cfg = WanVAEConfig(base_dim=8, num_res_blocks=1)
    ref, ours = make_pair(cfg, seed=11)
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = (torch.rand(1, 3, 5, 16, 16) * 2 - 1).to(torch.bfloat16)
    with torch.no_grad():
        z_ref = ref.encode(x).latent_dist.mode()
        x_ref = ref.decode(z_ref).sample
    # On CPU our bf16 path runs the same kernels on the same layouts as diffusers and is bit-identical today; a
    # layout or cast difference (e.g. non-contiguous q/k/v into SDPA) shows up here as ~3e-2 after the decoder.
    assert ours.encode(x).dtype == torch.bfloat16
    assert rel_err(ours.encode(x), z_ref) <= 1e-2
    assert rel_err(ours.decode(z_ref), x_ref) <= 1e-2


def test_state_dict_names_match_diffusers_at_release_size():
    cfg = WanVAEConfig.from_dict(WAN21_VAE_CONFIG_JSON)
    with torch.device("meta"):
        ref = AutoencoderKLWan(**cfg.to_dict())
        ours = WanVAE(cfg)
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    our_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert our_shapes == ref_shapes


# ----------------------------------------------------------------------------------------------------------------------
# Latent normalization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalize_matches_upstream_minimax_formula(dtype):
    vae = WanVAE(WanVAEConfig(base_dim=8, num_res_blocks=1))
    z = torch.randn(1, 16, 2, 3, 3).to(dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1).to(z.device, z.dtype)
    assert vae.latents_mean.shape == vae.latents_std.shape == (1, 16, 1, 1, 1)
    assert torch.equal(vae.normalize(z), (z - mean) * inv_std)
    assert torch.equal(vae.denormalize(z), z / inv_std + mean)
    if dtype == torch.float32:
        torch.testing.assert_close(vae.denormalize(vae.normalize(z)), z)


# ----------------------------------------------------------------------------------------------------------------------
# Config


def test_from_dict_real_config():
    cfg = WanVAEConfig.from_dict(WAN21_VAE_CONFIG_JSON)
    assert cfg == WanVAEConfig()
    assert cfg.spatial_compression == 8 and cfg.temporal_compression == 4
    d = cfg.to_dict()
    assert d["_class_name"] == "AutoencoderKLWan"
    assert WanVAEConfig.from_dict(d) == cfg
    for key, value in WAN21_VAE_CONFIG_JSON.items():
        if not key.startswith("_"):
            assert d[key] == value, key


def test_to_dict_builds_same_diffusers_config():
    cfg = WanVAEConfig(base_dim=8, num_res_blocks=1, z_dim=4, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    ref = AutoencoderKLWan(**cfg.to_dict())
    assert WanVAEConfig.from_dict(dict(ref.config)) == cfg


def test_unknown_key_rejected():
    with pytest.raises(FastRemoverError, match="base_dims"):
        WanVAEConfig.from_dict({**WAN21_VAE_CONFIG_JSON, "base_dims": 96})


@pytest.mark.parametrize(
    "key,value",
    [
        ("is_residual", True),
        ("patch_size", 2),
        ("decoder_base_dim", 256),
        ("attn_scales", [1.0]),
        ("temperal_downsample", [False, True]),
        ("temperal_downsample", [True, True, True]),
        ("latents_mean", [0.0] * 15),
        ("base_dim", 0),
        ("clip_output", False),
    ],
)
def test_unsupported_values_rejected(key, value):
    with pytest.raises(FastRemoverError, match=key):
        WanVAEConfig.from_dict({**WAN21_VAE_CONFIG_JSON, key: value})


def test_accepted_values():
    d = {**WAN21_VAE_CONFIG_JSON, "decoder_base_dim": 96, "dropout": 0.1, "clip_output": True, "patch_size": None}
    assert WanVAEConfig.from_dict(d).dropout == 0.1


# ----------------------------------------------------------------------------------------------------------------------
# CPU conv path and the cache


CONV_CASES = [
    # (in_ch, out_ch, frames, h, w, kernel, stride, padding)
    (8, 8, 5, 12, 20, (3, 3, 3), (1, 1, 1), (0, 1, 1)),
    (3, 16, 3, 17, 9, (3, 3, 3), (1, 1, 1), (0, 1, 1)),
    (16, 8, 6, 10, 14, (3, 3, 3), (1, 1, 1), (0, 0, 0)),
    (8, 16, 4, 12, 20, (1, 1, 1), (1, 1, 1), (0, 0, 0)),
    (16, 32, 1, 5, 7, (1, 1, 1), (1, 1, 1), (0, 0, 0)),
    (8, 8, 5, 6, 10, (3, 1, 1), (2, 1, 1), (0, 0, 0)),  # the downsample time_conv
    (8, 16, 3, 6, 10, (3, 1, 1), (1, 1, 1), (0, 0, 0)),  # the upsample time_conv
]


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_conv3d_per_tap_matches_conv3d(case, channels_last, batch):
    cin, cout, t, h, w, kernel, stride, padding = case
    torch.manual_seed(hash((case, channels_last, batch)) % 2**31)
    x = torch.randn(batch, cin, t, h, w)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    weight = torch.randn(cout, cin, *kernel)
    bias = torch.randn(cout)
    expected = F.conv3d(x, weight, bias, stride, padding)
    for got in (conv3d_per_tap(x, weight, bias, stride, padding), conv3d(x, weight, bias, stride, padding)):
        assert got.shape == expected.shape
        assert rel_err(got, expected) <= 1e-5
    assert rel_err(conv3d_per_tap(x, weight, None, stride, padding), F.conv3d(x, weight, None, stride, padding)) <= 1e-5


@pytest.mark.parametrize(
    "shape", [(1, 8, 6, 426, 10), (1, 8, 6, 427, 10), (1, 96, 6, 35, 8), (1, 96, 6, 36, 8), (2, 8, 3, 8, 8)]
)
def test_conv3d_dispatch_follows_aten_heuristic(shape):
    """`conv3d` takes the per-tap path exactly where PyTorch would use its slow reference conv3d kernel."""
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None:
        pytest.skip("this PyTorch does not expose _select_conv_backend")
    x = torch.empty(shape)
    weight = torch.empty(shape[1], shape[1], 3, 3, 3)
    backend = str(select(x, weight, None, [1, 1, 1], [0, 1, 1], [1, 1, 1], False, [0, 0, 0], 1, None))
    uses_slow = backend.endswith("Slow3d")
    ours_per_tap = shape[0] == 1 and shape[1] * shape[2] * shape[3] <= 20480
    assert uses_slow == ours_per_tap, backend


def test_causal_cache_keeps_stream_tail():
    cache, owner = CausalCache(), torch.nn.Identity()
    frames = torch.arange(6.0).view(1, 1, 6, 1, 1)
    assert cache.push(owner, frames[:, :, :1]) is None  # first chunk: nothing earlier
    assert cache.push(owner, frames[:, :, 1:2]).flatten().tolist() == [0.0]
    assert cache.push(owner, frames[:, :, 2:5]).flatten().tolist() == [0.0, 1.0]
    assert cache.push(owner, frames[:, :, 5:6]).flatten().tolist() == [3.0, 4.0]
    assert cache.push(owner, frames[:, :, 5:6], keep=2).flatten().tolist() == [4.0, 5.0]
    assert cache.first_visit(owner) and not cache.first_visit(owner)
