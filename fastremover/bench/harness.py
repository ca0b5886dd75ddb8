"""Side-by-side benchmark and verification: the upstream-style reference and our engine modes, in one process, on the
same weights, inputs, seed and device.

For each pipeline: one warm-up run, then `repeats` timed runs (median per stage, CUDA events and wall clock); the
reference's models are moved off the GPU while the engine runs and vice versa, so each peak-memory figure is that
pipeline's own. Fidelity is measured on the decoded video *before* compositing (PSNR mean / worst frame / inside the
mask, SSIM, cosine of the final latents). `hash_repeats` re-runs whole engine requests with no extra synchronization
and compares output hashes.

The reference runs a clip in one pass on the whole frame, so the engine run it is compared with does too (one window,
crop off: `fidelity_options`). Two optional extra engine runs measure what has no reference counterpart: a windowed
run when the clip is longer than `window` (seam metric of `fastremover.windows`), and crop off vs `crop` on the same
inputs (end-to-end times and their ratio, `crop_speedup`).
"""

from __future__ import annotations

import datetime as _dt
import gc
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fastremover import media
from fastremover.bench.metrics import fidelity
from fastremover.config import EngineConfig, LinearOptions, VAEOptions
from fastremover.masks import composite, dilate_masks
from fastremover.models.loading import RemoverModels
from fastremover.pipeline import RemovalPipeline, RunOptions
from fastremover.schedulers import DEFAULT_SCHEDULE
from fastremover.timing import StageTimer
from fastremover.windows import DEFAULT_WINDOW, MIN_WINDOW, Window, default_overlap, seam_metric

WORKLOADS = {  # name: (frames, height, width)
    "w1": (69, 240, 432),
    "w2": (81, 480, 832),
    "w3": (81, 720, 1280),
}
STAGES = ("preprocess", "vae_encode", "denoise", "vae_decode", "composite_write")


@dataclass
class BenchInputs:
    name: str
    frames: np.ndarray  # uint8 [F,H,W,3], F = 4k+1, H and W multiples of 16
    mask: np.ndarray  # bool [F,H,W] undilated
    fps: float = 24.0

    @property
    def size(self) -> tuple[int, int]:  # (W, H)
        return self.frames.shape[2], self.frames.shape[1]


def synthetic_inputs(workload: str, object_fraction: float = 0.15, travel: float = 1.0) -> BenchInputs:
    frames, height, width = WORKLOADS[workload]
    video, mask = media.synthetic_clip(frames, height, width, seed=0, object_fraction=object_fraction, travel=travel)
    return BenchInputs(workload, video.frames, mask, float(video.fps))


def file_inputs(video_path: str, mask_path: str, max_frames: int | None = None) -> BenchInputs:
    """A user's clip, cut to what the upstream pipeline can take unchanged: 4k+1 frames, sides multiples of 16
    (top-left crop), so the reference and the engine see exactly the same pixels."""
    video = media.read_video(video_path, max_frames=max_frames)
    mask = media.match_mask_to_video(media.read_mask(mask_path), video)
    f = (video.num_frames - 1) // 4 * 4 + 1
    h, w = video.height // 16 * 16, video.width // 16 * 16
    if h == 0 or w == 0:
        from fastremover.errors import FastRemoverError

        raise FastRemoverError(f"{video_path}: {video.width}x{video.height} is smaller than 16x16")
    return BenchInputs(Path(video_path).name, video.frames[:f, :h, :w].copy(), mask[:f, :h, :w].copy(), float(video.fps))


# ----------------------------------------------------------------------------------------------------------------------
# Work counts


