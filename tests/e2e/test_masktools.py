"""Masks from boxes: weightless tracking + GrabCut on synthetic clips with known masks, the CLI, and SAM2's plumbing.

The clips have a textured background that pans, and a textured blob object that moves (translation), grows
(scale change) or passes behind a textured bar (partial occlusion); the true mask of every frame is known.
``python tests/e2e/test_masktools.py [H W F]`` prints the per-clip IoU and the speed at that size (default 480 854 48).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from fastremover import media
from fastremover.errors import FastRemoverError
from fastremover.masktools import Box, build_mask, format_frames, parse_box
from fastremover.masktools.cli import add_box_args, add_mask_parser, box_mask_file, mask_from_args

KINDS = ("translation", "scale", "occlusion", "stretch")


# ---------------------------------------------------------------------------------------------------------------
# Synthetic clips with known masks
# ---------------------------------------------------------------------------------------------------------------


def _texture(rng: np.random.Generator, h: int, w: int, base, spread: float, cells=(24, 6)) -> np.ndarray:
    """Smooth colour noise at two scales around ``base``: ``uint8 [h, w, 3]``."""
    tex = np.zeros((h, w, 3), np.float32)
    for cell, weight in zip(cells, (1.0, 0.5), strict=True):
        noise = rng.standard_normal((max(2, h // cell), max(2, w // cell), 3)).astype(np.float32)
        tex += weight * cv2.resize(noise, (w, h), interpolation=cv2.INTER_CUBIC)
    return np.clip(np.asarray(base, np.float32) + spread * tex, 0, 255).astype(np.uint8)


def object_clip(kind: str, num_frames: int = 24, height: int = 136, width: int = 240, seed: int = 0,
                objects: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(frames uint8 [F, H, W, 3], true masks bool [objects, F, H, W])`` for one of ``KINDS``.

    The object is a blob (an ellipse with a wavy outline) with its own texture, drawn with a hard edge at a
    sub-pixel position; ``scale`` grows it by 70 % over the clip; ``occlusion`` slides a textured bar (a third of
    the object's width) across it in the opposite direction, and the true mask excludes the bar; ``stretch``
    deforms it (width x1.3 while height x0.75, and back: not a similarity, so the tracker's model does not fit).
    A second object (``objects=2``) moves the other way in the lower part of the frame.
    """
    rng = np.random.default_rng(seed)
    pan = 2
    bg = _texture(rng, height + 8, width + pan * num_frames + 8, rng.uniform(90, 160, 3), 35)
    r = 0.16 * min(height, width) * (0.8 if kind == "scale" else 1.0) * (0.7 if objects > 1 else 1.0)
    size = int(np.ceil(2.6 * r))
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) - (size - 1) / 2
    radius = r * (1 + 0.12 * np.sin(3 * np.arctan2(yy, xx) + 1.0))
    shape = (np.hypot(xx / 1.25, yy) <= radius).astype(np.float32)
    looks = [_texture(rng, size, size, colour, 45, cells=(8, 3)) for colour in ((200, 70, 60), (60, 90, 210))]
    bar = _texture(rng, height, int(0.5 * r) + 2, (70, 140, 90), 30, cells=(6, 3))
    frames = np.empty((num_frames, height, width, 3), np.uint8)
    masks = np.zeros((objects, num_frames, height, width), bool)
    for i in range(num_frames):
        t = i / max(1, num_frames - 1)
        frame = bg[4:4 + height, 4 + i * pan:4 + i * pan + width].copy()
        s = 1.0 + (0.7 * t if kind == "scale" else 0.0)
        sx, sy = (s, s)
        if kind == "stretch":
            sx, sy = 1 + 0.3 * np.sin(2 * np.pi * t), 1 - 0.25 * np.sin(2 * np.pi * t)
        for n in range(objects):
            cx = width * ((0.3 + 0.4 * t) if n == 0 else (0.75 - 0.4 * t))
            cy = height * ((0.5 if objects == 1 else 0.3) + 0.12 * np.sin(2 * np.pi * t)) if n == 0 else height * 0.72
            warp = np.array([[sx, 0, cx - sx * (size - 1) / 2], [0, sy, cy - sy * (size - 1) / 2]], np.float32)
            colour = cv2.warpAffine(looks[n], warp, (width, height), flags=cv2.INTER_LINEAR)
            alpha = cv2.warpAffine(shape, warp, (width, height), flags=cv2.INTER_LINEAR) >= 0.5
            frame[alpha] = colour[alpha]
            masks[:, i] &= ~alpha  # a later object hides an earlier one
            masks[n, i] = alpha
        if kind == "occlusion":
            x0 = int(round(width * (0.75 - 0.5 * t)))
            lo, hi = max(0, x0), min(width, x0 + bar.shape[1])
            if hi > lo:
                frame[:, lo:hi] = bar[:, : hi - lo]
                masks[:, i, :, lo:hi] = False
        frames[i] = frame
    return frames, masks


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-frame intersection over union of ``bool [F, H, W]`` masks (1 where both are empty)."""
    inter = np.logical_and(a, b).sum(axis=(1, 2))
    union = np.logical_or(a, b).sum(axis=(1, 2))
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def box_of(mask: np.ndarray, pad: int = 4) -> Box:
    """A user's box around one ``[H, W]`` mask: its bounds grown by ``pad`` pixels (clipped to the frame)."""
    ys, xs = np.nonzero(mask)
    h, w = mask.shape
    x0, y0 = max(0, xs.min() - pad), max(0, ys.min() - pad)
    x1, y1 = min(w, xs.max() + 1 + pad), min(h, ys.max() + 1 + pad)
    return Box(int(x0), int(y0), int(x1 - x0), int(y1 - y0))


