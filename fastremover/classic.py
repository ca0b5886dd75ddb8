"""The weightless remover: flow-guided video completion on the CPU (numpy + OpenCV, no learned weights).

In the spirit of flow-guided video completion (FGVC) and ProPainter's propagation stage, without their networks:

1. **Flow.** DIS optical flow between neighbouring frames, both directions, on half-resolution grey frames. The flow
   inside the fill region (the mask, grown a little because the object also corrupts the flow next to it) is thrown
   away and *completed*: a homography is fitted to the flow of the visible pixels (the camera's global motion), and
   the residual ``flow - homography`` is filled in by harmonic (membrane) interpolation from the region's boundary,
   i.e. the solution of ``laplacian(r) = 0`` inside with ``r`` = the measured residual outside.  A pure translation,
   zoom or rotation of the camera is therefore recovered exactly inside the mask.
2. **Propagation.** Two recurrent passes, forward (each frame looks at the previous one) and backward.  A pixel to be
   filled follows the completed flow one frame; if it lands on a visible pixel it takes that pixel as its source,
   otherwise it inherits the source the landing pixel found (a chain).  Sources are kept as (frame, sub-pixel
   position) and colours are sampled once from the original frame at the end, so long chains do not blur.  Each hop
   is checked for forward-backward consistency (``|f_ab(p) + f_ba(p + f_ab(p))|`` small); an inconsistent hop falls
   back to the pair's homography, at a lower confidence.  The two passes' candidates are blended with weights
   ``confidence / temporal distance``.
3. **Never-visible pixels** (no chain reaches a visible pixel, e.g. a still object on a still camera) are inpainted
   spatially (OpenCV Telea) on one key frame, which then counts as visible, and propagation runs again, so the fill
   is the same texture in every frame and does not flicker.
4. **Seam.** Gradient-domain blending: the fill is computed for a 2-pixel ring of visible pixels around the region
   too; the ring's error ``frame - fill`` is interpolated harmonically over the region and added, so the fill meets
   the frame without a hard edge (Poisson blending with the fill's own gradients as the guidance field).

Contract of :func:`classic_remove`: uint8 ``[F,H,W,3]`` + bool ``[F,H,W]`` -> uint8 ``[F,H,W,3]``, pixels outside
the mask unchanged, deterministic (same inputs -> same bytes).  The previous algorithm (nearest visible pixel in
time at the same position, then Telea) stays available as :func:`classic_remove_v1` for comparisons.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import cv2
import numpy as np

from fastremover.errors import FastRemoverError

FLOW_SCALE = 2  # flow is estimated on frames downscaled by this factor
FLOW_GROW = 3  # px (at flow scale) the fill region grows by for flow completion: the object's flow bleeds out
SEAM_RING = 2  # px of visible ring around the fill region used for the gradient-domain seam
OUTLIER_BAND = 12  # px (at flow scale) around the grown region where flow far from the camera's motion is dropped
OUTLIER_FLOW = 1.0  # px (at flow scale): "far" for OUTLIER_BAND
CAMERA_MODEL = "homography"  # or "similarity" (4 degrees of freedom)
RANSAC_PX = 0.3  # px (at flow scale): RANSAC inlier threshold of the camera fit
RESIDUAL_BAND = 24  # px (at flow scale): the flow residual inside is interpolated from beyond this band
STILL_PX = 0.25  # px (at flow scale): a camera that moves no corner this far is taken as still
FLOW_MARGIN = 48  # px (full scale) of completed flow kept around the fill region's box
KEY_INPAINT = cv2.INPAINT_TELEA  # spatial inpainting of key frames (cv2.INPAINT_NS: faster at radius 1-3)
MAX_KEY_FRAMES = 4  # spatially inpainted key frames before any leftover pixel is inpainted frame by frame

_CROSS = cv2.getStructuringElement(cv2.MORPH_CROSS, (3, 3))
_NEIGHBOUR_MEAN = np.array([[0, 0.25, 0], [0.25, 0, 0.25], [0, 0.25, 0]], np.float32)


def _refuse_full_mask(mask: np.ndarray) -> None:
    if mask.all():
        raise FastRemoverError(
            "the mask covers every pixel of every frame: the classic remover has nothing to fill from; "
            "use a diffusion model (--model PATH) or a mask that leaves part of the frame visible"
        )


def _grow(mask: np.ndarray, pixels: int) -> np.ndarray:
    """bool [H,W] grown by `pixels` in the 4-connected sense."""
    if pixels <= 0:
        return mask.copy()
    return cv2.dilate(mask.view(np.uint8), _CROSS, iterations=pixels).view(bool)


def _grow_disc(mask: np.ndarray, pixels: int) -> np.ndarray:
    """bool [H,W] grown by a disc of radius `pixels`."""
    if not mask.any():
        return mask.copy()
    return cv2.distanceTransform((~mask).view(np.uint8), cv2.DIST_L2, 3) <= pixels


def _still(homography: np.ndarray, h: int, w: int, tolerance: float = STILL_PX) -> bool:
    """Whether `homography` moves each corner of an [h, w] frame by less than `tolerance` px."""
    xs = np.array([0, w - 1, 0, w - 1], np.float32)
    ys = np.array([0, 0, h - 1, h - 1], np.float32)
    dx, dy = homography_flow(homography, ys, xs)
    return bool(np.hypot(dx, dy).max() < tolerance)


def _box(mask: np.ndarray, pad: int) -> tuple[int, int, int, int]:
    """Bounding box (y0, y1, x0, x1), half-open, of the set pixels of a non-empty bool [H,W], grown by `pad`."""
    ys = np.nonzero(mask.any(axis=1))[0]
    xs = np.nonzero(mask.any(axis=0))[0]
    h, w = mask.shape
    return max(0, ys[0] - pad), min(h, ys[-1] + 1 + pad), max(0, xs[0] - pad), min(w, xs[-1] + 1 + pad)


# ----------------------------------------------------------------------------------------------------------------------
# Harmonic (membrane) interpolation


def _relax(values: np.ndarray, hole: np.ndarray, iterations: int) -> np.ndarray:
    """Jacobi iterations of v <- mean of 4 neighbours on the hole pixels (replicated border: zero normal
    derivative)."""
    hole3 = hole[..., None]
    for _ in range(iterations):
        mean = cv2.filter2D(values, -1, _NEIGHBOUR_MEAN, borderType=cv2.BORDER_REPLICATE).reshape(values.shape)
        values = np.where(hole3, mean, values)
    return values


def _multigrid(values: np.ndarray, hole: np.ndarray, iterations: int, depth: int = 0) -> np.ndarray:
    """One coarse-to-fine solve: the hole's solution on a 2x coarser grid (known pixels averaged with the
    normalised box filter) is the start for the Jacobi steps here: `iterations` on the coarse grids, a third and a
    half of that on the two finest (the coarse grids carry the smooth part of the solution)."""
    h, w = hole.shape
    if min(h, w) >= 4 and hole.sum() > 16:
        ch, cw = (h + 1) // 2, (w + 1) // 2
        weight = (~hole).astype(np.float32)
        num = cv2.resize(values * weight[..., None], (cw, ch), interpolation=cv2.INTER_AREA).reshape(ch, cw, -1)
        den = cv2.resize(weight, (cw, ch), interpolation=cv2.INTER_AREA)
        coarse_hole = den <= 1e-6
        coarse = num / np.maximum(den, 1e-6)[..., None]
        coarse = _multigrid(coarse.astype(np.float32), coarse_hole, iterations, depth + 1)
        start = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_LINEAR).reshape(h, w, -1)
        values = np.where(hole[..., None], start, values)
    else:
        values = values.copy()
        values[hole] = values[~hole].mean(axis=0)
    steps = max(2, iterations // 3) if depth == 0 else iterations // 2 if depth == 1 else iterations
    return _relax(values, hole, steps)


def harmonic_fill(values: np.ndarray, hole: np.ndarray, iterations: int = 12) -> np.ndarray:
    """float32 [H,W,C] with the `hole` (bool [H,W]) pixels replaced by the membrane interpolation of the others.

    Solves ``laplacian(v) = 0`` on the hole with ``v`` fixed elsewhere (zero normal derivative at the frame border),
    approximately, by a coarse-to-fine Jacobi scheme on the hole's bounding box.  Exact for constant boundary values.
    Needs at least one pixel outside the hole.
    """
    values = np.asarray(values, np.float32)
    if values.ndim != 3 or hole.shape != values.shape[:2]:
        raise ValueError(f"values must be [H,W,C] and hole [H,W], got {values.shape} and {hole.shape}")
    if not hole.any():
        return values.copy()
    if hole.all():
        raise ValueError("harmonic_fill needs at least one known pixel")
    y0, y1, x0, x1 = _box(hole, 1)
    sub_hole = hole[y0:y1, x0:x1]
    if sub_hole.all():  # the hole's box touches known pixels only outside itself: solve on the whole frame
        y0, y1, x0, x1 = 0, hole.shape[0], 0, hole.shape[1]
        sub_hole = hole
    out = values.copy()
    out[y0:y1, x0:x1] = _multigrid(np.ascontiguousarray(values[y0:y1, x0:x1]), sub_hole, iterations)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Flow: estimation, completion


def fit_homography(flow: np.ndarray, known: np.ndarray, step: int = 6) -> np.ndarray | None:
    """3x3 homography mapping pixel p to p + flow(p), fitted (RANSAC, 1 px) to the `known` pixels of flow [H,W,2]
    on a grid of `step`; None when there are too few of them or the fit fails."""
    ys, xs = np.mgrid[step // 2 : flow.shape[0] : step, step // 2 : flow.shape[1] : step]
    keep = known[ys, xs]
    if keep.sum() < 12:
        return None
    ys, xs = ys[keep], xs[keep]
    src = np.stack([xs, ys], axis=-1).astype(np.float32)
    dst = src + flow[ys, xs]
    if CAMERA_MODEL == "similarity":
        affine, _ = cv2.estimateAffinePartial2D(src, dst, method=cv2.RANSAC, ransacReprojThreshold=RANSAC_PX)
        homography = None if affine is None else np.vstack([affine, [0.0, 0.0, 1.0]])
    else:
        homography, _ = cv2.findHomography(src, dst, cv2.RANSAC, RANSAC_PX)
    if homography is None or not np.isfinite(homography).all():
        return None
    return homography


def homography_flow(homography: np.ndarray, ys: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Displacement (dx, dy) that `homography` gives the points (xs, ys) (float arrays of one shape)."""
    h = homography
    den = h[2, 0] * xs + h[2, 1] * ys + h[2, 2]
    den = np.where(np.abs(den) < 1e-9, 1e-9, den)
    u = (h[0, 0] * xs + h[0, 1] * ys + h[0, 2]) / den
    v = (h[1, 0] * xs + h[1, 1] * ys + h[1, 2]) / den
    return (u - xs).astype(np.float32), (v - ys).astype(np.float32)