def dit_flops_per_step(models: RemoverModels, frames: int, height: int, width: int) -> dict:
    """Analytic FLOPs of one transformer forward: linears (2*M*N*K) and attention (QK^T and PV: 4*S^2*dim per layer)."""
    cfg = models.transformer.config
    t, h, w = (frames - 1) // 4 + 1, height // 8, width // 8
    pt, ph, pw = cfg.patch_size
    tokens = (t // pt) * (h // ph) * (w // pw)
    dim, ffn, layers = cfg.dim, cfg.ffn_dim, cfg.num_layers
    linear = 2 * tokens * layers * (4 * dim * dim + 2 * dim * ffn)
    linear += 2 * tokens * dim * (cfg.in_channels * pt * ph * pw + cfg.out_channels * pt * ph * pw)
    attention = 4 * tokens * tokens * dim * layers
    return {"tokens": tokens, "linear_tflop": linear / 1e12, "attention_tflop": attention / 1e12,
            "total_tflop": (linear + attention) / 1e12}


def vae_flops(pipe: RemovalPipeline, inputs: BenchInputs) -> dict:
    """Counted FLOPs of the two encodes and the decode (torch's FlopCounterMode over one extra run of the VAE)."""
    from torch.utils.flop_counter import FlopCounterMode

    prep = pipe.prepare(inputs.frames, dilate_masks(inputs.mask, 6), size=inputs.size)
    with torch.no_grad():
        with FlopCounterMode(display=False) as enc:
            masked_latents, _ = pipe.encode(prep)
        with FlopCounterMode(display=False) as dec:
            pipe.decode(masked_latents)
    return {"encode_tflop": enc.get_total_flops() / 1e12, "decode_tflop": dec.get_total_flops() / 1e12}


# ----------------------------------------------------------------------------------------------------------------------
# Runs


@dataclass
class PipelineRun:
    """Timings of repeated runs of one pipeline plus its last output."""

    label: str
    wall: list[dict] = field(default_factory=list)
    device: list[dict] = field(default_factory=list)
    peak_gib: float = 0.0
    pixels: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    frames: np.ndarray | None = None
    hashes: list[str] = field(default_factory=list)
    windows: list = field(default_factory=list)  # the engine's per-window geometry (pipeline.WindowRun) of the last run
    streamed: dict | None = None  # the engine: one request through the streaming path (streamed_write)
    # per stage, max over the timed runs (CUDA only; empty on the CPU): the peak of torch.cuda.max_memory_allocated
    # during the stage (everything resident: weights, inputs, working memory), and that peak minus what was allocated
    # when the stage began (the stage's own working memory)
    stage_peak_gib: dict = field(default_factory=dict)
    stage_peak_delta_gib: dict = field(default_factory=dict)

    def stages_s(self) -> dict[str, float]:
        """Median per stage over the timed runs; device (CUDA event) time where available, else wall clock."""
        runs = self.device if self.device and self.device[0] else self.wall
        return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in STAGES if any(k in r for r in runs)}

    def total_s(self) -> float:
        return statistics.median(sum(r.values()) for r in self.wall)

    def summary(self) -> dict:
        return {
            "stages_s": {k: round(v, 4) for k, v in self.stages_s().items()},
            "stages_wall_s": {k: round(statistics.median(r.get(k, 0.0) for r in self.wall), 4) for k in STAGES},
            "total_s": round(self.total_s(), 4),
            "peak_gib": round(self.peak_gib, 3),
            "stage_peak_gib": {k: round(v, 3) for k, v in self.stage_peak_gib.items()} or None,
            "stage_peak_delta_gib": {k: round(v, 3) for k, v in self.stage_peak_delta_gib.items()} or None,
            "runs": len(self.wall),
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


@dataclass
class PeakTimer(StageTimer):
    """A StageTimer that also records each stage's CUDA memory peak (torch.cuda.reset_peak_memory_stats when the
    stage begins, max_memory_allocated when it ends): `peaks[stage] = (peak GiB, peak - allocated at start GiB)`,
    max over repeated entries. `overall_gib` keeps the whole run's peak across those resets. No-op on the CPU.
    Stages must not nest (the pipeline's and the reference's do not)."""

    peaks: dict = field(default_factory=dict)
    overall_gib: float = 0.0

    @contextmanager
    def stage(self, name: str):
        if not self._cuda:
            with super().stage(name):
                yield
            return
        self.overall_gib = max(self.overall_gib, _peak(self.device))
        start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        with super().stage(name):
            yield
        peak = torch.cuda.max_memory_allocated(self.device)
        self.overall_gib = max(self.overall_gib, peak / 2**30)
        old = self.peaks.get(name, (0.0, 0.0))
        self.peaks[name] = (max(old[0], peak / 2**30), max(old[1], (peak - start) / 2**30))


def _write(frames: np.ndarray, fps: float, workdir: str) -> None:
    media.write_video(os.path.join(workdir, "out.mp4"), frames, fps)


def _time_requests(run: PipelineRun, device: torch.device, repeats: int, request, fold: str, fps: float,
                   workdir: str, warmups: int = 1):
    """`warmups` untimed requests plus `repeats` timed whole requests (repeats 0: one request, kept).
    `request(timer)` returns (result, frames to write); the write is timed as `composite_write`, into which the
    pipeline's own last stage `fold` is merged so both sides report the same stages. Returns the last result."""
    _reset_peak(device)
    overall = 0.0
    warmups = warmups if repeats else 0  # no timed run (verify): the one request is the result
    for i in range(warmups + max(repeats, 1)):
        timer = PeakTimer(device)
        result, frames = request(timer)
        with timer.stage("composite_write"):
            _write(frames, fps, workdir)
        wall = dict(timer.wall_s)
        wall["composite_write"] += wall.pop(fold, 0.0)
        dev = timer.device_s()
        if dev:
            dev["composite_write"] = dev.get("composite_write", 0.0) + dev.pop(fold, 0.0)
        if i >= warmups:
            run.wall.append(wall)
            run.device.append(dev)
            for stage, (peak, delta) in timer.peaks.items():
                run.stage_peak_gib[stage] = max(run.stage_peak_gib.get(stage, 0.0), peak)
                run.stage_peak_delta_gib[stage] = max(run.stage_peak_delta_gib.get(stage, 0.0), delta)
        overall = max(overall, timer.overall_gib)
    run.peak_gib = max(overall, _peak(device))  # the per-stage resets hide earlier peaks from max_memory_allocated
    return result


def run_reference(ref, inputs: BenchInputs, steps: int, seed: int, repeats: int, workdir: str,
                  schedule: str = DEFAULT_SCHEDULE) -> PipelineRun:
    run = PipelineRun("reference")
    dilated = dilate_masks(inputs.mask, 6)
    w, h = inputs.size

    def request(timer):
        result = ref(inputs.frames, inputs.mask, height=h, width=w, steps=steps, seed=seed, iterations=6, timer=timer,
                     schedule=schedule)
        return result, composite(inputs.frames, result.frames, dilated)

    result = _time_requests(run, ref.device, repeats, request, "postprocess", inputs.fps, workdir)
    run.pixels, run.latents, run.frames = result.pixels, result.latents, result.frames
    return run


def fidelity_options(inputs: BenchInputs, steps: int, seed: int, schedule: str = DEFAULT_SCHEDULE) -> RunOptions:
    """Engine options for the run compared with the reference. The reference has neither windows nor crops, so this
    is one window covering every frame and the whole frame at the reference's run size (explicit WxH)."""
    return RunOptions(steps=steps, seed=seed, dilate=6, size=f"{inputs.size[0]}x{inputs.size[1]}",
                      window=max(MIN_WINDOW, inputs.frames.shape[0]), overlap=0, crop="off", schedule=schedule)


def engine_warmups(pipe: RemovalPipeline) -> int:
    """Untimed requests before a warm measurement: enough for the denoiser to have recorded its CUDA graphs
    (engine/denoise.capture_pays: a shape is recorded on its CAPTURE_AFTER_CALLS-th call), else one."""
    if getattr(pipe.denoiser, "cuda_graphs", False) and pipe.device.type == "cuda":
        from fastremover.engine.denoise import CAPTURE_AFTER_CALLS

        return max(1, CAPTURE_AFTER_CALLS)
    return 1


def run_engine(pipe: RemovalPipeline, inputs: BenchInputs, steps: int, seed: int, repeats: int, workdir: str,
               hash_repeats: int = 0, options: RunOptions | None = None, streamed: bool = False) -> PipelineRun:
    """Time the engine on `inputs`; `options` default to `fidelity_options` (the run compared with the reference).
    `streamed`: also one request through the streaming path (`streamed_write`: exposed vs overlapped write)."""
    run = PipelineRun(pipe.config.mode)
    options = options or fidelity_options(inputs, steps, seed)

    def request(timer):
        result = pipe.remove(inputs.frames, inputs.mask, options, timer=timer, keep_pixels=True)
        return result, result.frames

    result = _time_requests(run, pipe.device, repeats, request, "composite", inputs.fps, workdir,
                            warmups=engine_warmups(pipe))
    run.pixels, run.latents, run.frames, run.windows = result.pixels, result.latents, result.frames, result.windows
    for _ in range(hash_repeats):  # whole requests, no stage synchronization
        out = pipe.remove(inputs.frames, inputs.mask, options, timer=StageTimer(pipe.device, sync=False))
        run.hashes.append(hashlib.sha256(out.frames.tobytes()).hexdigest())
    if streamed:
        runs = [streamed_write(pipe, inputs, options, workdir, reference=run.frames) for _ in range(max(1, repeats))]
        totals = [r["total_s"] for r in runs]
        run.streamed = {**sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2], "totals_s": totals,
                        "identical": all(r["identical"] for r in runs),
                        "frames_identical": all(r["frames_identical"] for r in runs)}
    return run


