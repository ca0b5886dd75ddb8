"""Box tracking without weights: sparse optical flow for motion, template matching as the fallback.

The state of one tracked object is a similarity transform ``A_t`` (rotation, uniform scale, translation; a 2x3
matrix) that maps pixel coordinates of the key frame (the frame the user drew the box on) to frame ``t``.  One step
``t -> t+1`` estimates the incremental transform ``M`` from corners on the object:

1. ``cv2.goodFeaturesToTrack`` on the object's current mask (eroded, so corners straddling the edge, which move
   with the background half the time, are not used);
2. pyramidal Lucas-Kanade forward ``t -> t+1`` and backward ``t+1 -> t``; a point is kept when it comes back to
   within ``FB_MAX_ERROR`` pixels of where it started (the forward-backward check);
3. ``cv2.estimateAffinePartial2D`` (4 degrees of freedom) with RANSAC on the kept points.

When too few points survive, the step falls back to normalised cross-correlation template matching of the
object's pixels in a search window (translation only).  ``A_{t+1} = M @ A_t`` (as 3x3 matrices), then
:func:`refine_to_key` re-estimates ``A_{t+1}`` directly against the key frame, starting from that prediction, which
keeps many chained steps from drifting.

Confidence of frame ``t`` (:func:`appearance_score`): normalised cross-correlation between the key frame's object
pixels and frame ``t`` warped back into key-frame coordinates by ``A_t^{-1}``.  It is near 1 for a well tracked
object, drops with the occluded fraction, and collapses when the box has slid off the object.
Everything here is deterministic (OpenCV's RANSAC uses a fixed seed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import cv2
import numpy as np

from fastremover.errors import FastRemoverError

__all__ = ["Box", "parse_box", "check_box", "Motion", "estimate_motion", "refine_to_key", "match_template", "compose",
           "transform_box", "appearance_score"]

MAX_POINTS = 200  #: corners seeded per step
MIN_POINTS = 8  #: fewer forward-backward-consistent points than this: use template matching instead
FB_MAX_ERROR = 1.0  #: px, forward-backward round-trip error allowed for a point
RANSAC_THRESHOLD = 1.5  #: px, reprojection error of a RANSAC inlier
_LK_PARAMS = dict(winSize=(21, 21), maxLevel=3,
                  criteria=(cv2.TERM_CRITERIA_EPS | cv2.TERM_CRITERIA_COUNT, 30, 0.01))


@dataclass(frozen=True)
class Box:
    """An axis-aligned box in pixels of the source frame: top-left ``(x, y)``, size ``(w, h)``."""

    x: int
    y: int
    w: int
    h: int

    def __str__(self) -> str:
        return f"{self.x},{self.y},{self.w},{self.h}"

    @property
    def corners(self) -> np.ndarray:
        """``float32 [4, 2]`` (x, y) of the four corners (the far corners are ``x + w``, ``y + h``)."""
        x0, y0, x1, y1 = self.x, self.y, self.x + self.w, self.y + self.h
        return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], np.float32)


_BOX_RE = re.compile(r"^\s*(-?\d+)\s*,\s*(-?\d+)\s*,\s*(-?\d+)\s*,\s*(-?\d+)\s*$")


def parse_box(text: str) -> Box:
    """``"X,Y,W,H"`` (integers, pixels) -> :class:`Box`. Raises ``FastRemoverError`` on any other text."""
    match = _BOX_RE.match(text)
    if match is None:
        raise FastRemoverError(f"--box {text!r} is not X,Y,W,H (four integers in pixels, e.g. --box 120,80,64,48)")
    return Box(*(int(v) for v in match.groups()))


def check_box(box: Box, height: int, width: int, label: str = "box") -> None:
    """Raise ``FastRemoverError`` unless ``box`` has a positive size and lies inside a ``width x height`` frame."""
    if box.w <= 0 or box.h <= 0:
        raise FastRemoverError(f"{label} {box} has zero or negative size; W and H must be at least 1 pixel")
    if box.x < 0 or box.y < 0 or box.x + box.w > width or box.y + box.h > height:
        raise FastRemoverError(
            f"{label} {box} is outside the {width}x{height} frame; X,Y is the top-left corner and "
            f"X+W <= {width}, Y+H <= {height} must hold"
        )


@dataclass
class Motion:
    """One tracking step: ``matrix`` (``float64 [2, 3]``) maps frame ``t`` to frame ``t+1``."""

    matrix: np.ndarray
    inliers: int  #: points that agree with ``matrix`` (0 for the template fallback)
    method: str  #: "flow" or "template"
    score: float  #: RANSAC inlier fraction for "flow", the correlation peak for "template"


def compose(outer: np.ndarray, inner: np.ndarray) -> np.ndarray:
    """``outer ∘ inner`` for 2x3 affine matrices: the point map ``p -> outer(inner(p))``."""
    return (np.vstack([outer, [0, 0, 1]]) @ np.vstack([inner, [0, 0, 1]]))[:2]


def invert(matrix: np.ndarray) -> np.ndarray:
    """Inverse of a 2x3 affine matrix."""
    return cv2.invertAffineTransform(np.asarray(matrix, np.float64))


def transform_box(box: Box, matrix: np.ndarray) -> np.ndarray:
    """Axis-aligned bounds ``(x0, y0, x1, y1)`` (float) of ``box``'s corners mapped by ``matrix``."""
    pts = box.corners @ np.asarray(matrix, np.float64)[:, :2].T + np.asarray(matrix, np.float64)[:, 2]
    return np.array([pts[:, 0].min(), pts[:, 1].min(), pts[:, 0].max(), pts[:, 1].max()])


