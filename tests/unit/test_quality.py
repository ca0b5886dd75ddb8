"""The ground-truth quality benchmark (fastremover.bench.quality): clips, metrics, runner and its files."""

import json

import numpy as np
import pytest

from fastremover.bench import quality as Q
from fastremover.masks import dilate_masks


def test_clips_are_deterministic_and_have_ground_truth():
    for name in ("pan", "static", "static_fixed_mask"):
        a, b = Q.make_clip(name, 6, 72, 128, seed=1), Q.make_clip(name, 6, 72, 128, seed=1)
        assert np.array_equal(a.frames, b.frames) and np.array_equal(a.mask, b.mask)
        assert a.frames.shape == a.clean.shape == (6, 72, 128, 3) and a.mask.shape == (6, 72, 128)
        assert np.array_equal(a.frames[~a.mask], a.clean[~a.mask])  # only the masked pixels differ from the truth
        assert 0.05 < a.mask.mean() < 0.12
        assert (np.abs(a.frames[a.mask].astype(int) - a.clean[a.mask]).mean()) > 10  # the object hides the truth
    pan, static = Q.make_clip("pan", 6, 72, 128), Q.make_clip("static", 6, 72, 128)
    assert pan.camera == "moving" and static.camera == "static"
    # the static camera's clean frames differ by sensor noise only; the panning camera's by real motion
    still = np.abs(static.clean[1].astype(int) - static.clean[0]).mean()
    moved = np.abs(pan.clean[-1].astype(int) - pan.clean[0]).mean()
    assert still < 3 < moved
    fixed = Q.make_clip("static_fixed_mask", 6, 72, 128)
    assert all(np.array_equal(fixed.mask[t], fixed.mask[0]) for t in range(6)) and fixed.kind == "completion"
    with pytest.raises(ValueError, match="unknown clip"):
        Q.make_clip("nope")


def test_metrics_on_the_truth_a_frozen_fill_and_noise():
    clip = Q.make_clip("pan", 8, 72, 128)
    mask = dilate_masks(clip.mask, Q.DILATE)
    truth = Q.quality_metrics(clip.clean, clip.clean, mask)
    assert truth["psnr_db"] == float("inf") and truth["temporal_error"] == 0
    assert truth["flicker_ratio"] == pytest.approx(1.0) and truth["ssim"] == pytest.approx(1.0)
    fixed = np.broadcast_to(mask[4], mask.shape)
    frozen = clip.clean.copy()
    frozen[fixed] = np.broadcast_to(clip.clean[0], frozen.shape)[fixed]  # the camera's move ignored, as v1 does
    m = Q.quality_metrics(frozen, clip.clean, fixed)
    assert m["flicker_ratio"] == 0 and m["temporal_error"] > 5 and m["psnr_db"] < 30
    rng = np.random.default_rng(0)
    noisy = np.clip(clip.clean + rng.normal(0, 10, clip.clean.shape), 0, 255).astype(np.uint8)
    n = Q.quality_metrics(noisy, clip.clean, mask)
    assert 26 < n["psnr_db"] < 30 and n["flicker_ratio"] > 1.2 and n["ssim"] < 0.95


def test_run_quality_writes_json_strips_and_a_table(tmp_path):
    result = Q.run_quality(tmp_path, clips=("pan", "static"), num_frames=10, height=80, width=144)
    rows = {(r["clip"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(c, m) for c in ("pan", "static") for m in ("classic", "classic_v1", "telea")}
    for r in rows.values():
        assert np.isfinite(r["psnr_db"]) and r["fps"] > 0 and 0 < r["mask_fraction"] < 0.2
    # the flow-guided remover on a moving camera against the old one, and no worse on a still camera
    assert rows[("pan", "classic")]["psnr_db"] > rows[("pan", "classic_v1")]["psnr_db"] + 3
    assert rows[("static", "classic")]["psnr_db"] > rows[("static", "classic_v1")]["psnr_db"] - 0.5
    saved = json.loads(next(tmp_path.glob("quality-2*.json")).read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    strips = sorted(p.name.split("-")[1] for p in tmp_path.glob("quality-*.png"))
    assert strips == ["demo", "pan", "static"]
    table = Q.format_quality_table(result)
    assert table.count("\n") == 1 + len(result["rows"]) and "| pan | moving | classic |" in table


def test_ssim_map_matches_the_metrics_module():
    from fastremover.bench.metrics import ssim_per_frame

    clip = Q.make_clip("pan", 2, 64, 96)
    a, b = clip.frames[0], clip.clean[1]
    reference = float(ssim_per_frame(Q._signed(a[None]), Q._signed(b[None]))[0])
    assert Q.ssim_map(a, b)[5:-5, 5:-5].mean() == pytest.approx(reference, abs=1e-6)
    assert np.allclose(Q.ssim_map(a, a), 1.0)


def test_picture_strip_has_one_panel_per_method_plus_input_and_truth():
    clip = Q.make_clip("static", 4, 72, 128)
    outs = {"a": clip.clean, "b": clip.frames}
    strip = Q.picture_strip(clip.frames, clip.mask, outs, clip.clean, crop=(60, 100))
    assert strip.shape == (60, 4 * 100, 3) and strip.dtype == np.uint8
    assert Q.picture_strip(clip.frames, clip.mask, outs, None, crop=(60, 100)).shape == (60, 300, 3)
