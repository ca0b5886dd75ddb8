"""Per-request options (RunOptions) and their limits, checked before anything is read, loaded or run. The engine's
options (how the model runs) are fastremover/config.py's EngineConfig.

This module imports neither torch nor the media libraries, so a bad flag is reported in well under a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastremover.errors import FastRemoverError
from fastremover.windows import CROP_MODES, DEFAULT_WINDOW, SHAPE_BUCKETS, validate_windows

SIZE_MULTIPLE = 16  # VAE 8x spatial downsampling times the transformer's 2x2 patches
MAX_SIDE = 7680  # --size: the longest side accepted (8K UHD width)
MAX_PIXELS = 3840 * 2160  # --size: width x height accepted (4K UHD)
MAX_STEPS = 1000
MAX_DILATE = 512
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit value

# The released pipeline's behaviour, per option (docs/upstream.md): the flow schedule (fastremover.schedulers, where
# these names are used), how decoded pixels become uint8, and what happens to the last frames of a clip whose length
# is not 4k+1. `UPSTREAM_COMPATIBLE` is the set of values --upstream-compatible gives (with composite and crop off).
SCHEDULES = ("minimax-remover", "diffusers")  # minimax-remover: diffusers 0.33.1's UniPC schedule (the default)
ROUNDINGS = ("round", "truncate")  # truncate: floor(x * 255), as upstream's export does
FRAME_TAILS = ("keep", "drop")  # drop: a 4k+2..4k+4-frame clip loses its last 1-3 frames, as upstream's VAE drops them
UPSTREAM_COMPATIBLE = {"schedule": "minimax-remover", "rounding": "truncate", "frame_tail": "drop", "composite": False,
                       "crop": "off"}


def _int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FastRemoverError(f"{name} {value!r}: must be a whole number between {low} and {high}")
    if not low <= value <= high:
        raise FastRemoverError(f"{name} {value}: must be between {low} and {high}")
    return value


def parse_size(size: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """"native"/None -> None; "WxH" or (W, H) -> (W, H): multiples of 16, each side at most MAX_SIDE and at most
    MAX_PIXELS in all."""
    if size is None or size == "native":
        return None
    if isinstance(size, str):
        try:
            w_str, h_str = size.lower().split("x")
            w, h = int(w_str), int(h_str)
        except ValueError:
            raise FastRemoverError(f"--size {size!r}: use 'native' or WIDTHxHEIGHT, e.g. 832x480") from None
    else:
        w, h = size
    if w <= 0 or h <= 0 or w % SIZE_MULTIPLE or h % SIZE_MULTIPLE:
        raise FastRemoverError(
            f"--size {w}x{h}: width and height must be positive multiples of {SIZE_MULTIPLE} "
            f"(e.g. {max(16, w // 16 * 16)}x{max(16, h // 16 * 16)}), or use --size native"
        )
    if max(w, h) > MAX_SIDE or w * h > MAX_PIXELS:
        raise FastRemoverError(
            f"--size {w}x{h}: at most {MAX_SIDE} pixels per side and {MAX_PIXELS:,} pixels in all "
            f"(3840x2160); choose a smaller size"
        )
    return w, h


@dataclass(frozen=True)
class RunOptions:
    """Per-request options of `RemovalPipeline.remove` (and of every layer above it: CLI, service, batch). Frozen:
    `validate()` checks an instance once and remembers it (every layer may call it; the checks run once per request);
    derive variants with `dataclasses.replace`."""

    steps: int = 12
    seed: int = 42
    dilate: int = 6
    size: str | tuple[int, int] = "native"
    composite: bool = True
    window: int = DEFAULT_WINDOW  # frames per window (used as the largest 4k+1 <= window); shorter clips: one window
    # frames each window shares with the previous one (conditioning + cross-fade); None: about a fifth of the window
    # as 4k+1 frames (17 for the default 81, see windows.default_overlap)
    overlap: int | None = None
    crop: str = "auto"  # auto | on | off: run the model on a box around the mask instead of the whole frame
    # canonical run shapes (fastremover.windows.bucket_side / bucket_length): crop sides snapped to this many sizes per
    # octave and a long clip's last window to this many lengths per window, so windows and clips share compiled
    # state; 0: crops at multiples of 16 and the last window as short as it can be
    shape_buckets: int = SHAPE_BUCKETS
    schedule: str = SCHEDULES[0]  # the UniPC flow schedule: minimax-remover (diffusers 0.33.1's) | diffusers (0.37+)
    rounding: str = "round"  # decoded pixels to uint8: round | truncate (upstream)
    frame_tail: str = "keep"  # clips of 4k+2..4k+4 frames: keep every frame | drop the last 1-3 (upstream)

    def validate(self) -> "RunOptions":
        """FastRemoverError naming the first option out of range; nothing else is touched. Returns self."""
        if self.__dict__.get("_valid"):
            return self
        _int("--steps", self.steps, 1, MAX_STEPS)
        _int("--seed", self.seed, 0, MAX_SEED)
        _int("--dilate", self.dilate, 0, MAX_DILATE)
        _int("--window", self.window, 1, 1_000_000)
        if self.overlap is not None:
            _int("--overlap", self.overlap, 0, 1_000_000)
        _int("shape_buckets", self.shape_buckets, 0, 64)
        parse_size(self.size)
        validate_windows(self.window, self.overlap)
        if self.crop not in CROP_MODES:
            raise FastRemoverError(f"--crop {self.crop!r}: choose one of {list(CROP_MODES)}")
        for flag, value, choices in (("--schedule", self.schedule, SCHEDULES), ("--rounding", self.rounding, ROUNDINGS),
                                     ("--frame-tail", self.frame_tail, FRAME_TAILS)):
            if value not in choices:
                raise FastRemoverError(f"{flag} {value!r}: choose one of {list(choices)}")
        if self.crop == "on" and parse_size(self.size) is not None:
            raise FastRemoverError(
                f"--crop on runs the model at the source resolution; it cannot be combined with --size {self.size} "
                "(use --size native, or --crop off)"
            )
        object.__setattr__(self, "_valid", True)  # frozen: the values cannot change after this check
        return self


def validate_gib(value, flag: str = "--max-decoded-gib") -> float:
    """A memory limit in GiB: a positive, finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise FastRemoverError(f"{flag} {value!r}: must be a positive number of GiB, e.g. 4")
    return float(value)


def validate_seed(value, flag: str = "--seed") -> int:
    return _int(flag, value, 0, MAX_SEED)


def upstream_compatible(options: RunOptions) -> RunOptions:
    """`options` with UPSTREAM_COMPATIBLE's values (--upstream-compatible); FastRemoverError where `options` asks for
    another value than both the default and the compatible one (e.g. --crop on), which the switch would silently
    override."""
    from dataclasses import replace

    default = RunOptions()
    for name, value in UPSTREAM_COMPATIBLE.items():
        given = getattr(options, name)
        if given != value and given != getattr(default, name):
            flag = {"composite": "--no-composite"}.get(name, "--" + name.replace("_", "-"))
            raise FastRemoverError(f"--upstream-compatible sets {flag} {value}; it cannot be combined with "
                                   f"{flag} {given}")
    return replace(options, **UPSTREAM_COMPATIBLE)


def validate_mask_threshold(threshold) -> int:
    return _int("--mask-threshold", threshold, 0, 255)
