"""The N-step denoise loop, eager or on the fast transformer, optionally replayed as one CUDA graph.

Graph capture needs every per-step input on the device before the loop starts: the scheduler's coefficients are
device tensors (schedulers.py), the timestep conditioning is precomputed (`FastTransformer.conditioning`), the RoPE
tables are cached by the model, and nothing in the loop touches the host. The first call for a given shape runs the
loop normally (which also compiles the Triton kernels and creates library handles). The call of a shape on which
`capture_pays` says a recording pays for itself (by default its second) runs the loop on a side stream (the warm-up
a recording needs) and then records it into a graph (recording launches nothing); later calls with the same shape,
steps and scheduler copy their inputs into the static buffers and replay. A shape seen once (a one-shot CLI run sees
each crop size once) is never recorded whole; where the host's launches bound its steps, the call records one
transformer step after its first two and replays that graph for the rest (`step_graph_pays`). Replay runs the very
same kernels on the same inputs as an eager call, so outputs are identical; the GPU tests check it with torch.equal.

Under sequence parallelism (the transformer's ParallelContext has several ranks) the captured loop holds the NCCL
collectives too. Every rank must then take the same branch: after the capture the ranks agree (one all-reduce)
whether all of them captured; if any could not, every rank drops its graph for that shape and runs the loop eagerly
from then on (the same kernels: the same result), with a logged note naming the error. A graph's collectives have no
NCCL timeout of their own, so a replay under sequence parallelism waits for its end with the context's collective
timeout and raises instead of hanging when a peer is gone.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Callable

import torch

from fastremover.env import kernel_tuning
from fastremover.log import logger
from fastremover.lru import LRUCache, held_while
from fastremover.models.transformer import RemoverTransformer
from fastremover.schedulers import DEFAULT_SCHEDULE, build_scheduler
from fastremover.timing import phase

if TYPE_CHECKING:  # the fast transformer needs Triton: imported only where a fast mode is built
    from fastremover.fast.transformer_fast import Conditioning, FastTransformer

Progress = Callable[[str, int, int], None]

# When recording a shape's loop as a CUDA graph pays (`capture_pays`), from `fastremover bench --cold --capture-costs`
# at the released config (bench/results/cold-real-fast-2026-12-05-8e5f193-h100.json, one H100, fast mode, dense
# FP8 attention; per latent shape: eager step, replayed step, recording):
#   3520 tokens: 64.8 / 13.3 ms, 0.87 s;  13440 tokens: 77.7 / 77.2 ms, 0.81 s;  16800 tokens: 106.0 / 105.4 ms, 0.82 s.
# An eager step costs the host HOST_STEP_S to launch whatever the shape; the GPU's share grows with the tokens
# (GPU_STEP_S_PER_TOKEN, the 13440-token step's slope, a little below the 16800-token one, so the rule errs towards
# recording). A replayed step saves what the host's launching adds over the GPU's work, max(0, HOST_STEP_S - gpu step):
# nothing from ~11k tokens on, where the GPU is the bottleneck. A recording costs CAPTURE_FIXED_S + steps *
# HOST_STEP_S (the host launches every step once more, into the graph, and instantiates it; the eager run before it
# computes the call's output). A shape is recorded on its CAPTURE_AFTER_CALLS-th call or later, if the calls so far,
# counted as the replays still to come, would pay for the recording.
CAPTURE_AFTER_CALLS = 2
HOST_STEP_S = 0.065
GPU_STEP_S_PER_TOKEN = 5.7e-6
CAPTURE_FIXED_S = 0.09


def step_saving_s(tokens: int) -> float:
    """Seconds a replayed step saves over an eager one for a latent grid of `tokens` tokens (the model above)."""
    return max(0.0, HOST_STEP_S - tokens * GPU_STEP_S_PER_TOKEN)


# A call that does not record its loop (a shape's first, in a one-shot CLI run every shape's) runs its first
# STEP_GRAPH_EAGER_STEPS steps eagerly (the first calibrates the 8-bit attention, and between them they create every
# kernel, plan and library object a later step uses), records the next step's transformer call as a CUDA graph of one
# step, and replays it for the remaining steps; the scheduler's steps stay eager. Recording one step costs its host
# launches (HOST_STEP_S) plus STEP_CAPTURE_FIXED_S to instantiate; it pays where the replays save more
# (`step_graph_pays`: host-bound shapes, below ~9.7k tokens at 12 steps).
STEP_GRAPH_EAGER_STEPS = 2
STEP_CAPTURE_FIXED_S = 0.03


def step_graph_pays(steps: int, tokens: int) -> bool:
    """Whether a call of `steps` steps at `tokens` tokens replays its later steps from a graph of one step."""
    replays = steps - STEP_GRAPH_EAGER_STEPS
    return replays > 0 and replays * step_saving_s(tokens) > STEP_CAPTURE_FIXED_S + HOST_STEP_S


def capture_pays(steps: int, calls: int, tokens: int = 0) -> bool:
    """Whether the `calls`-th call of a shape (`steps` steps, `tokens` tokens per step) records its loop as a CUDA
    graph: from the CAPTURE_AFTER_CALLS-th call on, when `calls` replays would save more than the recording costs
    (never where the GPU, not the host, bounds a step)."""
    if calls < CAPTURE_AFTER_CALLS:
        return False
    return calls * steps * step_saving_s(tokens) > CAPTURE_FIXED_S + steps * HOST_STEP_S


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

    def parallelize(self, ctx) -> None:
        """The parallel hook: the transformer runs this rank's tokens of ctx (fastremover/parallel/context.py)."""
        from fastremover.parallel.context import set_parallel

        set_parallel(self.transformer, ctx)

    @torch.no_grad()
    def __call__(self, noise, masked_latents, mask_latents, steps: int, progress: Progress | None = None,
                 schedule: str = DEFAULT_SCHEDULE):
        scheduler = build_scheduler(self.scheduler_config, steps, device=noise.device, schedule=schedule)

        def flow(model_input, i):
            return self.transformer(model_input, scheduler.timesteps[i].expand(model_input.shape[0]))

        return denoise_loop(scheduler, flow, noise, masked_latents, mask_latents, progress)


