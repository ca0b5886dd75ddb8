"""Ground-truth quality benchmark of the removers (`fastremover bench --quality`).

Clips with ground truth are synthesised: a large textured panorama (multi-scale noise, sinusoids, hard-edged shapes,
fine grain) filmed by a virtual camera (pan, drift, zoom, rotation; one clip adds a parallax layer that moves faster
than the background), plus sensor noise; this is the *clean* clip.  Object-removal clips paste a textured, rotating
cut-out over it (the mask is exactly the cut-out); video-completion clips blank a fixed or moving synthetic mask.  Every
remover sees the same input and the same mask dilated by 6 px (as the pipeline does), and its output is compared with
the clean clip inside that dilated mask:

- ``psnr_db``: PSNR over the mask pixels of all frames (``fastremover.bench.metrics.psnr_masked``);
- ``ssim``: mean of the SSIM map over the mask pixels (the window and constants of ``metrics.ssim_per_frame``,
  computed with OpenCV's separable blur: that function gives only frame means and its fp64 depthwise convolution is
  slow on a CPU);
- ``flicker_ratio``: mean frame-to-frame absolute change inside the mask (union of the two frames' masks) over the same
  in the clean clip (1: as lively as the truth; 0: frozen);
- ``temporal_error``: mean ``|(out_t - out_t-1) - (clean_t - clean_t-1)|`` inside the mask (flicker *and* freezing);
- ``fps``: frames per second of the remover alone on this machine.

Methods, side by side: ``classic`` (flow-guided, `fastremover.classic.classic_remove`), ``classic_v1`` (nearest
visible pixel in time + Telea), ``telea`` (per-frame OpenCV inpainting) and ``model`` (the diffusion pipeline, when a
model is given).  Outputs: a JSON of all rows, a table (:func:`format_quality_table`) and a picture strip per clip
(input with the mask outlined | each method | ground truth) as PNG.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import cv2
import numpy as np
import torch

from fastremover.bench.metrics import psnr_masked
from fastremover.classic import classic_remove, classic_remove_v1, telea_remove
from fastremover.masks import dilate_masks

DILATE = 6  # the pipeline's default mask dilation
NOISE_SIGMA = 1.5  # sensor noise of the clean clips (uint8 levels)
CLIPS = ("pan", "zoom_rotate", "parallax", "follow", "static", "static_fixed_mask", "pan_moving_mask")


@dataclass
class QualityClip:
    """One benchmark clip: `frames` (uint8 [F,H,W,3], the input), `mask` (bool [F,H,W], undilated), `clean` (the
    ground truth, uint8 [F,H,W,3]); `camera` is "moving" or "static", `kind` "object" or "completion"."""

    name: str
    camera: str
    kind: str
    frames: np.ndarray
    mask: np.ndarray
    clean: np.ndarray


# ----------------------------------------------------------------------------------------------------------------------
# Synthetic footage


def _noise(h: int, w: int, cell: int, rng: np.random.Generator, channels: int = 3) -> np.ndarray:
    """Smooth noise of feature size `cell` px (bicubic upsampling of a coarse normal grid), float32 [h,w,C]."""
    coarse = rng.standard_normal((max(2, h // cell + 2), max(2, w // cell + 2), channels)).astype(np.float32)
    big = cv2.resize(coarse, ((w // cell + 2) * cell, (h // cell + 2) * cell), interpolation=cv2.INTER_CUBIC)
    return big.reshape(big.shape[0], big.shape[1], channels)[:h, :w]


def panorama(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A textured uint8 [h,w,3] image: multi-scale colour noise, sinusoidal bands, hard-edged shapes, grain."""
    img = rng.uniform(70, 180, size=3).astype(np.float32) + np.zeros((h, w, 3), np.float32)
    for cell, amp in ((120, 45), (32, 25), (8, 12), (3, 6)):
        img += amp * _noise(h, w, cell, rng)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img += 18 * np.sin(0.05 * xx + 0.03 * yy + rng.uniform(0, 6))[..., None] * rng.uniform(-1, 1, 3)
    canvas = np.clip(img, 0, 255).astype(np.uint8)
    for _ in range(max(8, h * w // 6000)):
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        size = int(rng.integers(6, 40))
        shape = rng.integers(0, 3)
        if shape == 0:
            cv2.rectangle(canvas, (x, y), (x + size, y + int(size * rng.uniform(0.3, 2))), colour, -1, cv2.LINE_AA)
        elif shape == 1:
            cv2.circle(canvas, (x, y), size // 2, colour, -1, cv2.LINE_AA)
        else:
            cv2.line(canvas, (x, y), (x + int(rng.integers(-60, 60)), y + int(rng.integers(-60, 60))), colour,
                     int(rng.integers(1, 4)), cv2.LINE_AA)
    return canvas


def _camera(pano: np.ndarray, h: int, w: int, x: float, y: float, zoom: float = 1.0, angle_deg: float = 0.0,
            border: int = cv2.BORDER_REFLECT) -> np.ndarray:
    """The [h,w] view of `pano` whose top-left is at pano (x, y), zoomed in by `zoom` and rotated by `angle_deg`
    about the view's centre."""
    a = math.radians(angle_deg)
    c, s = math.cos(a) / zoom, math.sin(a) / zoom
    cx, cy = (w - 1) / 2, (h - 1) / 2
    # pano = R/zoom (frame - centre) + centre + (x, y)
    m = np.array([[c, -s, x + cx - c * cx + s * cy], [s, c, y + cy - s * cx - c * cy]], np.float64)
    return cv2.warpAffine(pano, m, (w, h), flags=cv2.INTER_CUBIC | cv2.WARP_INVERSE_MAP, borderMode=border)


def _sprite(radius: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A textured star-shaped cut-out: (uint8 [S,S,3] texture, bool [S,S] shape), S = 2.6 radius."""
    size = int(2.6 * radius) | 1
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) - size // 2
    theta, r = np.arctan2(yy, xx), np.hypot(xx, yy)
    p1, p2 = rng.uniform(0, 2 * np.pi, 2)
    edge = radius * (1 + 0.18 * np.sin(3 * theta + p1) + 0.1 * np.sin(5 * theta + p2))
    shape = r <= edge
    colour = rng.uniform(0, 255, 3).astype(np.float32)
    tex = colour + 50 * _noise(size, size, 10, rng) + 60 * (np.sin(xx * 0.25 + yy * 0.1) > 0)[..., None]
    return np.clip(tex, 0, 255).astype(np.uint8), shape


def _paste(frame: np.ndarray, tex: np.ndarray, shape: np.ndarray, cx: float, cy: float, angle_deg: float
           ) -> tuple[np.ndarray, np.ndarray]:
    """`frame` with the sprite centred at (cx, cy), rotated; returns (frame, bool mask of the sprite)."""
    h, w = frame.shape[:2]
    size = shape.shape[0]
    m = cv2.getRotationMatrix2D(((size - 1) / 2, (size - 1) / 2), angle_deg, 1.0)
    m[:, 2] += (cx - (size - 1) / 2, cy - (size - 1) / 2)
    mask = cv2.warpAffine(shape.view(np.uint8), m, (w, h), flags=cv2.INTER_NEAREST) > 0
    obj = cv2.warpAffine(tex, m, (w, h), flags=cv2.INTER_LINEAR)
    out = frame.copy()
    out[mask] = obj[mask]
    return out, mask


def _blob_mask(h: int, w: int, cx: float, cy: float, radius: float, phase: float) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    theta = np.arctan2(yy - cy, xx - cx)
    return np.hypot(xx - cx, yy - cy) <= radius * (1 + 0.15 * np.sin(4 * theta + phase))


def make_clip(name: str, num_frames: int = 40, height: int = 480, width: int = 854, seed: int = 0) -> QualityClip:
    """One of CLIPS, deterministic in (name, size, seed).  The object / mask covers about 8 % of the frame (about
    10 % once dilated); the moving cameras travel 60-120 px over the clip whatever its length."""
    if name not in CLIPS:
        raise ValueError(f"unknown clip {name!r}; choose from {CLIPS}")
    rng = np.random.default_rng([seed, CLIPS.index(name)])
    f, h, w = num_frames, height, width
    t = np.linspace(0.0, 1.0, f)
    margin = 140 * max(h, w) // 854 + 8
    pano = panorama(h + 2 * margin, w + 2 * margin, rng)
    radius = math.sqrt(0.08 * h * w / math.pi)
    # camera path (pano coordinates of the view's top-left), zoom and angle per frame
    cam_x = np.full(f, float(margin))
    cam_y = np.full(f, float(margin))
    zoom = np.ones(f)
    angle = np.zeros(f)
    travel = 0.14 * w  # about 120 px at 854
    if name in ("pan", "pan_moving_mask"):
        cam_x += travel * t - travel / 2
        cam_y += 0.25 * travel * t - travel / 8
    elif name == "zoom_rotate":
        zoom = 1.0 + 0.12 * t
        angle = 4.0 * t
        cam_x += 0.4 * travel * t
    elif name == "parallax":
        cam_x += 0.6 * travel * t - 0.3 * travel
    elif name == "follow":
        cam_x += 0.5 * travel * t - travel / 4  # 60 px at 854: the drift of the real clip
        cam_y += 0.1 * travel * np.sin(2 * np.pi * t)
    moving = name not in ("static", "static_fixed_mask")
    clean = np.stack([_camera(pano, h, w, cam_x[i], cam_y[i], zoom[i], angle[i]) for i in range(f)])
    if name == "parallax":  # a nearer layer of posts and boards that moves 2.2x faster than the background
        layer = panorama(h + 2 * margin, w + 4 * margin, rng)
        alpha = np.zeros(layer.shape[:2], np.uint8)
        for x in range(int(rng.integers(20, 60)), alpha.shape[1], int(w * 0.18)):
            cv2.rectangle(alpha, (x, 0), (x + int(rng.integers(12, 30)), alpha.shape[0]), 255, -1)
            y = int(rng.integers(0, alpha.shape[0] - 60))
            cv2.rectangle(alpha, (x - 40, y), (x + 70, y + 40), 255, -1)
        for i in range(f):
            dx = margin + 2.2 * (cam_x[i] - margin)
            view = _camera(layer, h, w, dx, cam_y[i])
            a = _camera(alpha[..., None].repeat(3, -1), h, w, dx, cam_y[i], border=cv2.BORDER_CONSTANT)
            a = a.astype(np.float32) / 255
            clean[i] = np.clip(view * a + clean[i] * (1 - a), 0, 255).astype(np.uint8)
    noise = rng.normal(0, NOISE_SIGMA, clean.shape).astype(np.float32)
    clean = np.clip(clean + noise, 0, 255).astype(np.uint8)

    frames = clean.copy()
    mask = np.zeros((f, h, w), bool)
    if name in ("static_fixed_mask", "pan_moving_mask"):  # video completion: blank a synthetic mask
        phase = rng.uniform(0, 6)
        for i in range(f):
            if name == "static_fixed_mask":
                cx, cy = 0.55 * w, 0.5 * h
            else:
                cx, cy = (0.25 + 0.5 * t[i]) * w, (0.5 + 0.15 * np.sin(2 * np.pi * t[i])) * h
            mask[i] = _blob_mask(h, w, cx, cy, radius, phase)
            frames[i][mask[i]] = (128, 128, 128)
    else:  # object removal: a textured cut-out over the clean clip
        tex, shape = _sprite(radius, rng)
        for i in range(f):
            if name == "follow":  # the camera follows the object: it stays near the frame's centre
                cx, cy = 0.5 * w + 4 * np.sin(5 * t[i]), 0.5 * h + 3 * np.cos(4 * t[i])
            else:
                cx = (0.2 + 0.6 * t[i]) * w
                cy = (0.5 + 0.12 * np.sin(2 * np.pi * t[i])) * h
            frames[i], mask[i] = _paste(clean[i], tex, shape, cx, cy, 25 * t[i])
    return QualityClip(name, "moving" if moving else "static",
                       "completion" if name in ("static_fixed_mask", "pan_moving_mask") else "object",
                       frames, mask, clean)


# ----------------------------------------------------------------------------------------------------------------------
# Metrics


def _signed(x: np.ndarray) -> torch.Tensor:
    """uint8 [F,H,W,3] -> float [1,3,F,H,W] in [-1,1] (the layout of fastremover.bench.metrics)."""
    return torch.from_numpy(x).permute(3, 0, 1, 2)[None].double() / 127.5 - 1


def _change(x: np.ndarray, mask: np.ndarray) -> float:
    """Mean absolute frame-to-frame change of x (uint8 [F,H,W,3]) over the pixels in mask[t] | mask[t-1]."""
    total, count = 0.0, 0
    for t in range(1, len(x)):
        m = mask[t] | mask[t - 1]
        if m.any():
            d = np.abs(x[t][m].astype(np.float32) - x[t - 1][m].astype(np.float32))
            total += float(d.sum())
            count += d.size
    return total / count if count else float("nan")


def _temporal_error(out: np.ndarray, clean: np.ndarray, mask: np.ndarray) -> float:
    total, count = 0.0, 0
    for t in range(1, len(out)):
        m = mask[t] | mask[t - 1]
        if m.any():
            d_out = out[t][m].astype(np.float32) - out[t - 1][m].astype(np.float32)
            d_clean = clean[t][m].astype(np.float32) - clean[t - 1][m].astype(np.float32)
            total += float(np.abs(d_out - d_clean).sum())
            count += d_out.size
    return total / count if count else float("nan")


def ssim_map(a: np.ndarray, b: np.ndarray, sigma: float = 1.5, window: int = 11) -> np.ndarray:
    """Per-pixel SSIM, float64 [H,W], of two uint8 [H,W,3] images (mean over channels): the Gaussian-window SSIM of
    ``fastremover.bench.metrics.ssim_per_frame`` (same window and constants; its mean over the pixels whose window
    lies inside the frame is that function's value), with reflected borders so every pixel has a value."""
    x, y = a.astype(np.float64) / 255, b.astype(np.float64) / 255

    def blur(t: np.ndarray) -> np.ndarray:
        return cv2.GaussianBlur(t, (window, window), sigma, borderType=cv2.BORDER_REFLECT)

    c1, c2 = 0.01**2, 0.03**2
    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y, cov = blur(x * x) - mu_x**2, blur(y * y) - mu_y**2, blur(x * y) - mu_x * mu_y
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return s.mean(axis=-1)


def _ssim_in_mask(out: np.ndarray, clean: np.ndarray, mask: np.ndarray, pad: int = 8) -> float:
    """Mean SSIM over the mask pixels of all frames (each frame's map computed on the box around its mask)."""
    total, count = 0.0, 0
    h, w = mask.shape[1:]
    for t in range(len(out)):
        if not mask[t].any():
            continue
        ys, xs = np.nonzero(mask[t].any(axis=1))[0], np.nonzero(mask[t].any(axis=0))[0]
        y0, y1 = max(0, ys[0] - pad), min(h, ys[-1] + 1 + pad)
        x0, x1 = max(0, xs[0] - pad), min(w, xs[-1] + 1 + pad)
        s = ssim_map(out[t, y0:y1, x0:x1], clean[t, y0:y1, x0:x1])[mask[t, y0:y1, x0:x1]]
        total += float(s.sum())
        count += s.size
    return total / count if count else float("nan")


def _psnr_in_mask(out: np.ndarray, clean: np.ndarray, mask: np.ndarray) -> float:
    """metrics.psnr_masked on the box around the mask of all frames (the same value, less memory)."""
    if not mask.any():
        return float("nan")
    union = mask.any(axis=0)
    ys, xs = np.nonzero(union.any(axis=1))[0], np.nonzero(union.any(axis=0))[0]
    box = (slice(None), slice(ys[0], ys[-1] + 1), slice(xs[0], xs[-1] + 1))
    return psnr_masked(_signed(out[box]), _signed(clean[box]), torch.from_numpy(np.ascontiguousarray(mask[box])))


def quality_metrics(out: np.ndarray, clean: np.ndarray, mask: np.ndarray) -> dict:
    """PSNR / SSIM / flicker ratio / temporal error of `out` against `clean` inside `mask` (the dilated mask)."""
    clean_change = _change(clean, mask)
    return {
        "psnr_db": _psnr_in_mask(out, clean, mask),
        "ssim": _ssim_in_mask(out, clean, mask),
        "flicker": _change(out, mask),
        "flicker_clean": clean_change,
        "flicker_ratio": _change(out, mask) / clean_change if clean_change > 0 else float("nan"),
        "temporal_error": _temporal_error(out, clean, mask),
    }


# ----------------------------------------------------------------------------------------------------------------------
# Runner


Method = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (frames, undilated mask) -> output frames


def _classic_method(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Method:
    def run(frames: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return fn(frames, dilate_masks(mask, DILATE))
    return run


def default_methods() -> dict[str, Method]:
    """The weightless methods compared: name -> (frames, undilated mask) -> output."""
    return {"classic": _classic_method(classic_remove), "classic_v1": _classic_method(classic_remove_v1),
            "telea": _classic_method(telea_remove)}


def model_method(model: str, config=None) -> Method:
    """The diffusion pipeline (checkpoint dir or "random") as a benchmark method, default run options (dilation 6);
    `config`: its EngineConfig (None: the defaults with the environment's overrides)."""
    from fastremover.pipeline import RemovalPipeline, RunOptions

    pipe = RemovalPipeline.from_model(model, config=config)

    def run(frames: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return pipe.remove(frames, mask, RunOptions(dilate=DILATE)).frames
    return run


def _label(panel: np.ndarray, text: str) -> np.ndarray:
    out = panel.copy()
    cv2.rectangle(out, (0, 0), (min(out.shape[1], 12 + 9 * len(text)), 20), (0, 0, 0), -1)
    cv2.putText(out, text, (5, 15), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (255, 255, 255), 1, cv2.LINE_AA)
    return out


def picture_strip(frames: np.ndarray, mask: np.ndarray, outputs: dict[str, np.ndarray], clean: np.ndarray | None,
                  frame: int | None = None, crop: tuple[int, int] = (288, 400)) -> np.ndarray:
    """uint8 [h, n*w, 3]: one frame (default the middle one), cropped to `crop` (h, w) around its mask: the input with
    the mask outlined in red | each output | the ground truth (when given)."""
    f = len(frames) // 2 if frame is None else frame
    h, w = mask.shape[1:]
    ch, cw = min(crop[0], h), min(crop[1], w)
    ys, xs = np.nonzero(mask[f])
    cy, cx = (int(ys.mean()), int(xs.mean())) if ys.size else (h // 2, w // 2)
    y0, x0 = int(np.clip(cy - ch // 2, 0, h - ch)), int(np.clip(cx - cw // 2, 0, w - cw))

    def cut(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x[f, y0 : y0 + ch, x0 : x0 + cw])

    edge = mask[f].view(np.uint8) - cv2.erode(mask[f].view(np.uint8), np.ones((3, 3), np.uint8))
    shown = frames.copy()
    shown[f][edge > 0] = (255, 0, 0)
    panels = [_label(cut(shown), "input + mask")]
    panels += [_label(cut(o), name) for name, o in outputs.items()]
    if clean is not None:
        panels.append(_label(cut(clean), "ground truth"))
    return np.concatenate(panels, axis=1)


def _write_png(path: Path, rgb: np.ndarray) -> None:
    cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, 9])


def run_quality(
    out_dir: str | os.PathLike | None = "bench/results",
    model: str | None = None,
    *,
    clips: tuple[str, ...] = CLIPS,
    num_frames: int = 40,
    height: int = 480,
    width: int = 854,
    seed: int = 0,
    methods: dict[str, Method] | None = None,
    demo: bool = True,
) -> dict:
    """Run every method on every clip; returns ``{"environment", "settings", "rows", "files"}``.

    One row per (clip, method): the metrics of :func:`quality_metrics` plus ``fps``.  With `out_dir`, writes
    ``quality-<date>-<commit>.json`` and one ``quality-<clip>-<date>-<commit>.png`` strip per clip (plus one of the
    demo clip, ``media.synthetic_clip``, without ground truth, when `demo`).  `model` adds the diffusion pipeline.
    """
    from fastremover import media
    from fastremover.bench.harness import environment

    methods = dict(methods or default_methods())
    if model is not None:
        methods["model"] = model_method(model)
    env = environment()
    stamp = f"{_dt.date.today().isoformat()}-{env['commit'][:7]}"
    out_path = Path(out_dir) if out_dir is not None else None
    if out_path is not None:
        out_path.mkdir(parents=True, exist_ok=True)
    rows, files = [], []
    for name in clips:
        clip = make_clip(name, num_frames, height, width, seed)
        dilated = dilate_masks(clip.mask, DILATE)
        outputs = {}
        for method, run in methods.items():
            start = time.perf_counter()
            out = run(clip.frames, clip.mask)
            seconds = time.perf_counter() - start
            outputs[method] = out
            rows.append({"clip": name, "camera": clip.camera, "kind": clip.kind, "method": method,
                         "mask_fraction": float(dilated.mean()), **quality_metrics(out, clip.clean, dilated),
                         "fps": len(out) / seconds})
        if out_path is not None:
            png = out_path / f"quality-{name}-{stamp}.png"
            _write_png(png, picture_strip(clip.frames, clip.mask, outputs, clip.clean))
            files.append(str(png))
    if demo and out_path is not None:
        video, mask = media.synthetic_clip(num_frames, height, width, seed=0)
        outputs = {m: run(video.frames, mask) for m, run in methods.items()}
        png = out_path / f"quality-demo-{stamp}.png"
        _write_png(png, picture_strip(video.frames, mask, outputs, None))
        files.append(str(png))
    result = {"environment": {**env, "cpu_count": os.cpu_count()},
              "settings": {"clips": list(clips), "num_frames": num_frames, "height": height, "width": width,
                           "seed": seed, "dilate": DILATE, "noise_sigma": NOISE_SIGMA, "methods": list(methods)},
              "rows": rows, "files": files}
    if out_path is not None:
        path = out_path / f"quality-{stamp}.json"
        files.append(str(path))
        path.write_text(json.dumps(result, indent=1, default=float))
    return result


def format_quality_table(result: dict) -> str:
    """The rows of :func:`run_quality` as a Markdown table, one line per (clip, method)."""
    lines = ["| clip | camera | method | PSNR dB | SSIM | flicker ratio | temporal err | fps |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['clip']} | {r['camera']} | {r['method']} | {r['psnr_db']:.2f} | {r['ssim']:.3f} | "
                     f"{r['flicker_ratio']:.2f} | {r['temporal_error']:.2f} | {r['fps']:.1f} |")
    return "\n".join(lines)