def _windows(src_bounds: np.ndarray, dst_bounds: np.ndarray, grow: float, height: int, width: int
             ) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Two crops of one size ``(w, h)``, centred on ``src_bounds`` and ``dst_bounds`` (``x0, y0, x1, y1``) grown by
    ``grow`` box sizes on each side and shifted to lie inside the frame: ``(src_xy, dst_xy, (w, h))``.
    (Lucas-Kanade needs both images of one size; cropping makes its pyramids cost the box, not the frame.)"""
    sizes = [(b[2] - b[0], b[3] - b[1]) for b in (src_bounds, dst_bounds)]
    w = int(min(width, np.ceil(max(s[0] for s in sizes) * (1 + 2 * grow)) + 16))
    h = int(min(height, np.ceil(max(s[1] for s in sizes) * (1 + 2 * grow)) + 16))
    corners = []
    for b in (src_bounds, dst_bounds):
        cx, cy = (b[0] + b[2]) / 2, (b[1] + b[3]) / 2
        corners.append((int(np.clip(round(cx - w / 2), 0, width - w)), int(np.clip(round(cy - h / 2), 0, height - h))))
    return corners[0], corners[1], (w, h)


def _similarity(src: np.ndarray, dst: np.ndarray, region: np.ndarray, src_xy: tuple[int, int],
                dst_xy: tuple[int, int], size: tuple[int, int], guess: np.ndarray | None, min_points: int
                ) -> tuple[np.ndarray, int, int] | None:
    """Corners of ``region`` on ``src`` tracked into ``dst`` (Lucas-Kanade, forward-backward checked) and a RANSAC
    similarity fitted to them, all in full-frame coordinates: ``(matrix, inliers, corners)`` or ``None``.

    Works on the crops ``src[src_xy : src_xy + size]`` and ``dst[dst_xy : ...]``.  ``guess`` (2x3, src -> dst),
    when given, is where each corner starts its search in ``dst``."""
    (sx, sy), (dx, dy), (w, h) = src_xy, dst_xy, size
    a, b = src[sy:sy + h, sx:sx + w], dst[dy:dy + h, dx:dx + w]
    m = np.ascontiguousarray(region[sy:sy + h, sx:sx + w]).view(np.uint8)
    pts = cv2.goodFeaturesToTrack(a, maxCorners=MAX_POINTS, qualityLevel=0.005, minDistance=3, mask=m, blockSize=5)
    if pts is None or len(pts) < min_points:
        return None
    src_pts = pts.reshape(-1, 2) + np.float32([sx, sy])
    if guess is None:
        start, flags = pts.copy(), 0
    else:
        guess = np.asarray(guess, np.float64)
        start = (src_pts @ guess[:, :2].T + guess[:, 2] - [dx, dy]).astype(np.float32).reshape(-1, 1, 2)
        flags = cv2.OPTFLOW_USE_INITIAL_FLOW
    fwd, status_f, _ = cv2.calcOpticalFlowPyrLK(a, b, pts, start, flags=flags, **_LK_PARAMS)
    back, status_b, _ = cv2.calcOpticalFlowPyrLK(b, a, fwd, pts.copy(), flags=cv2.OPTFLOW_USE_INITIAL_FLOW,
                                                 **_LK_PARAMS)
    round_trip = np.linalg.norm((back - pts).reshape(-1, 2), axis=1)
    good = (status_f.ravel() == 1) & (status_b.ravel() == 1) & (round_trip < FB_MAX_ERROR)
    if good.sum() < min_points:
        return None
    dst_pts = fwd.reshape(-1, 2) + np.float32([dx, dy])
    matrix, inliers = cv2.estimateAffinePartial2D(src_pts[good], dst_pts[good], method=cv2.RANSAC,
                                                  ransacReprojThreshold=RANSAC_THRESHOLD, maxIters=2000,
                                                  confidence=0.995, refineIters=10)
    if matrix is None or inliers is None or int(inliers.sum()) < min_points:
        return None
    return matrix.astype(np.float64), int(inliers.sum()), len(pts)


def estimate_motion(prev: np.ndarray, nxt: np.ndarray, region: np.ndarray, bounds: np.ndarray) -> Motion | None:
    """Similarity transform of the pixels in ``region`` (``bool [H, W]``) from grey frame ``prev`` to ``nxt``.

    ``bounds`` (``x0, y0, x1, y1``): the object's box in ``prev``; the search reaches one box size around it.
    Returns ``None`` when fewer than ``MIN_POINTS`` corners pass the forward-backward check or RANSAC fails.
    """
    height, width = prev.shape
    src_xy, _, size = _windows(bounds, bounds, 0.5, height, width)
    found = _similarity(prev, nxt, region, src_xy, src_xy, size, None, MIN_POINTS)
    if found is None:
        return None
    matrix, inliers, corners = found
    return Motion(matrix=matrix, inliers=inliers, method="flow", score=inliers / corners)


def refine_to_key(key: np.ndarray, grey: np.ndarray, key_region: np.ndarray, key_bounds: np.ndarray,
                  guess: np.ndarray) -> Motion | None:
    """Re-estimate the key-frame -> frame transform directly, starting from ``guess`` (the chained steps).

    Corners of ``key_region`` (inside ``key_bounds``) on the key frame are tracked straight into ``grey`` by
    Lucas-Kanade, each starting at ``guess`` applied to it, with the same forward-backward check and RANSAC as
    :func:`estimate_motion`.  This removes the drift that chaining many small steps accumulates.  ``None`` when
    it does not hold up (fewer than a quarter of the corners consistent, e.g. under a large scale change or
    heavy occlusion): keep ``guess`` then.
    """
    height, width = key.shape
    guess = np.asarray(guess, np.float64)
    x0, y0, x1, y1 = key_bounds
    corners = np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]]) @ guess[:, :2].T + guess[:, 2]
    target = np.array([corners[:, 0].min(), corners[:, 1].min(), corners[:, 0].max(), corners[:, 1].max()])
    src_xy, dst_xy, size = _windows(key_bounds, target, 0.25, height, width)
    found = _similarity(key, grey, key_region, src_xy, dst_xy, size, guess, MIN_POINTS)
    if found is None or found[1] < max(MIN_POINTS, found[2] // 4):
        return None
    matrix, inliers, corners_n = found
    return Motion(matrix=matrix, inliers=inliers, method="key", score=inliers / corners_n)


def match_template(prev: np.ndarray, nxt: np.ndarray, bounds: np.ndarray, mask: np.ndarray | None = None,
                   search: float = 1.0) -> Motion:
    """Translation of the patch ``prev[bounds]`` into ``nxt`` by normalised cross-correlation.

    ``bounds`` = ``(x0, y0, x1, y1)``; the search window extends ``search`` box sizes on each side.  ``mask``
    (``bool [H, W]``, the object in ``prev``) restricts the correlation to the object's pixels, so the background
    inside the box (which moves differently) does not vote.  ``score`` is the correlation peak (0 for a flat patch).
    """
    height, width = prev.shape
    x0, y0 = int(np.clip(np.floor(bounds[0]), 0, width - 1)), int(np.clip(np.floor(bounds[1]), 0, height - 1))
    x1, y1 = int(np.clip(np.ceil(bounds[2]), x0 + 1, width)), int(np.clip(np.ceil(bounds[3]), y0 + 1, height))
    patch = prev[y0:y1, x0:x1]
    weights = None
    if mask is not None and mask[y0:y1, x0:x1].sum() >= 16:
        weights = np.ascontiguousarray(mask[y0:y1, x0:x1]).astype(np.uint8) * np.uint8(255)
    pad_x, pad_y = int(np.ceil(search * (x1 - x0))), int(np.ceil(search * (y1 - y0)))
    sx0, sy0 = max(0, x0 - pad_x), max(0, y0 - pad_y)
    sx1, sy1 = min(width, x1 + pad_x), min(height, y1 + pad_y)
    window = nxt[sy0:sy1, sx0:sx1]
    if patch.std() < 1e-3 or window.shape[0] < patch.shape[0] or window.shape[1] < patch.shape[1]:
        return Motion(matrix=np.array([[1.0, 0, 0], [0, 1.0, 0]]), inliers=0, method="template", score=0.0)
    response = cv2.matchTemplate(window, patch, cv2.TM_CCOEFF_NORMED, mask=weights)
    response = np.nan_to_num(response, nan=-1.0, posinf=-1.0, neginf=-1.0)  # flat windows under a mask
    _, peak, _, (px, py) = cv2.minMaxLoc(response)
    dx, dy = sx0 + px - x0, sy0 + py - y0
    return Motion(matrix=np.array([[1.0, 0, dx], [0, 1.0, dy]]), inliers=0, method="template",
                  score=float(max(peak, 0.0)))


def appearance_score(key_grey: np.ndarray, key_mask: np.ndarray, grey: np.ndarray, matrix: np.ndarray
                     ) -> tuple[float, float]:
    """``(score, visible)``: how well frame ``grey`` shows the key frame's object where the track puts it.

    ``matrix`` maps key-frame coordinates to ``grey``'s; ``grey`` is warped back into the key frame and both are
    compared over the pixels of ``key_mask`` that land inside the frame; ``visible`` is their fraction of
    ``key_mask``.  ``score`` is the normalised cross-correlation clipped to [0, 1]; a nearly flat object (grey-level
    std < 4) cannot be correlated and is scored ``1 - mean|difference| / 64``.  Fewer than 16 visible pixels give
    ``score`` 0.
    """
    ys, xs = np.nonzero(key_mask)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    # Warp only the mask's box: shift the map so that output pixel (0, 0) is key-frame pixel (x0, y0).
    shifted = compose(np.asarray(matrix, np.float64), np.array([[1.0, 0, x0], [0, 1.0, y0]]))
    size = (int(x1 - x0), int(y1 - y0))
    warped = cv2.warpAffine(grey, shifted, size, flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, borderValue=0)
    valid = cv2.warpAffine(np.ones_like(grey), shifted, size, flags=cv2.INTER_NEAREST | cv2.WARP_INVERSE_MAP,
                           borderValue=0) > 0
    sel = key_mask[y0:y1, x0:x1]
    inside = valid[sel]
    visible = float(inside.mean())
    if inside.sum() < 16:
        return 0.0, visible
    a = key_grey[y0:y1, x0:x1][sel][inside].astype(np.float64)
    b = warped[sel][inside].astype(np.float64)
    if a.std() < 4.0:
        return 1.0 - min(1.0, float(np.abs(a - b).mean()) / 64.0), visible
    a = a - a.mean()
    b = b - b.mean()
    denom = float(np.sqrt((a * a).sum() * (b * b).sum()))
    if denom == 0.0:
        return 0.0, visible
    return float(np.clip((a * b).sum() / denom, 0.0, 1.0)), visible
