"""The sequence-parallel denoiser and VAE that the engine's build (fastremover/engine/build.py) makes for a context of
several ranks.

    ParallelEngine(ctx, heads, denoiser, vae)    the transformer gets the context (Ulysses: `denoiser.parallelize`),
                                                 the VAE encodes on two ranks and decodes by rows (parallel/vae.py)
      .denoiser   ParallelDenoiser: on rank 0 each call announces ("denoise", steps, schedule) to the other ranks,
                  then every rank runs the loop on its tokens
      .vae        ParallelVAE (a VideoVAE): on rank 0 the removal pair's encodes and the decode announce ("encode",) /
                  ("decode",) first; tiling, scaling and the memory model stay the inner VAE's
      .follow()   the other ranks: run each stage rank 0 announces until ("stop",)
      .stop()     rank 0, after the run

The pipeline on rank 0 calls the denoiser and the VAE as it calls one process's (the same request loop); the other
ranks build the same engine and call `follow()`. See fastremover/parallel/launch.py for how the ranks start.
"""

from __future__ import annotations

import torch

from fastremover.parallel.context import ParallelContext
from fastremover.parallel.ulysses import check_heads
from fastremover.schedulers import DEFAULT_SCHEDULE
from fastremover.engine.vae import VideoVAE


class ParallelEngine:
    """The stages of a parallel run, executed by every rank: rank 0 through `denoiser` / `vae`, the others from
    `follow`. `inner_denoiser` / `inner_vae`: the one-process modules it runs on each rank."""

    def __init__(self, ctx: ParallelContext, heads: int, denoiser, vae: VideoVAE):
        from fastremover.models.vae import WanVAE
        from fastremover.parallel.vae import RowParallelDecoder

        check_heads(heads, ctx.world_size)
        self.ctx = ctx
        self.inner_denoiser, self.inner_vae = denoiser, vae
        denoiser.parallelize(ctx)
        self.notes: list[str] = []
        module = getattr(vae, "module", None)  # the WanVAE of an EagerVideoVAE
        self.decoder = RowParallelDecoder(ctx, module) if isinstance(module, WanVAE) else None
        if self.decoder is None:
            self.notes.append(f"parallel VAE decode by rows needs the eager VAE; {type(vae).__name__} decodes on "
                              "rank 0")
        self.denoiser = ParallelDenoiser(self)
        self.vae = ParallelVAE(self)

    def describe(self) -> dict:
        return self.ctx.describe()

    # -- the stages, run by every rank -------------------------------------------------------------------------------

    def encode(self, frames: torch.Tensor | None, mask: torch.Tensor | None, progress=None):
        from fastremover.parallel.vae import encode_pair

        ctx = self.ctx
        frames = ctx.broadcast_tensor(frames)
        mask = ctx.broadcast_tensor(mask)
        first = frames * (1 - mask) if ctx.rank == 0 else None  # the pipeline's own expressions (bit-identical)
        second = 2 * mask - 1.0 if ctx.rank == 1 else None
        return encode_pair(ctx, self.inner_vae, first, second, progress)

    def denoise(self, noise, masked_latents, mask_latents, steps: int, progress=None,
                schedule: str = DEFAULT_SCHEDULE):
        ctx = self.ctx
        noise, masked_latents, mask_latents = (ctx.broadcast_tensor(t) for t in (noise, masked_latents, mask_latents))
        out = self.inner_denoiser(noise, masked_latents, mask_latents, steps, progress if ctx.is_root else None,
                                  schedule=schedule)
        return out if ctx.is_root else None

    def decode_iter(self, z, progress=None):
        z = self.ctx.broadcast_tensor(z)
        if self.decoder is not None:
            yield from self.decoder.decode_iter(z, progress)
        elif self.ctx.is_root:
            yield from self.inner_vae.decode_iter(z, progress)

    def follow(self) -> None:
        """The other ranks: run each stage rank 0 announces, until it says stop."""
        while True:
            cmd = self.ctx.broadcast_object(None)
            if cmd[0] == "stop":
                return
            if cmd[0] == "encode":
                self.encode(None, None)
            elif cmd[0] == "denoise":
                self.denoise(None, None, None, cmd[1], schedule=cmd[2])
            elif cmd[0] == "decode":
                for _ in self.decode_iter(None):
                    pass
            else:
                raise RuntimeError(f"unknown command from rank 0: {cmd!r}")

    def stop(self) -> None:
        self.ctx.broadcast_object(("stop",))


class ParallelDenoiser:
    """Rank 0's denoiser: announces the stage, then runs its part of it (ParallelEngine.denoise)."""

    def __init__(self, engine: ParallelEngine):
        self.engine = engine
        self.cuda_graphs = engine.inner_denoiser.cuda_graphs

    @property
    def notes(self) -> list[str]:
        return getattr(self.engine.inner_denoiser, "notes", [])

    def describe(self) -> dict:
        return self.engine.inner_denoiser.describe()

    def __call__(self, noise, masked_latents, mask_latents, steps: int, progress=None,
                 schedule: str = DEFAULT_SCHEDULE):
        self.engine.ctx.broadcast_object(("denoise", steps, schedule))
        return self.engine.denoise(noise, masked_latents, mask_latents, steps, progress, schedule=schedule)


class ParallelVAE(VideoVAE):
    """Rank 0's VideoVAE: the inner VAE with its two primitives that run over the ranks - the removal pair's encodes
    (`encode_removal_inputs`) and `decode_iter` - announcing their stage first; a tile of a tiled encode runs on
    rank 0 alone; tiling, scaling and the memory model are the inner VAE's."""

    def __init__(self, engine: ParallelEngine):
        self.engine = engine
        inner = engine.inner_vae
        self.config, self.device, self.dtype = inner.config, inner.device, inner.dtype

    def encode(self, x, progress=None):
        return self.engine.inner_vae.encode(x, progress)

    def memory_bytes(self, op, frames, height, width, batch=1):
        return self.engine.inner_vae.memory_bytes(op, frames, height, width, batch)

    def memory_budget(self):
        return self.engine.inner_vae.memory_budget()

    def encode_removal_inputs(self, frames, mask, progress=None):
        self.engine.ctx.broadcast_object(("encode",))
        return self.engine.encode(frames, mask, progress)

    def decode_iter(self, z, progress=None):
        self.engine.ctx.broadcast_object(("decode",))
        return self.engine.decode_iter(z, progress)

    def describe(self):
        return self.engine.inner_vae.describe() + f" (parallel over {self.engine.ctx.world_size} ranks)"
