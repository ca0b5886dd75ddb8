"""The VideoVAE interface: what the pipeline asks of a video VAE, and the eager Wan VAE behind it.

The pipeline talks to its VAE through these calls only (no device-type or attribute checks):

    encode_removal(frames, mask)  -> (masked latents, mask latents), both normalized
                                     = normalize(encode(frames * (1 - mask))), normalize(encode(2 * mask - 1))
    decode_latents_iter(latents)  -> pixel chunks [B, C, k, H, W] in [-1, 1], in order (k = 1, then 4 per latent frame)
    decode_latents(latents)       -> the whole video: the chunks concatenated (bit for bit)
    normalize(z) / denormalize(z) -> upstream MiniMax-Remover's latent scaling

Both are built on primitives each implementation provides (`encode`, `decode_iter`, `memory_bytes`) and one it may
override (`encode_removal_inputs`, the two removal encodes in one call). Each implementation owns its memory model:
`memory_bytes(op, frames, height, width, batch)` is the peak tensor bytes of one untiled call, and
`memory_budget()` the bytes a call may allocate now (None: memory is not planned, calls are never tiled). When the
modelled peak does not fit, the calls run in spatial tiles (`fastremover.engine.tiling`, the plan from that model);
a tiled decode has the whole video only after its last tile, so its chunks come at the end.

Implementations: `EagerVideoVAE` (below: the eager `models.vae.WanVAE`, with the eager memory model of
`tiling.estimate_call_bytes`) and `fastremover.fast.vae.FastWanVAE` (its own model).

Numerics: `decode_latents` is `torch.cat(list(decode_latents_iter(...)), dim=2)` bit for bit, and
`decode_iter(z)` yields exactly the frames `decode(z)` returns (each implementation's decode is its decode_iter
written into one tensor); normalize / denormalize are `WanVAE.normalize` / `.denormalize`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

import torch

from fastremover.models.vae import WanVAE, WanVAEConfig

Progress = Callable[[int, int], None]  # (done, total)
OPS = ("encode", "decode")


class VideoVAE(ABC):
    """A Wan-2.1-style causal video VAE as the pipeline uses it (see the module docstring).

    Subclasses set `config` (a WanVAEConfig), `device` and `dtype` and implement `encode`, `decode_iter` and
    `memory_bytes`. Thread safety: one call at a time per instance."""

    config: WanVAEConfig
    device: torch.device
    dtype: torch.dtype

    # -- primitives (untiled) ----------------------------------------------------------------------------------------

    @abstractmethod
    def encode(self, x: torch.Tensor, progress: Progress | None = None) -> torch.Tensor:
        """Video [B, C, F, H, W] in [-1, 1], F = 4k+1 -> posterior mode [B, z_dim, (F-1)//4 + 1, H/8, W/8]."""

    @abstractmethod
    def decode_iter(self, z: torch.Tensor, progress: Progress | None = None) -> Iterator[torch.Tensor]:
        """Latents [B, z_dim, T, h, w] (not normalized) -> the decoded video [B, C, 1 + 4(T-1), 8h, 8w] in [-1, 1], as
        one chunk per latent frame (1 frame, then 4 each), in order, each yielded as soon as it is decoded. The
        chunks are new tensors the caller may keep; their concatenation equals `decode(z)` bit for bit."""

    @abstractmethod
    def memory_bytes(self, op: str, frames: int, height: int, width: int, batch: int = 1) -> int:
        """Modelled peak bytes of the tensors one untiled `op` ("encode" / "decode") call allocates (inputs and
        weights not included), for a video of `frames` x `height` x `width` pixels (both ops) and `batch` videos."""

    def decode(self, z: torch.Tensor, progress: Progress | None = None) -> torch.Tensor:
        """The whole decoded video: `decode_iter`'s chunks concatenated."""
        return torch.cat(list(self.decode_iter(z, progress)), dim=2)

    def encode_removal_inputs(self, frames: torch.Tensor, mask: torch.Tensor,
                              progress: Progress | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(encode(frames * (1 - mask)), encode(2 * mask - 1)), not normalized; progress over both encodes."""

        def half(offset: int):
            return (lambda done, total: progress(offset * total + done, 2 * total)) if progress else None

        return self.encode(frames * (1 - mask), half(0)), self.encode(2 * mask - 1.0, half(1))

    def memory_budget(self) -> int | None:
        """Bytes a call may allocate now; None: memory is not planned (calls are never tiled). Default: 0.9 of what
        a new allocation can still get on a CUDA device (`tiling.default_budget_bytes`); None on other devices,
        whose host memory the VAE does not plan (calls there run untiled, as they always have)."""
        if self.device.type != "cuda":
            return None
        from fastremover.engine.tiling import default_budget_bytes

        return default_budget_bytes(self.device)

    # -- latent scaling ----------------------------------------------------------------------------------------------

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32).view(shape).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(self.config.latents_std, dtype=torch.float32).view(shape).to(z.device, z.dtype)
        return mean, inv_std

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """(z - mean) * (1 / std) in z's dtype, as upstream (= `WanVAE.normalize`)."""
        mean, inv_std = self._stats(z)
        return (z - mean) * inv_std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """z / (1 / std) + mean in z's dtype, as upstream (= `WanVAE.denormalize`)."""
        mean, inv_std = self._stats(z)
        return z / inv_std + mean

    # -- what the pipeline calls -------------------------------------------------------------------------------------

    def tile_plan(self, op: str, frames: int, height: int, width: int, batch: int = 1):
        """The spatial tiling an `op` call of this size needs under `memory_budget()` (a tiling.TilePlan), or
        None when it runs untiled. Uses this VAE's own `memory_bytes`."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        budget = self.memory_budget()
        if budget is None:
            return None
        from fastremover.engine.tiling import choose_tiling

        return choose_tiling(frames, height, width, self.dtype, budget, self.config, op=op, batch=batch,
                             call_bytes=lambda o, f, h, w: self.memory_bytes(o, f, h, w))

    @torch.no_grad()
    def encode_removal(self, frames: torch.Tensor, mask: torch.Tensor,
                       progress: Progress | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The removal pair's latents, normalized: (normalize(encode(frames * (1 - mask))),
        normalize(encode(2 * mask - 1))). frames, mask: [1, 3, F, H, W] (mask in {0, 1}), the VAE's device and dtype.
        Tiled when the VAE's memory model says one call does not fit; progress(done, total) over both encodes."""
        _, _, f, h, w = frames.shape
        plan = self.tile_plan("encode", f, h, w)
        if plan is None:
            za, zb = self.encode_removal_inputs(frames, mask, progress)
        else:
            from fastremover.engine.tiling import encode_tiled

            def half(offset: int):
                return (lambda done, total: progress(offset * total + done, 2 * total)) if progress else None

            za = encode_tiled(self.encode, frames * (1 - mask), plan.tile, plan.overlap, half(0))
            zb = encode_tiled(self.encode, 2 * mask - 1.0, plan.tile, plan.overlap, half(1))
        return self.normalize(za), self.normalize(zb)

    @torch.no_grad()
    def decode_latents_iter(self, latents: torch.Tensor, progress: Progress | None = None) -> Iterator[torch.Tensor]:
        """Normalized latents [B, z_dim, T, h, w] -> decoded pixel chunks in order (see `decode_iter`), after
        `denormalize(latents.to(dtype))`. A decode that must be tiled yields its chunks only once every tile is done
        (still one per latent frame)."""
        z = self.denormalize(latents.to(self.dtype))
        sc, tc = self.config.spatial_compression, self.config.temporal_compression
        frames = 1 + (z.shape[2] - 1) * tc
        plan = self.tile_plan("decode", frames, z.shape[3] * sc, z.shape[4] * sc, batch=z.shape[0])
        if plan is None:
            yield from self.decode_iter(z, progress)
            return
        from fastremover.engine.tiling import decode_tiled

        video = decode_tiled(self.decode, z, plan.tile_latent, plan.overlap_latent, progress)
        yield video[:, :, :1].clone()
        for start in range(1, frames, tc):
            yield video[:, :, start : start + tc].clone()

    def decode_latents(self, latents: torch.Tensor, progress: Progress | None = None) -> torch.Tensor:
        """The whole decoded video of normalized latents (`decode_latents_iter`'s chunks concatenated)."""
        return torch.cat(list(self.decode_latents_iter(latents, progress)), dim=2)

    def describe(self) -> str:
        """What EngineConfig.vae shows."""
        return type(self).__name__


class EagerVideoVAE(VideoVAE):
    """The eager `WanVAE` (reference-order modules) as a VideoVAE, with the eager memory model
    (`tiling.estimate_call_bytes`, validated against live tensor bytes in tests/parity/test_tiling.py)."""

    def __init__(self, vae: WanVAE, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        if device is not None or dtype is not None:
            vae.to(device, dtype)
        self.module = vae
        self.config = vae.config

    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    def encode(self, x: torch.Tensor, progress: Progress | None = None) -> torch.Tensor:
        return self.module.encode(x, progress=progress)

    def decode(self, z: torch.Tensor, progress: Progress | None = None) -> torch.Tensor:
        return self.module.decode(z, progress=progress)

    def decode_iter(self, z: torch.Tensor, progress: Progress | None = None) -> Iterator[torch.Tensor]:
        return self.module.decode_iter(z, progress=progress)

    def memory_bytes(self, op: str, frames: int, height: int, width: int, batch: int = 1) -> int:
        from fastremover.engine.tiling import estimate_call_bytes

        return batch * estimate_call_bytes(op, frames, height, width, self.dtype, self.config).total

    def describe(self) -> str:
        return "eager"