def streamed_write(pipe: RemovalPipeline, inputs: BenchInputs, options: RunOptions, workdir: str,
                   reference: np.ndarray | None = None) -> dict:
    """One request through the streaming path (`remove_stream` + `stream.OrderedWriter`, as `fastremover remove`
    runs): the whole request's wall time, the write time the window loop still waited for (`write_exposed_s`: queue
    full, and the final flush + audio + rename) and the writer thread's own work hidden behind the windows
    (`write_overlapped_s`). Also whether the file equals the serial write of the in-memory result (`identical`;
    `reference`: that result's frames, if already computed with the same options). `run_engine` runs it once per
    timed repeat and keeps the median request (`totals_s`: all of them)."""
    from fastremover.stream import OrderedWriter

    path = os.path.join(workdir, "streamed.mp4")
    writer = OrderedWriter(lambda frames: media.write_frames(path, frames, inputs.fps))
    exposed = 0.0
    emitted = []  # hashed after the clock stops: the emitted frames' bytes tell a pixel difference from a bitstream one

    def emit(frame):
        nonlocal exposed
        emitted.append(frame)
        t = time.perf_counter()
        writer.put(frame)
        exposed += time.perf_counter() - t

    start = time.perf_counter()
    try:
        streamed = pipe.remove_stream(zip(inputs.frames, inputs.mask), emit, options)
        t = time.perf_counter()
        writer.close()
        exposed += time.perf_counter() - t
    except BaseException:
        writer.abandon()
        raise
    total = time.perf_counter() - start
    digest = hashlib.sha256()
    for frame in emitted:
        digest.update(np.ascontiguousarray(frame).tobytes())
    del emitted
    serial = os.path.join(workdir, "serial.mp4")
    if reference is None:
        reference = pipe.remove(inputs.frames, inputs.mask, options).frames
    media.write_video(serial, reference, inputs.fps)
    with open(path, "rb") as a, open(serial, "rb") as b:
        streamed_bytes, serial_bytes = a.read(), b.read()
    identical = streamed_bytes == serial_bytes
    frames_identical = digest.hexdigest() == hashlib.sha256(np.ascontiguousarray(reference).tobytes()).hexdigest()
    out = {"total_s": round(total, 4), "write_exposed_s": round(exposed, 4),
           "write_overlapped_s": round(max(0.0, writer.busy_s - exposed), 4), "identical": identical,
           "frames_identical": frames_identical,
           # host wall time per stage of the request (no synchronization: GPU stages show their launch and wait time)
           "host_stages_s": {k: round(v, 4) for k, v in streamed.timer.wall_s.items()}}
    if not identical:  # where the two files part: container bytes only, or the decoded pictures too
        first = next((i for i, (x, y) in enumerate(zip(streamed_bytes, serial_bytes)) if x != y),
                     min(len(streamed_bytes), len(serial_bytes)))
        decoded_equal = np.array_equal(media.read_video(path).frames, media.read_video(serial).frames)
        out["difference"] = {"bytes": [len(streamed_bytes), len(serial_bytes)], "first_differing_byte": first,
                             "decoded_frames_equal": bool(decoded_equal)}
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The whole comparison


