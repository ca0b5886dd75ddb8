"""The weightless box-to-mask path behind ``fastremover.masktools.build_mask`` (see the package's docstring)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import cv2
import numpy as np

from fastremover.errors import FastRemoverError
from fastremover.masktools.segment import ROI_MARGIN, grabcut_object, roi_of, smooth_masks, warp_mask
from fastremover.masktools.track import (
    Box,
    Motion,
    appearance_score,
    check_box,
    compose,
    estimate_motion,
    invert,
    match_template,
    parse_box,
    refine_to_key,
    transform_box,
)

__all__ = ["Box", "MaskResult", "build_mask", "parse_box", "check_box", "format_frames", "overlay_preview",
           "MIN_CONFIDENCE"]

MIN_CONFIDENCE = 0.3  #: a frame whose confidence is below this is reported as uncertain
OUT_OF_FRAME = 0.1  #: below this visible fraction of the tracked object, a frame is not judged
MAX_ANCHOR_SHIFT = 0.1  #: largest key-frame re-anchoring, as a fraction of the box's size (sqrt of its area)
TEMPLATE_MIN_SCORE = 0.7  #: a weaker template match is not trusted: the last motion is repeated instead

Progress = Callable[[str, int, int], None]


@dataclass
class MaskResult:
    """What :func:`build_mask` found.

    ``mask``: ``bool [F, H, W]``, the union over objects (undilated).  ``confidence``: ``float32 [F]`` in [0, 1],
    per frame the lowest over objects (1 on the key frame).  ``uncertain_frames``: frame indices whose confidence
    is below ``min_confidence``.  ``boxes``: ``float64 [N, F, 4]`` tracked ``(x0, y0, x1, y1)`` per object and frame.
    """

    mask: np.ndarray
    confidence: np.ndarray
    uncertain_frames: list[int] = field(default_factory=list)
    boxes: np.ndarray | None = None
    object_confidence: np.ndarray | None = None  #: ``float32 [N, F]``

    def summary(self) -> dict:
        """JSON-ready facts about the mask (no pixels): frame count, size, per-frame confidence (3 decimals),
        the uncertain frames (list and ``"3-5, 9"`` text) and the tracked boxes as ``[x, y, w, h]`` per object and
        frame.  For a server or a UI that shows the tracking before a removal."""
        count, height, width = self.mask.shape
        boxes = [] if self.boxes is None else [
            [[round(float(x0), 1), round(float(y0), 1), round(float(x1 - x0), 1), round(float(y1 - y0), 1)]
             for x0, y0, x1, y1 in track] for track in self.boxes]
        return {
            "frames": int(count), "width": int(width), "height": int(height),
            "confidence": [round(float(c), 3) for c in self.confidence],
            "uncertain_frames": list(self.uncertain_frames),
            "uncertain_text": format_frames(self.uncertain_frames),
            "boxes": boxes,
        }


def format_frames(indices: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(parts)


def _as_box(box: Box | Sequence[int] | str) -> Box:
    if isinstance(box, Box):
        return box
    if isinstance(box, str):
        return parse_box(box)
    values = tuple(int(v) for v in box)
    if len(values) != 4:
        raise FastRemoverError(f"a box is X,Y,W,H (four integers), got {box!r}")
    return Box(*values)


def _check_frames(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    return frames


def _residual(frame: np.ndarray, other: np.ndarray, matrix: np.ndarray, roi: tuple[int, int, int, int]
              ) -> np.ndarray:
    """``float32 [H, W]``: |frame - other moved by ``matrix``|, the largest channel difference, computed inside
    ``roi`` = ``(x0, y0, x1, y1)`` only (255 elsewhere)."""
    x0, y0, x1, y1 = roi
    out = np.full(frame.shape[:2], 255.0, np.float32)
    if x1 <= x0 or y1 <= y0:
        return out
    shifted = compose(np.array([[1.0, 0, -x0], [0, 1.0, -y0]]), matrix)  # into ROI coordinates
    moved = cv2.warpAffine(other, shifted, (x1 - x0, y1 - y0), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    out[y0:y1, x0:x1] = cv2.absdiff(frame[y0:y1, x0:x1], moved).max(axis=2)
    return out


def _corner_shift(box: Box, a: np.ndarray, b: np.ndarray) -> float:
    """Mean distance (px) between ``box``'s corners mapped by the 2x3 transforms ``a`` and ``b``."""
    corners = box.corners.astype(np.float64)
    pa = corners @ a[:, :2].T + a[:, 2]
    pb = corners @ b[:, :2].T + b[:, 2]
    return float(np.linalg.norm(pa - pb, axis=1).mean())


