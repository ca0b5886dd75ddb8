"""`fastremover` command line: thin layers over the worker (`remove`, `batch`, `serve`), the pipeline (`demo`), the
bench harness (`bench`, `verify`) and the mask tools.

The model and engine flags of every command come from one definition (fastremover/config.py: add_model_args /
add_engine_args); a command builds its ModelSource and EngineConfig from them (`model_and_config`). Notes go to the
package logger, which `main` prints on stderr at the -v / -q level. User-caused problems (`FastRemoverError`) print
one line and exit with code 2; no tracebacks for bad input.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import dataclasses
import errno
import json
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

import numpy as np

from fastremover import __version__
from fastremover.batch.cli import EXIT_CLIPS_FAILED, add_batch_parser, pick_slots
from fastremover.config import EngineConfig, ModelSource, add_engine_args, add_model_args
from fastremover.env import torchrun_env
from fastremover.errors import FastRemoverError
from fastremover.h3.cli import add_parser as add_h3_parser, run as cmd_h3_decode
from fastremover.log import logger, setup_cli, teardown_cli
from fastremover.masktools.cli import add_box_args, add_mask_parser, box_mask_file, cmd_mask, mask_from_args
from fastremover.options import FRAME_TAILS, ROUNDINGS, SCHEDULES
from fastremover.serve.cli import add_serve_parser, cmd_serve
from fastremover.windows import CROP_MODES, DEFAULT_WINDOW

EXIT_USER_ERROR = 2
# OSErrors a user causes (permissions, missing or too-long paths, a full disk): one line, never a traceback.
USER_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR,
                         errno.ENOSPC, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP, getattr(errno, "EDQUOT", 122)})


def _err(message: str) -> None:
    print(f"fastremover: {message}", file=sys.stderr)


def warn(message: str) -> None:
    """A note for the user (a fallback, a doubt about the inputs): a log record, shown unless -q."""
    logger.warning(message)


def _left_behind(command: str) -> str:
    if command == "batch":
        return "the clips finished so far are kept; run the same batch again to continue"
    return "nothing was written"


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt, so every atomic write cleans up after itself."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _show_warning(message, category, filename, lineno, file=None, line=None):
    logger.warning(f"warning: {message}")


class _Bars:
    """One tqdm bar per stage, fed by the pipeline's progress callback. A stage that starts over (the denoise steps of
    the next window) gets a fresh bar."""

    UNITS = {"window": "window", "vae_encode": "chunk", "vae_decode": "frame", "frames": "frame"}

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bars: dict = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        bar = self.bars.get(stage)
        total = total or None  # "frames" of a clip whose length is not known yet: a bar without an end
        if bar is not None and (done < bar.n or total != bar.total):
            bar.close()
            bar = None
        if bar is None:
            unit = self.UNITS.get(stage, "step")
            bar = self.bars[stage] = tqdm(total=total, desc=stage, unit=unit, leave=stage == "frames",
                                          file=sys.stderr)
        bar.update(done - bar.n)
        if total and done >= total:
            bar.close()
            del self.bars[stage]

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


CROP_CHOICES = list(CROP_MODES)
NO_MODEL_NOTE = "no --model given: using the weightless classic remover (pass --model PATH for MiniMax-Remover)"


def _add_schedule_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULES[0],
                   help="UniPC flow schedule: minimax-remover (diffusers 0.33.1's, the released pipeline's; default) | "
                   "diffusers (diffusers 0.37 and later)")


def _add_model_args(p: argparse.ArgumentParser, default_model: str | None) -> None:
    """The model, the engine and the per-request flags of `remove`, `demo` and `batch` (the same definitions)."""
    add_model_args(p, default=default_model)
    p.add_argument("--steps", type=int, default=12, help="denoising steps (default 12)")
    p.add_argument("--seed", type=int, default=42, help="noise seed (default 42)")
    p.add_argument("--dilate", type=int, default=6, help="mask dilation in pixels, L1 diamond (default 6)")
    p.add_argument("--mask-threshold", type=int, default=20, help="mask pixel values > this (0-255) count as masked")
    p.add_argument("--size", default="native", help="native (pad to multiples of 16, default) or WxH, e.g. 832x480")
    add_engine_args(p)
    p.add_argument("--no-composite", action="store_true", help="keep the model's pixels outside the mask too")
    _add_schedule_arg(p)
    p.add_argument("--rounding", choices=ROUNDINGS, default=ROUNDINGS[0],
                   help="decoded pixels to 8 bits: round (default) | truncate (the released pipeline's export)")
    p.add_argument("--frame-tail", choices=FRAME_TAILS, default=FRAME_TAILS[0],
                   help="a clip of 4k+2 to 4k+4 frames: keep every frame (default) | drop the last 1-3 (the released "
                   "pipeline's VAE drops them)")
    p.add_argument("--upstream-compatible", action="store_true",
                   help="reproduce the released MiniMax-Remover pipeline: --schedule minimax-remover --rounding "
                   "truncate --frame-tail drop --no-composite --crop off (docs/upstream.md)")
    _add_window_args(p)
    p.add_argument("--crop", choices=CROP_CHOICES, default="auto",
                   help="run the model on a box around the mask: auto (when the box is under half the frame, default) "
                   "| on | off")
    p.add_argument("--max-decoded-gib", type=float, default=4.0,
                   help="host memory for the frames held at a time while streaming (about 15 bytes per pixel x "
                   "(window + 25) frames), not the whole clip (default 4)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_window_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"frames per window for long clips (default {DEFAULT_WINDOW}; used as the largest 4k+1 <= N)")
    p.add_argument("--overlap", type=int, default=None,
                   help="frames each window shares with the previous one: it continues from them and cross-fades "
                   "(default: about a fifth of the window, as 4k+1 frames: 17 for 81)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastremover", description="Remove objects from videos given a mask video.")
    parser.add_argument("--version", action="version", version=f"fastremover {__version__}")
    _add_verbosity(parser, default=0)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("remove", help="remove the masked object from a video")
    p.add_argument("video", help="video file (mp4/mov/mkv/webm/avi/gif, ...), folder of numbered frames, or an image")
    p.add_argument("--mask", default=None,
                   help="mask video/folder/image: white (> threshold) = remove (or build one with --box)")
    p.add_argument("-o", "--output", required=True, help="output .mp4/.mov/.mkv, a folder for PNG frames, or .png")
    _add_model_args(p, default_model=None)
    add_box_args(p)
    add_engine_args(p, ("parallel",))
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run of this same command from its last finished window (its state is "
                   "kept in .<output>.fastremover-resume beside the output until the run finishes)")
    p.add_argument("--timings-json", default=None, metavar="PATH",
                   help="also write where the time went to this JSON file: the process's one-time costs (imports, "
                   "weight read, host-to-device, quantization, Triton compiles, autotuning, cuDNN plans, graph "
                   "capture), each window, the first frame handed to the writer, the stages (bench --cold reads it)")

    p = sub.add_parser("demo", help="make a synthetic clip + mask, remove the object, write a side-by-side preview")
    p.add_argument("-o", "--output", default="fastremover-demo", help="output folder (default ./fastremover-demo)")
    p.add_argument("--frames", type=int, default=49, help="frames of the synthetic clip (default 49)")
    p.add_argument("--width", type=int, default=432)
    p.add_argument("--height", type=int, default=240)
    _add_model_args(p, default_model=None)
    add_box_args(p)

    sub.add_parser("info", help="versions, device, which fast paths are available, and the cached Hub models")

    p = sub.add_parser("download", help="fetch a model from the Hugging Face Hub into the local cache ahead of time")
    p.add_argument("model", help="ORG/NAME[@REVISION] (a branch, tag or commit; default main), e.g. "
                   "zibojia/minimax-remover: only its transformer/, vae/ and scheduler/ configs and weights")
    p.add_argument("--force", action="store_true", help="fetch every file again, even those already cached")
    p.add_argument("--quiet", action="store_true", help="no progress bars")

    p = sub.add_parser("warmup", help="fill the persistent cache ahead of time (compiled kernels, tuned configs, "
                       "cuDNN plans) by running the model once per size, so a later first run is fast",
                       description="Runs a synthetic clip through the model at each --sizes WxH with the engine "
                       "flags given, so Triton's compiled kernels, the autotuned kernel configs and the cuDNN plan "
                       "choices land in the persistent cache (FASTREMOVER_CACHE_DIR, default ~/.cache/fastremover) "
                       "for every later process on this machine: for images, services and batch runs. Sizes are "
                       "the model's run sizes: a clip's native size padded to multiples of 16, or a crop's size.")
    p.add_argument("--sizes", default="832x480", help="comma-separated run sizes WxH (default 832x480)")
    p.add_argument("--frames", type=int, default=DEFAULT_WINDOW,
                   help=f"frames of each synthetic clip (default {DEFAULT_WINDOW}: one whole window)")
    _add_model_args(p, default_model="random")

    p = sub.add_parser("bench", help="time the upstream-style reference and engine modes side by side (same process)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=["w1", "w2", "w3", "real"], default="w1",
                     help="synthetic clip: w1 69f 432x240, w2 81f 832x480, w3 81f 1280x720 (default w1); with --cold "
                     "also real: 152f 854x480 with a small moving object")
    src.add_argument("--video", help="benchmark on this clip instead (needs --mask)")
    p.add_argument("--mask", help="mask for --video")
    _add_compare_args(p, default_model="random")
    p.add_argument("--object-fraction", type=float, default=None,
                   help="mask area as a fraction of the frame for the synthetic workloads (default 0.15)")
    p.add_argument("--object-travel", type=float, default=None,
                   help="part of the frame width the synthetic object's path spans, (0, 1] (default 1: edge to edge)")
    p.add_argument("--crop", choices=CROP_CHOICES, default=None,
                   help="also time crop off vs this setting on the same inputs (native size) and report crop_speedup; "
                   "the fidelity comparison always runs crop off")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after one warm-up; medians are reported")
    p.add_argument("--hash-repeats", type=int, default=0, help="re-run whole engine requests N times, compare hashes")
    p.add_argument("--quality", action="store_true",
                   help="instead: the ground-truth quality benchmark of the removers (synthetic clips with known clean "
                   "footage): PSNR / SSIM / flicker inside the mask for the classic remover, its v1, per-frame "
                   "Telea, and the diffusion model given --model PATH; JSON + picture strips under --out")
    p.add_argument("--out", default="bench/results", help="folder for the JSON results (default bench/results)")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    p.add_argument("--nvfp4-fidelity", action="store_true",
                   help="also the NVFP4 fidelity rows (nvfp4, nvfp4+vae, nvfp4-w4a4 on a crop) against the dense "
                   "eager run")
    p.add_argument("--parallel", dest="parallel_ranks", type=int, default=None, metavar="N",
                   help="instead: the denoise loop under Ulysses over N ranks (one per GPU; CPU processes with "
                   "--device cpu) against the one-process loop on rank 0, in one command; JSON "
                   "<workload>-parallel<N>-<mode>-...: world size, transport, speedup, max relative difference, "
                   "exposed communication")
    add_engine_args(p, ("parallel",), exclude=("parallel.mode", "parallel.world_size", "parallel.timeout_s"),
                    help={"parallel.transport": "with --parallel: how q/k/v travel between ranks (default fp16: exact)",
                          "parallel.head_groups": "with --parallel: head groups whose exchange overlaps the previous "
                          "group's attention"})
    cold = p.add_argument_group("--cold: what a user's run costs (fastremover/bench/cold.py)")
    cold.add_argument("--cold", action="store_true",
                      help="instead: fresh processes of `fastremover remove --model FOLDER` (first run with empty "
                      "caches, second run), the upstream-style reference loading the same folder in a fresh process "
                      "(cold, warm), the warm in-process request, the first frame, a per-phase breakdown, the "
                      "new_shape_ratio; JSON cold-<workload>-<mode>-...; --modes names the one engine mode")
    cold.add_argument("--checkpoint", default=None, metavar="DIR",
                      help="--cold: the random-weight checkpoint folder (written there once when missing, and kept; "
                      "default: a temporary folder)")
    cold.add_argument("--no-reference", action="store_true", help="--cold: skip the reference's process")
    cold.add_argument("--shape-clips", type=int, default=6,
                      help="--cold: clips of other sizes / crops for the new_shape_ratio (default 6; 0: skip)")
    cold.add_argument("--shape-frames", type=int, default=41, help="--cold: frames of those clips (default 41)")
    cold.add_argument("--padding-cost", action="store_true",
                      help="--cold: also time the clip with canonical run shapes off and on (RunOptions.shape_buckets)")
    cold.add_argument("--capture-costs", action="store_true",
                      help="--cold, CUDA: an eager step, a replayed step, the graph recording and a call replaying "
                      "a graph of one step, per run shape (the costs of engine/denoise.capture_pays, step_graph_pays)")
    cold.add_argument("--precompile-variants", default="", metavar="V[,V]",
                      help="--cold: also the engine's first and second runs with FASTREMOVER_PRECOMPILE set to each "
                      "of these (wait, background, off, record-background), each with an empty cache of its own, "
                      "beside the default's")
    cold.add_argument("--cold-clip", default=None, metavar="FxWxH",
                      help="--cold: another clip size than the workload's, e.g. 9x96x64 (quick checks)")

    p = sub.add_parser("verify", help="fidelity of the engine modes against the reference on your checkpoint and clip")
    p.add_argument("video")
    p.add_argument("--mask", required=True)
    _add_compare_args(p, default_model=None)
    p.add_argument("--max-frames", type=int, default=None, help="use only the first N frames")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--attention-keeps", default=None, metavar="R,R,...",
                   help="with --attention sparse-* (sta, vsa, sta-cudnn, vsa-cudnn): instead of the reference comparison, the sparse "
                   "attention at each of these keep rates against the same mode's dense attention (PSNR, SSIM, "
                   "latent cosine, denoise time); --modes defaults to fast here")

    add_batch_parser(sub, _add_model_args)
    add_mask_parser(sub)
    add_serve_parser(sub)
    add_h3_parser(sub)
    for command in sub.choices.values():  # -v / -q after the subcommand too (`fastremover remove ... -v`)
        _add_verbosity(command, default=argparse.SUPPRESS)
    return parser


def _add_verbosity(p: argparse.ArgumentParser, default) -> None:
    """-v / -q (mutually exclusive). On a subcommand the default is SUPPRESS, so a flag given before the subcommand is
    kept unless one is given after it."""
    verbosity = p.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1, default=default,
                           help="also print debug records (the resolved engine configuration, per-stage details)")
    verbosity.add_argument("-q", "--silent", dest="verbosity", action="store_const", const=-1, default=default,
                           help="print errors only (no notes or warnings; progress bars: the commands' --quiet)")


def _add_compare_args(p: argparse.ArgumentParser, default_model: str | None) -> None:
    add_model_args(p, default=default_model, required=default_model is None,
                   help="random (preset config, random weights), PATH to a MiniMax-Remover checkpoint folder, or "
                   "ORG/NAME[@REVISION] on the Hugging Face Hub (as for remove)")
    p.add_argument("--modes", default="eager", help="comma-separated engine modes to compare: eager,exact,fast")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-flops", action="store_true", help="skip counting the VAE's FLOPs (an extra VAE pass)")
    _add_schedule_arg(p)
    # every engine flag but --mode (--modes lists the modes to compare)
    add_engine_args(p, exclude=("mode",))
    # The fidelity comparison always runs in one window (the reference has no windows); clips longer than --window
    # get one more, windowed, engine run whose seam metric is reported.
    _add_window_args(p)


def _announce_model(args) -> None:
    if args.model is None:
        warn(NO_MODEL_NOTE)
    if (args.device or "").startswith("cpu") and args.precision in ("fp16", "bf16"):
        warn(f"--precision {args.precision} on the CPU is very slow (conv3d); fp32 is recommended there")


def engine_config(args, **changes):
    """The EngineConfig of a command: its flags (and `changes`, with_ paths the command sets itself), then the
    environment's overrides (fastremover/config.py, the one place both are read); a bad value is a FastRemoverError
    before any file is read or model loaded."""
    config = EngineConfig.from_args(args, **changes)
    logger.debug("engine config: " + json.dumps(config.describe()))
    return config


def model_and_config(args) -> tuple[ModelSource, EngineConfig]:
    """The model source and the engine config of a command's flags, both checked."""
    return ModelSource.from_args(args), engine_config(args)