def key_frame(kind: str, num_frames: int) -> int:
    """Occlusion starts from frame 0 (the bar comes later); the others mid-clip (tracked both ways)."""
    return 0 if kind == "occlusion" else num_frames // 2


# ---------------------------------------------------------------------------------------------------------------
# Weightless path
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_weightless_masks_match_the_true_masks(kind):
    frames, truth = object_clip(kind)
    key = key_frame(kind, len(frames))
    calls = []
    result = build_mask(frames, [box_of(truth[0, key])], key, progress=lambda *a: calls.append(a))
    scores = iou(result.mask, truth[0])
    print(f"{kind}: mean IoU {scores.mean():.3f}, worst frame {scores.min():.3f}")
    assert result.mask.shape == truth.shape[1:] and result.mask.dtype == bool
    assert scores.mean() >= 0.9 and scores.min() >= 0.7, np.round(scores, 3)
    assert result.uncertain_frames == [] and result.confidence[key] == 1.0
    assert result.confidence.shape == (len(frames),) and result.boxes.shape == (1, len(frames), 4)
    assert calls[-1] == ("mask", len(frames), len(frames)) and len(calls) == len(frames)
    summary = result.summary()
    assert summary["frames"] == len(frames) and summary["uncertain_frames"] == [] and len(summary["boxes"][0]) == 24
    drawn = box_of(truth[0, key])
    assert summary["boxes"][0][key] == [drawn.x, drawn.y, drawn.w, drawn.h]


def test_two_boxes_are_two_objects_and_the_result_is_deterministic():
    frames, truth = object_clip("translation", num_frames=12, objects=2)
    boxes = [box_of(truth[0, 6]), str(box_of(truth[1, 6]))]  # a Box and an "X,Y,W,H" string
    first = build_mask(frames, boxes, 6)
    cv2.setRNGSeed(1234)  # OpenCV's thread RNG (GrabCut's k-means) in another state must not matter
    second = build_mask(frames, boxes, 6)
    assert np.array_equal(first.mask, second.mask) and np.array_equal(first.confidence, second.confidence)
    assert first.object_confidence.shape == (2, 12) and first.boxes.shape == (2, 12, 4)
    assert iou(first.mask, truth.any(axis=0)).mean() >= 0.9
    # each tracked box stays on its own object
    for n in range(2):
        centres = (first.boxes[n, :, :2] + first.boxes[n, :, 2:]) / 2
        ys, xs = np.nonzero(truth[n, -1])
        assert abs(centres[-1, 0] - xs.mean()) < 6 and abs(centres[-1, 1] - ys.mean()) < 6


