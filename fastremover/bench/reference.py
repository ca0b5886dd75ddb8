"""The upstream-style reference: what MiniMax-Remover's own code computes, built from diffusers pieces.

It is the oracle of our parity tests and the baseline of `fastremover bench` / `fastremover verify`:
- `UpstreamTransformer`: the upstream `Transformer3DModel` structure from diffusers building blocks (`Attention`,
  `FeedForward`, `FP32LayerNorm`, `Timesteps`/`TimestepEmbedding`) with upstream's attention processor: float64 complex
  RoPE applied on [B, H, S, D], SDPA. Loads our checkpoint names unchanged.
- `ReferencePipeline`: the upstream pipeline call order with diffusers' `AutoencoderKLWan` and diffusers' scheduler,
  scipy mask dilation, bilinear resize, fp16 (or the given dtype) everywhere upstream uses it. Its UniPC runs either
  schedule of fastremover.schedulers: "minimax-remover" (diffusers 0.33.1's, the release upstream pins) through
  diffusers' own `set_timesteps(sigmas=...)` with that release's unshifted sigmas, or "diffusers" (the installed
  release's own schedule).
diffusers and scipy are imported lazily: they are only needed for the reference (`pip install fastremover[reference]`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.errors import FastRemoverError
from fastremover.extras import install_hint
from fastremover.models.loading import RemoverModels
from fastremover.models.transformer import RemoverTransformerConfig
from fastremover.schedulers import DEFAULT_SCHEDULE, check_schedule, released_unshifted_sigmas
from fastremover.timing import StageTimer


#: The oldest diffusers the reference is checked against (the reference and dev extras' floor). 0.36 and older build
#: UniPC's flow-sigma schedule differently (fastremover.schedulers._unipc_schedule: the "minimax-remover" schedule,
#: which the reference gets from 0.38+ through custom sigmas) and lack `set_timesteps(sigmas=...)` for flow UniPC: a
#: reference run on them would differ from the engine by the schedule, not by anything the engine computes.
MIN_DIFFUSERS = (0, 38)


def _require_diffusers():
    try:
        import diffusers
        import scipy  # noqa: F401
    except ImportError:
        raise FastRemoverError(
            f"the reference pipeline needs diffusers and scipy: {install_hint('reference')}"
        ) from None
    version = tuple(int(part) for part in diffusers.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_DIFFUSERS:
        need = ".".join(map(str, MIN_DIFFUSERS))
        raise FastRemoverError(
            f"the reference pipeline needs diffusers >= {need} (installed: {diffusers.__version__}; older releases "
            f"build UniPC's flow schedule differently): pip install 'diffusers>={need}'"
        )


class _UpstreamAttnProcessor:
    """Upstream MiniMax-Remover attention: q/k RMSNorm, heads split, float64 complex RoPE, SDPA."""

    def __call__(self, attn, hidden_states, rotary_emb=None, **_):
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(hidden_states))
        value = attn.to_v(hidden_states)
        query = query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        def rope(x, freqs):
            x_c = torch.view_as_complex(x.to(torch.float64).unflatten(3, (-1, 2)))
            return torch.view_as_real(x_c * freqs).flatten(3, 4).type_as(x)

        query, key = rope(query, rotary_emb), rope(key, rotary_emb)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class _UpstreamBlock(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, heads: int, eps: float):
        super().__init__()
        from diffusers.models.attention import FeedForward
        from diffusers.models.attention_processor import Attention
        from diffusers.models.normalization import FP32LayerNorm

        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = Attention(
            query_dim=dim, heads=heads, kv_heads=heads, dim_head=dim // heads, qk_norm="rms_norm_across_heads",
            eps=eps, bias=True, cross_attention_dim=None, out_bias=True, processor=_UpstreamAttnProcessor(),
        )
        self.ffn = FeedForward(dim, inner_dim=ffn_dim, activation_fn="gelu-approximate")
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, hidden_states, temb, rotary_emb):
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + temb.float()).chunk(6, dim=1)
        norm = (self.norm1(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
        attn_output = self.attn1(hidden_states=norm, rotary_emb=rotary_emb)
        hidden_states = (hidden_states.float() + attn_output * gate).type_as(hidden_states)
        norm = (self.norm2(hidden_states.float()) * (1 + c_scale) + c_shift).type_as(hidden_states)
        ff_output = self.ffn(norm)
        return (hidden_states.float() + ff_output.float() * c_gate).type_as(hidden_states)


class _UpstreamConditionEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int):
        super().__init__()
        from diffusers.models.embeddings import TimestepEmbedding, Timesteps

        self.timesteps_proj = Timesteps(num_channels=freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedder = TimestepEmbedding(in_channels=freq_dim, time_embed_dim=dim)
        self.time_proj = nn.Linear(dim, 6 * dim)

    def forward(self, timestep):
        t = self.timesteps_proj(timestep)
        embedder_dtype = next(iter(self.time_embedder.parameters())).dtype
        if t.dtype != embedder_dtype:
            t = t.to(embedder_dtype)
        temb = self.time_embedder(t).type_as(self.time_proj.weight.data)
        return temb, self.time_proj(F.silu(temb))


class UpstreamTransformer(nn.Module):
    """The upstream `Transformer3DModel` forward, same parameter names as `RemoverTransformer`."""

    keep_fp32 = ("time_embedder", "scale_shift_table")

    def __init__(self, config: RemoverTransformerConfig):
        super().__init__()
        _require_diffusers()
        from diffusers.models.normalization import FP32LayerNorm

        self.config = config
        dim, d = config.dim, config.attention_head_dim
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.condition_embedder = _UpstreamConditionEmbedder(dim, config.freq_dim)
        self.blocks = nn.ModuleList(
            [_UpstreamBlock(dim, config.ffn_dim, config.num_attention_heads, config.eps) for _ in range(config.num_layers)]
        )
        self.norm_out = FP32LayerNorm(dim, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.freqs = self.rope_freqs()

    def rope_freqs(self) -> torch.Tensor:
        """Upstream's float64 complex RoPE table (a plain attribute, not a parameter or buffer)."""
        from diffusers.models.embeddings import get_1d_rotary_pos_embed

        config, d = self.config, self.config.attention_head_dim
        h_dim = w_dim = 2 * (d // 6)
        t_dim = d - h_dim - w_dim
        return torch.cat(
            [
                get_1d_rotary_pos_embed(dim_, config.rope_max_seq_len, 10000.0, use_real=False,
                                        repeat_interleave_real=False, freqs_dtype=torch.float64)
                for dim_ in (t_dim, h_dim, w_dim)
            ],
            dim=1,
        )

    def to_upstream_dtype(self, dtype: torch.dtype) -> "UpstreamTransformer":
        """What diffusers' from_pretrained(torch_dtype=fp16) does with `_keep_in_fp32_modules`."""
        for name, p in self.named_parameters():
            keep = any(part in self.keep_fp32 for part in name.split("."))
            p.data = p.data.to(torch.float32 if keep else dtype)
        return self

    def _rope(self, hidden_states):
        _, _, f, h, w = hidden_states.shape
        pt, ph, pw = self.config.patch_size
        f, h, w = f // pt, h // ph, w // pw
        d = self.config.attention_head_dim
        freqs = self.freqs.to(hidden_states.device).split_with_sizes([d // 2 - 2 * (d // 6), d // 6, d // 6], dim=1)
        return torch.cat(
            [
                freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
            ],
            dim=-1,
        ).reshape(1, 1, f * h * w, -1)

    def forward(self, hidden_states, timestep):
        b, _, f, h, w = hidden_states.shape
        pt, ph, pw = self.config.patch_size
        rotary_emb = self._rope(hidden_states)
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2)
        temb, timestep_proj = self.condition_embedder(timestep)
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
        for block in self.blocks:
            x = block(x, timestep_proj, rotary_emb)
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)
        x = x.reshape(b, f // pt, h // ph, w // pw, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def diffusers_vae(models: RemoverModels):
    """diffusers `AutoencoderKLWan` with the same config and weights as our VAE (fp32, CPU)."""
    _require_diffusers()
    from diffusers import AutoencoderKLWan
    from diffusers.utils import logging as diffusers_logging

    # `.to(fp16)` on a model without fp32 islands warns about `_keep_in_fp32_modules` ([] here): noise, not news.
    diffusers_logging.set_verbosity_error()

    cfg = {k: v for k, v in models.vae.config.to_dict().items() if not k.startswith("_")}
    vae = AutoencoderKLWan(**cfg)
    vae.load_state_dict({k: v.detach().float().cpu() for k, v in models.vae.state_dict().items()}, strict=True)
    return vae.eval()


def diffusers_scheduler(scheduler_config: dict):
    _require_diffusers()
    import diffusers

    cls = getattr(diffusers, scheduler_config.get("_class_name", "UniPCMultistepScheduler"))
    return cls.from_config(scheduler_config)


def set_diffusers_timesteps(scheduler, steps: int, device, schedule: str = DEFAULT_SCHEDULE) -> None:
    """`scheduler.set_timesteps` for `steps` steps with `schedule` (fastremover.schedulers.SCHEDULES). UniPC's
    "minimax-remover" schedule is diffusers 0.33.1's: given that release's unshifted sigmas, diffusers >= 0.38 shifts
    them exactly as 0.33.1 did (tests/parity/test_schedule_released.py checks the result against 0.33.1's values). Euler's
    schedule is the same under both names."""
    check_schedule(schedule)
    if schedule == "minimax-remover" and type(scheduler).__name__ == "UniPCMultistepScheduler":
        sigmas = released_unshifted_sigmas(scheduler.config.num_train_timesteps, steps)
        scheduler.set_timesteps(sigmas=sigmas, device=device)
    else:
        scheduler.set_timesteps(steps, device=device)


def upstream_transformer(models: RemoverModels) -> UpstreamTransformer:
    ref = UpstreamTransformer(models.transformer.config)
    ref.load_state_dict({k: v.detach().float().cpu() for k, v in models.transformer.state_dict().items()}, strict=True)
    return ref.eval()


@dataclass
class ReferenceResult:
    frames: np.ndarray  # uint8 [F,H,W,3] decoded frames at the run size (no compositing)
    pixels: torch.Tensor  # [1,3,F,H,W] decoded video in [-1,1] (fp32, CPU)
    latents: torch.Tensor  # final denoised latents (fp32, CPU)
    timer: StageTimer


class ReferencePipeline:
    """Upstream MiniMax-Remover call order with diffusers' VAE and scheduler, on the same weights as the engine."""

    def __init__(self, models: RemoverModels, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float16):
        self.device = torch.device(device)
        self.dtype = dtype
        self.transformer = upstream_transformer(models).to(self.device).to_upstream_dtype(dtype)
        self.vae = diffusers_vae(models).to(self.device, dtype)
        self.scheduler_config = models.scheduler_config

    @classmethod
    def from_pretrained(cls, path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float16) -> "ReferencePipeline":
        """Load a checkpoint folder the way upstream's own script does: each model built without allocating its
        weights, filled from its safetensors in `dtype` on the host (diffusers' `from_pretrained(torch_dtype=...)`,
        the fp32 islands kept in fp32), then moved to `device`; the VAE through diffusers' own `from_pretrained`.
        No fp32 copy of the whole model is made (the bench --cold reference)."""
        import json
        from pathlib import Path

        from fastremover.models.loading import load_safetensors_into
        from fastremover.schedulers import load_scheduler_config

        _require_diffusers()
        from diffusers import AutoencoderKLWan
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
        root = Path(path)
        with open(root / "transformer" / "config.json") as f:
            config = RemoverTransformerConfig.from_dict(json.load(f))
        with torch.device("meta"):
            transformer = UpstreamTransformer(config)
        transformer = transformer.to_upstream_dtype(dtype).to_empty(device="cpu")
        load_safetensors_into(transformer, root / "transformer", "transformer")
        transformer.freqs = transformer.rope_freqs()
        self = cls.__new__(cls)
        self.device, self.dtype = torch.device(device), dtype
        self.transformer = transformer.eval().to(self.device)
        self.vae = AutoencoderKLWan.from_pretrained(str(root / "vae"), torch_dtype=dtype).eval().to(self.device)
        self.scheduler_config = load_scheduler_config(root / "scheduler")
        return self

    def to(self, device: str | torch.device) -> "ReferencePipeline":
        """Move the models (e.g. off the GPU while the engine is measured)."""
        self.device = torch.device(device)
        self.transformer.to(self.device)
        self.vae.to(self.device)
        return self

    @staticmethod
    def expand_masks(mask: np.ndarray, iterations: int) -> torch.Tensor:
        """Upstream: scipy binary_dilation per frame on [H,W,1], repeated to 3 channels -> [1,3,F,H,W] fp32."""
        import scipy.ndimage

        out = np.stack(
            [scipy.ndimage.binary_dilation(m[..., None] > 0, iterations=iterations) if iterations > 0 else m[..., None] > 0
             for m in mask]
        ).astype(np.float32)
        t = torch.from_numpy(out).repeat(1, 1, 1, 3)
        return t.permute(3, 0, 1, 2)[None]

    @staticmethod
    def resize(x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        b, c, f, _, _ = x.shape
        y = F.interpolate(x.permute(0, 2, 1, 3, 4).reshape(b * f, c, *x.shape[-2:]), size=hw, mode="bilinear")
        return y.reshape(b, f, c, *hw).permute(0, 2, 1, 3, 4)

    @torch.no_grad()
    def __call__(
        self, frames: np.ndarray, mask: np.ndarray, *, height: int, width: int, steps: int = 12, seed: int = 42,
        iterations: int = 6, timer: StageTimer | None = None, schedule: str = DEFAULT_SCHEDULE,
    ) -> ReferenceResult:
        """frames uint8 [F,H,W,3] with F = 4k+1; mask bool/uint8 [F,H,W] (undilated); resized to height x width;
        `schedule`: the flow schedule (fastremover.schedulers.SCHEDULES; set_diffusers_timesteps)."""
        dev, dtype = self.device, self.dtype
        timer = timer or StageTimer(dev)
        with timer.stage("preprocess"):
            scheduler = diffusers_scheduler(self.scheduler_config)
            set_diffusers_timesteps(scheduler, steps, dev, schedule)
            num_latent_frames = (frames.shape[0] - 1) // 4 + 1
            generator = torch.Generator(device=dev).manual_seed(seed)
            latents = torch.randn(
                (1, 16, num_latent_frames, height // 8, width // 8), generator=generator, device=dev, dtype=dtype
            )
            masks = self.resize(self.expand_masks(mask, iterations), (height, width)).to(dev).to(dtype)
            masks[masks > 0] = 1
            images = torch.from_numpy(frames).float() / 127.5 - 1.0
            images = self.resize(images.permute(3, 0, 1, 2)[None], (height, width)).to(dev).to(dtype)
            masked_images = images * (1 - masks)
            cfg = self.vae.config
            latents_mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(dev, dtype)
            latents_inv_std = (1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)).to(dev, dtype)
        with timer.stage("vae_encode"):
            masked_latents = (self.vae.encode(masked_images).latent_dist.mode() - latents_mean) * latents_inv_std
            mask_latents = (self.vae.encode(2 * masks - 1.0).latent_dist.mode() - latents_mean) * latents_inv_std
        with timer.stage("denoise"):
            for t in scheduler.timesteps:
                model_input = torch.cat([latents.to(dtype), masked_latents, mask_latents], dim=1)
                noise_pred = self.transformer(model_input, t.expand(latents.shape[0]))
                latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        with timer.stage("vae_decode"):
            video = self.vae.decode(latents.to(dtype) / latents_inv_std + latents_mean, return_dict=False)[0]
        with timer.stage("postprocess"):
            pixels = video.float().cpu()
            frames_u8 = ((pixels[0] / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
        return ReferenceResult(frames=frames_u8, pixels=pixels, latents=latents.float().cpu(), timer=timer)