def _track_object(frames: np.ndarray, greys: np.ndarray, box: Box, key: int, done: Callable[[], None],
                  min_confidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One object through the clip: masks ``bool [F, H, W]``, transforms ``[F, 2, 3]`` (key frame -> frame),
    confidence ``[F]`` and boxes ``[F, 4]``."""
    count, height, width = greys.shape
    key_bounds = np.array([box.x, box.y, box.x + box.w, box.y + box.h], np.float64)
    key_mask = grabcut_object(frames[key], key_bounds)
    if not key_mask.any():
        raise FastRemoverError(f"found no object inside the box {box} on frame {key}; draw the box around the object")
    key_area = float(key_mask.sum())
    masks = np.zeros((count, height, width), bool)
    transforms = np.zeros((count, 2, 3), np.float64)
    confidence = np.zeros(count, np.float32)
    bounds = np.zeros((count, 4), np.float64)
    masks[key], transforms[key], confidence[key], bounds[key] = key_mask, np.eye(2, 3), 1.0, key_bounds
    done()
    erode = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (5, 5))
    key_region = cv2.erode(key_mask.view(np.uint8), erode).astype(bool)
    for step in (1, -1):
        prev, velocity = key, None
        for t in range(key + step, count if step > 0 else -1, step):
            region = cv2.erode(masks[prev].view(np.uint8), erode).astype(bool)
            if region.sum() < 16:
                region = masks[prev]
            motion = estimate_motion(greys[prev], greys[t], region, bounds[prev]) if region.any() else None
            if motion is None:
                x0, y0, x1, y1 = bounds[prev]
                whole = x0 >= 0 and y0 >= 0 and x1 <= width and y1 <= height
                motion = (match_template(greys[prev], greys[t], bounds[prev], masks[prev])
                          if whole or velocity is None else None)
                if (motion is None or motion.score < TEMPLATE_MIN_SCORE) and velocity is not None:
                    # Nothing to hold on to (the object is leaving the frame, blurred or hidden; a box cut by the
                    # frame edge is mostly background, which template matching would follow): keep its motion.
                    motion = Motion(matrix=velocity.copy(), inliers=0, method="velocity", score=0.0)
            velocity = motion.matrix
            transforms[t] = compose(motion.matrix, transforms[prev])
            anchored = refine_to_key(greys[key], greys[t], key_region, key_bounds, transforms[t])
            if anchored is not None and _corner_shift(box, anchored.matrix, transforms[t]) <= max(
                    2.0, MAX_ANCHOR_SHIFT * float(np.sqrt(box.w * box.h))):
                # A drift correction is small; a large one means the similarity no longer fits (the object
                # deforms) and the key-frame fit latched onto part of it: keep the chained estimate then.
                motion.matrix = compose(anchored.matrix, invert(transforms[prev]))
                transforms[t] = anchored.matrix
            bounds[t] = transform_box(box, transforms[t])
            roi = roi_of(bounds[t], ROI_MARGIN, height, width)
            prior = warp_mask(masks[prev], motion.matrix)
            shape = warp_mask(key_mask, transforms[t])
            residual = _residual(frames[t], frames[prev], motion.matrix, roi)
            shape_residual = _residual(frames[t], frames[key], transforms[t], roi)
            masks[t] = grabcut_object(frames[t], bounds[t], prior, residual, shape, shape_residual)
            score, visible = appearance_score(greys[key], key_mask, greys[t], transforms[t])
            if confidence[prev] >= min_confidence and masks[prev].sum() >= 16:
                # An object that changes its look (turns, deforms) drifts away from the key frame but stays like
                # its previous frame; that counts only while the chain back to the key frame is trusted.
                score = max(score, appearance_score(greys[prev], masks[prev], greys[t], motion.matrix)[0])
            if visible < OUT_OF_FRAME:
                confidence[t] = 1.0  # the object has left the frame: nothing to mask, nothing to doubt
            else:
                if motion.method != "flow":
                    score = min(score, motion.score)
                expected = key_area * abs(float(np.linalg.det(transforms[t][:, :2]))) * visible
                confidence[t] = min(score, float(masks[t].sum()) / max(1.0, expected), 1.0)
            prev = t
            done()
    masks = smooth_masks(masks, transforms, frames)
    return masks, transforms, confidence, bounds


def build_mask(frames: np.ndarray, boxes: Sequence[Box | Sequence[int] | str], frame: int = 0, *,
               progress: Progress | None = None, min_confidence: float = MIN_CONFIDENCE) -> MaskResult:
    """Masks of the objects inside ``boxes`` on frame ``frame``, tracked through all of ``frames``.

    ``frames``: ``uint8 [F, H, W, 3]`` RGB.  ``boxes``: :class:`Box`, ``(x, y, w, h)`` tuples or ``"X,Y,W,H"``
    strings, in pixels of the source frame; one object each.  ``progress(stage, done, total)`` is called with stage
    ``"mask"`` after every frame of every object.  Raises ``FastRemoverError`` for a box outside the frame or of
    zero size, a frame index out of range, or a box with no object inside; frames where the object may be lost
    are *reported* (``uncertain_frames``), not raised: the caller decides.  Deterministic.
    """
    frames = _check_frames(frames)
    count, height, width = frames.shape[:3]
    if not boxes:
        raise FastRemoverError("give at least one --box X,Y,W,H around the object to remove")
    if not -count <= frame < count:
        raise FastRemoverError(f"--frame {frame} is out of range: the clip has {count} frames (0..{count - 1})")
    frame %= count
    parsed = [_as_box(b) for b in boxes]
    for i, box in enumerate(parsed):
        check_box(box, height, width, label=f"box {i + 1}" if len(parsed) > 1 else "the box")
    greys = np.stack([cv2.cvtColor(f, cv2.COLOR_RGB2GRAY) for f in frames])
    total, finished = count * len(parsed), [0]

    def done() -> None:
        finished[0] += 1
        if progress is not None:
            progress("mask", finished[0], total)

    mask = np.zeros((count, height, width), bool)
    confidences, tracks = [], []
    for box in parsed:
        masks, _, confidence, bounds = _track_object(frames, greys, box, frame, done, min_confidence)
        mask |= masks
        confidences.append(confidence)
        tracks.append(bounds)
    per_object = np.stack(confidences)
    confidence = per_object.min(axis=0)
    uncertain = [int(i) for i in np.flatnonzero(confidence < min_confidence)]
    return MaskResult(mask=mask, confidence=confidence, uncertain_frames=uncertain, boxes=np.stack(tracks),
                      object_confidence=per_object)


def overlay_preview(frames: np.ndarray, mask: np.ndarray, boxes: np.ndarray | None = None,
                    uncertain: Sequence[int] = ()) -> np.ndarray:
    """The clip with the mask tinted red (``pixel/2 + (127, 0, 0)``, as ``demo``'s preview) and the tracked boxes
    drawn (green, yellow on uncertain frames).  ``uint8 [F, H, W, 3]``; the input is not modified."""
    out = np.asarray(frames).copy()
    out[mask] = (out[mask] // 2 + np.array([127, 0, 0], np.uint8)).astype(np.uint8)
    if boxes is not None:
        flagged = set(int(i) for i in uncertain)
        for track in boxes:
            for t, (x0, y0, x1, y1) in enumerate(track):
                colour = (255, 220, 0) if t in flagged else (0, 255, 0)
                cv2.rectangle(out[t], (int(round(x0)), int(round(y0))), (int(round(x1)) - 1, int(round(y1)) - 1),
                              colour, 1)
    return out