def host() -> dict:
    """The machine's host side, so that results from two leases of the same GPU can be told apart: its processor,
    the cores this process may use, and the rate of a fixed pure-Python loop (millions of iterations per second, the
    best of three; a fresh process's imports and a request's kernel launches are host-bound Python)."""
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    def loop(n: int = 200_000) -> float:
        t, total = time.perf_counter(), 0
        for i in range(n):
            total += i & 7
        return n / (time.perf_counter() - t) / 1e6

    return {"cpu": model or "unknown", "cores": cores, "python_loop_mops": round(max(loop() for _ in range(3)), 2)}


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, cwd=Path(__file__).resolve().parent).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", False
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or 'unknown'})"
    return {"gpu": gpu, "torch": torch.__version__, "commit": commit + ("-dirty" if dirty else ""),
            "command": " ".join(["fastremover", *sys.argv[1:]]) if sys.argv else "", "python": platform.python_version(),
            "host": host()}


def script_environment() -> dict:
    """`environment()` for a script run as `python SCRIPT ...` (tools/, experiments/): its command line as run."""
    return {**environment(), "command": " ".join(["python", *sys.argv])}


def compare(
    models: RemoverModels,
    inputs: BenchInputs,
    config: EngineConfig | None = None,
    *,
    modes: list[str],
    steps: int = 12,
    seed: int = 42,
    repeats: int = 1,
    hash_repeats: int = 0,
    count_flops: bool = True,
    window: int = DEFAULT_WINDOW,
    overlap: int | None = None,
    crop: str | None = None,
    on_result=None,
    nvfp4_rows: bool | dict = False,
    schedule: str = DEFAULT_SCHEDULE,
) -> list[dict]:
    """Run the reference and each engine mode on `inputs`; returns one result dict per mode. `config`: the engine
    config every mode runs with (its `mode` replaced by each of `modes`; None: the defaults with the environment's
    overrides); its device and precision are the reference's too.

    Fidelity is always the reference vs the engine in one window on the whole frame. If the clip has more than
    `window` frames, the engine also runs in windows of `window` (`overlap` shared, None = the default) and the seam
    metric is reported; with `crop` ("auto" | "on" | "off") it also runs crop off vs `crop` at the native size and
    reports both end-to-end times. `on_result(result)` is called as soon as each mode's result is complete (the CLI
    saves it right away, so a run cut short still leaves the finished modes' JSON), and progress goes to stderr.
    `nvfp4_rows`: also the NVFP4 fidelity rows (`nvfp4_fidelity`: each NVFP4 option against the dense eager run at
    `precision`), stored in every mode's result as "nvfp4_fidelity"; a dict: those rows with these keyword
    arguments of nvfp4_fidelity (options, crop_inputs, vae_min_in_channels). `schedule`: the flow schedule of every
    run, the reference's and the engine's (fastremover.schedulers.SCHEDULES).
    """
    # bad flags fail before the long runs
    RunOptions(window=window, overlap=overlap, crop=crop or "off", schedule=schedule).validate()
    from fastremover.bench.reference import ReferencePipeline
    from fastremover.engine.build import DTYPES, resolve_device, resolve_precision

    config = config if config is not None else EngineConfig.from_env()
    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    config = config.with_(device=str(device), precision=precision)
    env = environment()
    work = dit_flops_per_step(models, *inputs.frames.shape[:3])
    started = time.perf_counter()

    def log(what: str) -> None:
        print(f"bench: {what} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="fastremover-bench-") as workdir:
        ref = ReferencePipeline(models, device=device, dtype=DTYPES[precision])
        ref_run = run_reference(ref, inputs, steps, seed, repeats, workdir, schedule)
        log(f"reference: {1 + repeats} runs done")
        ref.to("cpu")
        del ref
        gc.collect()
        nvfp4 = None
        if nvfp4_rows:
            extra = nvfp4_rows if isinstance(nvfp4_rows, dict) else {}
            nvfp4 = nvfp4_fidelity(models, inputs, steps=steps, seed=seed, device=str(device), precision=precision,
                                   **extra)
            log("nvfp4 fidelity rows done")
        results = []
        for mode in modes:
            pipe = RemovalPipeline(models, config.with_(mode=mode))
            eng = run_engine(pipe, inputs, steps, seed, repeats, workdir, hash_repeats, streamed=True,
                             options=fidelity_options(inputs, steps, seed, schedule))
            log(f"{mode}: {1 + repeats} timed runs + {hash_repeats} hash runs done")
            flops = vae_flops(pipe, inputs) if count_flops else {}
            result = _result_dict(env, inputs, steps, seed, precision, pipe, ref_run, eng, work, flops)
            result["schedule"] = schedule
            if nvfp4 is not None:
                result["nvfp4_fidelity"] = nvfp4
            if inputs.frames.shape[0] > window:
                result.update(_windowed_run(pipe, inputs, steps, seed, window, overlap, workdir, schedule))
            if crop is not None:
                result.update(_crop_comparison(pipe, inputs, steps, seed, repeats, window, overlap, crop, workdir,
                                               schedule))
            results.append(result)
            log(f"{mode}: done")
            if on_result is not None:
                on_result(result)
            models.transformer.to("cpu")
            models.vae.to("cpu")
            del pipe
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def _windowed_run(pipe, inputs, steps, seed, window, overlap, workdir, schedule=DEFAULT_SCHEDULE) -> dict:
    """One engine run in windows (crop off, same run size as the fidelity run): how visible are the boundaries?"""
    options = RunOptions(steps=steps, seed=seed, dilate=6, size=f"{inputs.size[0]}x{inputs.size[1]}",
                         window=window, overlap=overlap, crop="off", schedule=schedule)
    run = run_engine(pipe, inputs, steps, seed, 0, workdir, options=options)
    windows = [Window(w.start, w.stop, w.overlap) for w in run.windows]
    seams = seam_metric(run.frames, dilate_masks(inputs.mask, 6), windows)
    return {
        "window": window,
        "overlap": default_overlap(window) if overlap is None else overlap,
        "windows": len(windows),
        "windowed_total_s": round(run.total_s(), 4),
        **{k: (round(v, 4) if v is not None else None) for k, v in seams.items()},
    }


def _crop_comparison(pipe, inputs, steps, seed, repeats, window, overlap, crop, workdir,
                     schedule=DEFAULT_SCHEDULE) -> dict:
    """The same request with crop off and with `crop`, at the native size (a crop cannot be combined with a resize)."""
    runs = {}
    for setting in dict.fromkeys(("off", crop)):  # --crop off: one run, compared with itself
        options = RunOptions(steps=steps, seed=seed, dilate=6, size="native", window=window, overlap=overlap,
                             crop=setting, schedule=schedule)
        runs[setting] = run_engine(pipe, inputs, steps, seed, repeats, workdir, options=options)
    off, cropped = runs["off"], runs[crop]
    return {
        "crop_setting": crop,
        "crop_off_total_s": round(off.total_s(), 4),
        "crop_total_s": round(cropped.total_s(), 4),
        "crop_speedup": round(off.total_s() / cropped.total_s(), 4),
        "crop_off_stages_s": off.summary().get("stages_wall_s"),
        "crop_stages_s": cropped.summary().get("stages_wall_s"),
        "crop_boxes": [list(w.box) if w.box else None for w in cropped.windows],  # (y0, y1, x0, x1); None = whole frame
        "crop_run_sizes": [f"{w.run_hw[1]}x{w.run_hw[0]}" if w.run_hw else None for w in cropped.windows],
        "crop_fidelity": "not measured: the cropped run differs from the reference by design (the model sees only the "
                         "crop); psnr/ssim/latent_cos are from the full-frame, one-window run",
    }


NVFP4_OPTIONS = ("nvfp4", "nvfp4+vae", "nvfp4-w4a4@crop")  # the fidelity rows of nvfp4_fidelity


def _conv_plans_report(pipe: RemovalPipeline) -> list[dict] | None:
    plans = getattr(pipe.vae, "conv_plans", None)
    return plans.report() if plans is not None else None


def _eager_vae(pipe: RemovalPipeline):
    """The nn.Module behind the pipeline's VAE (the eager WanVAE of an EagerVideoVAE, or the module itself)."""
    return getattr(pipe.vae, "module", pipe.vae)


def _pipeline_for(models: RemoverModels, weights: str, device, precision: str, vae_min_in_channels: int):
    """An eager pipeline on a private copy of `models` with `weights` ("dense", "nvfp4", "nvfp4+vae", "nvfp4-w4a4"),
    and what was packed: (pipe, {"transformer": Nvfp4Report dict or None, "vae": Nvfp4ConvReport dict or None})."""
    import copy

    from fastremover.fast.nvfp4_conv import Nvfp4CausalConv3d, quantize_vae_convs_nvfp4
    from fastremover.models.vae import WanVAE

    dit = {"nvfp4+vae": "nvfp4"}.get(weights, weights)
    config = EngineConfig(device=str(device), precision=precision, mode="eager",  # the VAE's convs: the +vae row only
                          linears=LinearOptions(weights=dit, force_w4a4=True),  # W4A4 runs on a crop; the CLI refuses
                          vae=VAEOptions(nvfp4_convs=False)).with_env()
    pipe = RemovalPipeline(copy.deepcopy(models), config=config)
    packed = {"transformer": pipe.config.nvfp4, "vae": None}
    if weights == "nvfp4+vae":
        vae = _eager_vae(pipe)
        if not isinstance(vae, WanVAE):
            raise RuntimeError(f"nvfp4+vae needs the eager VAE, the pipeline built {type(pipe.vae).__name__}")
        if not any(isinstance(m, Nvfp4CausalConv3d) for m in vae.modules()):  # (the pipeline may do it itself)
            packed["vae"] = quantize_vae_convs_nvfp4(vae, min_in_channels=vae_min_in_channels).describe()
    return pipe, packed


def nvfp4_fidelity(models: RemoverModels, inputs: BenchInputs, *, steps: int = 12, seed: int = 42,
                   device: str | None = None, precision: str | None = None, options=NVFP4_OPTIONS,
                   crop_inputs: BenchInputs | None = None, vae_min_in_channels: int | None = None) -> dict:
    """Fidelity of each NVFP4 option against the dense run of the same eager pipeline at the same precision (fp16 on
    a GPU: the fp16 reference; fp32 on the CPU), on the same inputs, seed and steps. Options:
        nvfp4            the DiT's block linears in NVFP4 (W4A16)
        nvfp4+vae        and the VAE's 3x3x3 convs with >= vae_min_in_channels (default 192) input channels
        nvfp4-w4a4@crop  W4A4 emulation, on a crop (crop on; its dense baseline is the same crop run): the mode it
                         is meant for
    Full-frame rows: PSNR mean / worst frame / inside the mask of the decoded video before compositing, SSIM, latent
    cosine, as `compare` reports them. Crop rows: PSNR inside the mask of the composited output (uint8; latent
    cosine where the pipeline keeps the latents of a cropped run, else None). Each row records resident weight
    bytes and what was packed. Every run is on a private copy of `models`. `crop_inputs`: the crop rows' clip (default `inputs`)."""
    from fastremover.bench.metrics import cosine
    from fastremover.fast.nvfp4_conv import MIN_IN_CHANNELS, Nvfp4CausalConv3d
    from fastremover.engine.build import resolve_device, resolve_precision
    from fastremover.ops.linear.nvfp4 import Nvfp4Linear, resident_bytes

    unknown = [o for o in options if o not in NVFP4_OPTIONS]
    if unknown:
        raise ValueError(f"unknown NVFP4 options {unknown}: choose from {list(NVFP4_OPTIONS)}")
    device = resolve_device(device)
    precision = resolve_precision(precision, device)
    vae_min = MIN_IN_CHANNELS if vae_min_in_channels is None else vae_min_in_channels
    crop_inputs = crop_inputs or inputs
    full = fidelity_options(inputs, steps, seed)
    crop = RunOptions(steps=steps, seed=seed, dilate=6, size="native",
                      window=max(MIN_WINDOW, crop_inputs.frames.shape[0]), overlap=0, crop="on")
    mask = torch.from_numpy(dilate_masks(inputs.mask, 6))

    def run(weights: str, clip: BenchInputs, opts: RunOptions):
        pipe, packed = _pipeline_for(models, weights, device, precision, vae_min)
        calls = []
        for m in pipe.models.transformer.modules():  # proof that the NVFP4 layers ran
            if isinstance(m, Nvfp4Linear):
                m.register_forward_hook(lambda *_: calls.append(1))
        started = time.perf_counter()
        result = pipe.remove(clip.frames, clip.mask, opts, keep_pixels=True)
        _sync(device)
        info = {"total_s": round(time.perf_counter() - started, 4), "nvfp4_calls": len(calls),
                "transformer_bytes": resident_bytes(pipe.models.transformer),
                "vae_bytes": resident_bytes(_eager_vae(pipe)),
                "vae_nvfp4_convs": sum(isinstance(m, Nvfp4CausalConv3d) for m in _eager_vae(pipe).modules()),
                "packed": packed}
        pipe.close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return result, info

    rows = []
    base, base_info = run("dense", inputs, full)
    rows.append({"weights": "dense", "pass": "full frame", **base_info})
    crop_base = None
    for option in options:
        weights, _, where = option.partition("@")
        if where == "crop":
            if crop_base is None:
                crop_base, info = run("dense", crop_inputs, crop)
                rows.append({"weights": "dense", "pass": "crop", **info})
            res, info = run(weights, crop_inputs, crop)
            boxes = [list(w.box) if w.box else None for w in res.windows if w.ran]
            d = (res.frames.astype(np.float64) - crop_base.frames.astype(np.float64))[res.mask] / 255.0
            mse = float((d * d).mean()) if d.size else float("nan")
            rows.append({"weights": weights, "pass": "crop", "crop_boxes": boxes,
                         "psnr_mask_db": math.inf if mse == 0 else 10 * math.log10(1.0 / mse),
                         "latent_cos": (cosine(res.latents, crop_base.latents)
                                        if res.latents is not None and crop_base.latents is not None else None),
                         **info})
        else:
            res, info = run(weights, inputs, full)
            m = mask
            pad = res.pixels.shape[2] - m.shape[0]
            if pad > 0:
                m = torch.cat([m, m[-1:].expand(pad, -1, -1)])
            rows.append({"weights": option, "pass": "full frame",
                         **fidelity(res.pixels, base.pixels, m, res.latents, base.latents, device=device), **info})
    for r in rows:
        for k, v in list(r.items()):
            if isinstance(v, float) and math.isfinite(v):
                r[k] = round(v, 6 if k == "latent_cos" else 4)
    return {"baseline": f"dense, eager, {precision}", "precision": precision, "steps": steps, "seed": seed,
            "vae_min_in_channels": vae_min, "rows": rows}


def format_nvfp4_table(fid: dict) -> str:
    """The NVFP4 fidelity rows as text."""
    lines = [f"NVFP4 fidelity against {fid['baseline']} ({fid['steps']} steps)",
             f"{'weights':<12}{'pass':<12}{'PSNR':>8}{'min':>8}{'mask':>8}{'lat cos':>11}{'DiT MiB':>9}"
             f"{'VAE MiB':>9}{'total s':>9}"]
    fmt = lambda v, w, p: f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
    for r in fid["rows"]:
        lines.append(f"{r['weights']:<12}{r['pass']:<12}" + fmt(r.get("psnr_mean_db"), 8, 2)
                     + fmt(r.get("psnr_min_db"), 8, 2) + fmt(r.get("psnr_mask_db"), 8, 2)
                     + fmt(r.get("latent_cos"), 11, 6) + fmt(r["transformer_bytes"] / 2**20, 9, 1)
                     + fmt(r["vae_bytes"] / 2**20, 9, 1) + fmt(r["total_s"], 9, 2))
    return "\n".join(lines)


def _result_dict(env, inputs, steps, seed, precision, pipe, ref_run, eng, work, flops) -> dict:
    ref_s, eng_s = ref_run.stages_s(), eng.stages_s()
    vae_ref = ref_s.get("vae_encode", 0) + ref_s.get("vae_decode", 0)
    vae_eng = eng_s.get("vae_encode", 0) + eng_s.get("vae_decode", 0)
    mask = torch.from_numpy(dilate_masks(inputs.mask, 6))
    pad = ref_run.pixels.shape[2] - mask.shape[0]
    if pad > 0:
        mask = torch.cat([mask, mask[-1:].expand(pad, -1, -1)])
    fid = fidelity(eng.pixels, ref_run.pixels, mask, eng.latents, ref_run.latents, device=pipe.device)
    denoise_s = eng_s.get("denoise", float("nan"))
    out = {
        **env,
        "workload": inputs.name,
        "frames": int(inputs.frames.shape[0]),
        "size": f"{inputs.size[0]}x{inputs.size[1]}",
        "steps": steps,
        "seed": seed,
        "precision": precision,
        "mode": pipe.config.mode,
        "engine_config": pipe.config.describe(),
        "model": pipe.config.model,
        # a Hugging Face Hub model: its id and the commit that ran ("org/name@<sha>" in "model" too)
        "model_revision": getattr(pipe.models, "revision", None),
        # the engine run compared with the reference has the reference's geometry: one pass, the whole frame
        "fidelity_run": {"windows": 1, "crop": "off"},
        "reference": ref_run.summary(),
        "engine": eng.summary(),
        "streamed": eng.streamed,
        "speedup_total": round(ref_run.total_s() / eng.total_s(), 4),
        # the request as `fastremover remove` runs it (streamed, write overlapped) against the reference's whole run
        "speedup_streamed": round(ref_run.total_s() / eng.streamed["total_s"], 4) if eng.streamed else None,
        "speedup_denoise": round(ref_s["denoise"] / eng_s["denoise"], 4),
        "speedup_vae": round(vae_ref / vae_eng, 4) if vae_eng else None,
        "vae": pipe.config.vae,
        # per conv signature: the cuDNN plan the fast VAE chose (fast/cudnn_conv.py), torch's and its time per call
        "vae_conv_plans": _conv_plans_report(pipe),
        # engine / reference per VAE stage (CUDA): absolute peaks, and the stages' own working memory
        "vae_stage_peak_ratio": _ratios(eng.stage_peak_gib, ref_run.stage_peak_gib),
        "vae_stage_peak_delta_ratio": _ratios(eng.stage_peak_delta_gib, ref_run.stage_peak_delta_gib),
        **{k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v) for k, v in fid.items()},
        "dit_tflop_per_step": round(work["total_tflop"], 3),
        "dit_linear_tflop_per_step": round(work["linear_tflop"], 3),
        "dit_attention_tflop_per_step": round(work["attention_tflop"], 3),
        "dit_tokens": work["tokens"],
        "dit_tflops_achieved": round(work["total_tflop"] * steps / denoise_s, 1) if denoise_s else None,
        "reference_dit_tflops_achieved": round(work["total_tflop"] * steps / ref_s["denoise"], 1),
        **{f"vae_{k}": round(v, 2) for k, v in flops.items()},
    }
    if eng.hashes:
        out["hash_repeats"] = len(eng.hashes)
        # one hash proves nothing about determinism: only two or more runs get a verdict
        out["hashes_identical"] = len(set(eng.hashes)) == 1 if len(eng.hashes) >= 2 else None
        out["output_sha256"] = eng.hashes[0]
    return out


