"""`fastremover` command line: a thin layer over `RemovalPipeline` and the media functions.

User-caused problems (`FastRemoverError`) print one line and exit with code 2; no tracebacks for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from fastremover.errors import FastRemoverError

EXIT_USER_ERROR = 2


def _err(message: str) -> None:
    print(f"fastremover: {message}", file=sys.stderr)


class _Bars:
    """One tqdm bar per stage, fed by the pipeline's progress callback. A stage that starts over (the denoise steps of
    the next window) gets a fresh bar."""

    UNITS = {"window": "window", "vae_encode": "chunk", "vae_decode": "frame"}

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bars: dict = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        bar = self.bars.get(stage)
        if bar is not None and (done < bar.n or total != bar.total):
            bar.close()
            bar = None
        if bar is None:
            unit = self.UNITS.get(stage, "step")
            bar = self.bars[stage] = tqdm(total=total, desc=stage, unit=unit, leave=False, file=sys.stderr)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
            del self.bars[stage]

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def check_writable(path: str) -> None:
    """Fail before the (long) run if the output cannot be written."""
    out = Path(path)
    parent = out.parent if out.suffix else out
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fastremover-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise FastRemoverError(f"cannot write the output {path}: {e.strerror or e}; choose another -o path") from None


# = fastremover.windows.CROP_MODES and DEFAULT_WINDOW (literals: importing the package's numerical modules pulls in
# OpenCV, and building the parser should stay light); tests/test_windows.py checks they agree.
CROP_CHOICES = ["auto", "on", "off"]
DEFAULT_WINDOW = 81


def _add_model_args(p: argparse.ArgumentParser, default_model: str | None) -> None:
    p.add_argument(
        "--model",
        default=default_model,
        help="classic (weightless fill, default when omitted) | random (preset config, random weights) | PATH to a "
        "MiniMax-Remover checkpoint folder with transformer/ vae/ scheduler/",
    )
    p.add_argument("--preset", default="minimax-remover", help="config for --model random: minimax-remover | tiny")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights for --model random")
    p.add_argument("--steps", type=int, default=12, help="denoising steps (default 12)")
    p.add_argument("--seed", type=int, default=42, help="noise seed (default 42)")
    p.add_argument("--dilate", type=int, default=6, help="mask dilation in pixels, L1 diamond (default 6)")
    p.add_argument("--mask-threshold", type=int, default=20, help="mask pixel values > this (0-255) count as masked")
    p.add_argument("--size", default="native", help="native (pad to multiples of 16, default) or WxH, e.g. 832x480")
    p.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default=None, help="default fp16 on GPU, fp32 on CPU")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--mode", choices=["auto", "eager", "exact", "fast"], default="auto",
                   help="engine: eager (reference order), exact (fused kernels + CUDA graph, no quantization), fast "
                   "(exact + FP8 linears + 8-bit attention); auto = exact on a CUDA GPU, eager elsewhere")
    _add_vae_precision_arg(p)
    _add_attention_arg(p)
    p.add_argument("--no-composite", action="store_true", help="keep the model's pixels outside the mask too")
    _add_window_args(p)
    p.add_argument("--crop", choices=CROP_CHOICES, default="auto",
                   help="run the model on a box around the mask: auto (when the box is under half the frame, default) "
                   "| on | off")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_attention_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", choices=["auto", "sdpa", "fp8", "fp8-triton", "fa3", "fp8-fa3", "fp8-flash3"],
                   default="auto",
                   help="attention backend of modes exact/fast: auto (exact: fa3 where it can run, else sdpa; fast: "
                   "fp8-flash3 where it is built, else fp8 = cuDNN FP8 attention with centred K and V, else "
                   "fp8-triton = our Triton FP8 kernel), or one of them explicitly (an "
                   "error if it cannot run here); fa3 / fp8-fa3: FlashInfer's FA3-style Hopper kernels, fp16 / FP8 "
                   "(needs pip install flashinfer-python); fp8-flash3: FlashAttention-3's own FP8 kernel (built "
                   "from source: bench/build_flash3.sh)")


def _add_vae_precision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vae-precision", choices=["auto", "fp16", "fp8"], default="auto",
                   help="VAE of modes exact/fast on a GPU (the fast channels-last VAE): auto / fp16 = the model dtype; "
                   "fp8 = FP8 3x3x3 conv3d (lossy); the eager mode always runs the eager VAE")


def _add_window_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"frames per window for long clips (default {DEFAULT_WINDOW}; used as the largest 4k+1 <= N)")
    p.add_argument("--overlap", type=int, default=None,
                   help="frames each window shares with the previous one: it continues from them and cross-fades "
                   "(default: about a fifth of the window, as 4k+1 frames: 17 for 81)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastremover", description="Remove objects from videos given a mask video.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("remove", help="remove the masked object from a video")
    p.add_argument("video", help="video file (mp4/mov/mkv/webm/gif), folder of numbered frames, or an image")
    p.add_argument("--mask", required=True, help="mask video/folder/image: white (> threshold) = remove")
    p.add_argument("-o", "--output", required=True, help="output .mp4/.mov/.mkv, a folder for PNG frames, or .png")
    _add_model_args(p, default_model=None)

    p = sub.add_parser("demo", help="make a synthetic clip + mask, remove the object, write a side-by-side preview")
    p.add_argument("-o", "--output", default="fastremover-demo", help="output folder (default ./fastremover-demo)")
    p.add_argument("--frames", type=int, default=49, help="frames of the synthetic clip (default 49)")
    p.add_argument("--width", type=int, default=432)
    p.add_argument("--height", type=int, default=240)
    _add_model_args(p, default_model=None)

    sub.add_parser("info", help="versions, device, and which fast paths are available")

    p = sub.add_parser("bench", help="time the upstream-style reference and engine modes side by side (same process)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=["w1", "w2", "w3"], default="w1",
                     help="synthetic clip: w1 69f 432x240, w2 81f 832x480, w3 81f 1280x720 (default w1)")
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
    p.add_argument("--out", default="bench/results", help="folder for the JSON results (default bench/results)")
    p.add_argument("--no-save", action="store_true", help="print the table only")

    p = sub.add_parser("verify", help="fidelity of the engine modes against the reference on your checkpoint and clip")
    p.add_argument("video")
    p.add_argument("--mask", required=True)
    _add_compare_args(p, default_model=None)
    p.add_argument("--max-frames", type=int, default=None, help="use only the first N frames")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return parser


def _add_compare_args(p: argparse.ArgumentParser, default_model: str | None) -> None:
    p.add_argument("--model", default=default_model, required=default_model is None,
                   help="random (preset config, random weights) or PATH to a MiniMax-Remover checkpoint folder")
    p.add_argument("--preset", default="minimax-remover", help="config for --model random")
    p.add_argument("--weights-seed", type=int, default=0)
    p.add_argument("--modes", default="eager", help="comma-separated engine modes to compare: eager,exact,fast")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--no-flops", action="store_true", help="skip counting the VAE's FLOPs (an extra VAE pass)")
    _add_vae_precision_arg(p)
    _add_attention_arg(p)
    # The fidelity comparison always runs in one window (the reference has no windows); clips longer than --window
    # get one more, windowed, engine run whose seam metric is reported.
    _add_window_args(p)


def _pipeline_from_args(args):
    from fastremover.pipeline import RemovalPipeline, warn

    model = args.model
    if model is None:
        warn("no --model given: using the weightless classic remover (pass --model PATH for MiniMax-Remover)")
        model = "classic"
    if (args.device or "").startswith("cpu") and args.precision in ("fp16", "bf16"):
        warn(f"--precision {args.precision} on the CPU is very slow (conv3d); fp32 is recommended there")
    pipe = RemovalPipeline.from_model(
        model, preset=args.preset, weights_seed=args.weights_seed, device=args.device, precision=args.precision,
        mode=args.mode, vae_precision=args.vae_precision, attention=args.attention,
    )
    for note in pipe.config.notes:
        warn(note)
    return pipe


def _options_from_args(args):
    """RunOptions from the flags, validated: bad flags fail before any file is read or model loaded."""
    from fastremover.pipeline import RunOptions

    options = RunOptions(
        steps=args.steps, seed=args.seed, dilate=args.dilate, size=args.size, composite=not args.no_composite,
        window=args.window, overlap=args.overlap, crop=args.crop,
    )
    options.validate()
    return options


def _run_removal(args, options, frames: np.ndarray, mask: np.ndarray):
    from fastremover.pipeline import warn

    pipe = _pipeline_from_args(args)
    bars = _Bars(enabled=not args.quiet)
    try:
        result = pipe.remove(frames, mask, options, progress=bars)
    finally:
        bars.close()
    for note in result.notes:
        warn(note)
    return pipe, result


def cmd_remove(args) -> int:
    from fastremover import media

    options = _options_from_args(args)
    check_writable(args.output)
    video = media.read_video(args.video)
    mask = media.match_mask_to_video(media.read_mask(args.mask, threshold=args.mask_threshold), video)
    pipe, result = _run_removal(args, options, video.frames, mask)
    media.write_video(args.output, result.frames, video.fps, audio_from=video.source if video.has_audio else None)
    print(f"wrote {args.output}: {len(result.frames)} frames {video.width}x{video.height} @ {float(video.fps):.3f} fps "
          f"[{pipe.config.model}, {pipe.config.device}, {pipe.config.precision}, mode {pipe.config.mode}, "
          f"vae {pipe.config.vae}]")
    print(f"timing: {result.timer.summary()}")
    if (line := _geometry_line(result)):
        print(line)
    return 0


def _geometry_line(result) -> str:
    """How the clip was split and cropped, when it was (empty for one full-frame window)."""
    runs = [w for w in result.windows if w.ran]
    cropped = [w for w in runs if w.box is not None]
    if len(result.windows) <= 1 and not cropped:
        return ""
    parts = []
    if len(result.windows) > 1:
        longest = max(w.stop - w.start for w in result.windows)
        overlap = min(w.overlap for w in result.windows[1:])  # the last window may share more
        parts.append(f"{len(result.windows)} windows of up to {longest} frames (overlap {overlap})")
    if cropped:
        sizes = sorted({f"{w.box[3] - w.box[2]}x{w.box[1] - w.box[0]}" for w in cropped})
        parts.append(f"cropped in {len(cropped)} of {len(runs)} windows ({', '.join(sizes)})")
    return "windows: " + "; ".join(parts)


def cmd_demo(args) -> int:
    from fastremover import media

    options = _options_from_args(args)
    out = Path(args.output)
    check_writable(str(out / "input.mp4"))
    video, mask = media.synthetic_clip(args.frames, args.height, args.width, seed=0)
    media.write_video(out / "input.mp4", video.frames, video.fps)
    media.write_video(out / "mask.mp4", np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), video.fps)
    pipe, result = _run_removal(args, options, video.frames, mask)
    media.write_video(out / "output.mp4", result.frames, video.fps)
    overlay = video.frames.copy()
    overlay[result.mask] = (overlay[result.mask] // 2 + np.array([127, 0, 0], np.uint8)).astype(np.uint8)
    preview = np.concatenate([overlay, result.frames], axis=2)
    media.write_video(out / "preview.mp4", preview, video.fps)
    print(f"demo in {out}/: input.mp4 mask.mp4 output.mp4 preview.mp4 (left: input with the mask in red, right: output)")
    print(f"[{pipe.config.model}, {pipe.config.device}, {pipe.config.precision}, mode {pipe.config.mode}] "
          f"timing: {result.timer.summary()}")
    if (line := _geometry_line(result)):
        print(line)
    return 0


def _compare(args, inputs, repeats: int, hash_repeats: int, on_result=None) -> list[dict]:
    from fastremover.bench.harness import compare
    from fastremover.models.loading import load_models
    from fastremover.pipeline import MODES, RunOptions

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise FastRemoverError(f"--modes {args.modes!r}: choose from {list(MODES)}")
    crop = getattr(args, "crop", None)  # bench only
    RunOptions(window=args.window, overlap=args.overlap, crop=crop or "off").validate()  # before loading the model
    models = load_models(args.model, args.preset, args.weights_seed)
    return compare(models, inputs, modes=modes, steps=args.steps, seed=args.seed, repeats=repeats,
                   hash_repeats=hash_repeats, device=args.device, precision=args.precision,
                   count_flops=not args.no_flops, window=args.window, overlap=args.overlap, crop=crop,
                   vae_precision=args.vae_precision, attention=args.attention, on_result=on_result)


def cmd_bench(args) -> int:
    from fastremover.bench.harness import file_inputs, format_table, save_results, synthetic_inputs

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


def cmd_verify(args) -> int:
    from fastremover import media
    from fastremover.bench.harness import file_inputs, format_table

    inputs = file_inputs(args.video, args.mask, max_frames=args.max_frames)
    results = _compare(args, inputs, repeats=0, hash_repeats=0)
    print(format_table(results))
    if args.json:
        import json

        with media.atomic_write_path(args.json) as tmp:
            Path(tmp).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_info(args) -> int:
    from fastremover.info import collect_info, format_info

    print(format_info(collect_info()))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"remove": cmd_remove, "demo": cmd_demo, "info": cmd_info, "bench": cmd_bench, "verify": cmd_verify}
    try:
        return commands[args.command](args)
    except FastRemoverError as e:
        _err(f"error: {e}")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
