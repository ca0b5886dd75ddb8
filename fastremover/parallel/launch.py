"""Starting the ranks of a parallel run, and what each rank does in it.

Two ways in:
    fastremover remove ... --parallel ulysses --gpus N     this process starts N ranks (`spawn`: one process each,
                                                           torch.multiprocessing's spawn start method) and waits
    torchrun --nproc-per-node N -m fastremover remove ... --parallel ulysses
                                                           torchrun starts them; each reads its rank from the
                                                           environment (ParallelContext.from_env)

Either way every rank runs `remove_rank`: rank 0 alone checks and reads the inputs, drives the pipeline and writes
the output; the other ranks build the same model and follow rank 0's commands (`follow`): for each stage rank 0
broadcasts what comes next, then the tensors it needs, and every rank runs its part of that stage

    ("encode", ...)   the masked video and the mask video, encoded on ranks 0 and 1 at once (parallel/vae.py)
    ("denoise", ...)  the noise and both latents; every rank runs the denoise loop on its tokens (Ulysses), the
                      flow prediction gathered on every rank each step, so all ranks step the same latents
    ("decode", ...)   the latents; the decoder split by rows, the video gathered on rank 0
    ("stop",)         the run is over

At start-up every rank checks that all ranks see the same options and model (ParallelContext.barrier_same: an
all-gather of a fingerprint). An error on any rank ends every rank: collectives time out (the context's timeout),
the first failure is written to the rendezvous store and re-raised by every rank as the same message, `spawn`
stops the ranks that are still running and raises it once; rank 0 writes its output only after the run succeeded
(and atomically), so there is no partial output.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import time
from typing import Any, Callable

import torch

from fastremover.errors import FastRemoverError
from fastremover.parallel.context import DEFAULT_TIMEOUT_S, ParallelContext, ParallelError, set_parallel

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else device


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, device: str,
           options: dict, threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    ctx = None
    try:  # the rendezvous store lives in the launcher, so it outlives any rank (the error channel needs it)
        ctx = ParallelContext.initialize(rank, world_size, master_port=port, device=_rank_device(device, rank),
                                         use_existing_store=True, **options)
        out = ctx.run(lambda: fn(ctx, *args))
        results.put((rank, "ok", _pack(out)))
    except ParallelError as e:
        results.put((rank, "error", str(e)))
    except BaseException as e:  # failed before the context existed (rendezvous)
        results.put((rank, "error", f"rank {rank} failed: {type(e).__name__}: {e}"))
    finally:
        if ctx is not None:
            try:
                ctx.close()
            except Exception:
                pass


def _mp_context():
    """forkserver where the platform has it: one server process imports torch and this package once, and each rank
    is forked from it (no CUDA or thread pool is ever started in the server, so forking it is safe); else spawn."""
    import multiprocessing as mp

    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "fastremover.parallel.launch", "fastremover.parallel.context"])
        return ctx
    return mp.get_context("spawn")


def spawn(fn: Callable, world_size: int, args: tuple = (), *, device: str = "cpu", timeout_s: float = 600.0,
          collective_timeout_s: float = DEFAULT_TIMEOUT_S, grace_s: float = 10.0, threads: int | None = None,
          **options) -> list:
    """Run fn(ctx, *args) on `world_size` new processes (rank r on cuda:r for device "cuda"); returns the ranks'
    return values in rank order. fn must be importable by name (the new processes unpickle it).

    Errors: the first rank error (one message naming the rank, the same every rank reports) is raised as a
    ParallelError once the others stop - they fail in their next collective - or after grace_s, when the ones
    still running are terminated. A run longer than timeout_s is terminated and raised as a timeout."""
    if world_size < 1:
        raise FastRemoverError(f"--gpus {world_size}: must be at least 1")
    import torch.distributed as dist
    from datetime import timedelta

    ctx = _mp_context()
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=collective_timeout_s),
                          wait_for_workers=False)
    port = store.port
    options = {"timeout_s": collective_timeout_s, **options}
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, results, device, options, threads),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    first_error: str | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, payload = results.get(timeout=min(0.2, deadline - now))
            except queue_module.Empty:
                for r, p in enumerate(procs):  # a rank that died without a word (killed, crashed)
                    if r not in done and not p.is_alive() and p.exitcode not in (0, None):
                        try:  # its message may still be in flight
                            rank, status, payload = results.get(timeout=0.5)
                        except queue_module.Empty:
                            rank, status, payload = r, "error", f"rank {r} exited with code {p.exitcode}"
                        break
                else:
                    continue
            if status == "ok":
                done[rank] = _unpack(payload)
            else:
                done[rank] = None
                if first_error is None:
                    first_error = payload
                    deadline = min(deadline, time.monotonic() + grace_s)
    finally:
        for p in procs:
            p.join(timeout=0.1 if first_error or len(done) < world_size else 5.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if first_error is not None:
        raise ParallelError(first_error)
    if len(done) < world_size:
        missing = sorted(set(range(world_size)) - set(done))
        raise ParallelError(f"parallel run timed out after {timeout_s:.0f} s waiting for ranks {missing}")
    return [done[r] for r in range(world_size)]


# ----------------------------------------------------------------------------------------------------------------------
# One rank of a parallel removal


def _fingerprint_job(spec, job) -> dict:
    """What every rank must agree on before anything runs: the model spec (without the per-rank device) and the job
    (paths and options; the files themselves are read by rank 0 alone)."""
    from dataclasses import asdict

    spec_d = {k: v for k, v in asdict(spec).items() if k != "device"}
    return {"spec": spec_d, "job": None if job is None else asdict(job)}


def weights_fingerprint(pipe) -> list:
    """A cheap digest of the loaded weights (per module: element count and the fp64 sum of all parameters)."""
    out = []
    for name in ("transformer", "vae"):
        module = getattr(pipe.models, name, None) if pipe.models is not None else None
        if module is None:
            continue
        total = sum(p.detach().double().sum().item() for p in module.parameters())
        out.append((name, sum(p.numel() for p in module.parameters()), float(total)))
    return out


def _eager_module(vae):
    """The eager WanVAE behind a pipeline VAE (an EagerVideoVAE's module, or the WanVAE itself), else None."""
    from fastremover.models.vae import WanVAE

    module = getattr(vae, "module", vae)
    return module if isinstance(module, WanVAE) else None


class ParallelEngine:
    """A built RemovalPipeline spread over the ranks of ctx: the transformer gets the context (Ulysses), the VAE
    encodes on two ranks and decodes by rows; on rank 0 the pipeline's denoiser and VAE are replaced by proxies
    that announce each stage to the other ranks (`follow`) before running their part of it."""

    def __init__(self, ctx: ParallelContext, pipe, *, cuda_graphs: bool = True):
        from fastremover.fast.denoise import EagerDenoiser, FastDenoiser
        from fastremover.parallel.context import check_heads
        from fastremover.parallel.vae import RowParallelDecoder

        if pipe.models is None:
            raise FastRemoverError("--parallel ulysses needs a model (--model random or a checkpoint), not classic")
        self.ctx, self.pipe = ctx, pipe
        self.denoiser, self.vae = pipe.denoiser, pipe.vae
        self.notes: list[str] = []
        check_heads(pipe.models.transformer.config.num_attention_heads, ctx.world_size)
        if isinstance(self.denoiser, EagerDenoiser):
            set_parallel(self.denoiser.transformer, ctx)
        elif isinstance(self.denoiser, FastDenoiser):
            set_parallel(self.denoiser.fast, ctx)
            if self.denoiser.cuda_graphs and not cuda_graphs:
                self.denoiser.cuda_graphs = False
                self.notes.append("sequence parallel: the denoise loop runs without CUDA graphs (as asked)")
        else:
            raise FastRemoverError(f"--parallel ulysses: unsupported denoiser {type(self.denoiser).__name__}")
        module = _eager_module(self.vae)
        self.decoder = RowParallelDecoder(ctx, module) if module is not None else None
        if self.decoder is None:
            self.notes.append(f"parallel VAE decode by rows needs the eager VAE; {type(self.vae).__name__} decodes "
                              "on rank 0")
        if ctx.is_root:
            pipe.denoiser = _RootDenoiser(self)
            pipe.vae = _root_vae(self)

    # the stages, run by every rank (rank 0 through the proxies, the others from `follow`)

    def encode(self, frames: torch.Tensor | None, mask: torch.Tensor | None, progress=None):
        from fastremover.parallel.vae import encode_pair

        ctx = self.ctx
        frames = ctx.broadcast_tensor(frames)
        mask = ctx.broadcast_tensor(mask)
        first = frames * (1 - mask) if ctx.rank == 0 else None  # the pipeline's own expressions (bit-identical)
        second = 2 * mask - 1.0 if ctx.rank == 1 else None
        return encode_pair(ctx, self.vae, first, second, progress)

    def denoise(self, noise, masked_latents, mask_latents, steps: int, progress=None, schedule: str | None = None):
        ctx = self.ctx
        noise, masked_latents, mask_latents = (ctx.broadcast_tensor(t) for t in (noise, masked_latents, mask_latents))
        extra = {} if schedule is None else {"schedule": schedule}
        out = self.denoiser(noise, masked_latents, mask_latents, steps, progress if ctx.is_root else None, **extra)
        return out if ctx.is_root else None

    def decode_iter(self, z, progress=None):
        z = self.ctx.broadcast_tensor(z)
        if self.decoder is not None:
            yield from self.decoder.decode_iter(z, progress)
        elif self.ctx.is_root:
            yield from self.vae.decode_iter(z, progress)

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


class _RootDenoiser:
    def __init__(self, engine: ParallelEngine):
        self.engine = engine
        self.cuda_graphs = engine.denoiser.cuda_graphs

    def describe(self) -> dict:
        return {**self.engine.denoiser.describe(), **self.engine.ctx.describe()}

    def __call__(self, noise, masked_latents, mask_latents, steps: int, progress=None, schedule: str | None = None):
        self.engine.ctx.broadcast_object(("denoise", steps, schedule))
        return self.engine.denoise(noise, masked_latents, mask_latents, steps, progress, schedule=schedule)


def _root_vae(engine: ParallelEngine):
    """Rank 0's VAE: the pipeline's VideoVAE with its two primitives that run over the ranks replaced - the removal
    pair's encodes (encode_removal_inputs) and decode_iter; tiling, scaling and the memory model stay the VAE's
    (fastremover.vae_api.VideoVAE builds encode_removal / decode_latents_iter on these)."""
    from fastremover.vae_api import VideoVAE

    inner = engine.vae

    class RootVAE(VideoVAE):
        config, device, dtype = inner.config, inner.device, inner.dtype

        def encode(self, x, progress=None):  # a tile of a tiled encode: rank 0 alone
            return inner.encode(x, progress)

        def memory_bytes(self, op, frames, height, width, batch=1):
            return inner.memory_bytes(op, frames, height, width, batch)

        def memory_budget(self):
            return inner.memory_budget()

        def encode_removal_inputs(self, frames, mask, progress=None):
            engine.ctx.broadcast_object(("encode",))
            return engine.encode(frames, mask, progress)

        def decode_iter(self, z, progress=None):
            engine.ctx.broadcast_object(("decode",))
            return engine.decode_iter(z, progress)

        def describe(self):
            return inner.describe() + f" (parallel over {engine.ctx.world_size} ranks)"

    return RootVAE()


def build_pipeline(spec):
    from fastremover.pipeline import RemovalPipeline

    return RemovalPipeline.from_model(
        spec.model, preset=spec.preset, weights_seed=spec.weights_seed, device=spec.device, precision=spec.precision,
        mode=spec.mode, attention=spec.attention, vae_precision=spec.vae_precision, weights=spec.weights,
        force_w4a4=spec.force_w4a4)


def remove_rank(ctx: ParallelContext, spec, job, progress=None, build: Callable | None = None,
                cuda_graphs: bool = True):
    """One rank of a parallel removal (module docstring): rank 0 returns the JobResult, the others None.
    build(spec) -> RemovalPipeline (default: RemovalPipeline.from_model)."""
    from dataclasses import replace

    from fastremover.worker import RemovalWorker

    spec = replace(spec, device=str(ctx.device))
    ctx.barrier_same("options and model", _fingerprint_job(spec, job))
    pipe = (build or build_pipeline)(spec)
    engine = ParallelEngine(ctx, pipe, cuda_graphs=cuda_graphs)
    ctx.barrier_same("model weights", weights_fingerprint(pipe))
    if not ctx.is_root:
        engine.follow()
        return None
    worker = RemovalWorker(spec, pipeline=pipe)
    worker.check(job)
    result = worker.run(job, progress=progress)
    engine.stop()
    result.notes.extend(engine.notes)
    result.notes.extend(getattr(engine.denoiser, "notes", []))  # e.g. a shape whose graph capture failed
    result.describe.update(ctx.describe())
    return result


def run_remove(spec, job, *, gpus: int | None = None, transport: str = "fp16", head_groups: int = 1,
               timeout_s: float = DEFAULT_TIMEOUT_S, progress=None):
    """`remove --parallel ulysses`: under torchrun (WORLD_SIZE > 1 in the environment) this process is one rank;
    otherwise `gpus` ranks are started here (one per GPU, or CPU processes with --device cpu; rank 0 then runs in a
    child process, so `progress` is not shown). Returns rank 0's JobResult on rank 0 (and in the launching process),
    None on the other ranks."""
    from fastremover.parallel.options import check_parallel_flags

    check_parallel_flags("ulysses", gpus, transport, head_groups, timeout_s)
    options = {"transport": transport, "head_groups": head_groups}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ctx = ParallelContext.from_env(device=spec.device, timeout_s=timeout_s, **options)
        try:
            return ctx.run(lambda: remove_rank(ctx, spec, job, progress if ctx.is_root else None))
        finally:
            ctx.close()
    if gpus is None or gpus < 2:
        raise FastRemoverError("--parallel ulysses: give --gpus N (N >= 2), or start the ranks with torchrun")
    device = spec.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if device != "cuda":
            raise FastRemoverError(f"--gpus {gpus}: use --device cuda (rank r runs on cuda:r), not {device}")
        if torch.cuda.device_count() < gpus:
            raise FastRemoverError(f"--gpus {gpus}: only {torch.cuda.device_count()} CUDA GPUs are visible")
    from dataclasses import replace

    threads = max(1, (os.cpu_count() or 1) // gpus) if device == "cpu" else None  # CPU ranks share the cores
    results = spawn(remove_rank, gpus, (replace(spec, device=device), job), device=device, threads=threads,
                    collective_timeout_s=timeout_s, timeout_s=max(3600.0, timeout_s), **options)
    return results[0]