def _options_from_args(args):
    """RunOptions from the flags, validated: bad flags fail before any file is read or model loaded."""
    from fastremover.options import RunOptions, upstream_compatible

    options = RunOptions(
        steps=args.steps, seed=args.seed, dilate=args.dilate, size=args.size, composite=not args.no_composite,
        window=args.window, overlap=args.overlap, crop=args.crop, schedule=args.schedule, rounding=args.rounding,
        frame_tail=args.frame_tail,
    )
    if args.upstream_compatible:
        options = upstream_compatible(options)
    options.validate()
    return options


def _run_line(result) -> str:
    d = result.describe
    return f"[{d.get('model')}, {d.get('device')}, {d.get('precision')}, mode {d.get('mode')}, vae {d.get('vae')}]"


def check_unused_flags(args, source: ModelSource, config: EngineConfig) -> None:
    """Flags that would change nothing in this run are refused, not ignored: the user meant something by them."""
    weights = config.linears.weights
    if source.kind == "classic" and weights != "dense":
        raise FastRemoverError(f"--weights {weights} sets how the diffusion model's transformer is stored; the classic "
                               "remover (no --model) has none: drop --weights, or give --model PATH")
    if config.linears.force_w4a4 and weights != "nvfp4-w4a4":
        raise FastRemoverError("--force-w4a4 applies to --weights nvfp4-w4a4 only: drop it, or add --weights "
                               "nvfp4-w4a4")
    boxes = getattr(args, "box", None) or getattr(args, "point", None) or getattr(args, "sam2", None)
    if getattr(args, "preview_mask", None) and not boxes and getattr(args, "mask", None):
        raise FastRemoverError("--preview-mask shows the mask built from --box; with --mask nothing is built: drop it")


