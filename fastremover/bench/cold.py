"""`fastremover bench --cold`: what a user's run costs, not only a warm in-process request.

One checkpoint folder is written once (random weights at the preset, fp16 like the released one, `save_checkpoint`),
one clip with a moving object (the project's synthetic clip tool, `media.synthetic_clip`) is written as files, and
then, each in a FRESH PROCESS:

    engine first run     `fastremover remove CLIP --mask MASK -o OUT --model FOLDER --mode M` with empty cache
                         folders (FASTREMOVER_CACHE_DIR and TRITON_CACHE_DIR: new, empty), as on a new machine
    engine second run    the same command again with those caches warm
    reference            `python -m fastremover.bench.cold reference ...`: the upstream-order pipeline loading the
                         same folder the way upstream does (`ReferencePipeline.from_pretrained`: fp16 on the host,
                         then to the device), one cold run (imports, load, read, run, write), then one warm run

and in this process, after them:

    engine warm          a `RemovalWorker` on the same folder running the same job as the CLI (the streamed request:
                         read, windows, write) after warm-up requests
    new_shape_ratio      that warm worker given `shape_clips` clips of other sizes / crop boxes one after another:
                         each clip's first time over its own warm time (the worst one is `new_shape_ratio`)
    padding_cost         (flag) the clip with `shape_buckets` 0 and the default, warm: the time and pixels the
                         canonical shapes add, and the run shapes each gives
    capture_costs        (flag, CUDA) per latent shape of the run: an eager step, a replayed step and the recording
                         of the denoise loop as a CUDA graph, and a call replaying a graph of one step (the costs
                         engine/denoise.capture_pays and step_graph_pays use)

The engine's processes write `--timings-json` (fastremover/timing.py): the cold run's `phases` come from there
(start-up until the CLI's main, imports, weight read, host-to-device, quantization, Triton compiles, autotuning,
cuDNN plans and graphs, cuBLASLt plans, graph capture: exclusive host seconds) plus each window's span
(`window_<i>`, which contains the phases spent in it); `first_frame_s` is the time from the process's start to the
first output frame handed to the writer.

JSON: bench/results/cold-<clip>-<mode>-<date>-<sha>.json with the provenance of every bench JSON (gpu, commit,
command, torch, python). Nothing here asserts a time: the acceptance ratios are computed and stored.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Cold workloads: (frames, height, width, object_fraction, travel). "real": the size of the clip the issue measured
#: (152 frames 854x480, a small object moving over part of the frame: crops of changing size, 3 windows).
COLD_CLIPS = {
    "w2": (81, 480, 832, 0.15, 1.0),
    "real": (152, 480, 854, 0.04, 0.5),
}
SHAPE_CLIPS = 6


def _sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pythonpath_env(extra: dict) -> dict:
    """The environment of a child process: this one's, with this checkout first on PYTHONPATH, plus `extra`."""
    from fastremover.env import child_environment

    return child_environment(extra, pythonpath_first=str(Path(__file__).resolve().parents[2]))


# ----------------------------------------------------------------------------------------------------------------------
# Inputs


def write_clip(folder: Path, frames: int, height: int, width: int, object_fraction: float, travel: float,
               seed: int = 0) -> tuple[Path, Path]:
    """The synthetic clip (input.mp4) and its mask (mask.mp4) in `folder`, as a user would have them."""
    from fastremover import media

    import numpy as np

    video, mask = media.synthetic_clip(frames, height, width, seed=seed, object_fraction=object_fraction,
                                       travel=travel)
    folder.mkdir(parents=True, exist_ok=True)
    media.write_video(folder / "input.mp4", video.frames, video.fps)
    media.write_video(folder / "mask.mp4", np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), video.fps)
    return folder / "input.mp4", folder / "mask.mp4"


def write_checkpoint(folder: Path, preset: str, seed: int) -> Path:
    """Random weights at `preset` saved once as a diffusers-layout folder, fp16 like the released checkpoint (the
    transformer's fp32 islands in fp32)."""
    import torch

    from fastremover.models.loading import random_models, save_checkpoint

    models = random_models(preset, seed)
    models.transformer.to_inference_dtype(torch.float16)
    models.vae.half()
    return save_checkpoint(models, folder)


