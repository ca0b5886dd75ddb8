"""`bench --parallel` and `info`'s parallel lines: a parallel denoise timed against the one-process reference in
the same command, and what this machine offers for parallel runs.

`bench_denoise(config, ...)` starts the config's `parallel.world_size` ranks (launch.spawn), builds the same
random-weight model on each, and on every rank runs (1) the reference: the denoise loop on rank 0 alone, the other ranks waiting at a barrier, and
(2) the same loop under Ulysses on all ranks. It returns one JSON-able record (rank 0's view):

    world_size, sp_transport, head_groups, mode, device, latent_shape, steps, repeats
    reference_s, parallel_s (medians), speedup
    max_rel_diff           the parallel latents against the reference's
    collective_host_s      host seconds waiting in the collectives per run (gloo: the exposed communication)
    exposed_comm_s         CUDA only: seconds of the GPU timeline where communication kernels (NCCL) ran and no
                           other kernel did, per run, from torch.profiler (`exposed_time`; that run without CUDA
                           graphs, so that every kernel is traced); None elsewhere
    cuda_graphs            whether the timed loops replay CUDA graphs (fast denoisers on CUDA: the reference's and,
                           with the collectives inside, the parallel one's); graph_notes: captures that failed

The exposed-communication rule: the union of the communication kernels' intervals minus the union of every other
kernel's intervals, so communication hidden behind compute (head-group pipelining, other streams) does not count.
"""

from __future__ import annotations

import statistics
import time

import torch

