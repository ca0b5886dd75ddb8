"""Masks without a mask video: boxes drawn on one frame, tracked through the clip, segmented per frame.

``build_mask(frames, boxes, frame)`` is the weightless path (OpenCV only, see :mod:`.track` and :mod:`.segment`):
for each box, GrabCut segments the object on the key frame ``frame``; the object is then followed frame by frame
forwards to the end and backwards to the start (sparse optical flow -> similarity transform, re-anchored on the
key frame; template matching, then constant motion, as the fallbacks), re-segmented in every frame with GrabCut
seeded by the moved box, the moved previous mask and the moved key-frame mask, and the masks are smoothed over time
with a motion-compensated median of three.  Several boxes are several objects; the result is the
union of their masks.  The mask is *not* dilated: ``remove`` dilates it (``--dilate``) like any mask video.

:mod:`.sam2` does the same with a local SAM2 checkpoint; :mod:`.cli` wires both into the command line.
"""

from __future__ import annotations

import importlib

_LAZY = ("Box", "MaskResult", "build_mask", "parse_box", "check_box", "format_frames", "overlay_preview",
         "MIN_CONFIDENCE")

__all__ = list(_LAZY)


def __getattr__(name: str):
    """The names of :mod:`.build`, imported on first use: the command line imports :mod:`.cli` for its parser on
    every run, and OpenCV and the trackers are needed only where a box becomes a mask."""
    if name not in _LAZY:
        raise AttributeError(f"module 'fastremover.masktools' has no attribute {name!r}")
    value = getattr(importlib.import_module("fastremover.masktools.build"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
