"""Index math for long clips and small objects: temporal windows, crop boxes, and the seam metric.

Pure NumPy, no models: `RemovalPipeline.remove` uses these to split any frame count into overlapping windows (so model
memory is bounded by one window) and to run the model only on a crop around the mask (so small objects are fast).

Conventions: a window is a half-open frame range ``[start, stop)``; a box is ``(y0, y1, x0, x1)``, half-open, the same
convention as :func:`fastremover.masks.mask_bbox`, so ``frames[:, y0:y1, x0:x1]`` is exactly the box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fastremover.errors import FastRemoverError
from fastremover.masks import mask_bbox

__all__ = [
    "Window", "plan_windows", "next_window", "window_lookahead", "ceil_4k1", "usable_window_length", "default_overlap", "stream_prefetch", "validate_windows", "crossfade_weights",
    "seam_transitions", "seam_metric",
    "Box", "CROP_MODES", "expand_box", "snap_box", "crop_box", "choose_crop",
    "SHAPE_BUCKETS", "bucket_side", "bucket_length", "run_shapes",
]

# ----------------------------------------------------------------------------------------------------------------------
# Temporal windows

DEFAULT_WINDOW = 81  # frames: what MiniMax-Remover / Wan 2.1 were trained on (21 latent frames)
# Streaming: frames decoded (and masks dilated) ahead of the window loop in a background thread. Each costs a frame
# of host memory (2.6 MiB at 720p), so the read-ahead covers the decode of a window's first frames, not all of them.
STREAM_PREFETCH = 16
MIN_WINDOW = 5  # the smallest 4k+1 clip with more than one latent frame


@dataclass(frozen=True)
class Window:
    """Frames ``[start, stop)`` of the clip; the first ``overlap`` of them are shared with the previous window."""

    start: int
    stop: int
    overlap: int = 0

    @property
    def length(self) -> int:
        return self.stop - self.start


def ceil_4k1(n: int) -> int:
    """Smallest 4k+1 >= n (n >= 1)."""
    return (n - 1 + 3) // 4 * 4 + 1


def usable_window_length(window: int) -> int:
    """Largest 4k+1 <= window: the VAE encodes 1 + 4k frames, so other lengths would only add padding frames."""
    return (window - 1) // 4 * 4 + 1


def default_overlap(window: int) -> int:
    """The overlap used when none is given: about a fifth of the window, as 4k+1 frames (17 for 81, so 64 new frames
    per window; 5 for 21; 1 for 9).

    4k+1 known frames fill whole latent frames of the causal VAE (latent 0 is frame 0 alone, every later latent is 4
    frames), so the known/unknown boundary falls between latents rather than inside one.
    """
    later_latents = (usable_window_length(max(window, MIN_WINDOW)) - 1) // 4
    return 4 * int(later_latents / 5 + 0.5) + 1


def stream_prefetch(options, model: bool) -> int:
    """Frames `RemovalPipeline.remove_stream` reads (decoded, masks dilated) ahead of the windows by default (options:
    a RunOptions): with a model, one window's new frames, so the next window's input is ready when the current one
    ends; for the classic fill (which is CPU-bound itself) at most STREAM_PREFETCH."""
    usable = usable_window_length(options.window)
    overlap = default_overlap(options.window) if options.overlap is None else options.overlap
    new = max(1, usable - overlap)
    return new if model else min(STREAM_PREFETCH, new)


def validate_windows(window: int, overlap: int | None) -> None:
    """FastRemoverError with a clear message for window/overlap values that cannot work (None = the default)."""
    if window < MIN_WINDOW:
        raise FastRemoverError(
            f"--window {window}: a window needs at least {MIN_WINDOW} frames (default {DEFAULT_WINDOW})"
        )
    if overlap is None:
        return
    if overlap < 0:
        raise FastRemoverError(
            f"--overlap {overlap}: must be >= 0 (default {default_overlap(window)} for --window {window})"
        )
    usable = usable_window_length(window)
    if overlap >= usable:
        used = f" (used as {usable}: windows are 4k+1 frames)" if usable != window else ""
        raise FastRemoverError(
            f"--overlap {overlap} must be smaller than --window {window}{used}, so every window adds new frames"
        )


def bucket_length(length: int, window: int, buckets: int = 0) -> int:
    """The last window's length (4k+1 frames, at most `window`, itself 4k+1) snapped up to one of `buckets` canonical
    lengths per window: its latent frames T = (length - 1) / 4 + 1 rounded up to 1 + a multiple of
    ceil((T_window - 1) / buckets), at most the window's (81 frames, buckets 4: 21, 41, 61 or 81 frames), so the last
    windows of clips of any length share a few shapes. buckets 0: `length` unchanged."""
    if buckets <= 0 or length >= window:
        return min(length, window)
    latents, full = (length - 1) // 4 + 1, (window - 1) // 4 + 1
    step = max(1, -(-(full - 1) // buckets))
    snapped = min(full, 1 + -(-(latents - 1) // step) * step)
    return 4 * (snapped - 1) + 1


def plan_windows(num_frames: int, window: int = DEFAULT_WINDOW, overlap: int | None = None,
                 buckets: int = 0) -> list[Window]:
    """Split ``num_frames`` into windows that cover every frame, consecutive ones sharing at least ``overlap`` frames
    (``None``: :func:`default_overlap`).

    A clip of at most ``window`` frames is one window (whatever its length: the pipeline pads it as before).  Longer
    clips use windows of ``usable_window_length(window)`` frames (4k+1) advancing by ``window - overlap``; the last
    window ends at the last frame and is only as long as it needs to be (the smallest 4k+1 that holds the remaining
    frames plus ``overlap`` known ones), so it may share more than ``overlap`` frames with the one before it; with
    ``buckets`` its length is snapped up to one of a few canonical lengths (:func:`bucket_length`), starting it
    earlier.
    """
    validate_windows(window, overlap)
    overlap = default_overlap(window) if overlap is None else overlap
    if num_frames < 1:
        raise FastRemoverError("the video has no frames")
    if num_frames <= window:
        return [Window(0, num_frames, 0)]
    window = usable_window_length(window)
    windows = [Window(0, window, 0)]
    while True:
        prev = windows[-1]
        start = prev.stop - overlap
        if start + window >= num_frames:
            length = bucket_length(min(window, ceil_4k1(num_frames - prev.stop + overlap)), window, buckets)
            windows.append(Window(num_frames - length, num_frames, prev.stop - (num_frames - length)))
            return windows
        windows.append(Window(start, start + window, overlap))


def window_lookahead(prev: Window | None, window: int = DEFAULT_WINDOW, overlap: int | None = None) -> int:
    """How many frames of the clip (from frame 0) must have been read, unless the clip ends earlier, for
    :func:`next_window` to place the window after ``prev`` (``None``: the first window)."""
    overlap = default_overlap(window) if overlap is None else overlap
    if prev is None:
        return window + 1  # frame `window` exists <=> the clip needs more than one window
    return prev.stop - overlap + usable_window_length(window) + 1


def next_window(prev: Window | None, known: int, ended: bool, window: int = DEFAULT_WINDOW,
                overlap: int | None = None, buckets: int = 0) -> Window | None:
    """The window after ``prev`` (``None``: the first) of :func:`plan_windows`, decided from the first ``known``
    frames of a clip that is read as it goes: ``ended`` says that ``known`` is the clip's length; otherwise ``known``
    must be at least :func:`window_lookahead`. Returns ``None`` after the last window.

    Windows before the last one do not depend on the clip's length, so a clip can be planned window by window with
    one window of look-ahead; the sequence equals ``plan_windows(length, window, overlap, buckets)``.
    """
    validate_windows(window, overlap)
    overlap = default_overlap(window) if overlap is None else overlap
    if not ended and known < window_lookahead(prev, window, overlap):
        raise ValueError(f"next_window needs {window_lookahead(prev, window, overlap)} frames, got {known}")
    usable = usable_window_length(window)
    if prev is None:
        if ended and known < 1:
            raise FastRemoverError("the video has no frames")
        return Window(0, known, 0) if ended and known <= window else Window(0, usable, 0)
    if ended and prev.stop >= known:
        return None
    start = prev.stop - overlap
    if ended and start + usable >= known:
        length = bucket_length(min(usable, ceil_4k1(known - prev.stop + overlap)), usable, buckets)
        return Window(known - length, known, prev.stop - (known - length))
    return Window(start, start + usable, overlap)


def crossfade_weights(overlap: int) -> np.ndarray:
    """Weight of the *new* window on each of the ``overlap`` shared frames: (i+1)/(overlap+1), rising linearly.

    Neither end reaches 0 or 1, so the first shared frame already moves a little towards the new window and the last
    one still keeps a little of the old: the change is spread evenly over overlap+1 frame steps.
    """
    return np.arange(1, overlap + 1, dtype=np.float32) / np.float32(overlap + 1)


def seam_transitions(windows: list[Window], num_frames: int) -> np.ndarray:
    """Frame steps ``t`` (the pair ``t, t+1``) where a window boundary can show: for each window after the first,
    from the step into its first frame to the step out of the previous window's last frame (the whole cross-fade band;
    with no overlap just the one hard cut).  Sorted, unique, within ``[0, num_frames - 2]``."""
    steps: set[int] = set()
    for prev, win in zip(windows, windows[1:]):
        steps.update(range(max(0, win.start - 1), min(num_frames - 1, prev.stop)))
    return np.array(sorted(steps), dtype=np.int64)


def seam_metric(frames: np.ndarray, mask: np.ndarray, windows: list[Window]) -> dict:
    """How visible the window boundaries are: mean |frame[t+1] - frame[t]| inside the mask at boundary steps vs at
    all other steps.

    ``frames`` uint8 ``[F, H, W, 3]`` (the output), ``mask`` bool ``[F, H, W]`` (the dilated mask that was removed).
    Per step ``t`` the absolute difference is averaged over the pixels (and channels) where ``mask[t] | mask[t+1]``;
    steps with no masked pixel are left out.  Returns ``seam_boundary`` (mean over the steps of
    :func:`seam_transitions`), ``seam_inside`` (mean over the other steps) and ``seam_ratio`` = boundary / inside:
    about 1 when the boundaries are invisible, large for a jump ("fog", a colour or content change).  Values are
    ``None`` where undefined (one window, or no masked step on one side).
    """
    frames = np.asarray(frames)
    mask = np.asarray(mask, dtype=bool)
    if frames.ndim != 4 or mask.shape != frames.shape[:3]:
        raise ValueError(f"frames [F,H,W,3] and mask [F,H,W] must match, got {frames.shape} and {mask.shape}")
    num_frames = frames.shape[0]
    per_step = np.full(max(0, num_frames - 1), np.nan)
    for t in range(num_frames - 1):
        region = mask[t] | mask[t + 1]
        if region.any():
            diff = np.abs(frames[t + 1][region].astype(np.int16) - frames[t][region].astype(np.int16))
            per_step[t] = float(diff.mean())
    at_boundary = np.zeros(per_step.shape, dtype=bool)
    at_boundary[seam_transitions(windows, num_frames)] = True

    def mean(values: np.ndarray) -> float | None:
        values = values[np.isfinite(values)]
        return float(values.mean()) if values.size else None

    boundary, inside = mean(per_step[at_boundary]), mean(per_step[~at_boundary])
    ratio = boundary / inside if boundary is not None and inside else None
    return {"seam_boundary": boundary, "seam_inside": inside, "seam_ratio": ratio}


# ----------------------------------------------------------------------------------------------------------------------
# Crop boxes

Box = tuple[int, int, int, int]  # (y0, y1, x0, x1), half-open
CROP_MODES = ("auto", "on", "off")
CROP_MARGIN_FRACTION = 0.25  # context around the mask's box, per side, as a fraction of the box's side...
CROP_MIN_MARGIN = 32  # ...but at least this many pixels: the model fills the hole from what it sees around it
CROP_MIN_SIDE = 256  # below this the model sees too little of the scene; frames smaller than this are used whole
CROP_MULTIPLE = 16  # VAE 8x downsampling times the transformer's 2x2 patches
CROP_AUTO_MAX_AREA = 0.5  # `auto` crops when the crop is less than this fraction of the frame's area
# Canonical run shapes (RunOptions.shape_buckets): crop sides snapped to SHAPE_BUCKETS sizes per octave (bucket_side),
# the last window of a long clip to SHAPE_BUCKETS lengths per window (bucket_length), so the windows of one clip and
# clips of similar size share captured graphs, cuDNN plans and tuned kernels. A crop grows into more of the frame
# (more context, no padding); the cost is at most 1/SHAPE_BUCKETS more pixels per side (docs/performance.md).
SHAPE_BUCKETS = 4


def bucket_side(side: int, per_octave: int = SHAPE_BUCKETS, multiple: int = CROP_MULTIPLE) -> int:
    """The canonical size for a side of `side` px: the smallest multiple of `step` that holds it, where `step` is the
    largest power of two below `side` divided by `per_octave` (a multiple of `multiple`, at least `multiple`;
    per_octave 4: 256, 320, 384, 448, 512, 640, 768, 896, 1024, ...: at most 1/per_octave larger than `side`).
    per_octave 0: the next multiple of `multiple`."""
    if side <= multiple or per_octave <= 0:
        return max(multiple, -(-side // multiple) * multiple)
    octave = 1 << ((side - 1).bit_length() - 1)
    step = max(multiple, octave // per_octave // multiple * multiple)
    return -(-side // step) * step


def expand_box(box: Box, frame_hw: tuple[int, int], margin_fraction: float = CROP_MARGIN_FRACTION,
               min_margin: int = CROP_MIN_MARGIN) -> Box:
    """Grow ``box`` on each side by ``max(min_margin, margin_fraction * its side)``, clipped to the frame."""
    y0, y1, x0, x1 = box
    height, width = frame_hw
    my = max(min_margin, math.ceil(margin_fraction * (y1 - y0)))
    mx = max(min_margin, math.ceil(margin_fraction * (x1 - x0)))
    return max(0, y0 - my), min(height, y1 + my), max(0, x0 - mx), min(width, x1 + mx)


def _snap_axis(lo: int, hi: int, size: int, multiple: int, min_side: int, buckets: int = 0) -> tuple[int, int]:
    """A range of a multiple of ``multiple`` (at least ``min_side``; with ``buckets``, a canonical size of
    :func:`bucket_side`) containing ``[lo, hi)``, centred on it and shifted to lie inside ``[0, size)``; the whole axis
    if that does not fit or the axis is not longer than ``min_side``."""
    if size <= min_side:
        return 0, size
    side = bucket_side(max(min_side, hi - lo), buckets, multiple)
    if side >= size:
        return 0, size
    start = (lo + hi - side) // 2  # floor: with side >= hi - lo, [start, start + side) still contains [lo, hi)
    start = min(max(start, 0), size - side)
    return start, start + side


def snap_box(box: Box, frame_hw: tuple[int, int], multiple: int = CROP_MULTIPLE, min_side: int = CROP_MIN_SIDE,
             buckets: int = 0) -> Box:
    """A box the model can run on that contains ``box``: each side a multiple of ``multiple`` (with ``buckets``: one
    of the canonical sizes of :func:`bucket_side`) and at least ``min_side``, inside the frame; an axis that cannot
    hold that (frame side <= ``min_side``, or the snapped side would reach the frame's) is taken whole (the pipeline
    then pads it to a multiple of 16 as for any frame)."""
    y0, y1, x0, x1 = box
    height, width = frame_hw
    ya, yb = _snap_axis(y0, y1, height, multiple, min_side, buckets)
    xa, xb = _snap_axis(x0, x1, width, multiple, min_side, buckets)
    return ya, yb, xa, xb


def crop_box(mask: np.ndarray, **params) -> Box | None:
    """The crop for the (dilated) masks of one window, bool ``[F, H, W]``: the union of the per-frame bounding boxes,
    plus context (:func:`expand_box`), snapped (:func:`snap_box`).  ``None`` for an empty mask.
    ``params``: ``margin_fraction``, ``min_margin``, ``multiple``, ``min_side``, ``buckets`` (the module's defaults
    otherwise; buckets 0)."""
    box = mask_bbox(mask)  # over all frames: the union of the per-frame boxes
    if box is None:
        return None
    frame_hw = mask.shape[-2:]
    expand = {k: params[k] for k in ("margin_fraction", "min_margin") if k in params}
    snap = {k: params[k] for k in ("multiple", "min_side", "buckets") if k in params}
    return snap_box(expand_box(box, frame_hw, **expand), frame_hw, **snap)


def choose_crop(mask: np.ndarray, mode: str = "auto", max_area: float = CROP_AUTO_MAX_AREA, **params) -> Box | None:
    """The box to run the model on for one window's dilated mask ``[F, H, W]``, or ``None`` for the whole frame.

    ``off``: always the whole frame; ``on``: the crop of :func:`crop_box` (``None`` if that is the whole frame
    anyway); ``auto``: the crop only when its area is less than ``max_area`` of the frame's, where the saving is worth
    the narrower view.
    """
    if mode not in CROP_MODES:
        raise FastRemoverError(f"--crop {mode!r}: choose one of {list(CROP_MODES)}")
    if mode == "off":
        return None
    box = crop_box(mask, **params)
    height, width = mask.shape[-2:]
    if box is None or box == (0, height, 0, width):
        return None
    if mode == "auto" and (box[1] - box[0]) * (box[3] - box[2]) >= max_area * height * width:
        return None
    return box


def run_shapes(windows: list) -> list[tuple]:
    """The distinct run shapes (frames, (H, W)) of a request's windows (pipeline.WindowRun), in first-seen order:
    each new one pays its own captures, plans and tuning in a warm process."""
    seen: list[tuple] = []
    for w in windows:
        if getattr(w, "run_hw", None) is None:
            continue
        shape = (w.stop - w.start, tuple(w.run_hw))
        if shape not in seen:
            seen.append(shape)
    return seen