from fastremover.engine.interfaces import SINGLE
from fastremover.parallel.context import ParallelContext


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def exposed_time(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Length of union(comm) minus union(compute): the time communication runs with nothing else running."""
    total = 0.0
    busy = _union(compute)
    for start, end in _union(comm):
        covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
        total += (end - start) - covered
    return total


def _is_comm_kernel(name: str) -> bool:
    n = name.lower()
    return "nccl" in n or "alltoall" in n or "allgather" in n or "allreduce" in n


def exposed_from_profile(prof) -> float:
    """Exposed communication (seconds) of a torch.profiler run with CUDA activity: kernels whose names are NCCL's
    against all other kernels (GPU timestamps, microseconds in the trace)."""
    comm, compute = [], []
    for ev in prof.events():
        if getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        span = (ev.time_range.start / 1e6, ev.time_range.end / 1e6)
        (comm if _is_comm_kernel(ev.name) else compute).append(span)
    return exposed_time(comm, compute)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_rank(ctx: ParallelContext, config, preset: str, latent_shape: tuple, steps: int, repeats: int,
               profile: bool) -> dict | None:
    """One rank of bench_denoise (module docstring). Rank 0 returns the record, the others None."""
    import torch.distributed as dist

    from fastremover.engine.build import DTYPES, build_denoiser, resolve_precision
    from fastremover.models.loading import random_models

    device = ctx.device
    dtype = resolve_precision(config.precision, device)
    torch_dtype = DTYPES[dtype]
    mode = config.mode
    models = random_models(preset, 0)
    models.transformer.to(device).to_inference_dtype(torch_dtype)
    denoiser, _ = build_denoiser(models.transformer, models.scheduler_config, mode, device, config=config,
                                 attention=config.attention.backend)
    graphs = bool(denoiser.cuda_graphs)  # both loops as `remove` runs them: captured on CUDA (fast denoisers)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(latent_shape, generator=g).to(device, torch_dtype) for _ in range(3)]

    def run():
        _sync(device)
        t = time.perf_counter()
        out = denoiser(*inputs, steps)
        _sync(device)
        return out, time.perf_counter() - t

    from fastremover.engine.denoise import CAPTURE_AFTER_CALLS

    warm = max(1, CAPTURE_AFTER_CALLS) if graphs else 1  # kernels, allocator, and the graph's recording
    ref_times, ref = [], None
    denoiser.parallelize(SINGLE)
    for _ in range(repeats + warm):  # the first runs warm up (kernels, allocator, a graph's recording)
        if ctx.is_root:
            ref, seconds = run()
            ref_times.append(seconds)
        dist.barrier(group=ctx.group)
    denoiser.parallelize(ctx)
    par_times, comm = [], []
    for i in range(repeats + warm):
        ctx.comm_seconds = 0.0
        out, seconds = run()
        par_times.append(seconds)
        comm.append(ctx.comm_seconds)
    exposed = None
    if profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as torch_profile

        denoiser.cuda_graphs = False  # the timeline of the loop's own launches (a replayed graph's kernels may not be
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # traced one by one)
            run()
        denoiser.cuda_graphs = graphs
        exposed = exposed_from_profile(prof)
    denoiser.parallelize(SINGLE)
    if not ctx.is_root:
        return None
    ref_s, par_s = statistics.median(ref_times[warm:]), statistics.median(par_times[warm:])
    return {
        **ctx.describe(), "mode": mode, "device": str(device), "dtype": dtype, "preset": preset,
        "latent_shape": list(latent_shape), "steps": steps, "repeats": repeats,
        "reference_s": ref_s, "parallel_s": par_s, "speedup": ref_s / par_s if par_s else None,
        "max_rel_diff": ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item(),
        "collective_host_s": statistics.median(comm[warm:]), "exposed_comm_s": exposed,
        "cuda_graphs": graphs, "graph_notes": list(getattr(denoiser, "notes", [])),
    }


def latent_shape(frames: int, height: int, width: int) -> tuple[int, int, int, int, int]:
    """The denoise latents of a clip at the run size (Wan VAE: 4x time, 8x space, 16 channels)."""
    return (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)


def bench_denoise(config, *, preset: str = "minimax-remover", latent_shape: tuple = (1, 16, 21, 60, 104),
                  steps: int = 12, repeats: int = 3, profile: bool = True, threads: int | None = None) -> dict:
    """The record of the module docstring for an EngineConfig: its mode, attention, precision and parallel options
    (`parallel.world_size` new ranks, one per GPU on a CUDA device; `parallel.timeout_s` per collective, and 1.5x
    that for the whole run at least 30 minutes). threads: torch's CPU threads per rank (None: torch's default)."""
    from fastremover.engine.build import resolve_device
    from fastremover.parallel.launch import spawn

    p = config.parallel
    device = resolve_device(config.device)
    device = "cuda" if device.type == "cuda" else str(device)
    results = spawn(bench_rank, p.world_size, (config, preset, tuple(latent_shape), steps, repeats, profile),
                    device=device, timeout_s=max(1800.0, 1.5 * p.timeout_s), collective_timeout_s=p.timeout_s,
                    threads=threads, transport=p.transport, head_groups=p.head_groups)
    return results[0]


def parallel_info() -> dict:
    """What `fastremover info` shows for parallel runs: the visible GPUs, the NCCL version torch was built with,
    and which torch.distributed backends exist."""
    import torch.distributed as dist

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                         "capability": f"{p.major}.{p.minor}"})
    nccl = None
    if dist.is_available() and dist.is_nccl_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # a CUDA build without a usable NCCL library
            nccl = None
    return {"gpus": gpus, "nccl": nccl, "gloo": dist.is_available() and dist.is_gloo_available(),
            "parallel": "ulysses (degrees dividing the head count; 12 heads: 2, 3, 4, 6, 12)"}


def info_lines() -> list[str]:
    """parallel_info as the lines `fastremover info` prints."""
    info = parallel_info()
    lines = [f"GPUs: {len(info['gpus'])}" + "".join(
        f"\n  cuda:{g['index']} {g['name']} {g['memory_gib']} GiB sm_{g['capability'].replace('.', '')}"
        for g in info["gpus"])]
    lines.append(f"NCCL: {info['nccl'] or 'not available'}; gloo: {'yes' if info['gloo'] else 'no'}")
    lines.append(f"parallel: {info['parallel']}")
    return lines
