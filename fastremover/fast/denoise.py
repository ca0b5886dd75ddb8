"""The N-step denoise loop, eager or on the fast transformer, optionally replayed as one CUDA graph.

Graph capture needs every per-step input on the device before the loop starts: the scheduler's coefficients are
device tensors (schedulers.py), the timestep conditioning is precomputed (`FastTransformer.conditioning`), the RoPE
tables are cached by the model, and nothing in the loop touches the host. The first call for a given shape runs the
loop normally (which also compiles the Triton kernels and creates library handles), then records it into a graph
(recording launches nothing); later calls with the same shape, steps and scheduler copy their inputs into the static
buffers and replay. Replay runs the very same kernels on the same inputs as the first call, so outputs are identical;
the GPU tests check it with torch.equal.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable

import torch

from fastremover.fast.lru import LRUCache
from fastremover.models.transformer import RemoverTransformer
from fastremover.schedulers import build_scheduler

if TYPE_CHECKING:  # the fast transformer needs Triton: imported only where a fast mode is built
    from fastremover.fast.transformer_fast import Conditioning, FastTransformer

Progress = Callable[[str, int, int], None]


def denoise_loop(scheduler, flow: Callable, noise, masked_latents, mask_latents, progress: Progress | None = None):
    """The N-step loop in upstream order: each step the model sees cat([x, masked_lat, mask_lat]) and the scheduler
    steps x. `flow(model_input, i)` is the transformer call of step i."""
    dtype = masked_latents.dtype
    latents = noise
    scheduler.reset()
    for i in range(scheduler.num_steps):
        model_input = torch.cat([latents.to(dtype), masked_latents, mask_latents], dim=1)
        latents = scheduler.step(i, flow(model_input, i), latents)
        if progress:
            progress("denoise", i + 1, scheduler.num_steps)
    return latents


class EagerDenoiser:
    """The reference-order loop on the eager module (upstream call order)."""

    cuda_graphs = False

    def __init__(self, transformer: RemoverTransformer, scheduler_config: dict):
        self.transformer = transformer
        self.scheduler_config = scheduler_config

    def describe(self) -> dict:
        return {"fused_kernels": "none", "fp8_linears": False, "attention": "sdpa", "cuda_graphs": False}

    @torch.no_grad()
    def __call__(self, noise, masked_latents, mask_latents, steps: int, progress: Progress | None = None):
        scheduler = build_scheduler(self.scheduler_config, steps, device=noise.device)

        def flow(model_input, i):
            return self.transformer(model_input, scheduler.timesteps[i].expand(model_input.shape[0]))

        return denoise_loop(scheduler, flow, noise, masked_latents, mask_latents, progress)


class FastDenoiser:
    """The loop on `FastTransformer`; with `cuda_graphs`, captured once per (shape, steps) and replayed.

    At most `max_graphs` captured graphs are kept (least recently used first out: crop mode gives every request its
    own shape); an evicted graph's memory goes back to the allocator and its shape is captured again if it returns.
    One denoiser serves one thread at a time."""

    def __init__(self, fast: FastTransformer, scheduler_config: dict, cuda_graphs: bool, max_graphs: int = 4):
        self.fast = fast
        self.scheduler_config = scheduler_config
        self.cuda_graphs = cuda_graphs
        self._graphs: LRUCache[tuple] = LRUCache(max_graphs)

    def describe(self) -> dict:
        return {**self.fast.describe(), "cuda_graphs": self.cuda_graphs}

    def _loop(self, scheduler, cond: Conditioning, noise, masked_latents, mask_latents, progress=None):
        def flow(model_input, i):
            return self.fast.forward_step(model_input, cond, i)

        return denoise_loop(scheduler, flow, noise, masked_latents, mask_latents, progress)

    @torch.no_grad()
    def __call__(self, noise, masked_latents, mask_latents, steps: int, progress: Progress | None = None):
        key = (tuple(noise.shape), noise.dtype, tuple(masked_latents.shape), masked_latents.dtype, steps,
               json.dumps(self.scheduler_config, sort_keys=True, default=str))
        if key in self._graphs:
            graph, static_inputs, static_out, *_held = self._graphs.get(key)
            for buf, src in zip(static_inputs, (noise, masked_latents, mask_latents)):
                buf.copy_(src)
            graph.replay()
            if progress:
                progress("denoise", steps, steps)
            return static_out.clone()

        scheduler = build_scheduler(self.scheduler_config, steps, device=noise.device)
        cond = self.fast.conditioning(scheduler.timesteps, noise.shape[0])
        if not (self.cuda_graphs and noise.device.type == "cuda"):
            return self._loop(scheduler, cond, noise, masked_latents, mask_latents, progress)
        # First call: run on a side stream (the usual warm-up before capture: kernels compiled, handles created for a
        # non-default stream), then record the same loop into a graph.
        side = torch.cuda.Stream(noise.device)
        side.wait_stream(torch.cuda.current_stream(noise.device))
        with torch.cuda.stream(side):
            out = self._loop(scheduler, cond, noise, masked_latents, mask_latents, progress)
        torch.cuda.current_stream(noise.device).wait_stream(side)
        static_inputs = (noise.clone(), masked_latents.clone(), mask_latents.clone())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self._loop(scheduler, cond, *static_inputs)
        # scheduler, cond and the transformer's per-shape tensors stay referenced by the cache entry: the graph
        # reads their device tensors.
        held = self.fast.shape_state(tuple(noise.shape), noise.device)
        self._graphs.put(key, (graph, static_inputs, static_out, scheduler, cond, held))
        return out
