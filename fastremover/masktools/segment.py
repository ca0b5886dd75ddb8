"""Per-frame segmentation of a tracked object with GrabCut, and motion-compensated temporal smoothing.

GrabCut (``cv2.grabCut``: colour GMMs for object and background + a graph cut) works on a region of interest
around the tracked box (downscaled to at most ``MAX_SIDE`` pixels), labelled as

* outside the box (grown by 6 %): certain background;
* inside the box: probable background, except
* the previous frame's mask moved by the step's motion (``prior``) where the moved previous frame matches the
  frame: probable object, and its core (the prior eroded by about an eighth of the box): certain object;
* the key frame's mask moved by the key -> frame transform (``shape``) where the moved key frame matches the
  frame: certain object.  That is what brings back the parts an occluder uncovers; the pixels the occluder hides
  match neither, so GrabCut's colour models decide them.

The key frame has no prior: GrabCut starts from the rectangle alone.  The result keeps the connected components
that touch the prior (the largest one on the key frame) and fills their holes.

Temporal smoothing (:func:`smooth_masks`) is a median of three frames after motion compensation, where a
neighbour only has a say on content that moved with the object.
"""

from __future__ import annotations

import cv2
import numpy as np

__all__ = ["roi_of", "ROI_MARGIN", "grabcut_object", "keep_components", "fill_holes", "smooth_masks"]

GRABCUT_ITERS_KEY = 5  #: iterations on the key frame (rectangle initialisation)
GRABCUT_ITERS = 1  #: iterations on the other frames (mask initialisation)
RESIDUAL_MAX = 30.0  #: largest channel difference above which the moved previous frame disagrees with the frame
MAX_SIDE = 256  #: the ROI is downscaled so that its longer side is at most this many pixels for GrabCut
MIN_GMM_SAMPLES = 32  #: GrabCut fits 5-component colour models: fewer pixels on either side and it is skipped
ROI_MARGIN = 0.25  #: GrabCut's region of interest: the box grown by this fraction of its size on each side


def roi_of(bounds: np.ndarray, margin: float, height: int, width: int) -> tuple[int, int, int, int]:
    """``(x0, y0, x1, y1)`` integer ROI: ``bounds`` grown by ``margin`` of its size (at least 4 px), clipped."""
    x0, y0, x1, y1 = bounds
    mx = max(4.0, margin * (x1 - x0))
    my = max(4.0, margin * (y1 - y0))
    return (int(max(0, np.floor(x0 - mx))), int(max(0, np.floor(y0 - my))),
            int(min(width, np.ceil(x1 + mx))), int(min(height, np.ceil(y1 + my))))


_CROSS = cv2.getStructuringElement(cv2.MORPH_CROSS, (3, 3))


def _small(mask: np.ndarray, roi: tuple[int, int, int, int], size: tuple[int, int]) -> np.ndarray:
    """``mask[roi]`` resized to ``size`` (w, h) with nearest neighbour."""
    x0, y0, x1, y1 = roi
    part = np.ascontiguousarray(mask[y0:y1, x0:x1]).view(np.uint8)
    return cv2.resize(part, size, interpolation=cv2.INTER_NEAREST) > 0


def fill_holes(mask: np.ndarray) -> np.ndarray:
    """``mask`` (``bool [H, W]``) with every background region that does not touch the border filled."""
    padded = np.pad(mask, 1).astype(np.uint8)
    flood = padded.copy()
    cv2.floodFill(flood, None, (0, 0), 1)
    holes = flood == 0
    return (padded.astype(bool) | holes)[1:-1, 1:-1]


def keep_components(mask: np.ndarray, prior: np.ndarray | None) -> np.ndarray:
    """Connected components (8-connected) of ``mask`` that overlap ``prior``; the largest one when ``prior`` is None
    or nothing overlaps it."""
    count, labels, stats, _ = cv2.connectedComponentsWithStats(mask.view(np.uint8), connectivity=8)
    if count <= 1:
        return mask.copy()
    if prior is not None:
        hit = np.unique(labels[prior & mask])
        hit = hit[hit > 0]
        if len(hit):
            return np.isin(labels, hit)
    largest = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
    return labels == largest