class FastDenoiser:
    """The loop on `FastTransformer`; with `cuda_graphs`, captured once per (shape, steps) and replayed.

    At most `max_graphs` captured graphs are kept (least recently used first out: crop mode gives every request its
    own shape); an evicted graph's memory goes back to the allocator and its shape is captured again if it returns.
    A graph keeps the library objects it recorded (cuDNN attention graphs, cuBLASLt plans:
    fastremover/lru.held_while). Which shapes are recorded, and when: `capture_pays`. One denoiser serves one thread
    at a time."""

    def __init__(self, fast: FastTransformer, scheduler_config: dict, cuda_graphs: bool, max_graphs: int = 4,
                 step_graphs: bool = True):
        self.fast = fast
        self.scheduler_config = scheduler_config
        self.cuda_graphs = cuda_graphs
        self.step_graphs = step_graphs  # (and KernelTuning.step_graphs) graphs of one step in unrecorded calls
        self._graphs: LRUCache[tuple] = LRUCache(max_graphs)
        self._uncaptured: LRUCache[str] = LRUCache(max(16, max_graphs))  # shapes whose capture failed: why
        # calls per shape: a shape whose graph was evicted and returns is recorded again on its next call
        self._calls: LRUCache[int] = LRUCache(max(64, 4 * max_graphs))
        self.notes: list[str] = []

    def describe(self) -> dict:
        return {**self.fast.describe(), "cuda_graphs": self.cuda_graphs}

    def parallelize(self, ctx) -> None:
        """The parallel hook: the fast transformer runs this rank's tokens of ctx (a captured graph records the
        collectives of the context it ran under: the graph cache's key includes it)."""
        from fastremover.parallel.context import set_parallel

        set_parallel(self.fast, ctx)

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)
        logger.warning(note)

    @property
    def _context(self):
        return getattr(self.fast, "parallel", None)

    def _loop(self, scheduler, cond: Conditioning, noise, masked_latents, mask_latents, progress=None):
        def flow(model_input, i):
            return self.fast.forward_step(model_input, cond, i)

        return denoise_loop(scheduler, flow, noise, masked_latents, mask_latents, progress)

    def _loop_step_graph(self, scheduler, cond: Conditioning, noise, masked_latents, mask_latents, progress=None):
        """`_loop` with the steps from STEP_GRAPH_EAGER_STEPS on replayed from a CUDA graph of one transformer step
        (recorded here, dropped at the end): each replay runs the eager step's kernels on the same values (the
        step's input and conditioning rows copied into the graph's static buffers), so the output is the eager
        loop's. Returns (latents, why): `why` names the error where the recording failed (the remaining steps then
        ran eagerly), else None."""
        state: dict = {"why": None}

        def flow(model_input, i):
            if i < STEP_GRAPH_EAGER_STEPS or state["why"] is not None:
                return self.fast.forward_step(model_input, cond, i)
            if "graph" not in state:
                static_in, slot = model_input.clone(), cond.slot()
                slot.fill(cond, i)
                try:
                    with held_while() as state["libraries"]:
                        state["graph"], state["out"] = record_one(
                            lambda: self.fast.forward_step(static_in, slot, 0, calibrate=False), model_input.device)
                except Exception as e:  # a capture the driver or a library refused: eager (the same kernels)
                    state["why"] = f"capture failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                    return self.fast.forward_step(model_input, cond, i)
                state["in"], state["slot"] = static_in, slot
            else:
                state["in"].copy_(model_input)
                state["slot"].fill(cond, i)
            state["graph"].replay()
            return state["out"].clone()  # (a scheduler may keep a step's output; the next replay overwrites this one)

        out = denoise_loop(scheduler, flow, noise, masked_latents, mask_latents, progress)
        return out, state["why"]

    @torch.no_grad()
    def __call__(self, noise, masked_latents, mask_latents, steps: int, progress: Progress | None = None,
                 schedule: str = DEFAULT_SCHEDULE):
        ctx = self._context  # a graph records the collectives of its context (or none): part of the key
        key = (tuple(noise.shape), noise.dtype, tuple(masked_latents.shape), masked_latents.dtype, steps, schedule,
               json.dumps(self.scheduler_config, sort_keys=True, default=str),
               None if ctx is None or not ctx.is_parallel else (id(ctx), ctx.rank, ctx.world_size))
        if key in self._graphs:
            graph, static_inputs, static_out, *_held = self._graphs.get(key)
            for buf, src in zip(static_inputs, (noise, masked_latents, mask_latents)):
                buf.copy_(src)
            graph.replay()
            if ctx is not None and ctx.is_parallel:
                wait_for_replay(noise.device, ctx.timeout_s, ctx.rank)
            if progress:
                progress("denoise", steps, steps)
            return static_out.clone()

        scheduler = build_scheduler(self.scheduler_config, steps, device=noise.device, schedule=schedule)
        cond = self.fast.conditioning(scheduler.timesteps, noise.shape[0])
        if not (self.cuda_graphs and noise.device.type == "cuda") or key in self._uncaptured:
            return self._loop(scheduler, cond, noise, masked_latents, mask_latents, progress)
        calls = (self._calls.get(key) or 0) + 1
        self._calls.put(key, calls)
        _, _, t, h, w = noise.shape
        tokens = t * (h // 2) * (w // 2)
        if not capture_pays(steps, calls, tokens):
            if (self.step_graphs and step_graph_pays(steps, tokens) and not (ctx is not None and ctx.is_parallel)
                    and kernel_tuning().step_graphs):
                out, why = self._loop_step_graph(scheduler, cond, noise, masked_latents, mask_latents, progress)
                if why is not None:
                    self._uncaptured.put(key, why)
                    self._note(f"the denoise loop of shape {list(noise.shape)} runs without a CUDA graph: {why}")
                return out
            return self._loop(scheduler, cond, noise, masked_latents, mask_latents, progress)
        # The call that records: run on a side stream first (the usual warm-up before capture: kernels compiled,
        # library handles, plans and cuDNN graphs created for this shape, none of which may happen during the
        # recording), then record the same loop into a graph.
        side = torch.cuda.Stream(noise.device)
        side.wait_stream(torch.cuda.current_stream(noise.device))
        with torch.cuda.stream(side):
            out = self._loop(scheduler, cond, noise, masked_latents, mask_latents, progress)
        torch.cuda.current_stream(noise.device).wait_stream(side)
        static_inputs = (noise.clone(), masked_latents.clone(), mask_latents.clone())

        def record():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self._loop(scheduler, cond, *static_inputs)
            return graph, static_out

        with phase("graph_capture"), held_while() as libraries:
            captured, why = capture_agreed(record, self._context)
        if captured is None:
            self._uncaptured.put(key, why)
            self._note(f"the denoise loop of shape {list(noise.shape)} runs without a CUDA graph: {why}")
            return out
        graph, static_out = captured
        # scheduler, cond, the transformer's per-shape tensors and the library objects the recording used stay
        # referenced by the cache entry: the graph reads their device memory.
        held = self.fast.shape_state(tuple(noise.shape), noise.device)
        self._graphs.put(key, (graph, static_inputs, static_out, scheduler, cond, held, libraries))
        return out


def record_one(fn: Callable, device: torch.device):
    """(graph, fn's output) with fn's launches recorded into a CUDA graph on a side stream (nothing runs). Unlike
    torch.cuda.graph it neither synchronizes nor empties the allocator's cache (a graph made and dropped within one
    call), and only this thread's unsafe calls break the capture (other threads' work goes on)."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            out = fn()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001 (the capture is invalid already; fn's error is the one to report)
                pass
            raise
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(side)
    return graph, out


def capture_agreed(record: Callable, ctx=None):
    """(record(), None) when the capture succeeded here and - under sequence parallelism (`ctx` with several ranks) -
    on every rank; else (None, why). `why` names this rank's exception, or says that another rank's capture failed
    (then this rank's own graph is dropped: graphs with collectives must be replayed by every rank or by none)."""
    result, why = None, None
    try:
        result = record()
    except Exception as e:  # a capture the driver or a library refused: eager instead (same kernels, same result)
        why = f"capture failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if ctx is not None and ctx.is_parallel and not ctx.agree(why is None):
        return None, why or "the capture failed on another rank (every rank runs without the graph)"
    return (result, None) if why is None else (None, why)


def wait_for_replay(device, timeout_s: float, rank: int = 0, *, event=None, clock=time.monotonic,
                    sleep=time.sleep) -> None:
    """Wait (polling an event recorded behind the replay) until the GPU finished a graph with collectives, at most
    timeout_s; then a ParallelError: a replayed NCCL kernel waits for its peers forever, and NCCL's watchdog does
    not see work inside a graph."""
    from fastremover.parallel.context import ParallelError

    if event is None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    deadline = clock() + timeout_s
    delay = 1e-4
    while not event.query():
        if clock() >= deadline:
            raise ParallelError(f"rank {rank}: the denoise loop's CUDA graph did not finish within {timeout_s:g} s "
                                "(its collectives wait for a rank that stopped)")
        sleep(delay)
        delay = min(delay * 2, 0.01)
