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


def validate_mask_threshold(threshold) -> int:
    return _int("--mask-threshold", threshold, 0, 255)