def cmd_remove(args) -> int:
    from fastremover.options import validate_gib
    from fastremover.outputs import Wanted, check_outputs, scratch_folder
    from fastremover.timing import RequestClock, phase
    from fastremover.worker import Job, RemovalWorker

    options = _options_from_args(args)
    source, config = model_and_config(args)
    check_unused_flags(args, source, config)
    validate_gib(args.max_decoded_gib)
    full_frames = options.crop == "off" or options.size != "native"
    if config.linears.weights == "nvfp4-w4a4" and not config.linears.force_w4a4 and full_frames:
        why = "--crop off" if options.crop == "off" else f"--size {options.size} (no crop)"
        raise FastRemoverError(f"--weights nvfp4-w4a4 quantizes activations to 4 bits, which collapses on full frames, "
                               f"and {why} runs every window on full frames: use --crop on or auto, or add "
                               "--force-w4a4 to run it anyway")
    boxes = bool(args.box or args.point or args.sam2)
    if args.mask is None and not boxes:
        raise FastRemoverError("give --mask MASK (white = remove) or --box X,Y,W,H around the object")
    parallel = config.parallel.mode != "none"
    if parallel and boxes and torchrun_env() is not None:
        raise FastRemoverError("--box under torchrun: make the mask first (fastremover mask ...) and pass --mask")
    # Every path this command writes, against the inputs and each other, before anything is read.
    check_outputs([Wanted("-o", args.output), Wanted("--preview-mask", args.preview_mask),
                   Wanted("--timings-json", args.timings_json, endings=(".json",))],
                  inputs=[args.video, args.mask])
    clock = None
    with scratch_folder("boxmask") if boxes else contextlib.nullcontext() as tmp:
        mask = box_mask_file(args, tmp) or args.mask  # --box: the tracked mask as lossless frames
        job = Job(video=args.video, mask=mask, output=args.output, options=options,
                  mask_threshold=args.mask_threshold, max_decoded_gib=args.max_decoded_gib, resume=args.resume)
        bars = _Bars(enabled=not args.quiet)
        try:
            if parallel:
                from fastremover.parallel.launch import run_remove

                job.validate()  # rank 0 checks the files; the flags fail here, before any rank starts
                _announce_model(args)
                result = run_remove(source, config, job, progress=bars)
                if result is None:  # a torchrun rank other than 0: rank 0 reports
                    return 0
            else:
                worker = RemovalWorker(source, config)
                # the output path, the inputs and their decoded size: before the load, and before torch is imported
                # (a refusal here imports neither torch nor the engine; the worker's load counts their import as
                # "imports" too)
                with phase("imports"):
                    target = worker.check(job)
                _announce_model(args)
                clock = RequestClock(bars)
                result = worker.run(job, progress=clock, target=target)
        finally:
            bars.close()
        if clock is not None and args.timings_json:
            _write_timings(args.timings_json, result, clock)
    print(f"wrote {args.output}: {result.num_frames} frames {result.width}x{result.height} @ {float(result.fps):.3f} "
          f"fps {_run_line(result)}")
    print("timing: " + "  ".join(f"{k} {v:.2f}s" for k, v in result.stages.items()) + f"  | total {result.seconds:.2f}s"
          f"  ({result.num_frames / max(result.seconds, 1e-9):.1f} frames/s)")
    if result.geometry:
        print(result.geometry)
    logger.debug("engine: " + json.dumps(result.describe, default=str))
    return 0