def _ratios(eng: dict, ref: dict) -> dict | None:
    out = {k: round(eng[k] / ref[k], 4) for k in ("vae_encode", "vae_decode") if eng.get(k) and ref.get(k)}
    return out or None


# ----------------------------------------------------------------------------------------------------------------------
# Reporting


def format_table(results: list[dict]) -> str:
    if not results:
        return "(no results)"
    head = results[0]
    lines = [
        f"{head['workload']}: {head['frames']} f {head['size']}, {head['steps']} steps, {head['precision']}, "
        f"{head['gpu']}, model {head['model']}",
        f"{'pipeline':<12}" + "".join(f"{s:>16}" for s in STAGES) + f"{'total':>10}{'speedup':>9}{'peak GiB':>10}"
        f"{'PSNR':>8}{'min':>7}{'mask':>7}{'SSIM':>8}{'lat cos':>10}",
    ]

    def row(label, summ, extra=""):
        st = summ["stages_s"]
        return f"{label:<12}" + "".join(f"{st.get(s, 0):>16.3f}" for s in STAGES) + f"{summ['total_s']:>10.3f}" + extra

    lines.append(row("reference", head["reference"], f"{1.0:>9.2f}x{head['reference']['peak_gib']:>9.2f}"))
    for r in results:
        fmt = lambda v, w, p: f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{str(v):>{w}}"  # noqa: E731
        lines.append(row(r["mode"], r["engine"], f"{r['speedup_total']:>9.2f}x{r['engine']['peak_gib']:>9.2f}"
                         + fmt(r["psnr_mean_db"], 8, 1) + fmt(r["psnr_min_db"], 7, 1) + fmt(r["psnr_mask_db"], 7, 1)
                         + fmt(r["ssim_mean"], 8, 4) + fmt(r["latent_cos"], 10, 6)))
    for r in results:
        ec = r.get("engine_config") or {}
        lines.append(f"engine [{r['mode']}]: attention {ec.get('attention', '?')}, fp8 GEMM {ec.get('fp8_gemm', '?')}, "
                     f"ffn1 {ec.get('ffn1', '?')}, cuda graphs {ec.get('cuda_graphs', '?')}"
                     + (f"; notes: {ec['notes']}" if ec.get("notes") else ""))
        lines.append(
            f"roofline [{r['mode']}]: DiT {r['dit_tflop_per_step']:.2f} TFLOP/step "
            f"(linear {r['dit_linear_tflop_per_step']:.2f}, attention {r['dit_attention_tflop_per_step']:.2f}, "
            f"{r['dit_tokens']} tokens) -> {r['dit_tflops_achieved']} TFLOP/s achieved "
            f"(reference {r['reference_dit_tflops_achieved']}); VAE encode {r.get('vae_encode_tflop', '?')} + decode "
            f"{r.get('vae_decode_tflop', '?')} TFLOP"
            + (f"; hashes over {r['hash_repeats']} runs identical: {r['hashes_identical']}"
               if r.get("hashes_identical") is not None else
               "; determinism not checked (use --hash-repeats 2 or more)" if "hash_repeats" in r else "")
        )
        if r.get("vae_stage_peak_ratio"):
            pk, pr = r["engine"]["stage_peak_gib"] or {}, r["reference"]["stage_peak_gib"] or {}
            lines.append(
                f"vae [{r['mode']}]: {r['vae']}; peak GiB encode {pk.get('vae_encode', 0):.2f} "
                f"(reference {pr.get('vae_encode', 0):.2f}), decode {pk.get('vae_decode', 0):.2f} "
                f"(reference {pr.get('vae_decode', 0):.2f}); ratios {r['vae_stage_peak_ratio']}, working memory "
                f"ratios {r['vae_stage_peak_delta_ratio']}"
            )
        if r.get("vae_conv_plans"):
            rows = r["vae_conv_plans"]
            chosen = [c for c in rows if c["plan"] != "torch"]
            lines.append(f"vae convs [{r['mode']}]: {len(chosen)} of {len(rows)} large conv signatures on a faster cuDNN "
                         f"plan (torch's bits); per call {sum(c['torch_ms'] for c in chosen):.2f} -> "
                         f"{sum(c['ms'] for c in chosen):.2f} ms summed over those signatures")
        if r.get("streamed"):
            st = r["streamed"]
            lines.append(
                f"write [{r['mode']}]: streamed request {st['total_s']:.3f}s (median of {len(st.get('totals_s', [0]))}; "
                f"{r.get('speedup_streamed') or 0:.2f}x the reference's total); write exposed {st['write_exposed_s']:.3f}s, "
                f"overlapped {st['write_overlapped_s']:.3f}s (one encoder thread; byte-identical to the serial "
                f"write: {st['identical']}, frames identical: {st.get('frames_identical')}); composite_write above is the "
                "serial write"
            )
        if "seam_ratio" in r:
            ratio = f"{r['seam_ratio']:.2f}" if r["seam_ratio"] is not None else "n/a"
            lines.append(
                f"windows [{r['mode']}]: {r['windows']} x {r['window']} frames (overlap {r['overlap']}) in "
                f"{r['windowed_total_s']:.3f}s; seam ratio {ratio} (boundary {r['seam_boundary']} / inside "
                f"{r['seam_inside']}, mean |frame step| inside the mask)"
            )
        if "crop_speedup" in r:
            lines.append(
                f"crop [{r['mode']}]: off {r['crop_off_total_s']:.3f}s vs {r['crop_setting']} {r['crop_total_s']:.3f}s "
                f"-> {r['crop_speedup']:.2f}x; run sizes {r['crop_run_sizes']} (fidelity above is the full-frame run)"
            )
    if results[0].get("nvfp4_fidelity"):
        lines.append(format_nvfp4_table(results[0]["nvfp4_fidelity"]))
    return "\n".join(lines)


def save_results(results: list[dict], out_dir: str | os.PathLike = "bench/results") -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    date = _dt.date.today().isoformat()
    for r in results:
        sha = r["commit"][:7]
        if r.get("parallel") == "ulysses":  # `bench --parallel`: <workload>-parallel<N>-<mode>-<transport>
            what = f"{r['workload']}-parallel{r['world_size']}-{r['mode']}-{r['sp_transport']}"
        else:
            crop = f"-crop{r['crop_setting']}" if "crop_setting" in r else ""  # a crop run never overwrites a plain one
            what = f"{r['workload']}-{r['mode']}{crop}"
        path = out_dir / f"{what}-{date}-{sha}.json"
        n = 2
        while path.exists():  # another run of the same workload, mode and commit (other flags): keep both
            path = out_dir / f"{what}-{date}-{sha}-run{n}.json"
            n += 1
        with media.atomic_write_path(path) as tmp:
            Path(tmp).write_text(json.dumps(r, indent=2, sort_keys=False) + "\n")
        paths.append(path)
    return paths