# ----------------------------------------------------------------------------------------------------------------------
# Fresh processes


def run_process(argv: list[str], env: dict, what: str, timeout_s: float | None = None) -> dict:
    """Run `python argv...` to its end: wall seconds from the spawn, the spawn's wall-clock time, the exit status.
    A failure raises with the end of its stderr."""
    spawn = time.time()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return {"wall_s": wall, "spawn_unix": spawn, "stdout": proc.stdout, "stderr_tail": proc.stderr[-2000:]}


def engine_process(video: Path, mask: Path, out: Path, checkpoint: Path, mode: str, cache_dir: Path,
                   engine_args: list[str], what: str, extra_env: dict | None = None) -> dict:
    """`fastremover remove` in a fresh process with the persistent cache (and Triton's) in `cache_dir` (and the
    variables of `extra_env`)."""
    timings = out.with_suffix(".timings.json")
    # (CUDA_CACHE_PATH: the driver's JIT cache, where cuDNN's runtime-compiled kernels land, new with the cache
    # folder too: a machine's earlier runs do not warm a first-ever run)
    env = _pythonpath_env({"FASTREMOVER_CACHE_DIR": str(cache_dir), "TRITON_CACHE_DIR": str(cache_dir / "triton"),
                           "CUDA_CACHE_PATH": str(cache_dir / "cuda"), **(extra_env or {})})
    argv = ["-m", "fastremover", "remove", str(video), "--mask", str(mask), "-o", str(out), "--model",
            str(checkpoint), "--mode", mode, "--timings-json", str(timings), "--quiet", *engine_args]
    run = run_process(argv, env, what)
    record = json.loads(timings.read_text())
    spawn = run["spawn_unix"]
    marks = record.get("marks_unix", {})
    phases = {"startup": round(marks["main"] - spawn, 4) if "main" in marks else None}
    phases.update({k: round(v, 4) for k, v in record.get("phases_s", {}).items()})
    for i, s in enumerate(record.get("windows_s", []), 1):
        phases[f"window_{i}"] = round(s, 4)
    first = record.get("first_frame_unix")
    # milestones, seconds from the spawn: main (the CLI starts), engine_ready (model loaded, engine built),
    # request_start (the clock of the streamed request), first_frame
    stamps = {**marks, **({"request_start": record["request_start_unix"]} if record.get("request_start_unix") else {})}
    at = {k: round(v - spawn, 4) for k, v in sorted(stamps.items(), key=lambda kv: kv[1])}
    return {"wall_s": round(run["wall_s"], 4), "first_frame_s": round(first - spawn, 4) if first else None,
            "milestones_s": at, "phases": phases, "phase_counts": record.get("counts", {}), "stages_s": record.get("stages_s"),
            "device_stages_s": record.get("device_stages_s"),
            "request_s": record.get("seconds"), "cache": record.get("cache"), "sha256": _sha256(out),
            "engine": {k: record.get("engine", {}).get(k) for k in ("mode", "attention", "vae", "cuda_graphs",
                                                                     "precision", "device")}}


def reference_process(video: Path, mask: Path, out: Path, checkpoint: Path, device: str, precision: str,
                      steps: int, seed: int) -> dict:
    """The upstream-order reference in a fresh process (this module's `reference` command): cold, then warm."""
    record_path = out.with_suffix(".reference.json")
    argv = ["-m", "fastremover.bench.cold", "reference", "--model", str(checkpoint), "--video", str(video),
            "--mask", str(mask), "-o", str(out), "--json", str(record_path), "--device", device, "--precision",
            precision, "--steps", str(steps), "--seed", str(seed)]
    run = run_process(argv, _pythonpath_env({"CUDA_CACHE_PATH": str(out.parent / "reference-cuda-cache")}),
                      "the reference")
    record = json.loads(record_path.read_text())
    spawn = run["spawn_unix"]
    return {"cold_s": round(record["cold_end_unix"] - spawn, 4), "warm_s": round(record["warm_s"], 4),
            "process_wall_s": round(run["wall_s"], 4),
            "phases": {"startup": round(record["main_unix"] - spawn, 4), **record["phases_s"]},
            "frames": record["frames"], "size": record["size"], "sha256": _sha256(out)}