def complete_flow(flow: np.ndarray, hole: np.ndarray, homography: np.ndarray | None = None) -> np.ndarray:
    """flow [H,W,2] with the `hole` pixels replaced: ``homography flow + harmonic fill of (flow - homography flow)``.

    With ``homography=None`` the flow itself is filled harmonically; where the hole's box holds no measured flow,
    the homography's flow alone is used.  Pixels outside the hole are unchanged.
    """
    if not hole.any():
        return flow.copy()
    if homography is None:
        return np.zeros_like(flow) if hole.all() else harmonic_fill(flow, hole)
    y0, y1, x0, x1 = _box(hole, 2)
    ys, xs = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    hx, hy = homography_flow(homography, ys, xs)
    base = np.stack([hx, hy], axis=-1)
    sub_hole = hole[y0:y1, x0:x1]
    if sub_hole.all():  # nothing measured around the hole: the camera's motion alone
        residual = np.zeros_like(base)
    else:
        residual = harmonic_fill(flow[y0:y1, x0:x1] - base, sub_hole)
    out = flow.copy()
    out[y0:y1, x0:x1] = np.where(hole[y0:y1, x0:x1, None], base + residual, flow[y0:y1, x0:x1])
    return out


def sample_points(field: np.ndarray, gy: np.ndarray, gx: np.ndarray) -> np.ndarray:
    """field float32 [h,w,C] (C <= 4) sampled bilinearly at grid positions (gy, gx) (float [N]; outside the grid the
    border value is repeated) -> [N,C].  OpenCV's remap: weights quantised to 1/32 px."""
    n = gy.size
    cols = 256
    rows = max(1, -(-n // cols))
    pad = rows * cols - n
    my = np.pad(gy.astype(np.float32), (0, pad)).reshape(rows, cols)
    mx = np.pad(gx.astype(np.float32), (0, pad)).reshape(rows, cols)
    out = cv2.remap(field, mx, my, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    return out.reshape(rows * cols, -1)[:n]


@dataclass
class FlowField:
    """Flow from frame a to frame b on a box of frame a, stored on a grid `scale` times coarser than the frame.

    ``data[i, j]`` is the displacement (dx, dy) in grid pixels at grid pixel (oy + i, ox + j), whose centre is the
    frame position ``((oy + i + 0.5) * scale - 0.5, (ox + j + 0.5) * scale - 0.5)``.  ``homography`` (grid
    coordinates, a -> b) is the camera's motion fitted to the visible flow, or None.
    """

    data: np.ndarray  # float32 [h, w, 2]
    oy: int = 0
    ox: int = 0
    scale: int = 1
    homography: np.ndarray | None = None

    def _grid(self, ys: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.scale
        return (ys + 0.5) / s - 0.5, (xs + 0.5) / s - 0.5

    def sample(self, ys: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dx, dy) in frame pixels at frame positions (ys, xs) (float arrays [N]); clamped to the stored box."""
        gy, gx = self._grid(ys, xs)
        d = sample_points(self.data, gy - self.oy, gx - self.ox) * self.scale
        return d[:, 0], d[:, 1]

    def camera(self, ys: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(dx, dy) of the homography at frame positions (ys, xs), or None without one."""
        if self.homography is None:
            return None
        gy, gx = self._grid(ys, xs)
        dx, dy = homography_flow(self.homography, gy, gx)
        return dx * self.scale, dy * self.scale


def inconsistent(forward: np.ndarray, backward: np.ndarray, tolerance: float = 0.5) -> np.ndarray:
    """bool [H,W]: pixels p where |forward(p) + backward(p + forward(p))| > tolerance + 5 % of |forward(p)|, or
    whose target p + forward(p) leaves the frame (flows [H,W,2] in grid pixels)."""
    h, w = forward.shape[:2]
    gx, gy = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
    mx, my = gx + forward[..., 0], gy + forward[..., 1]
    back = cv2.remap(backward, mx, my, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    err = np.hypot(forward[..., 0] + back[..., 0], forward[..., 1] + back[..., 1])
    outside = (mx < 0) | (mx > w - 1) | (my < 0) | (my > h - 1)
    return (err > tolerance + 0.05 * np.hypot(forward[..., 0], forward[..., 1])) | outside


def _dis(preset: int) -> cv2.DISOpticalFlow:
    return cv2.DISOpticalFlow_create(preset)


@functools.lru_cache(maxsize=64)
def flow_runs(height: int, width: int, preset: int = cv2.DISOPTICAL_FLOW_PRESET_FAST) -> bool:
    """Whether OpenCV's DIS flow runs on frames of this size (it has a minimum that depends on its version and
    preset, e.g. 8 px on the short side and 12 on the long one): asked of OpenCV itself, on a blank frame."""
    blank = np.zeros((height, width), np.uint8)
    try:
        _dis(preset).calc(blank, blank, None)
    except cv2.error:
        return False
    return True


def flow_scale(height: int, width: int, scale: int = FLOW_SCALE,
               preset: int = cv2.DISOPTICAL_FLOW_PRESET_FAST) -> int | None:
    """The downscale factor the flow runs at for frames of ``height x width``: ``scale``, or 1 where the downscaled
    frames are below DIS's minimum size, or None where even the full-size ones are (no flow: per-frame fill)."""
    for factor in dict.fromkeys((scale, 1)):
        if flow_runs(-(-height // factor), -(-width // factor), preset):
            return factor
    return None


def estimate_flows(
    frames: np.ndarray,
    region: np.ndarray,
    *,
    scale: int = FLOW_SCALE,
    preset: int = cv2.DISOPTICAL_FLOW_PRESET_FAST,
) -> dict[tuple[int, int], FlowField]:
    """Completed flows between neighbouring frames, both directions, for every pair where either frame has `region`
    pixels (bool [F,H,W], the pixels to fill): ``{(a, b): flow a -> b}`` with |a - b| = 1. Frames too small for the
    flow at `scale` get it at full size; frames too small for it at all get none (a warning says so): the remover
    then fills every frame on its own."""
    num, h, w = region.shape
    runs_at = flow_scale(h, w, scale, preset)
    if runs_at is None:
        warnings.warn(f"frames of {w}x{h} are below the optical flow's minimum size: the classic remover fills each "
                      "frame on its own (no motion to follow), which may flicker", stacklevel=2)
        return {}
    scale = runs_at
    gh, gw = -(-h // scale), -(-w // scale)
    grey: dict[int, np.ndarray] = {}
    small: dict[int, np.ndarray] = {}

    def prepare(i: int) -> None:
        if i in grey:
            return
        g = cv2.cvtColor(frames[i], cv2.COLOR_RGB2GRAY)
        m = region[i].view(np.uint8)
        if scale > 1:
            g = cv2.resize(g, (gw, gh), interpolation=cv2.INTER_AREA)
            m = cv2.resize(m, (gw, gh), interpolation=cv2.INTER_AREA)
        grey[i] = g
        small[i] = _grow(m > 0, FLOW_GROW)

    dis = _dis(preset)
    margin = -(-FLOW_MARGIN // scale)
    flows: dict[tuple[int, int], FlowField] = {}
    for t in range(1, num):
        if not (region[t].any() or region[t - 1].any()):
            continue
        prepare(t)
        prepare(t - 1)
        hole = small[t] | small[t - 1]
        y0, y1, x0, x1 = _box(hole, margin)
        raw = {(a, b): dis.calc(grey[a], grey[b], None) for a, b in ((t, t - 1), (t - 1, t))}
        # Completed too, in both directions: pixels of the box whose flow fails the forward-backward check, and
        # those of a band around the region whose flow strays from the camera's motion (the moving object drags
        # the flow of the background next to it; in the band that is more likely than true parallax).
        near = np.zeros_like(hole)
        near[y0:y1, x0:x1] = True
        band = _grow(hole, OUTLIER_BAND) & ~hole
        fill_here = hole | (near & _grow(inconsistent(raw[(t, t - 1)], raw[(t - 1, t)])
                                         | inconsistent(raw[(t - 1, t)], raw[(t, t - 1)]), 1))
        homographies = {}
        far = ~(fill_here | _grow_disc(hole, RESIDUAL_BAND))
        for a, b in ((t, t - 1), (t - 1, t)):
            fit_on = far if far.sum() > 0.05 * far.size else ~fill_here
            homographies[(a, b)] = None if fill_here.all() else fit_homography(raw[(a, b)], fit_on)
            if homographies[(a, b)] is not None:
                bys, bxs = np.nonzero(band)
                hx, hy = homography_flow(homographies[(a, b)], bys.astype(np.float32), bxs.astype(np.float32))
                off = np.hypot(raw[(a, b)][bys, bxs, 0] - hx, raw[(a, b)][bys, bxs, 1] - hy) > OUTLIER_FLOW
                fill_here[bys[off], bxs[off]] = True
        for a, b in ((t, t - 1), (t - 1, t)):
            homography = homographies[(a, b)]
            if fill_here.all():
                done = np.zeros_like(raw[(a, b)])
            elif homography is not None and _still(homography, gh, gw):
                # A still camera: the background behind the mask is still too (what moves is what is removed).
                homography = np.eye(3)
                done = raw[(a, b)].copy()
                done[fill_here] = 0
            else:
                # The residual is interpolated from beyond a wide band: next to the object it is mostly its drag.
                done = complete_flow(raw[(a, b)], fill_here | _grow_disc(hole, RESIDUAL_BAND), homography)
            flows[(a, b)] = FlowField(np.ascontiguousarray(done[y0:y1, x0:x1]), y0, x0, scale, homography)
    return flows


# ----------------------------------------------------------------------------------------------------------------------
# Propagation


@dataclass
class Sources:
    """Where each pixel to fill of one frame takes its colour from: frame index (-1: none), position, confidence."""

    frame: np.ndarray  # int32 [N]
    y: np.ndarray  # float32 [N]
    x: np.ndarray  # float32 [N]
    confidence: np.ndarray  # float32 [N]


def _hop(
    ys: np.ndarray, xs: np.ndarray, there: FlowField, back: FlowField, tolerance: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Landing positions (qy, qx) of the points one frame on, and the hop's confidence.

    Consistent hops (``|f_ab(p) + f_ba(q)| <= tolerance + 5 % of |f_ab|``) get ``exp(-err^2 / 2)``; the others move
    by the camera's homography instead, at confidence 0.25 (or keep the flow at 0.1 when there is no homography)."""
    fx, fy = there.sample(ys, xs)
    qy, qx = ys + fy, xs + fx
    bx, by = back.sample(qy, qx)
    err = np.hypot(fx + bx, fy + by)
    bad = err > tolerance + 0.05 * np.hypot(fx, fy)
    confidence = np.exp(-0.5 * err * err).astype(np.float32)
    if bad.any():
        cam = there.camera(ys[bad], xs[bad])
        if cam is None:
            confidence[bad] = 0.1
        else:
            qx[bad], qy[bad] = xs[bad] + cam[0], ys[bad] + cam[1]
            confidence[bad] = 0.25
    return qy, qx, confidence


def propagation_pass(
    known: np.ndarray,
    region: np.ndarray,
    flows: dict[tuple[int, int], FlowField],
    order: range,
    tolerance: float = 1.0,
    coords: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> list[Sources | None]:
    """One recurrent pass over `order` (frame indices, each step one frame on from the last).

    known: bool [F,H,W], the pixels that are sources; region: bool [F,H,W], the pixels that get a source (may include
    known pixels, e.g. the seam ring).  A region pixel of frame t hops along flow (t -> previous frame of the pass) and
    takes the landing pixel's source: the landing pixel itself if it is known, else the source it was given.  The
    sub-pixel part of the landing position is added to the inherited position (exact for translations).
    Returns per frame the Sources of its region pixels (row-major order), or None for frames without region pixels.
    coords: the region's pixels per frame as np.nonzero gives them, when already at hand.
    """
    num, h, w = known.shape
    out: list[Sources | None] = [None] * num
    # Dense maps of the previous frame of the pass, written only at its region pixels and reset after use: elsewhere
    # a pixel is its own source (frame -2 = "this frame", if it is known) at offset 0 and confidence 1.
    src_frame = np.full((h, w), -2, np.int32)
    src_dy = np.zeros((h, w), np.float32)
    src_dx = np.zeros((h, w), np.float32)
    src_conf = np.ones((h, w), np.float32)
    prev, prev_ys, prev_xs = -1, None, None
    for t in order:
        ys, xs = coords[t] if coords is not None else np.nonzero(region[t])
        src = None
        if ys.size:
            src = Sources(np.full(ys.size, -1, np.int32), np.zeros(ys.size, np.float32),
                          np.zeros(ys.size, np.float32), np.zeros(ys.size, np.float32))
            if prev >= 0 and (t, prev) in flows:
                fy, fx = ys.astype(np.float32), xs.astype(np.float32)
                qy, qx, hop_conf = _hop(fy, fx, flows[(t, prev)], flows[(prev, t)], tolerance)
                ny, nx = np.rint(qy).astype(np.int32), np.rint(qx).astype(np.int32)
                inside = (ny >= 0) & (ny < h) & (nx >= 0) & (nx < w)
                ny, nx = np.clip(ny, 0, h - 1), np.clip(nx, 0, w - 1)
                k = src_frame[ny, nx]
                k = np.where(k == -2, np.where(known[prev, ny, nx], prev, -1), k)
                k = np.where(inside, k, -1)
                ok = k >= 0
                src.frame = k.astype(np.int32)
                src.y = np.where(ok, ny + src_dy[ny, nx] + (qy - ny), 0).astype(np.float32)
                src.x = np.where(ok, nx + src_dx[ny, nx] + (qx - nx), 0).astype(np.float32)
                src.confidence = np.where(ok, src_conf[ny, nx] * hop_conf, 0).astype(np.float32)
            out[t] = src
        if prev_ys is not None:  # back to the defaults
            src_frame[prev_ys, prev_xs] = -2
            src_dy[prev_ys, prev_xs] = 0
            src_dx[prev_ys, prev_xs] = 0
            src_conf[prev_ys, prev_xs] = 1
            prev_ys = prev_xs = None
        if src is not None:
            fill = ~known[t, ys, xs]  # known region pixels (the ring) stay their own source for the next frame
            prev_ys, prev_xs = ys[fill], xs[fill]
            src_frame[prev_ys, prev_xs] = src.frame[fill]
            src_dy[prev_ys, prev_xs] = src.y[fill] - prev_ys
            src_dx[prev_ys, prev_xs] = src.x[fill] - prev_xs
            src_conf[prev_ys, prev_xs] = src.confidence[fill]
        prev = t
    return out


def sample_sources(frames: np.ndarray, known: np.ndarray, src: Sources) -> tuple[np.ndarray, np.ndarray]:
    """Colours (float32 [N,3]) at the sources, bilinear over the known pixels only (weights renormalised), and a
    bool [N] of the sources that gave a colour."""
    num, h, w = known.shape
    valid = src.frame >= 0
    k = np.where(valid, src.frame, 0).astype(np.int64)
    y = np.clip(src.y, 0, h - 1)
    x = np.clip(src.x, 0, w - 1)
    y0 = np.minimum(y.astype(np.int64), h - 2)  # y - y0 reaches 1 on the last row, as bilinear needs
    x0 = np.minimum(x.astype(np.int64), w - 2)
    wy, wx = (y - y0).astype(np.float32), (x - x0).astype(np.float32)
    base = (k * h + y0) * w + x0
    flat = frames.reshape(-1, 3)
    flat_known = known.reshape(-1)
    colour = np.zeros((k.size, 3), np.float32)
    total = np.zeros(k.size, np.float32)
    for offset, weight in ((0, (1 - wy) * (1 - wx)), (1, (1 - wy) * wx), (w, wy * (1 - wx)), (w + 1, wy * wx)):
        index = base + offset
        wgt = weight * np.take(flat_known, index)
        colour += wgt[:, None] * np.take(flat, index, axis=0)
        total += wgt
    ok = valid & (total > 1e-3)
    colour[ok] /= total[ok, None]
    return colour, ok


def _blend(t: int, frames: np.ndarray, known: np.ndarray, forward: Sources | None, backward: Sources | None
           ) -> tuple[np.ndarray, np.ndarray]:
    """Colours [N,3] of one frame's region pixels from the two passes, weighted by confidence / temporal distance,
    and bool [N] of those that got any."""
    acc = None
    weight = None
    for src in (forward, backward):
        if src is None:
            continue
        colour, ok = sample_sources(frames, known, src)
        wgt = np.where(ok, src.confidence / np.maximum(np.abs(src.frame - t), 1), 0).astype(np.float32)
        acc = wgt[:, None] * colour if acc is None else acc + wgt[:, None] * colour
        weight = wgt if weight is None else weight + wgt
    got = weight > 0
    acc[got] /= weight[got, None]
    return acc, got


def propagate(
    frames: np.ndarray,
    known: np.ndarray,
    region: np.ndarray,
    flows: dict[tuple[int, int], FlowField],
    coords: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> tuple[list[np.ndarray | None], list[np.ndarray | None]]:
    """Both passes and their blend: per frame, float32 [N,3] colours of its `region` pixels (row-major) and bool [N]
    of the pixels that got a colour (None for frames without region pixels)."""
    num = len(frames)
    coords = coords if coords is not None else [np.nonzero(r) for r in region]
    forward = propagation_pass(known, region, flows, range(num), coords=coords)
    backward = propagation_pass(known, region, flows, range(num - 1, -1, -1), coords=coords)
    colours: list[np.ndarray | None] = [None] * num
    got: list[np.ndarray | None] = [None] * num
    for t in range(num):
        if forward[t] is not None:
            colours[t], got[t] = _blend(t, frames, known, forward[t], backward[t])
    return colours, got


# ----------------------------------------------------------------------------------------------------------------------
# The remover


def _inpaint(frame: np.ndarray, hole: np.ndarray, radius: int, method: int = cv2.INPAINT_TELEA) -> np.ndarray:
    """OpenCV inpainting (Telea or Navier-Stokes) of one RGB uint8 frame."""
    bgr = cv2.cvtColor(frame, cv2.COLOR_RGB2BGR)
    return cv2.cvtColor(cv2.inpaint(bgr, hole.view(np.uint8) * np.uint8(255), radius, method), cv2.COLOR_BGR2RGB)


def _composite(frame: np.ndarray, ys: np.ndarray, xs: np.ndarray, fill: np.ndarray, where: np.ndarray
               ) -> np.ndarray:
    """uint8 copy of `frame` with the rounded fill (float32 [N,3] at pixels (ys, xs)) where `where` (bool [N])."""
    out = frame.copy()
    out[ys[where], xs[where]] = np.clip(np.rint(fill[where]), 0, 255).astype(np.uint8)
    return out


def _seam_correction(frame: np.ndarray, ys: np.ndarray, xs: np.ndarray, fill: np.ndarray, hole: np.ndarray,
                     boundary: np.ndarray) -> np.ndarray:
    """float32 [N,3] correction of the fill at pixels (ys, xs): ``frame - fill`` on the `boundary` pixels (visible
    ring pixels with a fill), interpolated harmonically over the others (the `hole` pixels and the ring pixels
    without a fill)."""
    if not boundary.any():
        return np.zeros_like(fill)
    y0, x0 = int(ys.min()) - 1, int(xs.min()) - 1
    y0, x0 = max(0, y0), max(0, x0)
    y1, x1 = min(frame.shape[0], int(ys.max()) + 2), min(frame.shape[1], int(xs.max()) + 2)
    ly, lx = ys - y0, xs - x0
    diff = np.zeros((y1 - y0, x1 - x0, 3), np.float32)
    diff[ly[boundary], lx[boundary]] = frame[ys[boundary], xs[boundary]].astype(np.float32) - fill[boundary]
    unknown = np.zeros((y1 - y0, x1 - x0), bool)
    unknown[ly[~boundary], lx[~boundary]] = True
    return harmonic_fill(diff, unknown)[ly, lx]


def classic_remove(
    frames: np.ndarray,
    mask: np.ndarray,
    inpaint_radius: int = 5,
    *,
    seam: bool = True,
    flow_preset: int = cv2.DISOPTICAL_FLOW_PRESET_FAST,
) -> np.ndarray:
    """Fill the masked pixels of `frames` (uint8 [F,H,W,3]) given a bool mask [F,H,W]; unmasked pixels are unchanged.

    Flow-guided propagation with a spatially inpainted key frame for never-visible pixels (OpenCV Telea
    inpainting of radius `inpaint_radius`) and a gradient-domain seam (module docstring).  seam=False leaves out the
    seam correction; flow_preset is the OpenCV DIS preset.
    """
    _refuse_full_mask(mask)
    frames = np.ascontiguousarray(frames)
    mask = np.asarray(mask, bool)
    num, h, w = mask.shape
    out = frames.copy()
    if not mask.any():
        return out
    ring_width = SEAM_RING if seam else 0
    region = np.stack([_grow(m, ring_width) if m.any() else m for m in mask])  # hole + seam ring
    known = ~region  # ring pixels are not sources, so the ring's fill comes from the same places as the hole's
    coords = [np.nonzero(r) for r in region]  # row-major, the order of every per-frame array below
    in_mask = [mask[t][coords[t]] for t in range(num)]
    flows = estimate_flows(frames, region, preset=flow_preset)

    colours, got = propagate(frames, known, region, flows, coords)
    fill = [np.zeros((len(c[0]), 3), np.float32) if col is None else col for c, col in zip(coords, colours)]
    filled = [np.zeros(len(c[0]), bool) if g is None else g.copy() for c, g in zip(coords, got)]

    # Never-visible pixels: inpaint one key frame at a time, let it count as visible, propagate again.
    work = work_known = None
    for _ in range(MAX_KEY_FRAMES):
        missing = [np.nonzero(in_mask[t] & ~filled[t])[0] for t in range(num)]  # ring: just no seam constraint
        counts = [len(m) for m in missing]
        key = int(np.argmax(counts))
        if counts[key] == 0:
            break
        ys, xs = coords[key]
        hole = np.zeros((h, w), bool)
        hole[ys[missing[key]], xs[missing[key]]] = True
        if hole.all():
            break
        composite = _composite(frames[key], ys, xs, fill[key], in_mask[key] & filled[key])
        composite = _inpaint(composite, hole, inpaint_radius, KEY_INPAINT)
        fill[key][missing[key]] = composite[ys[missing[key]], xs[missing[key]]]
        filled[key][missing[key]] = True
        missing[key] = missing[key][:0]
        if work is None:
            work, work_known = frames.copy(), known.copy()
        work[key] = composite
        work_known[key] = True
        todo = np.zeros_like(region)
        todo_coords = []
        for t in range(num):
            ty, tx = coords[t][0][missing[t]], coords[t][1][missing[t]]
            todo[t, ty, tx] = True
            todo_coords.append((ty, tx))
        colours, got = propagate(work, work_known, todo, flows, todo_coords)
        for t in range(num):
            if colours[t] is not None and got[t].any():
                idx = missing[t][got[t]]
                fill[t][idx] = colours[t][got[t]]
                filled[t][idx] = True

    for t in range(num):
        if not in_mask[t].any():
            continue
        ys, xs = coords[t]
        left = in_mask[t] & ~filled[t]
        if left.any():  # chains that reach nothing: inpaint this frame (a last resort, not temporally stable)
            hole = np.zeros((h, w), bool)
            hole[ys[left], xs[left]] = True
            if hole.all():
                fill[t][left] = frames[~mask].mean(axis=0)
            else:
                composite = _composite(frames[t], ys, xs, fill[t], in_mask[t] & filled[t])
                fill[t][left] = _inpaint(composite, hole, inpaint_radius, KEY_INPAINT)[ys[left], xs[left]]
        value = fill[t]
        if seam:
            value = value + _seam_correction(frames[t], ys, xs, value, in_mask[t], ~in_mask[t] & filled[t])
        sel = in_mask[t]
        out[t, ys[sel], xs[sel]] = np.clip(np.rint(value[sel]), 0, 255).astype(np.uint8)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Version 1 (kept for comparisons): nearest visible pixel in time at the same position, then Telea


def nearest_visible_fill(frames: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """frames uint8 [F,H,W,3], mask bool [F,H,W] -> (filled frames, bool [F,H,W] of pixels no frame could fill)."""
    num_frames = frames.shape[0]
    # next_visible[f, y, x]: first g >= f with mask[g, y, x] False, or num_frames if none (one backward scan).
    next_visible = np.empty(mask.shape, dtype=np.int32)
    current = np.full(mask.shape[1:], num_frames, dtype=np.int32)
    for f in range(num_frames - 1, -1, -1):
        current = np.where(mask[f], current, f)
        next_visible[f] = current
    out = frames.copy()
    unfilled = np.zeros_like(mask)
    prev_visible = np.full(mask.shape[1:], -1, dtype=np.int32)  # last g <= f with mask False, forward scan
    for f in range(num_frames):
        prev_visible = np.where(mask[f], prev_visible, f)
        ys, xs = np.nonzero(mask[f])
        if ys.size == 0:
            continue
        prev = prev_visible[ys, xs]
        nxt = next_visible[f, ys, xs]
        has_prev, has_next = prev >= 0, nxt < num_frames
        use_prev = has_prev & (~has_next | (f - prev <= nxt - f))
        src = np.where(use_prev, prev, nxt)
        ok = has_prev | has_next
        out[f, ys[ok], xs[ok]] = frames[src[ok], ys[ok], xs[ok]]
        unfilled[f, ys[~ok], xs[~ok]] = True
    return out, unfilled


def classic_remove_v1(frames: np.ndarray, mask: np.ndarray, inpaint_radius: int = 5) -> np.ndarray:
    """The first classic remover: each masked pixel copied from the temporally nearest frame where the same pixel is
    visible (ties: the earlier frame), the rest inpainted per frame with Telea.  Unmasked pixels are unchanged."""
    _refuse_full_mask(mask)
    out, unfilled = nearest_visible_fill(frames, mask)
    for f in np.nonzero(unfilled.reshape(len(unfilled), -1).any(axis=1))[0]:
        # unfilled[f] is never the whole frame: that would mean mask.all(), refused above.
        out[f] = _inpaint(out[f], unfilled[f], inpaint_radius)
    return out


def telea_remove(frames: np.ndarray, mask: np.ndarray, inpaint_radius: int = 5) -> np.ndarray:
    """Per-frame OpenCV Telea inpainting of the mask (no temporal information; a baseline for the benchmark)."""
    _refuse_full_mask(mask)
    out = frames.copy()
    for f in range(len(frames)):
        if mask[f].any() and not mask[f].all():
            out[f] = _inpaint(frames[f], mask[f], inpaint_radius)
    return out
