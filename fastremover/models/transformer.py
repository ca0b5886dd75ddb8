"""The MiniMax-Remover diffusion transformer: a Wan-2.1-style DiT without text cross-attention.

Eager math only; the fast paths in `fastremover.fast` replace pieces of it explicitly. Module and parameter names are the
checkpoint's (`blocks.{i}.attn1.to_q.weight`, `blocks.{i}.ffn.net.0.proj.weight`, ...), so a diffusers-layout safetensors
file loads with a strict key check.

Forward (one denoise step), shapes for the released model (dim = 12 heads x 128 = 1536):
    x [B, 48, T, H, W]  --patch_embedding (Conv3d k=s=(1,2,2))-->  tokens [B, S, dim],  S = T * H/2 * W/2
    timestep [B] --sinusoid(256)--> time_embedder (fp32) = temb --SiLU, time_proj--> per-block modulation [B, 6, dim]
    30 x block:  adaLN(LN_fp32(x)) -> self-attention (q/k RMSNorm over all heads, 3D RoPE) -> gated residual
                 adaLN(LN_fp32(x)) -> GELU-tanh MLP -> gated residual
    norm_out (adaLN with the final 2-row table) -> proj_out -> unpatchify -> [B, 16, T, H, W]

Precision follows the upstream model loaded in fp16: `time_embedder` and every `scale_shift_table` stay fp32
(`keep_fp32` below), the modulation arithmetic and the LayerNorms run in fp32, everything else in the model dtype.
The only intended difference from upstream: RoPE is applied with fp32 cos/sin tables computed once in float64,
instead of upstream's float64 complex multiply on every call (a known slow spot); on fp16/bf16 activations the
result rounds to the same values except for rare one-ulp differences.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.errors import FastRemoverError
from fastremover.lru import LRUCache
from fastremover.models.config_types import check_config_types
from fastremover.engine.interfaces import SINGLE


ROPE_CACHE_SIZE = 16  # RoPE tables kept per model (one per latent grid the model has seen lately)


@dataclass(frozen=True)
class RemoverTransformerConfig:
    """`transformer/config.json` of a MiniMax-Remover checkpoint (diffusers `Transformer3DModel` keys)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 12
    attention_head_dim: int = 128
    in_channels: int = 48
    out_channels: int = 16
    freq_dim: int = 256
    ffn_dim: int = 8960
    num_layers: int = 30
    cross_attn_norm: bool = True  # accepted for config compatibility; there is no cross-attention in this model
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, d: dict) -> "RemoverTransformerConfig":
        known = {f.name for f in fields(cls)}
        given = {k: v for k, v in d.items() if not k.startswith("_")}
        unknown = sorted(set(given) - known)
        if unknown:
            raise FastRemoverError(
                f"transformer config has unknown keys {unknown}; expected a MiniMax-Remover Transformer3DModel config "
                f"(keys: {sorted(known)})"
            )
        check_config_types(cls, given, "transformer")
        if "patch_size" in given:
            given["patch_size"] = tuple(given["patch_size"])
        cfg = cls(**given)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        d = asdict(self)
        d["patch_size"] = list(self.patch_size)
        return {"_class_name": "Transformer3DModel", **d}

    def validate(self) -> None:
        problems = []
        if self.qk_norm != "rms_norm_across_heads":
            problems.append(f"qk_norm={self.qk_norm!r} (only 'rms_norm_across_heads' is supported)")
        if self.added_kv_proj_dim is not None:
            problems.append(f"added_kv_proj_dim={self.added_kv_proj_dim} (image/text conditioning is not part of MiniMax-Remover)")
        if len(self.patch_size) != 3 or self.patch_size[0] != 1:
            problems.append(f"patch_size={list(self.patch_size)} (expected [1, p, p])")
        if self.attention_head_dim % 2 or self.attention_head_dim < 6:
            problems.append(f"attention_head_dim={self.attention_head_dim} (must be even and >= 6 for 3D RoPE)")
        if problems:
            raise FastRemoverError("unsupported transformer config: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------------------------
# Embeddings


def timestep_sinusoid(timestep: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal timestep embedding, [cos | sin] order (diffusers `Timesteps(flip_sin_to_cos=True, shift=0)`), fp32."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    angles = timestep[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def rope_frequencies(head_dim: int, max_seq_len: int, theta: float = 10000.0) -> torch.Tensor:
    """Per-axis RoPE angles in float64, [max_seq_len, head_dim/2], columns = [t-axis | h-axis | w-axis] frequencies.

    The t axis gets `head_dim - 4*(head_dim//6)` channels (44 of 128), h and w `2*(head_dim//6)` each (42).
    """
    hw = 2 * (head_dim // 6)
    t = head_dim - 2 * hw
    pos = torch.arange(max_seq_len, dtype=torch.float64)
    parts = []
    for axis_dim in (t, hw, hw):
        inv_freq = 1.0 / (theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float64) / axis_dim))
        parts.append(torch.outer(pos, inv_freq))
    return torch.cat(parts, dim=1)


def rope_cos_sin(
    grid: tuple[int, int, int], head_dim: int, max_seq_len: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [S, head_dim/2] for a post-patch grid (frames, rows, cols), token order f-major like the
    flattened patch embedding."""
    f, h, w = grid
    if max(grid) > max_seq_len:
        raise FastRemoverError(
            f"latent grid {grid} exceeds rope_max_seq_len={max_seq_len}; use a smaller --size or shorter windows"
        )
    angles = rope_frequencies(head_dim, max_seq_len)
    hw = head_dim // 6
    t_half = head_dim // 2 - 2 * hw
    a_t, a_h, a_w = angles.split([t_half, hw, hw], dim=1)
    table = torch.cat(
        [
            a_t[:f].view(f, 1, 1, -1).expand(f, h, w, -1),
            a_h[:h].view(1, h, 1, -1).expand(f, h, w, -1),
            a_w[:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(f * h * w, head_dim // 2)
    return table.cos().float().to(device), table.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive (even, odd) channel pairs of x [B, S, H, D] by the angles of cos/sin [S, D/2]; fp32 math."""
    xf = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack([x_even * c - x_odd * s, x_even * s + x_odd * c], dim=-1)
    return out.flatten(-2).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# Blocks


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a weight; statistics in fp32 (diffusers `RMSNorm` semantics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(self.weight.dtype) * self.weight


def sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch SDPA on [B, S, H, D] tensors -> [B, S, H, D] (a transposed view of SDPA's [B, H, S, D] output)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class SelfAttention(nn.Module):
    """`attn1`: q/k/v projections with bias, RMSNorm of q and k across all heads, RoPE, SDPA, output projection.

    The attention runs through `parallel.attention` (fastremover.parallel.context: size 1 calls SDPA directly; under
    sequence parallelism q/k/v hold this rank's tokens and it exchanges heads for tokens around the call)."""

    parallel = SINGLE

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])  # index 0 as in the checkpoint (`to_out.0.weight`)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q = self.norm_q(self.to_q(x)).unflatten(2, (self.heads, -1))  # [B, S, H, D]
        k = self.norm_k(self.to_k(x)).unflatten(2, (self.heads, -1))
        v = self.to_v(x).unflatten(2, (self.heads, -1))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self.parallel.attention(sdpa_bshd, q, k, v)  # [B, S, H, D]
        return self.to_out[0](out.flatten(2))


class GeluProj(nn.Module):
    """`ffn.net.0`: Linear then tanh-approximated GELU."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        # `net.1` is a dropout in the checkpoint's module tree (no weights); Identity keeps the indices.
        self.net = nn.ModuleList([GeluProj(dim, inner), nn.Identity(), nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


def layer_norm_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without affine parameters, computed in fp32 (diffusers `FP32LayerNorm(elementwise_affine=False)`)."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


def modulation_table(rows: int, dim: int) -> nn.Parameter:
    """The learned [1, rows, dim] shift / scale / gate table, drawn N(0, 1 / dim) like diffusers' init. Built on the
    meta device (the checkpoint load), only its shape: a draw or a division on meta runs torch's Python
    decompositions, whose first use imports torch._dynamo (~1 s on a CPU, seconds in a fresh GPU process)."""
    if torch.get_default_device().type == "meta":
        return nn.Parameter(torch.empty(1, rows, dim))
    return nn.Parameter(torch.randn(1, rows, dim) / dim**0.5)


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, heads: int, eps: float):
        super().__init__()
        self.eps = eps
        self.attn1 = SelfAttention(dim, heads, eps)
        self.ffn = FeedForward(dim, ffn_dim)
        self.scale_shift_table = modulation_table(6, dim)

    def modulation(self, timestep_proj: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(shift, scale, gate, c_shift, c_scale, c_gate), each [B, 1, dim] fp32."""
        return (self.scale_shift_table + timestep_proj.float()).chunk(6, dim=1)

    def forward(self, x: torch.Tensor, timestep_proj: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        shift, scale, gate, c_shift, c_scale, c_gate = self.modulation(timestep_proj)
        n = (layer_norm_fp32(x, self.eps) * (1 + scale) + shift).to(x.dtype)
        x = (x.float() + self.attn1(n, rope) * gate).to(x.dtype)
        n = (layer_norm_fp32(x, self.eps) * (1 + c_scale) + c_shift).to(x.dtype)
        x = (x.float() + self.ffn(n).float() * c_gate).to(x.dtype)
        return x


class TimestepEmbedding(nn.Module):
    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class ConditionEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = TimestepEmbedding(freq_dim, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)

    def forward(self, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep [B] -> (temb [B, dim], timestep_proj [B, 6, dim]), both in time_proj's dtype."""
        freq = timestep_sinusoid(timestep, self.freq_dim).to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(freq).to(self.time_proj.weight.dtype)
        return temb, self.time_proj(F.silu(temb)).unflatten(1, (6, -1))


# ----------------------------------------------------------------------------------------------------------------------
# Model


class RemoverTransformer(nn.Module):
    # Parameters upstream keeps in fp32 when the model is loaded in fp16 (diffusers `_keep_in_fp32_modules`).
    keep_fp32 = ("time_embedder", "scale_shift_table")
    # the sequence-parallel context (fastremover.parallel.context.set_parallel); size 1: one process, no collectives
    parallel = SINGLE

    def __init__(self, config: RemoverTransformerConfig):
        super().__init__()
        config.validate()
        self.config = config
        dim = config.dim
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.condition_embedder = ConditionEmbedder(dim, config.freq_dim)
        self.blocks = nn.ModuleList(
            [TransformerBlock(dim, config.ffn_dim, config.num_attention_heads, config.eps) for _ in range(config.num_layers)]
        )
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = modulation_table(2, dim)
        # per (grid, device), the most recent ROPE_CACHE_SIZE (a captured graph keeps its own tables referenced)
        self._rope_cache: LRUCache[tuple[torch.Tensor, torch.Tensor]] = LRUCache(ROPE_CACHE_SIZE)

    def to_inference_dtype(self, dtype: torch.dtype) -> "RemoverTransformer":
        """Cast to `dtype`, keeping the upstream fp32 islands (time embedder, modulation tables) in fp32."""
        for name, p in self.named_parameters():
            keep = any(part in self.keep_fp32 for part in name.split("."))
            p.data = p.data.to(torch.float32 if keep else dtype)
        self._rope_cache.clear()
        return self

    def post_patch_grid(self, latent_shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int]:
        _, _, t, h, w = latent_shape
        pt, ph, pw = self.config.patch_size
        if t % pt or h % ph or w % pw:
            raise FastRemoverError(f"latent size {(t, h, w)} is not divisible by the patch size {self.config.patch_size}")
        return t // pt, h // ph, w // pw

    def rope(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin tables for a grid, computed once per (grid, device) and cached."""
        key = (grid, str(device))
        tables = self._rope_cache.get(key)
        if tables is None:
            tables = rope_cos_sin(grid, self.config.attention_head_dim, self.config.rope_max_seq_len, device)
            self._rope_cache.put(key, tables)
        return tables

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[B, S, out*pt*ph*pw] -> [B, out, T, H, W] (token order f, h, w; patch channel order pt, ph, pw, out)."""
        b = x.shape[0]
        f, h, w = grid
        pt, ph, pw = self.config.patch_size
        x = x.reshape(b, f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, -1, f * pt, h * ph, w * pw)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """hidden_states [B, in_channels, T, H, W] (noisy latents ++ masked-video latents ++ mask latents), timestep [B]
        -> flow prediction [B, out_channels, T, H, W] in the model dtype."""
        grid = self.post_patch_grid(hidden_states.shape)
        rope = self.rope(grid, hidden_states.device)
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2)
        # sequence parallel: this rank's tokens (and their RoPE rows) from here to proj_out; size 1: unchanged
        x, rope = self.parallel.shard_tokens(x), self.parallel.shard_rope(rope)
        temb, timestep_proj = self.condition_embedder(timestep)
        for block in self.blocks:
            x = block(x, timestep_proj, rope)
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (layer_norm_fp32(x, self.config.eps) * (1 + scale) + shift).to(x.dtype)
        out = self.parallel.gather_tokens(self.proj_out(x), math.prod(grid))  # every rank: all tokens' predictions
        return self.unpatchify(out, grid)
