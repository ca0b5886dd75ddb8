"""The engine's contracts: what the pipeline and the models ask of the parts the engine builds.

    ParallelHook   the sequence-parallel hook every model holds and calls at the only points where sequence
                   parallelism changes its data flow (shard_tokens, shard_rope, attention, sequence_mean,
                   quant_centred, gather_tokens); `SINGLE` is the size-1 hook every model holds by default (each call
                   returns its input or calls the attention directly), fastremover.parallel.context.ParallelContext
                   the hook of a run over several ranks
    Denoiser       the N-step loop the pipeline calls (engine/denoise.py: EagerDenoiser, FastDenoiser;
                   engine/parallel.py: ParallelDenoiser)

The other seams are defined where their implementations register: `VideoVAE` in engine/vae.py (its default methods
plan spatial tiles, engine/tiling.py), `AttentionBackend` in ops/attention/registry.py, `LinearMethod` and
`LinearLayer` in ops/linear/registry.py. This module sits below the models (they hold `SINGLE`), so it imports
nothing of the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@runtime_checkable
class ParallelHook(Protocol):
    """Rank and world size of a run, and the model hooks (fastremover/parallel/context.py describes each)."""

    rank: int
    world_size: int

    @property
    def is_parallel(self) -> bool: ...

    @property
    def is_root(self) -> bool: ...

    def describe(self) -> dict: ...

    def agree(self, ok: bool) -> bool: ...

    def shard_tokens(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor: ...

    def shard_rope(self, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_tokens(self, y: torch.Tensor, total: int, dim: int = 1) -> torch.Tensor: ...

    def attention(self, fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def sequence_mean(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def quant_centred(self, v: torch.Tensor, tokens_per_batch: int) -> tuple[Any, Any, Any]: ...


class SingleProcess:
    """The size-1 ParallelHook: one process, no collectives; every hook returns its input or calls `fn` directly,
    so the single-process numerics and kernels are untouched."""

    rank = 0
    world_size = 1
    transport = "fp16"
    head_groups = 1
    comm_seconds = 0.0

    @property
    def is_parallel(self) -> bool:
        return False

    @property
    def is_root(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"parallel": "none", "world_size": 1, "sp_transport": self.transport, "head_groups": self.head_groups}

    def agree(self, ok: bool) -> bool:
        return ok

    def shard_tokens(self, x, dim: int = 1):
        return x

    def shard_rope(self, rope):
        return rope

    def gather_tokens(self, y, total: int, dim: int = 1):
        return y

    def attention(self, fn, q, k, v):
        return fn(q, k, v)

    def sequence_mean(self, x, out=None):
        import torch

        return torch.mean(x, dim=1, dtype=torch.float32, out=out)

    def quant_centred(self, v, tokens_per_batch: int):
        raise RuntimeError("quant_centred is the sequence-parallel V statistics (ParallelContext); one process "
                           "quantizes V in the fused kernel")

    def __repr__(self) -> str:
        return "SINGLE"


SINGLE = SingleProcess()  # the size-1 hook every model holds


class Denoiser(Protocol):
    """The N-step denoise loop: noise and the two conditioning latents [B, C, T, h, w] -> the denoised latents.
    `parallelize(hook)` gives its transformer a ParallelHook; `describe()` is what the ResolvedEngine records."""

    def __call__(self, noise: torch.Tensor, masked_latents: torch.Tensor, mask_latents: torch.Tensor, steps: int,
                 progress: Progress | None = None, schedule: str = ...) -> torch.Tensor: ...

    def parallelize(self, ctx: ParallelHook) -> None: ...

    def describe(self) -> dict: ...