def cmd_batch(args) -> int:
    """Plan, run and report a batch; returns the exit code (FastRemoverError for a problem with the batch itself)."""
    from fastremover.batch.driver import Runner, run_batch
    from fastremover.batch.plan import plan_batch
    from fastremover.options import validate_gib

    options = _options_from_args(args)  # the same flags -> the same options and model as `remove`
    source, config = model_and_config(args)
    check_unused_flags(args, source, config)
    validate_gib(args.max_decoded_gib)
    if args.ray is not None:
        if args.gpus is not None:
            raise FastRemoverError("--gpus is for one host; with --ray each actor takes one GPU of the cluster "
                                   "(set how many with --workers)")
        if args.workers is not None and args.workers < 1:
            raise FastRemoverError(f"--workers {args.workers}: must be at least 1")
        from fastremover.batch.ray_runner import import_ray

        import_ray()  # a missing ray is a problem with the batch itself: said before any clip is planned or run
        runner = Runner(kind="ray", workers=args.workers, address=args.ray)
    else:
        runner = Runner(kind="local", slots=tuple(pick_slots(args.gpus, args.workers, args.device)))
    plan = plan_batch(args.inputs, args.output_dir, masks=args.masks, options=options,
                      mask_threshold=args.mask_threshold, max_decoded_gib=args.max_decoded_gib)
    _announce_model(args)
    summary = run_batch(plan, source, config, runner, force=args.force, progress=not args.quiet)
    print(summary.table())
    return 0 if summary.all_succeeded else EXIT_CLIPS_FAILED