def grabcut_object(frame: np.ndarray, bounds: np.ndarray, prior: np.ndarray | None = None,
                   residual: np.ndarray | None = None, shape: np.ndarray | None = None,
                   shape_residual: np.ndarray | None = None) -> np.ndarray:
    """Segment the object inside ``bounds`` (``(x0, y0, x1, y1)`` float) of ``frame`` (``uint8 [H, W, 3]``).

    ``prior`` (``bool [H, W]``): where the object is expected (the previous mask moved by the tracked motion);
    ``residual`` (``float32 [H, W]``): |frame - motion-compensated previous frame|, largest over the channels.
    Both ``None`` on the key frame.  ``shape`` (``bool [H, W]``): the key frame's mask moved by the key -> frame
    transform, and ``shape_residual``: |frame - key frame moved the same way|; the part of ``shape`` the key frame
    explains is certain object (that is what brings back parts that an occluder uncovers).
    Returns ``bool [H, W]``, empty outside the ROI (``roi_of(bounds, ROI_MARGIN)``);
    ``residual`` and ``shape_residual`` are read inside that ROI only.
    """
    height, width = frame.shape[:2]
    rx0, ry0, rx1, ry1 = roi_of(bounds, ROI_MARGIN, height, width)
    if rx1 - rx0 < 2 or ry1 - ry0 < 2:  # the box has left the frame
        return np.zeros((height, width), bool)
    roi = np.ascontiguousarray(frame[ry0:ry1, rx0:rx1])
    rh, rw = roi.shape[:2]
    factor = min(1.0, MAX_SIDE / max(rh, rw))
    size = (max(1, round(rw * factor)), max(1, round(rh * factor)))
    small = roi if factor == 1.0 else cv2.resize(roi, size, interpolation=cv2.INTER_AREA)
    # The box (grown by 6 % so an edge pixel of the object is never "certain background") in ROI pixels.
    bx0, by0, bx1, by1 = roi_of(bounds, 0.06, height, width)
    box = (np.array([bx0 - rx0, by0 - ry0, bx1 - rx0, by1 - ry0], np.float64) * factor).round().astype(int)
    box[[0, 2]] = np.clip(box[[0, 2]], 0, size[0])
    box[[1, 3]] = np.clip(box[[1, 3]], 0, size[1])
    bgd, fgd = np.zeros((1, 65), np.float64), np.zeros((1, 65), np.float64)
    labels = np.full((size[1], size[0]), cv2.GC_BGD, np.uint8)
    labels[box[1]:box[3], box[0]:box[2]] = cv2.GC_PR_BGD
    prior_small = None
    if prior is None:
        if (box[2] - box[0]) * (box[3] - box[1]) < MIN_GMM_SAMPLES or labels.size - (box[2] - box[0]) * (
                box[3] - box[1]) < MIN_GMM_SAMPLES:
            # Too small for colour models (or a box covering the whole frame): the box itself is the object.
            out = np.zeros((height, width), bool)
            x0, y0, x1, y1 = (int(round(v)) for v in bounds)
            out[max(0, y0):max(0, y1), max(0, x0):max(0, x1)] = True
            return out
        rect = (int(box[0]), int(box[1]), int(box[2] - box[0]), int(box[3] - box[1]))
        cv2.setRNGSeed(0)  # GrabCut's k-means initialisation draws from OpenCV's thread RNG: make it repeatable
        cv2.grabCut(small, labels, rect, bgd, fgd, GRABCUT_ITERS_KEY, cv2.GC_INIT_WITH_RECT)
    else:
        prior_small = _small(prior, (rx0, ry0, rx1, ry1), size)
        inside = np.zeros_like(prior_small)
        inside[box[1]:box[3], box[0]:box[2]] = True
        prior_small &= inside
        agree = np.ones_like(prior_small)
        if residual is not None:
            res = cv2.resize(np.ascontiguousarray(residual[ry0:ry1, rx0:rx1]), size, interpolation=cv2.INTER_AREA)
            agree = cv2.GaussianBlur(res, (5, 5), 0) < RESIDUAL_MAX
        radius = max(1, int(round(0.12 * min(box[2] - box[0], box[3] - box[1]))))
        kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * radius + 1, 2 * radius + 1))
        core = cv2.erode(prior_small.view(np.uint8), kernel).astype(bool)
        labels[prior_small & agree] = cv2.GC_PR_FGD
        labels[core & agree] = cv2.GC_FGD
        if shape is not None and shape_residual is not None:
            shape_small = _small(shape, (rx0, ry0, rx1, ry1), size) & inside
            shape_small = cv2.erode(shape_small.view(np.uint8), _CROSS).astype(bool)
            res = np.ascontiguousarray(shape_residual[ry0:ry1, rx0:rx1])
            res = cv2.GaussianBlur(cv2.resize(res, size, interpolation=cv2.INTER_AREA), (5, 5), 0)
            explained = shape_small & (res < RESIDUAL_MAX)
            labels[explained] = cv2.GC_FGD
            prior_small |= explained
        objects = int(((labels == cv2.GC_FGD) | (labels == cv2.GC_PR_FGD)).sum())
        if objects == 0:
            return np.zeros((height, width), bool)
        if objects >= MIN_GMM_SAMPLES and labels.size - objects >= MIN_GMM_SAMPLES:
            cv2.setRNGSeed(0)
            cv2.grabCut(small, labels, None, bgd, fgd, GRABCUT_ITERS, cv2.GC_INIT_WITH_MASK)
    fg = (labels == cv2.GC_FGD) | (labels == cv2.GC_PR_FGD)
    fg = keep_components(fg, prior_small)
    fg = fill_holes(fg)
    if factor != 1.0:
        fg = cv2.resize(fg.view(np.uint8) * np.uint8(255), (rw, rh), interpolation=cv2.INTER_LINEAR) > 127
    out = np.zeros((height, width), bool)
    out[ry0:ry1, rx0:rx1] = fg
    return out