def test_a_lost_object_is_reported_with_its_frames():
    frames, truth = object_clip("translation", num_frames=16, seed=0)
    other, _ = object_clip("translation", num_frames=16, seed=5)
    frames[11:] = other[11:]  # a cut: from frame 11 on the object is gone
    result = build_mask(frames, [box_of(truth[0, 3])], 3)
    assert result.uncertain_frames == list(range(11, 16)), np.round(result.confidence, 2)
    assert result.confidence[:11].min() > 0.8
    args = _box_parser().parse_args(["--box", str(box_of(truth[0, 3])), "--frame", "3"])
    with pytest.raises(FastRemoverError, match=r"lost on frames 11-15;.*--allow-uncertain"):
        mask_from_args(args, frames)
    args.allow_uncertain = True
    assert mask_from_args(args, frames).shape == truth.shape[1:]
    # with several objects the message says which one was lost
    args = _box_parser().parse_args(["--box", str(box_of(truth[0, 3])), "--box", "0,0,40,30", "--frame", "3"])
    with pytest.raises(FastRemoverError, match=r"lost on frames 11-15 \(object 1\);"):
        mask_from_args(args, frames)


def test_an_object_leaving_the_frame_is_not_a_lost_object():
    frames, truth = object_clip("translation", num_frames=24)
    frames, truth = np.ascontiguousarray(frames[:, :, :100]), truth[0][:, :, :100]  # it leaves by the right edge
    assert truth[:8].all(axis=0).any() and not truth[-8:].any()
    result = build_mask(frames, [box_of(truth[0])], 0)
    assert result.uncertain_frames == [], np.round(result.confidence, 2)
    assert iou(result.mask, truth).mean() >= 0.9 and not result.mask[-8:].any()


def test_bad_boxes_and_frames_are_clear_errors():
    frames = np.zeros((4, 40, 60, 3), np.uint8)
    cases = [
        (lambda: parse_box("10,10,20"), "not X,Y,W,H"),
        (lambda: parse_box("a,b,c,d"), "not X,Y,W,H"),
        (lambda: build_mask(frames, [Box(50, 10, 20, 10)], 0), "outside the 60x40 frame"),
        (lambda: build_mask(frames, [Box(-1, 0, 5, 5)], 0), "outside the 60x40 frame"),
        (lambda: build_mask(frames, [Box(5, 5, 0, 10)], 0), "zero or negative size"),
        (lambda: build_mask(frames, ["5,5,10,10", Box(5, 5, 10, -3)], 0), "box 2 5,5,10,-3 has zero"),
        (lambda: build_mask(frames, [Box(5, 5, 10, 10)], 4), "--frame 4 is out of range: the clip has 4 frames"),
        (lambda: build_mask(frames, [], 0), "at least one --box"),
    ]
    for i, (fn, words) in enumerate(cases):
        with pytest.raises(FastRemoverError) as info:
            fn()
        assert words in str(info.value), f"case {i}: {info.value}"
        assert "\n" not in str(info.value)
    assert parse_box(" 1, 2,3 ,4 ") == Box(1, 2, 3, 4) and str(Box(1, 2, 3, 4)) == "1,2,3,4"
    assert format_frames([9, 3, 4, 5, 12, 13]) == "3-5, 9, 12-13"


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def _box_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_box_args(parser)
    parser.add_argument("--quiet", action="store_true", default=True)
    return parser