def reference_main(argv: list[str] | None = None) -> int:
    """`python -m fastremover.bench.cold reference`: load the folder the upstream way, run the clip cold (and write
    it), then warm; a JSON record of the times."""
    main_unix = time.time()
    p = argparse.ArgumentParser(prog="python -m fastremover.bench.cold reference")
    p.add_argument("command", choices=["reference"])
    p.add_argument("--model", required=True)
    p.add_argument("--video", required=True)
    p.add_argument("--mask", required=True)
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    phases = {}
    t = time.perf_counter()
    import torch

    from fastremover import media
    from fastremover.bench.harness import file_inputs
    from fastremover.bench.reference import ReferencePipeline

    phases["imports"] = time.perf_counter() - t
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    device = torch.device(args.device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t = time.perf_counter()
    ref = ReferencePipeline.from_pretrained(args.model, device, dtype)
    sync()
    phases["load"] = time.perf_counter() - t

    def request():
        times = {}
        t = time.perf_counter()
        inputs = file_inputs(args.video, args.mask)  # 4k+1 frames, sides multiples of 16: what upstream takes
        times["read"] = time.perf_counter() - t
        t = time.perf_counter()
        w, h = inputs.size
        result = ref(inputs.frames, inputs.mask, height=h, width=w, steps=args.steps, seed=args.seed)
        sync()
        times["run"] = time.perf_counter() - t
        t = time.perf_counter()
        media.write_video(args.output, result.frames, inputs.fps)
        times["write"] = time.perf_counter() - t
        return times, inputs

    cold, inputs = request()
    cold_end = time.time()
    phases.update(cold)
    warm, _ = request()
    record = {"main_unix": main_unix, "cold_end_unix": cold_end, "phases_s": {k: round(v, 4) for k, v in
                                                                              phases.items()},
              "warm_s": sum(warm.values()), "warm_phases_s": warm, "frames": int(inputs.frames.shape[0]),
              "size": f"{inputs.size[0]}x{inputs.size[1]}"}
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# In this process: the warm engine, new shapes, the padding cost, capture costs


def _warm_job(worker, job, runs: int) -> list:
    return [worker.run(job) for _ in range(runs)]


def shape_clips(frames: int, height: int, width: int, count: int = SHAPE_CLIPS) -> list[dict]:
    """`count` clips whose run shapes differ from each other: whole frames of three sizes and crops around objects of
    three sizes (a crop needs a frame larger than the crop's minimum side; smaller frames get more whole-frame
    sizes)."""
    from fastremover.options import SIZE_MULTIPLE

    crops = min(height, width) >= 320
    specs, whole = [], 0
    for i in range(count):
        if crops and i % 2 == 1:  # a crop around an object of another size
            specs.append({"frames": frames, "height": height, "width": width,
                          "object_fraction": (0.02, 0.05, 0.09)[(i // 2) % 3], "crop": "on"})
        else:  # a whole frame, 16 px lower and 32 px narrower than the one before
            specs.append({"frames": frames, "height": max(32, height - SIZE_MULTIPLE * whole),
                          "width": max(32, width - 2 * SIZE_MULTIPLE * whole), "object_fraction": 0.15,
                          "crop": "off"})
            whole += 1
    return specs


def phase_delta(before: dict) -> dict:
    """The process's one-time phases (fastremover/timing.py's PHASES) spent since `before` (a copy of its seconds),
    those above 1 ms: what a request paid for its new shapes (captures, cuDNN graphs and plans, compiles)."""
    from fastremover.timing import PHASES

    delta = {k: v - before.get(k, 0.0) for k, v in PHASES.seconds.items()}
    return {k: round(v, 4) for k, v in sorted(delta.items()) if v > 1e-3}


def new_shape_ratio(pipe, specs: list[dict], options, warm_runs: int) -> dict:
    """Each clip once after the other (its first run in a process that is warm for other shapes), then each again
    `warm_runs` times: per clip first / last-warm time (whole request in memory, synchronized at its stages) and the
    one-time phases its first run paid (`first_phases_s`)."""
    from dataclasses import replace

    from fastremover import media
    from fastremover.timing import PHASES, time_triton_compiles
    from fastremover.windows import run_shapes

    clips = []
    for spec in specs:
        video, mask = media.synthetic_clip(spec["frames"], spec["height"], spec["width"], seed=1,
                                           object_fraction=spec["object_fraction"], travel=0.4)
        clips.append((spec, video.frames, mask, replace(options, crop=spec["crop"])))

    def timed(frames, mask, opts):
        t = time.perf_counter()
        result = pipe.remove(frames, mask, opts)
        return time.perf_counter() - t, result

    time_triton_compiles()
    first = []
    for spec, frames, mask, opts in clips:
        before = dict(PHASES.seconds)
        seconds, result = timed(frames, mask, opts)
        first.append((seconds, [[n, list(hw)] for n, hw in run_shapes(result.windows)], phase_delta(before)))
    rows = []
    for (spec, frames, mask, opts), (cold_s, shapes, phases) in zip(clips, first):
        warm = [timed(frames, mask, opts)[0] for _ in range(warm_runs)]
        rows.append({**spec, "run_shapes": shapes, "first_s": round(cold_s, 4), "warm_s": round(warm[-1], 4),
                     "ratio": round(cold_s / max(warm[-1], 1e-9), 4), "first_phases_s": phases})
    return {"new_shape_ratio": max(r["ratio"] for r in rows), "clips": rows}


def padding_cost(pipe, frames, mask, options, warm_runs: int) -> dict:
    """The clip warm with canonical shapes off (shape_buckets 0) and on (the options' setting): request time, the
    pixels the model ran on (frames x height x width summed over the windows), the distinct run shapes."""
    from dataclasses import replace

    from fastremover.windows import run_shapes

    rows = {}
    for buckets in (0, options.shape_buckets):
        opts = replace(options, shape_buckets=buckets)
        times = []
        for _ in range(warm_runs + 1):
            t = time.perf_counter()
            result = pipe.remove(frames, mask, opts)
            times.append(time.perf_counter() - t)
        pixels = sum((w.stop - w.start) * w.run_hw[0] * w.run_hw[1] for w in result.windows if w.run_hw)
        rows[f"buckets_{buckets}"] = {"warm_s": round(times[-1], 4), "first_s": round(times[0], 4),
                                      "model_pixels": int(pixels),
                                      "run_shapes": [[s[0], list(s[1])] for s in run_shapes(result.windows)]}
    off, on = rows["buckets_0"], rows[f"buckets_{options.shape_buckets}"]
    rows["time_ratio"] = round(on["warm_s"] / max(off["warm_s"], 1e-9), 4)
    rows["pixel_ratio"] = round(on["model_pixels"] / max(off["model_pixels"], 1), 4)
    return rows


def capture_costs(pipe, latent_shapes: list[tuple], steps: int) -> dict:
    """Per latent shape [1, 16, T, H, W]: one eager step, one replayed step of the recorded loop, the recording
    itself, and a whole call with its later steps replayed from a graph of one step (seconds; with whether that
    call's output equals the eager loop's), on the pipeline's fast denoiser; the constants of
    engine/denoise.capture_pays and step_graph_pays come from these.
    {"skipped": why} off CUDA or without a fast denoiser."""
    import torch

    from fastremover.engine.denoise import FastDenoiser
    from fastremover.schedulers import build_scheduler

    den = pipe.denoiser
    if pipe.device.type != "cuda" or not isinstance(den, FastDenoiser):
        return {"skipped": "needs a CUDA GPU and a fast mode (exact or fast)"}
    rows = []
    dev, dtype = pipe.device, pipe.dtype
    for shape in latent_shapes:
        g = torch.Generator(dev).manual_seed(0)
        x = [torch.randn(shape, generator=g, device=dev, dtype=dtype) for _ in range(3)]
        scheduler = build_scheduler(den.scheduler_config, steps, device=dev)
        cond = den.fast.conditioning(scheduler.timesteps, shape[0])

        def eager():
            return den._loop(scheduler, cond, *x)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            eager()  # warm-up on a side stream, as the denoiser does before a recording
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        eager()
        torch.cuda.synchronize(dev)
        eager_s = time.perf_counter() - t
        static = [v.clone() for v in x]
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            den._loop(scheduler, cond, *static)
        torch.cuda.synchronize(dev)
        capture_s = time.perf_counter() - t
        graph.replay()
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(dev)
        replay_s = time.perf_counter() - t
        del graph
        # a call that does not record: its later steps replayed from a graph of one step (engine/denoise's
        # step_graph_pays decides when the engine does it); the time of the whole call and whether its output is
        # the eager loop's
        want = eager()
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        stepped, why = den._loop_step_graph(scheduler, cond, *x)
        torch.cuda.synchronize(dev)
        step_graph_s = time.perf_counter() - t
        _, _, frames, h, w = shape
        rows.append({"latent_shape": list(shape), "tokens": frames * (h // 2) * (w // 2), "steps": steps,
                     "eager_step_s": round(eager_s / steps, 6), "replay_step_s": round(replay_s / steps, 6),
                     "capture_s": round(capture_s, 6), "step_graph_call_s": round(step_graph_s, 6),
                     "step_graph_equal": why is None and bool(torch.equal(stepped, want)), "step_graph_error": why})
    return {"rows": rows}


# ----------------------------------------------------------------------------------------------------------------------
# The whole measurement


def bench_cold(*, clip: str = "w2", mode: str = "fast", preset: str = "minimax-remover", weights_seed: int = 0,
               steps: int = 12, seed: int = 42, device: str | None = None, precision: str | None = None,
               checkpoint: str | None = None, reference: bool = True, shapes: int = SHAPE_CLIPS,
               shape_frames: int = 41, warm_runs: int = 2, padding: bool = False, captures: bool = False,
               clip_override: tuple[int, int, int] | None = None, object_fraction: float | None = None,
               travel: float | None = None, engine_args: list[str] | None = None, workdir: str | None = None,
               config=None, precompile_variants: tuple[str, ...] = (), log=print) -> dict:
    """Every measurement of the module docstring; returns the JSON record. clip_override (frames, height, width):
    another clip size (quick checks). engine_args: extra `fastremover remove` flags for the engine's processes;
    config: the EngineConfig those flags make, for the warm engine in this process (mode, device and precision
    replaced by the arguments). precompile_variants: FASTREMOVER_PRECOMPILE values (e.g. "wait") whose own
    first-ever and second runs (an empty cache of their own) are recorded too, beside the same reference and warm
    figures (`precompile_variants` in the record)."""
    import torch

    from fastremover.bench.harness import environment
    from fastremover.config import EngineConfig, ModelSource
    from fastremover.env import environment_set
    from fastremover.options import RunOptions
    from fastremover.worker import Job, RemovalWorker

    frames, height, width, fraction, path = COLD_CLIPS[clip]
    if clip_override:
        frames, height, width = clip_override
    fraction = fraction if object_fraction is None else object_fraction
    path = path if travel is None else travel
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    precision = precision or ("fp16" if device.startswith("cuda") else "fp32")
    engine_args = list(engine_args or []) + ["--steps", str(steps), "--seed", str(seed), "--device", device,
                                             "--precision", precision]
    own = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="fastremover-cold-"))
    work.mkdir(parents=True, exist_ok=True)
    record: dict = {**environment(), "benchmark": "cold", "workload": clip, "mode": mode, "preset": preset,
                    "frames": frames, "size": f"{width}x{height}", "steps": steps, "device": device,
                    "precision": precision}
    environment_kept = contextlib.ExitStack()  # this process's cache variables while the warm engine runs
    try:
        log(f"[cold] clip {clip}: {frames} frames {width}x{height} in {work}")
        video, mask = write_clip(work / "clip", frames, height, width, fraction, path)
        ckpt = Path(checkpoint) if checkpoint else work / "checkpoint"
        if not (ckpt / "transformer" / "config.json").exists():
            t = time.perf_counter()
            write_checkpoint(ckpt, preset, weights_seed)
            log(f"[cold] wrote the {preset} checkpoint to {ckpt} in {time.perf_counter() - t:.1f}s")
        record["checkpoint_bytes"] = sum(p.stat().st_size for p in ckpt.rglob("*.safetensors"))
        cache_dir = work / "cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        first = engine_process(video, mask, work / "first.mp4", ckpt, mode, cache_dir, engine_args, "engine run 1")
        log(f"[cold] engine first run {first['wall_s']:.2f}s (first frame {first['first_frame_s']}s)")
        second = engine_process(video, mask, work / "second.mp4", ckpt, mode, cache_dir, engine_args, "engine run 2")
        log(f"[cold] engine second run {second['wall_s']:.2f}s")
        variants = {}
        for value in precompile_variants:
            v_cache = work / f"cache-precompile-{value}"
            shutil.rmtree(v_cache, ignore_errors=True)
            env = {"FASTREMOVER_PRECOMPILE": value}
            runs = [engine_process(video, mask, work / f"{value}-{i}.mp4", ckpt, mode, v_cache, engine_args,
                                   f"engine run {i} (precompile {value})", env) for i in (1, 2)]
            variants[value] = {"engine_first_run_s": runs[0]["wall_s"], "engine_second_run_s": runs[1]["wall_s"],
                               "first_frame_s": runs[0]["first_frame_s"], "phases": runs[0]["phases"],
                               "phases_second": runs[1]["phases"], "phase_counts": runs[0]["phase_counts"],
                               "sha256": [r["sha256"] for r in runs]}
            log(f"[cold] precompile {value}: first run {runs[0]['wall_s']:.2f}s, second {runs[1]['wall_s']:.2f}s")
        ref = None
        if reference:
            ref = reference_process(video, mask, work / "reference.mp4", ckpt, device, precision, steps, seed)
            log(f"[cold] reference cold {ref['cold_s']:.2f}s, warm {ref['warm_s']:.2f}s")
        # The warm engine in this process (the caches of the runs above are warm now: the same folder)
        from fastremover import cache

        environment_kept.enter_context(environment_set({"FASTREMOVER_CACHE_DIR": str(cache_dir),
                                                        "TRITON_CACHE_DIR": str(cache_dir / "triton")}))
        environment_kept.callback(cache.reset_default_cache)  # afterwards: the cache the variables name again
        cache.reset_default_cache()
        config = (config or EngineConfig.from_env()).with_(mode=mode, device=device, precision=precision)
        worker = RemovalWorker(ModelSource(str(ckpt)), config)
        options = RunOptions(steps=steps, seed=seed)
        job = Job(video=str(video), mask=str(mask), output=str(work / "warm.mp4"), options=options)
        warm = _warm_job(worker, job, 1 + warm_runs)
        warm_s = warm[-1].seconds
        log(f"[cold] engine warm streamed request {warm_s:.2f}s")
        record.update({
            "engine_first_run_s": first["wall_s"], "engine_second_run_s": second["wall_s"],
            "engine_warm_s": round(warm_s, 4),
            "reference_cold_s": ref["cold_s"] if ref else None, "reference_warm_s": ref["warm_s"] if ref else None,
            "first_frame_s": first["first_frame_s"], "first_frame_second_s": second["first_frame_s"],
            "phases": first["phases"], "phases_second": second["phases"],
            "phase_counts": first["phase_counts"],
            "engine_first": {k: first[k] for k in ("stages_s", "device_stages_s", "request_s", "milestones_s", "cache",
                                                   "engine")},
            "engine_second": {k: second[k] for k in ("stages_s", "device_stages_s", "request_s", "milestones_s",
                                                     "cache")},
            "engine_warm_stages_s": {k: round(v, 4) for k, v in warm[-1].stages.items()},
            "engine_warm_device_stages_s": {k: round(v, 4) for k, v in warm[-1].device_stages.items()},
            "reference": ref,
            "outputs_identical": len({first["sha256"], second["sha256"], warm[-1].sha256}) == 1,
            "output_sha256": first["sha256"], "geometry": warm[-1].geometry,
        })
        record["ratios"] = {
            "second_over_warm": round(second["wall_s"] / warm_s, 4),
            "first_over_warm": round(first["wall_s"] / warm_s, 4),
            "reference_cold_over_engine_second": round(ref["cold_s"] / second["wall_s"], 4) if ref else None,
        }
        for value, v in variants.items():
            v["outputs_identical"] = set(v.pop("sha256")) == {first["sha256"]}
            v["ratios"] = {"second_over_warm": round(v["engine_second_run_s"] / warm_s, 4),
                           "first_over_warm": round(v["engine_first_run_s"] / warm_s, 4)}
        if variants:
            record["precompile_variants"] = variants
        pipe = worker.pipeline
        if shapes:
            specs = shape_clips(shape_frames, height, width, shapes)
            record.update(new_shape_ratio(pipe, specs, options, warm_runs))
            record["new_shape_clips"] = record.pop("clips")
            log(f"[cold] new_shape_ratio {record['new_shape_ratio']:.3f}")
        else:
            record["new_shape_ratio"] = None
        if padding:
            from fastremover import media

            v = media.read_video(str(video))
            m = media.match_mask_to_video(media.read_mask(str(mask)), v)
            record["padding_cost"] = padding_cost(pipe, v.frames, m, options, warm_runs)
            log(f"[cold] padding cost: time x{record['padding_cost']['time_ratio']}, pixels "
                f"x{record['padding_cost']['pixel_ratio']}")
        if captures:
            from fastremover.windows import ceil_4k1

            z = pipe.models.vae.config.z_dim
            latent = [] if pipe.device.type != "cuda" else sorted(
                {(1, z, (ceil_4k1(n) - 1) // 4 + 1, hw[0] // 8, hw[1] // 8)
                 for n, hw in _shapes_of(pipe, video, mask, options)})
            record["capture_costs"] = capture_costs(pipe, latent, steps)
        record["cache"] = cache.describe()
        worker.close()
    finally:
        environment_kept.close()  # this process's variables as they were
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return record


def _shapes_of(pipe, video, mask, options) -> list[tuple]:
    """The run shapes (frames, (H, W)) of the clip's windows (one in-memory request)."""
    from fastremover import media
    from fastremover.windows import run_shapes

    v = media.read_video(str(video))
    m = media.match_mask_to_video(media.read_mask(str(mask)), v)
    return run_shapes(pipe.remove(v.frames, m, options).windows)


def save_cold(record: dict, out_dir: str | os.PathLike = "bench/results") -> Path:
    """bench/results/cold-<clip>-<mode>-<date>-<sha>.json (a -runN suffix keeps an earlier one)."""
    from fastremover import media

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = f"cold-{record['workload']}-{record['mode']}-{_dt.date.today().isoformat()}-{record['commit'][:7]}"
    path, n = out_dir / f"{base}.json", 2
    while path.exists():
        path, n = out_dir / f"{base}-run{n}.json", n + 1
    with media.atomic_write_path(path) as tmp:
        Path(tmp).write_text(json.dumps(record, indent=2) + "\n")
    return path


def format_cold(record: dict) -> str:
    def s(v):
        return "-" if v is None else f"{v:.2f}s"

    lines = [f"cold {record['workload']} ({record['frames']} frames {record['size']}), mode {record['mode']}, "
             f"{record['gpu']}",
             f"  engine first run {s(record['engine_first_run_s'])}  second run {s(record['engine_second_run_s'])}  "
             f"warm streamed {s(record['engine_warm_s'])}  first frame {s(record['first_frame_s'])}",
             f"  reference cold {s(record['reference_cold_s'])}  warm {s(record['reference_warm_s'])}",
             f"  second/warm {record['ratios']['second_over_warm']}  first/warm {record['ratios']['first_over_warm']}"
             f"  reference cold/engine second {record['ratios']['reference_cold_over_engine_second']}"
             f"  new_shape_ratio {record.get('new_shape_ratio')}  outputs identical {record['outputs_identical']}",
             "  phases of the first run: " + "  ".join(f"{k} {v:.2f}s" for k, v in record["phases"].items()
                                                       if v is not None)]
    for value, v in record.get("precompile_variants", {}).items():
        lines.append(f"  precompile {value}: first run {s(v['engine_first_run_s'])}  second run "
                     f"{s(v['engine_second_run_s'])}  first frame {s(v['first_frame_s'])}  second/warm "
                     f"{v['ratios']['second_over_warm']}  first/warm {v['ratios']['first_over_warm']}  outputs "
                     f"identical {v['outputs_identical']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(reference_main())