def warp_mask(mask: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """``mask`` (``bool [H, W]``) moved by the 2x3 ``matrix`` (nearest neighbour; outside the frame is empty)."""
    height, width = mask.shape
    return cv2.warpAffine(mask.view(np.uint8), np.asarray(matrix, np.float64), (width, height),
                          flags=cv2.INTER_NEAREST, borderValue=0) > 0


def smooth_masks(masks: np.ndarray, key_to_frame: np.ndarray, frames: np.ndarray) -> np.ndarray:
    """Motion-compensated, appearance-gated majority of 3 over time.

    ``masks``: ``bool [F, H, W]`` of one object; ``key_to_frame``: ``float64 [F, 2, 3]``, the tracked transforms
    from the key frame to each frame; ``frames``: the ``uint8 [F, H, W, 3]`` clip.  A neighbour ``s = t +- 1``
    is mapped into frame ``t`` by ``A_t A_s^-1`` and has a say at pixel ``p`` only where its frame, mapped the same
    way, matches frame ``t`` (largest channel difference, 5x5-blurred, below ``RESIDUAL_MAX``): it speaks only for
    content that really moved with the object, so an occluder crossing the object is neither painted over nor
    used to erase what it uncovers.  Pixel ``p`` of frame ``t`` is flipped when both neighbours have a say there
    and both disagree with it (the median of three, with abstentions keeping the frame's own label): this removes
    one-frame flicker at the edges and one-frame holes or blobs.  The first and last frames are returned unchanged.
    """
    from fastremover.masktools.track import compose, invert

    count, height, width = masks.shape
    out = masks.copy()
    for t in range(1, count - 1):
        near = masks[t - 1 : t + 2].any(axis=0)
        if not near.any():
            continue
        ys, xs = np.nonzero(near)
        margin = 8
        y0, y1 = max(0, ys.min() - margin), min(height, ys.max() + 1 + margin)
        x0, x1 = max(0, xs.min() - margin), min(width, xs.max() + 1 + margin)
        own = masks[t, y0:y1, x0:x1]
        against = np.ones(own.shape, bool)
        for s in (t - 1, t + 1):
            # Map frame s into the ROI of frame t: dst(p) = src(A_s A_t^-1 (p + offset)).
            to_s = compose(compose(key_to_frame[s], invert(key_to_frame[t])), np.array([[1.0, 0, x0], [0, 1.0, y0]]))
            size = (int(x1 - x0), int(y1 - y0))
            flags = cv2.WARP_INVERSE_MAP
            moved_mask = cv2.warpAffine(masks[s].view(np.uint8), to_s, size, flags=cv2.INTER_NEAREST | flags,
                                        borderValue=0)
            moved = cv2.warpAffine(frames[s], to_s, size, flags=cv2.INTER_LINEAR | flags,
                                   borderMode=cv2.BORDER_REPLICATE)
            diff = cv2.absdiff(frames[t, y0:y1, x0:x1], moved).max(axis=2).astype(np.float32)
            agree = cv2.GaussianBlur(diff, (5, 5), 0) < RESIDUAL_MAX
            against &= agree & ((moved_mask > 0) != own)
        out[t, y0:y1, x0:x1] = own ^ against
    return out