def test_mask_command_writes_the_mask_and_a_preview(tmp_path, capsys):
    frames, truth = object_clip("scale", num_frames=10)
    src = tmp_path / "in.mp4"
    media.write_video(src, frames, 12)
    parser = argparse.ArgumentParser()
    add_mask_parser(parser.add_subparsers(dest="command"))
    out, preview = tmp_path / "mask.mp4", tmp_path / "preview.mp4"
    args = parser.parse_args(["mask", str(src), "--box", str(box_of(truth[0, 5])), "--frame", "5", "-o", str(out),
                              "--preview", str(preview), "--quiet"])
    assert args.func(args) == 0
    assert "wrote" in capsys.readouterr().out
    written = media.read_mask(out)
    assert written.shape == truth.shape[1:]
    assert iou(written, truth[0]).mean() >= 0.85  # through H.264 twice (input and mask)
    shown = media.read_video(preview)
    assert shown.frames.shape == frames.shape and shown.fps == 12
    # the overlay tints masked pixels red: on the object the red channel dominates the source's more than outside
    gain = shown.frames[..., 0].astype(int) - shown.frames[..., 1].astype(int)
    assert gain[written].mean() > gain[~written].mean() + 40

    args = parser.parse_args(["mask", str(src), "-o", str(out)])
    with pytest.raises(FastRemoverError, match="at least one --box"):
        args.func(args)
    args = parser.parse_args(["mask", str(src), "--box", "0,0,10,10", "--frame", "10", "-o", str(out)])
    with pytest.raises(FastRemoverError, match="--frame 10 is out of range: the clip has 10 frames"):
        args.func(args)


def test_box_options_for_remove_and_demo(tmp_path):
    frames, truth = object_clip("translation", num_frames=6)
    parser = _box_parser()
    assert mask_from_args(parser.parse_args([]), frames) is None
    mask = mask_from_args(parser.parse_args(["--box", str(box_of(truth[0, 0]))]), media.Video(frames, 24))
    assert mask.shape == truth.shape[1:] and iou(mask, truth[0]).mean() >= 0.9
    # remove --box: the mask goes to the removal job as a lossless PNG frame folder
    src = tmp_path / "in.mp4"
    media.write_video(src, frames, 24)
    args = parser.parse_args(["--box", str(box_of(truth[0, 0]))])
    args.video, args.output, args.mask = str(src), str(tmp_path / "out.mp4"), None
    folder = box_mask_file(args, tmp_path)
    assert np.array_equal(media.read_mask(folder), mask_from_args(args, media.read_video(src)))
    args.mask = "mask.mp4"
    with pytest.raises(FastRemoverError, match="either --mask MASK or --box"):
        box_mask_file(args, tmp_path)
    with pytest.raises(FastRemoverError, match="--point needs --sam2"):
        mask_from_args(parser.parse_args(["--box", "1,1,5,5", "--point", "3,3"]), frames)
    with pytest.raises(FastRemoverError, match="--sam2 needs at least one --box"):
        mask_from_args(parser.parse_args(["--sam2", "somewhere"]), frames)


# ---------------------------------------------------------------------------------------------------------------
# SAM2
# ---------------------------------------------------------------------------------------------------------------


def test_sam2_folder_errors_need_no_package(tmp_path):
    from fastremover.masktools.sam2 import find_checkpoint, parse_point

    with pytest.raises(FastRemoverError, match="no such folder"):
        find_checkpoint(tmp_path / "missing")
    with pytest.raises(FastRemoverError, match=r"no checkpoint \(\*.pt\)"):
        find_checkpoint(tmp_path)
    (tmp_path / "a.pt").write_bytes(b"x")
    (tmp_path / "b.pt").write_bytes(b"x")
    with pytest.raises(FastRemoverError, match="several checkpoints"):
        find_checkpoint(tmp_path)
    (tmp_path / "b.pt").unlink()
    with pytest.raises(FastRemoverError, match="not an official release name"):
        find_checkpoint(tmp_path)
    (tmp_path / "model.yaml").write_text("model: {}\n")
    assert find_checkpoint(tmp_path).config.name == "model.yaml"
    assert parse_point("3,4").label == 1 and parse_point("3,4,0").label == 0
    with pytest.raises(FastRemoverError, match="not X,Y or X,Y,LABEL"):
        parse_point("3,4,2")


