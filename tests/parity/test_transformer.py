"""Our RemoverTransformer against the upstream structure built from diffusers blocks (float64 complex RoPE)."""

import pytest
import torch

from fastremover.bench.reference import UpstreamTransformer
from fastremover.errors import FastRemoverError
from fastremover.models.loading import PRESETS, random_init_
from fastremover.models.transformer import (
    RemoverTransformer,
    RemoverTransformerConfig,
    apply_rope,
    rope_cos_sin,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def make_pair(cfg: RemoverTransformerConfig, seed: int):
    ours = random_init_(RemoverTransformer(cfg), seed).eval()
    ref = UpstreamTransformer(cfg).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


@pytest.mark.parametrize(
    "cfg_kwargs,latent_shape",
    [
        (dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2, freq_dim=32), (1, 48, 3, 8, 12)),
        (dict(num_attention_heads=3, attention_head_dim=24, ffn_dim=96, num_layers=3, freq_dim=64), (2, 48, 2, 6, 4)),
        (dict(num_attention_heads=2, attention_head_dim=128, ffn_dim=128, num_layers=1), (1, 48, 5, 4, 6)),
    ],
)
def test_transformer_matches_upstream_structure(cfg_kwargs, latent_shape):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    cfg = RemoverTransformerConfig(**cfg_kwargs)
    ours, ref = make_pair(cfg, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(latent_shape, generator=g)
    t = torch.rand(latent_shape[0], generator=g) * 1000
    with torch.no_grad():
        a, b = ours(x, t), ref(x, t)
    assert a.shape == (latent_shape[0], 16, *latent_shape[2:])
    assert rel_err(a, b) <= 1e-4, rel_err(a, b)
    # The check must be able to fail: a perturbed weight changes the output well beyond the bound.
    with torch.no_grad():
        ours.blocks[0].attn1.norm_k.weight.mul_(1.5)
        assert rel_err(ours(x, t), b) > 1e-3


def test_rope_fp32_tables_match_float64_complex():
    d, grid = 128, (3, 5, 7)
    cos, sin = rope_cos_sin(grid, d, 1024)
    x = torch.randn(1, grid[0] * grid[1] * grid[2], 2, d)
    ref = UpstreamTransformer(RemoverTransformerConfig(num_attention_heads=1, attention_head_dim=d, num_layers=0))
    freqs = ref._rope(torch.zeros(1, 48, grid[0], grid[1] * 2, grid[2] * 2))  # [1,1,S,D/2] complex128
    x_c = torch.view_as_complex(x.double().transpose(1, 2).unflatten(3, (-1, 2)))
    expect = torch.view_as_real(x_c * freqs).flatten(3, 4).transpose(1, 2)
    assert rel_err(apply_rope(x, cos, sin), expect) <= 1e-6


def test_fp16_keeps_upstream_fp32_islands():
    cfg = RemoverTransformerConfig.from_dict(PRESETS["tiny"]["transformer"])
    model = RemoverTransformer(cfg).to_inference_dtype(torch.float16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["condition_embedder.time_embedder.linear_1.weight"] == torch.float32
    assert dtypes["blocks.0.scale_shift_table"] == torch.float32
    assert dtypes["scale_shift_table"] == torch.float32
    assert dtypes["condition_embedder.time_proj.weight"] == torch.float16
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.float16


def test_config_roundtrip_and_errors():
    cfg = RemoverTransformerConfig()
    assert RemoverTransformerConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.dim == 1536 and cfg.num_layers == 30 and cfg.ffn_dim == 8960
    with pytest.raises(FastRemoverError, match="unknown keys"):
        RemoverTransformerConfig.from_dict({**cfg.to_dict(), "text_dim": 4096})
    with pytest.raises(FastRemoverError, match="qk_norm"):
        RemoverTransformerConfig.from_dict({**cfg.to_dict(), "qk_norm": "layer_norm"})
    with pytest.raises(FastRemoverError, match="rope_max_seq_len"):
        rope_cos_sin((2, 2000, 4), 128, 1024)