def _write_timings(path: str, result, clock) -> None:
    """The run's timing record (see --timings-json), written atomically."""
    import time

    from fastremover import cache
    from fastremover.outputs import write_text
    from fastremover.timing import PHASES

    record = {"end_unix": time.time(), **PHASES.describe(), **clock.describe(), "stages_s": result.stages,
              "device_stages_s": {k: round(v, 6) for k, v in result.device_stages.items()},
              "seconds": result.seconds, "num_frames": result.num_frames, "geometry": result.geometry,
              "cache": cache.describe(), "engine": result.describe}
    write_text(path, json.dumps(record, indent=1, default=str) + "\n")


def cmd_warmup(args) -> int:
    """Run each --sizes size once (a synthetic clip with a moving object, the whole frame), so the persistent cache
    holds what a first run at that size would compile, tune and choose."""
    import time

    from fastremover import cache

    sizes = []
    for text in args.sizes.split(","):
        from fastremover.options import parse_size

        size = parse_size(text.strip())
        if size is None:
            raise FastRemoverError(f"--sizes {args.sizes!r}: give run sizes WxH, e.g. 832x480,1280x720")
        sizes.append(size)
    if not 1 <= args.frames <= 1000:
        raise FastRemoverError(f"--frames {args.frames}: must be between 1 and 1000")
    if args.model in (None, "classic"):
        raise FastRemoverError("warmup needs a diffusion model: --model PATH (or random)")
    options = _options_from_args(args)
    from fastremover.worker import RemovalWorker

    worker = RemovalWorker(*model_and_config(args))  # built as `remove` builds it: load_source, the engine's build
    _announce_model(args)
    from fastremover import media

    pipe = worker.pipeline
    store = cache.default_cache()
    if pipe.device.type != "cuda":
        warn("warmup on the CPU: nothing is compiled or tuned there; the runs only check the model")
    run = dataclasses.replace(options, size="native", crop="off")
    # every size's Triton kernels in one concurrent batch first (a no-op off the fast CUDA paths)
    pipe.engine.precompile([shape for width, height in sizes
                            for shape in pipe.planned_shapes(args.frames, height, width, run)], background=False)
    for width, height in sizes:
        video, mask = media.synthetic_clip(args.frames, height, width, seed=0, object_fraction=0.1)
        before = store.stats()
        t = time.perf_counter()
        bars = _Bars(enabled=not args.quiet)
        try:
            pipe.remove(video.frames, mask, run, progress=bars)
        finally:
            bars.close()
        after = store.stats()
        print(f"warmed {width}x{height} ({args.frames} frames) in {time.perf_counter() - t:.1f}s: cache hits "
              f"{after['hits'] - before['hits']}, new entries {after['writes'] - before['writes']}", flush=True)
    where = store.root if store.enabled else "off (FASTREMOVER_CACHE_DIR)"
    print(f"cache: {where}" + "".join(f"; {k}={v}" for k, v in cache.describe()["tool_dirs"].items()))
    return 0


DEMO_FILES = ("input.mp4", "mask.mp4", "output.mp4", "preview.mp4")
DEMO_MARKER = ".fastremover-demo"


