"""Starting the ranks of a parallel run, and what each rank does in it.

Two ways in:
    fastremover remove ... --parallel ulysses --gpus N     this process starts N ranks (`spawn`: one process each,
                                                           torch.multiprocessing's spawn start method) and waits
    torchrun --nproc-per-node N -m fastremover remove ... --parallel ulysses
                                                           torchrun starts them; each reads its rank from the
                                                           environment (ParallelContext.from_env)

Either way every rank runs `remove_rank` with the same model source and EngineConfig (its `parallel` options: the
ranks, the transport, the collective timeout). Each rank builds its pipeline with its ParallelContext, so the engine's
build makes the sequence-parallel denoiser and VAE (engine/parallel.py). Rank 0 alone checks and reads the inputs,
drives the request loop and writes the output; the other ranks follow rank 0's commands (`follow`): for each stage
rank 0 broadcasts what comes next, then the tensors it needs, and every rank runs its part of that stage

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
import time
from dataclasses import asdict, replace
from typing import Any, Callable

import torch

from fastremover.config import DEFAULT_PARALLEL_TIMEOUT_S, EngineConfig, ModelSource
from fastremover.env import torchrun_env
from fastremover.errors import FastRemoverError
from fastremover.parallel.context import ParallelContext, ParallelError


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
    if rank == 0:  # rank 0's notes reach the user as the CLI's would (the other ranks' are the same notes)
        from fastremover.log import setup_cli

        setup_cli(0)
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
          collective_timeout_s: float = DEFAULT_PARALLEL_TIMEOUT_S, grace_s: float = 10.0, threads: int | None = None,
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


def _fingerprint_job(source: ModelSource, config: EngineConfig, job) -> dict:
    """What every rank must agree on before anything runs: the model source, the engine config (without the per-rank
    device) and the job (paths and options; the files themselves are read by rank 0 alone)."""
    return {"source": source.describe(), "config": {k: v for k, v in config.describe().items() if k != "device"},
            "job": None if job is None else asdict(job)}


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


def build_pipeline(source: ModelSource, config: EngineConfig, ctx: ParallelContext):
    """This rank's pipeline: the engine's build makes the sequence-parallel denoiser and VAE for ctx."""
    from fastremover.pipeline import RemovalPipeline

    return RemovalPipeline.from_model(source, config=config, parallel=ctx)


def remove_rank(ctx: ParallelContext, source: ModelSource, config: EngineConfig, job, progress=None,
                build: Callable | None = None):
    """One rank of a parallel removal (module docstring): rank 0 returns the JobResult, the others None.
    build(source, config, ctx) -> RemovalPipeline (default: `build_pipeline`)."""
    from fastremover.worker import RemovalWorker

    config = config.with_(device=str(ctx.device))
    ctx.barrier_same("options and model", _fingerprint_job(source, config, job))
    pipe = (build or build_pipeline)(source, config, ctx)
    ctx.barrier_same("model weights", weights_fingerprint(pipe))
    if not ctx.is_root:
        pipe.follow()
        return None
    result = RemovalWorker(source, config, pipeline=pipe).run(job, progress=progress)
    pipe.stop()
    return result


def run_remove(source: ModelSource, config: EngineConfig, job, progress=None):
    """`remove --parallel ulysses`: under torchrun (config.torchrun_env: WORLD_SIZE > 1) this process is one rank;
    otherwise `config.parallel.world_size` ranks are started here (one per GPU, or CPU processes with --device cpu;
    rank 0 then runs in a child process, so `progress` is not shown). Returns rank 0's JobResult on rank 0 (and in
    the launching process), None on the other ranks."""
    from fastremover.engine.build import resolve_device

    p = config.parallel
    options = {"transport": p.transport, "head_groups": p.head_groups}
    device = resolve_device(config.device)
    torchrun = torchrun_env()
    if torchrun is not None:
        ctx = ParallelContext.from_env(torchrun, device=device, timeout_s=p.timeout_s, **options)
        try:
            return ctx.run(lambda: remove_rank(ctx, source, config, job, progress if ctx.is_root else None))
        finally:
            ctx.close()
    gpus = p.world_size
    if gpus is None or gpus < 2:
        raise FastRemoverError("--parallel ulysses: give --gpus N (N >= 2), or start the ranks with torchrun")
    if device.type == "cuda":
        if device.index is not None:
            raise FastRemoverError(f"--gpus {gpus}: use --device cuda (rank r runs on cuda:r), not {device}")
        if torch.cuda.device_count() < gpus:
            raise FastRemoverError(f"--gpus {gpus}: only {torch.cuda.device_count()} CUDA GPUs are visible")
    threads = max(1, (os.cpu_count() or 1) // gpus) if device.type == "cpu" else None  # CPU ranks share the cores
    results = spawn(remove_rank, gpus, (source, replace(config, device=device.type), job), device=device.type,
                    threads=threads, collective_timeout_s=p.timeout_s, timeout_s=max(3600.0, p.timeout_s),
                    **options)
    return results[0]