def _tiny_sam2_folder(folder: Path) -> Path:
    """A randomly initialised SAM2 video model small enough for a CPU test: the package's hiera-t config with every
    width and depth cut down, saved as config .yaml + checkpoint .pt the way ``--sam2`` expects them."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    sam2 = pytest.importorskip("sam2", reason="the sam2 package is not installed")
    cfg = OmegaConf.load(Path(sam2.__file__).parent / "configs/sam2.1/sam2.1_hiera_t.yaml")
    m = cfg.model
    m.image_size, m.num_maskmem = 128, 3
    trunk = m.image_encoder.trunk
    trunk.embed_dim, trunk.stages, trunk.global_att_blocks, trunk.window_spec = 16, [1, 1, 2, 1], [3], [4, 4, 4, 2]
    m.image_encoder.neck.backbone_channel_list = [128, 64, 32, 16]
    m.image_encoder.neck.d_model = m.image_encoder.neck.position_encoding.num_pos_feats = 32
    layer = m.memory_attention.layer
    m.memory_attention.d_model = layer.d_model = 32
    m.memory_attention.num_layers, layer.dim_feedforward = 1, 64
    for attention in (layer.self_attention, layer.cross_attention):
        attention.embedding_dim, attention.feat_sizes = 32, [8, 8]
    layer.cross_attention.kv_in_dim = 16
    enc = m.memory_encoder
    enc.out_dim = enc.position_encoding.num_pos_feats = 16
    enc.in_dim = enc.mask_downsampler.embed_dim = enc.fuser.layer.dim = 32
    enc.fuser.num_layers = 1
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, folder / "tiny.yaml")
    torch.manual_seed(0)
    model = instantiate(cfg.model, _recursive_=True)
    torch.save({"model": model.state_dict()}, folder / "tiny.pt")
    return folder


def test_sam2_path_with_a_tiny_random_model(tmp_path):
    pytest.importorskip("sam2", reason="the sam2 package is not installed (pip install -e '.[sam2]')")
    import torch

    from fastremover.masktools.cli import mask_result_from_args
    from fastremover.masktools.sam2 import load_video_predictor

    folder = _tiny_sam2_folder(tmp_path / "sam2")
    frames, truth = object_clip("translation", num_frames=4, height=64, width=96)
    # the remove/demo options: --sam2 DIR with a box (one object) and a click (a second object), keyed on frame 1
    args = _box_parser().parse_args(["--box", str(box_of(truth[0, 1])), "--point", "10,10", "--frame", "1",
                                     "--sam2", str(folder), "--allow-uncertain"])
    args.device = "cpu"
    result = mask_result_from_args(args, frames)
    # random weights: the masks mean nothing; shapes, frame count and bookkeeping must be right
    assert result.mask.shape == (4, 64, 96) and result.mask.dtype == bool
    assert result.object_confidence.shape == (2, 4) and result.boxes.shape == (2, 4, 4)
    assert set(result.uncertain_frames) == set(np.flatnonzero(result.confidence < 0.5).tolist())

    # a checkpoint that does not fit its config is a clear error
    state = torch.load(folder / "tiny.pt", weights_only=True)
    state["model"].pop(next(iter(state["model"])))
    torch.save(state, folder / "tiny.pt")
    with pytest.raises(FastRemoverError, match="does not fit tiny.yaml: 1 missing"):
        load_video_predictor(folder, "cpu")
    (folder / "tiny.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(FastRemoverError, match="cannot read the SAM2 checkpoint"):
        load_video_predictor(folder, "cpu")


# ---------------------------------------------------------------------------------------------------------------
# Measurement (not a test): python tests/e2e/test_masktools.py [H W F]
# ---------------------------------------------------------------------------------------------------------------


def _measure(height: int, width: int, num_frames: int) -> None:
    for kind in KINDS:
        frames, truth = object_clip(kind, num_frames, height, width)
        key = key_frame(kind, num_frames)
        start, cpu = time.perf_counter(), time.process_time()
        result = build_mask(frames, [box_of(truth[0, key])], key)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        scores = iou(result.mask, truth[0])
        print(f"{kind:12s} {width}x{height} x{num_frames}: IoU mean {scores.mean():.3f} worst {scores.min():.3f} "
              f"lowest confidence {result.confidence.min():.2f} | {num_frames / wall:.1f} fps wall, "
              f"{num_frames / cpu:.1f} fps per CPU-second")


if __name__ == "__main__":
    _measure(*(int(v) for v in sys.argv[1:4])) if len(sys.argv) > 3 else _measure(480, 854, 48)