def _demo_folder_rule(out: Path) -> str | None:
    """The demo writes its four files into `out`: a new or empty folder, or one an earlier demo wrote (it holds the
    marker and nothing but the demo's files), so no file of the user's is ever replaced."""
    try:
        names = set(os.listdir(out))
    except OSError as e:
        return f"cannot list it: {e.strerror or e}"
    if names and (DEMO_MARKER not in names or names - set(DEMO_FILES) - {DEMO_MARKER}):
        return "already holds files the demo did not write; choose a new or empty folder"
    return None


def cmd_demo(args) -> int:
    from fastremover import media
    from fastremover.worker import RemovalWorker, geometry_line

    options = _options_from_args(args)
    for name, value, low, high in (("--frames", args.frames, 1, 2000), ("--width", args.width, 16, 3840),
                                   ("--height", args.height, 16, 2160)):
        if not low <= value <= high:
            raise FastRemoverError(f"{name} {value}: must be between {low} and {high}")
    from fastremover.outputs import Wanted, check_outputs, write_text

    out = Path(args.output)
    source, config = model_and_config(args)
    check_unused_flags(args, source, config)
    check_outputs([Wanted("-o", args.output, rule=_demo_folder_rule),
                   Wanted("--preview-mask", getattr(args, "preview_mask", None))])
    worker = RemovalWorker(source, config)
    _announce_model(args)
    video, mask = media.synthetic_clip(args.frames, args.height, args.width, seed=0)
    built = mask_from_args(args, video)  # --box: the tracked mask instead of the true one
    if built is not None:
        iou = (built & mask).sum() / max(1, (built | mask).sum())
        print(f"mask from --box: IoU {iou:.3f} against the true mask")
        mask = built
    write_text(out / DEMO_MARKER, "written by fastremover demo\n")
    media.write_video(out / "input.mp4", video.frames, video.fps)
    media.write_video(out / "mask.mp4", np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), video.fps)
    bars = _Bars(enabled=not args.quiet)
    try:
        result = worker.pipeline.remove(video.frames, mask, options, progress=bars)
    finally:
        bars.close()
    media.write_video(out / "output.mp4", result.frames, video.fps)
    overlay = video.frames.copy()
    overlay[result.mask] = (overlay[result.mask] // 2 + np.array([127, 0, 0], np.uint8)).astype(np.uint8)
    preview = np.concatenate([overlay, result.frames], axis=2)
    media.write_video(out / "preview.mp4", preview, video.fps)
    config = worker.pipeline.config
    print(f"demo in {out}/: input.mp4 mask.mp4 output.mp4 preview.mp4 (left: input with the mask in red, right: output)")
    print(f"[{config.model}, {config.device}, {config.precision}, mode {config.mode}] "
          f"timing: {result.timer.summary()}")
    if (line := geometry_line(result)):
        print(line)
    return 0


def _compare(args, inputs, repeats: int, hash_repeats: int, on_result=None) -> list[dict]:
    from fastremover.bench.harness import compare
    from fastremover.config import MODES
    from fastremover.options import RunOptions

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise FastRemoverError(f"--modes {args.modes!r}: choose from {list(MODES)}")
    crop = getattr(args, "crop", None)  # bench only
    # before loading the model
    RunOptions(window=args.window, overlap=args.overlap, crop=crop or "off", schedule=args.schedule).validate()
    from fastremover.pipeline import load_source

    source, config = model_and_config(args)
    return compare(load_source(source), inputs, config, modes=modes, steps=args.steps, seed=args.seed, repeats=repeats,
                   hash_repeats=hash_repeats, count_flops=not args.no_flops, window=args.window,
                   overlap=args.overlap, crop=crop, on_result=on_result,
                   nvfp4_rows=getattr(args, "nvfp4_fidelity", False), schedule=args.schedule)


def cmd_bench(args) -> int:
    if args.quality:
        from fastremover.bench.quality import format_quality_table, run_quality

        model = None if args.model in (None, "classic", "random") else args.model  # a checkpoint adds its column
        result = run_quality(None if args.no_save else args.out, model=model)
        print(format_quality_table(result))
        for path in result["files"]:
            print(f"wrote {path}")
        return 0
    from fastremover.bench.harness import file_inputs, format_table, save_results, synthetic_inputs

    if args.parallel_ranks is not None:
        return _bench_parallel(args)
    if args.cold:
        return _bench_cold(args)
    if args.workload == "real":
        raise FastRemoverError("--workload real is a --cold workload")

    if args.video:
        if not args.mask:
            raise FastRemoverError("--video needs --mask")
        if args.object_fraction is not None or args.object_travel is not None:
            raise FastRemoverError("--object-fraction/--object-travel set the synthetic workload's object; not for --video")
        inputs = file_inputs(args.video, args.mask)
    else:
        fraction = 0.15 if args.object_fraction is None else args.object_fraction
        if not 0 < fraction < 0.6:
            raise FastRemoverError(f"--object-fraction {fraction}: must be between 0 and 0.6 (exclusive)")
        travel = 1.0 if args.object_travel is None else args.object_travel
        if not 0 < travel <= 1:
            raise FastRemoverError(f"--object-travel {travel}: must be in (0, 1]")
        inputs = synthetic_inputs(args.workload, object_fraction=fraction, travel=travel)
    if args.repeats < 0 or args.hash_repeats < 0:
        raise FastRemoverError("--repeats and --hash-repeats must be >= 0")
    def save(result: dict) -> None:  # each mode's JSON as soon as it is complete
        if not args.no_save:
            for path in save_results([result], args.out):
                print(f"wrote {path}", flush=True)

    results = _compare(args, inputs, args.repeats, args.hash_repeats, on_result=save)
    print(format_table(results))
    return 0


def _bench_cold(args) -> int:
    """`bench --cold`: fastremover.bench.cold.bench_cold for one engine mode, saved as cold-<workload>-<mode>-...."""
    from fastremover.bench.cold import COLD_CLIPS, bench_cold, format_cold, save_cold

    if args.video:
        raise FastRemoverError("--cold runs a synthetic --workload (w2 or real); not with --video")
    if args.workload not in COLD_CLIPS:
        raise FastRemoverError(f"--cold --workload {args.workload}: choose one of {sorted(COLD_CLIPS)}")
    if args.model not in (None, "random"):
        raise FastRemoverError("--cold writes random weights at --preset to a checkpoint folder (--checkpoint DIR)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if len(modes) != 1 or modes[0] not in ("eager", "exact", "fast"):
        raise FastRemoverError(f"--cold --modes {args.modes!r}: give one engine mode (eager, exact or fast)")
    override = None
    if args.cold_clip:
        try:
            override = tuple(int(v) for v in args.cold_clip.lower().split("x"))
            frames, width, height = override
        except ValueError:
            raise FastRemoverError(f"--cold-clip {args.cold_clip!r}: use FRAMESxWIDTHxHEIGHT, e.g. 9x96x64") from None
        if frames < 1 or width < 32 or height < 32:
            raise FastRemoverError(f"--cold-clip {args.cold_clip}: at least 1 frame of 32x32")
        override = (frames, height, width)
    if args.shape_clips < 0 or args.shape_frames < 1 or args.repeats < 0:
        raise FastRemoverError("--shape-clips must be >= 0, --shape-frames and --repeats positive")
    variants = tuple(dict.fromkeys(v.strip() for v in args.precompile_variants.split(",") if v.strip()))
    if not set(variants) <= {"wait", "background", "off", "record-background"}:
        raise FastRemoverError(f"--precompile-variants {args.precompile_variants!r}: choose from wait, background, off, "
                               "record-background")
    config = engine_config(args)
    engine_args = ["--attention", args.attention, "--vae-precision", args.vae_precision]
    record = bench_cold(clip=args.workload, mode=modes[0], preset=args.preset, weights_seed=args.weights_seed,
                        steps=args.steps, seed=args.seed, device=config.device, precision=config.precision,
                        checkpoint=args.checkpoint, reference=not args.no_reference, shapes=args.shape_clips,
                        shape_frames=args.shape_frames, warm_runs=args.repeats + 1,
                        padding=args.padding_cost, captures=args.capture_costs, clip_override=override,
                        object_fraction=args.object_fraction, travel=args.object_travel, engine_args=engine_args,
                        config=config, precompile_variants=variants)
    print(format_cold(record))
    if not args.no_save:
        print(f"wrote {save_cold(record, args.out)}")
    return 0


def _bench_parallel(args) -> int:
    """`bench --parallel N`: fastremover.parallel.bench.bench_denoise on the workload's latent shape, one record per
    mode, saved with the provenance of every bench JSON."""
    from fastremover.bench.harness import WORKLOADS, environment, save_results
    from fastremover.parallel.bench import bench_denoise, latent_shape
    from fastremover.parallel.ulysses import check_heads

    ranks = args.parallel_ranks
    if args.video:
        raise FastRemoverError("--parallel times the denoise loop on a --workload's shape; not with --video")
    if args.model not in (None, "random"):
        raise FastRemoverError("--parallel runs random weights at --preset (the loop's speed does not depend on them)")
    if ranks < 2:
        raise FastRemoverError(f"--parallel {ranks}: give a world size of at least 2")
    config = engine_config(args, parallel__mode="ulysses", parallel__world_size=ranks)
    import torch

    from fastremover.engine.build import resolve_device
    from fastremover.models.loading import PRESETS

    if args.preset not in PRESETS:
        raise FastRemoverError(f"--preset {args.preset!r}: choose one of {sorted(PRESETS)}")
    check_heads(PRESETS[args.preset]["transformer"]["num_attention_heads"], ranks)
    device = resolve_device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < ranks:
        raise FastRemoverError(f"--parallel {ranks}: only {torch.cuda.device_count()} CUDA GPUs are visible "
                               "(--device cpu runs CPU processes)")
    if args.repeats < 1:
        raise FastRemoverError("--repeats must be >= 1 with --parallel")
    frames, height, width = WORKLOADS[args.workload]
    shape = latent_shape(frames, height, width)
    threads = max(1, (os.cpu_count() or 1) // ranks) if device.type == "cpu" else None
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows = []
    for mode in modes:
        rec = bench_denoise(config.with_(mode=mode), preset=args.preset, latent_shape=shape, steps=args.steps,
                            repeats=args.repeats, threads=threads)
        rec = {**environment(), "workload": args.workload, "frames": frames, "size": f"{width}x{height}",
               "preset": args.preset, **rec}
        rows.append(rec)
        if not args.no_save:
            for path in save_results([rec], args.out):
                print(f"wrote {path}", flush=True)
    print(f"{'mode':8} {'ranks':>5} {'transport':>9} {'reference':>10} {'parallel':>9} {'speedup':>8} "
          f"{'max rel diff':>12} {'exposed comm':>12}")
    for r in rows:
        comm = r.get("exposed_comm_s")
        comm = f"{comm:.4f}s" if comm is not None else f"host {r.get('collective_host_s', 0):.3f}s"
        print(f"{r['mode']:8} {r['world_size']:>5} {r['sp_transport']:>9} {r['reference_s']:>9.3f}s "
              f"{r['parallel_s']:>8.3f}s {r['speedup']:>7.2f}x {r['max_rel_diff']:>12.3g} {comm:>12}")
    return 0


def cmd_verify(args) -> int:
    from fastremover.bench.harness import file_inputs, format_table

    if args.json is not None:
        from fastremover.outputs import Wanted, check_outputs

        check_outputs([Wanted("--json", args.json, endings=(".json",))], inputs=[args.video, args.mask])
    if args.attention_keeps is not None:
        table, results = _verify_sparse(args)
    else:
        inputs = file_inputs(args.video, args.mask, max_frames=args.max_frames)
        results = _compare(args, inputs, repeats=0, hash_repeats=0)
        table = format_table(results)
    print(table)
    if args.json:
        from fastremover.outputs import write_text

        write_text(args.json, json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _verify_sparse(args) -> tuple[str, list[dict]]:
    """`verify --attention-keeps`: fastremover.bench.sparse_fidelity (flags checked before the model loads); its table
    and rows."""
    from fastremover.bench.harness import file_inputs
    from fastremover.bench.sparse_fidelity import format_sparse_table, parse_keeps, sparse_fidelity
    from fastremover.engine.build import resolve_device, resolve_mode
    from fastremover.ops.attention import get
    from fastremover.pipeline import load_source

    keeps = parse_keeps(args.attention_keeps)
    source, config = model_and_config(args)
    if config.attention.backend == "auto" or get(config.attention.backend).token_layout is None:
        raise FastRemoverError("--attention-keeps needs a sparse --attention (sparse-sta, sparse-vsa, "
                               "sparse-sta-cudnn or sparse-vsa-cudnn)")
    if config.attention.keep is not None:
        raise FastRemoverError("give the keep rates with --attention-keeps only (not --attention-keep too)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes != "eager" else ["fast"]
    device = resolve_device(config.device)
    for mode in modes:
        ran = resolve_mode(mode, device)[0] if mode in ("exact", "fast") else mode
        if ran not in ("exact", "fast"):
            raise FastRemoverError(f"--attention {config.attention.backend} runs in the exact and fast modes on a "
                                   f"CUDA GPU; --modes {mode} runs {ran} here")
    inputs = file_inputs(args.video, args.mask, max_frames=args.max_frames)
    rows = sparse_fidelity(load_source(source), inputs, config, modes=modes, keeps=keeps, steps=args.steps,
                           seed=args.seed)
    return format_sparse_table(rows), rows


def cmd_download(args) -> int:
    from fastremover.models.hub import download_model

    resolved = download_model(args.model, progress=not args.quiet, force=args.force)
    print(f"{resolved.repo_id}@{resolved.revision} is in the cache: {resolved.path}")
    print(f"run it: fastremover remove VIDEO --mask MASK -o OUT --model {args.model}")
    return 0


def cmd_info(args) -> int:
    from fastremover.info import collect_info, format_info

    from fastremover.parallel.bench import info_lines

    print(format_info(collect_info()))
    print("\n".join(info_lines()))
    return 0


def _escape_unencodable(exc: UnicodeError):
    """Encoding error handler of the CLI's stdout / stderr: a name that is not valid UTF-8 (its bytes kept as
    surrogates) is written back as those bytes, any other character the terminal's encoding lacks as an escape."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    if all("\udc80" <= c <= "\udcff" for c in exc.object[exc.start:exc.end]):
        return codecs.lookup_error("surrogateescape")(exc)
    return codecs.backslashreplace_errors(exc)


codecs.register_error("fastremover-escape", _escape_unencodable)


def _printable_stdio() -> None:
    """Printing a path never fails: file names are the user's (any bytes) and the locale may be C (ASCII)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="fastremover-escape")


def main(argv: list[str] | None = None) -> int:
    from fastremover.timing import mark

    mark("main")  # the harness (bench --cold) measures the interpreter's start-up up to here
    _printable_stdio()
    args = build_parser().parse_args(argv)
    commands = {"remove": cmd_remove, "demo": cmd_demo, "info": cmd_info, "download": cmd_download,
                "bench": cmd_bench, "verify": cmd_verify, "mask": cmd_mask, "serve": cmd_serve, "batch": cmd_batch,
                "h3-decode": cmd_h3_decode, "warmup": cmd_warmup}
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    handler = setup_cli(args.verbosity)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return commands[args.command](args)
    except FastRemoverError as e:
        _err(f"error: {e}")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        _err(f"interrupted; {_left_behind(args.command)}")
        return 130
    except Terminated:
        _err(f"terminated (SIGTERM); {_left_behind(args.command)}")
        return 143
    except OSError as e:
        if e.errno not in USER_ERRNOS:
            raise
        where = f" {e.filename}" if e.filename else ""
        _err(f"error: cannot access{where}: {e.strerror or e}")
        return EXIT_USER_ERROR
    finally:
        teardown_cli(handler)
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
