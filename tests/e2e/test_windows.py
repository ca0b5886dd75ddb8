"""Long clips in overlapping windows, the seam metric, and the mask-bbox crop mode (CPU, tiny preset, fp32)."""

import json

import numpy as np
import pytest
import torch

from fastremover import media
from fastremover.bench.harness import BenchInputs, compare
from fastremover.cli import main
from fastremover.config import EngineConfig
from fastremover.errors import FastRemoverError
from fastremover.masks import composite, dilate_masks, feather_alpha
from fastremover.models.loading import random_models
from fastremover.pipeline import RemovalPipeline, RunOptions, crop_feather
from fastremover.windows import (
    Window,
    choose_crop,
    crop_box,
    crossfade_weights,
    default_overlap,
    expand_box,
    plan_windows,
    seam_metric,
    seam_transitions,
    snap_box,
    usable_window_length,
    validate_windows,
)

CPU32 = EngineConfig(device="cpu", precision="fp32")

# ----------------------------------------------------------------------------------------------------------------------
# Window planning (pure)


def check_plan(num_frames: int, window: int, overlap: int) -> list[Window]:
    windows = plan_windows(num_frames, window, overlap)
    covered = np.zeros(num_frames, int)
    for w in windows:
        covered[w.start : w.stop] += 1
    assert covered.min() >= 1, "every frame is in some window"
    assert windows[0].start == 0 and windows[0].overlap == 0 and windows[-1].stop == num_frames
    if num_frames <= window:
        assert windows == [Window(0, num_frames, 0)]
        return windows
    usable = usable_window_length(window)
    for prev, w in zip(windows, windows[1:]):
        assert prev.start < w.start <= prev.stop, "windows advance, with no gap"
        assert w.overlap == prev.stop - w.start >= overlap
        assert (w.length - 1) % 4 == 0 and w.length <= usable, "4k+1 frames, never longer than the window"
    for w in windows[1:-1]:  # all but the last (which ends at the last frame) share exactly `overlap` frames
        assert w.overlap == overlap and w.length == usable
    assert windows[0].length == usable
    return windows


def test_plan_windows_exhaustive_small():
    for window in (5, 8, 9, 13, 21, 33):
        for overlap in range(0, usable_window_length(window)):
            for num_frames in range(1, 120):
                check_plan(num_frames, window, overlap)


@pytest.mark.parametrize("num_frames", [81, 82, 145, 146, 400, 4001, 10_000])
def test_plan_windows_default_sizes(num_frames):
    windows = check_plan(num_frames, 81, 17)
    if num_frames > 81:
        # stride 64 until the last window, which is only as long as the remaining frames plus the overlap need
        assert [w.start for w in windows[:-1]] == list(range(0, 64 * (len(windows) - 1), 64))


def test_default_overlap():
    assert [default_overlap(w) for w in (5, 9, 13, 21, 33, 81, 161)] == [1, 1, 5, 5, 9, 17, 33]
    assert plan_windows(200, 81) == plan_windows(200, 81, 17)


def test_plan_windows_examples():
    assert plan_windows(400, 81, 17) == [
        Window(0, 81, 0), Window(64, 145, 17), Window(128, 209, 17), Window(192, 273, 17), Window(256, 337, 17),
        Window(319, 400, 18),
    ]
    # One frame more than a window: the last window is short (21 = the smallest 4k+1 holding 17 + 1 frames).
    assert plan_windows(82, 81, 17) == [Window(0, 81, 0), Window(61, 82, 20)]
    # A window that is not 4k+1 is used as the largest 4k+1 below it (the VAE encodes 1 + 4k frames).
    assert plan_windows(30, 12, 3) == [Window(0, 9, 0), Window(6, 15, 3), Window(12, 21, 3), Window(18, 27, 3),
                                       Window(21, 30, 6)]
    assert plan_windows(12, 12, 3) == [Window(0, 12, 0)]  # not longer than the window: one window, as before
    assert plan_windows(20, 5, 0) == [Window(0, 5), Window(5, 10), Window(10, 15), Window(15, 20)]


def test_window_validation_messages():
    for window, overlap, needle in [(4, 0, "--window 4"), (0, 0, "at least 5"), (9, 9, "--overlap 9"),
                                    (9, -1, "--overlap -1"), (8, 5, "used as 5")]:
        with pytest.raises(FastRemoverError, match=needle):
            validate_windows(window, overlap)
        with pytest.raises(FastRemoverError):
            RunOptions(window=window, overlap=overlap).validate()
    with pytest.raises(FastRemoverError, match="--crop"):
        RunOptions(crop="maybe").validate()
    with pytest.raises(FastRemoverError, match="--size"):
        RunOptions(crop="on", size="64x64").validate()
    RunOptions(crop="auto", size="64x64").validate()  # auto just means the whole frame with an explicit size


def test_crossfade_weights_and_seam_transitions():
    w = crossfade_weights(3)
    assert np.allclose(w, [0.25, 0.5, 0.75]) and crossfade_weights(0).size == 0
    windows = [Window(0, 9, 0), Window(6, 15, 3), Window(12, 20, 3)]
    # steps 5..8 (into frame 6 .. out of frame 8) and 11..14
    assert seam_transitions(windows, 20).tolist() == [5, 6, 7, 8, 11, 12, 13, 14]
    assert seam_transitions([Window(0, 5), Window(5, 10)], 10).tolist() == [4]  # a hard cut: one step
    assert seam_transitions([Window(0, 10)], 10).size == 0


def test_seam_metric_sees_a_jump_and_not_smooth_motion():
    rng = np.random.default_rng(0)
    num_frames, windows = 24, [Window(0, 13, 0), Window(12, 24, 1)]
    mask = np.zeros((num_frames, 16, 16), bool)
    mask[:, 4:12, 4:12] = True
    # Smooth: the masked content drifts by the same amount every frame -> ratio 1.
    ramp = (np.arange(num_frames)[:, None, None, None] * 3 + 40 + np.zeros((1, 16, 16, 3))).astype(np.uint8)
    smooth = seam_metric(ramp, mask, windows)
    assert smooth["seam_ratio"] == pytest.approx(1.0)
    assert smooth["seam_inside"] == pytest.approx(3.0)
    # A jump at the boundary (new content from frame 12 on) -> large ratio; outside the mask it does not count.
    jump = ramp.copy()
    jump[12:, 4:12, 4:12] += 60
    jump[:, :4] = rng.integers(0, 255, (num_frames, 4, 16, 3))
    assert seam_metric(jump, mask, windows)["seam_ratio"] > 5
    assert seam_metric(ramp, mask, [Window(0, 24)])["seam_ratio"] is None  # one window: nothing to measure


# ----------------------------------------------------------------------------------------------------------------------
# Crop boxes (pure)


def test_expand_box_margin_and_clip():
    # 25 % of the side, at least 32 px.
    assert expand_box((100, 140, 200, 400), (1000, 1000)) == (68, 172, 150, 450)
    assert expand_box((100, 500, 100, 110), (1000, 1000)) == (0, 600, 68, 142)
    assert expand_box((5, 20, 990, 999), (1000, 1000)) == (0, 52, 958, 1000)  # clipped to the frame
    assert expand_box((10, 20, 10, 20), (100, 100), margin_fraction=0.5, min_margin=2) == (5, 25, 5, 25)


def test_snap_box_properties():
    rng = np.random.default_rng(1)
    for _ in range(3000):
        height, width = (int(v) for v in rng.integers(8, 1200, size=2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height + 1, size=2))
        x0, x1 = sorted(int(v) for v in rng.integers(0, width + 1, size=2))
        y1, x1 = max(y1, y0 + 1), max(x1, x0 + 1)
        if y1 > height or x1 > width:
            continue
        min_side = int(rng.choice([16, 64, 256]))
        b = snap_box((y0, y1, x0, x1), (height, width), min_side=min_side)
        assert 0 <= b[0] <= y0 and y1 <= b[1] <= height and 0 <= b[2] <= x0 and x1 <= b[3] <= width, "contains, inside"
        for lo, hi, size in ((b[0], b[1], height), (b[2], b[3], width)):
            if (lo, hi) != (0, size):  # a partial axis: a multiple of 16, at least the minimum side
                assert (hi - lo) % 16 == 0 and hi - lo >= min_side
            if size <= min_side:
                assert (lo, hi) == (0, size), "frames smaller than the minimum are used whole"


def test_snap_box_examples():
    assert snap_box((100, 140, 200, 260), (720, 1280)) == (0, 256, 102, 358)  # min side 256, centred, shifted in
    assert snap_box((300, 701, 10, 20), (720, 1280)) == (292, 708, 0, 256)  # 401 -> 416, centred; x shifted in
    assert snap_box((10, 20, 10, 20), (200, 300)) == (0, 200, 0, 256)  # height 200 <= 256: whole axis
    assert snap_box((0, 300, 0, 20), (300, 400)) == (0, 300, 0, 256)  # snapped side would reach the frame: whole


def test_crop_box_union_and_choice():
    mask = np.zeros((3, 480, 864), bool)
    mask[0, 100:120, 100:130] = True
    mask[2, 200:230, 300:320] = True  # union box (100, 230, 100, 320)
    # 130x220 box; margins max(32, 25 %) = 33 and 55 px -> 196x330 -> snapped to 256x336, centred
    assert crop_box(mask) == (37, 293, 42, 378)
    assert choose_crop(mask, "auto") == (37, 293, 42, 378)  # 256*336 / (480*864) ~ 21 % of the frame
    assert choose_crop(mask, "off") is None
    big = np.zeros((2, 480, 864), bool)
    big[:, 100:380, 150:650] = True
    assert choose_crop(big, "on") == (24, 456, 24, 776)  # 432x752 ...
    assert choose_crop(big, "auto") is None  # ... is 78 % of the frame: auto runs on the whole frame
    big[:, 40:400, 50:700] = True
    assert choose_crop(big, "on") is None  # the crop would be the whole frame
    full = np.zeros((1, 100, 100), bool)
    full[0, 40:50, 40:50] = True
    assert choose_crop(full, "on") is None  # frame smaller than the minimum side: the whole frame, nothing to crop
    assert choose_crop(np.zeros((2, 300, 300), bool), "on") is None


# ----------------------------------------------------------------------------------------------------------------------
# Long clips end to end


@pytest.fixture(scope="module")
def long_clip():
    video, mask = media.synthetic_clip(400, 64, 96, seed=0)
    return video.frames, mask


@pytest.fixture(scope="module")
def tiny_pipe():
    return RemovalPipeline(random_models("tiny", seed=0), EngineConfig(device="cpu", precision="fp32"))


def seams_of(result) -> dict:
    windows = [Window(w.start, w.stop, w.overlap) for w in result.windows]
    return seam_metric(result.frames, result.mask, windows)


@pytest.mark.parametrize("backend", ["tiny", "classic"])
def test_400_frames_in_windows(long_clip, tiny_pipe, backend):
    frames, mask = long_clip
    pipe = tiny_pipe if backend == "tiny" else RemovalPipeline(None, EngineConfig(device="cpu"))
    calls = []
    result = pipe.remove(frames, mask, RunOptions(steps=2), progress=lambda *a: calls.append(a))
    assert result.frames.shape == frames.shape and result.frames.dtype == np.uint8
    outside = ~result.mask
    assert np.array_equal(result.frames[outside], frames[outside])
    assert not np.array_equal(result.frames[result.mask], frames[result.mask])
    assert [(w.start, w.stop, w.overlap) for w in result.windows] == [
        (w.start, w.stop, w.overlap) for w in plan_windows(400, 81, 17)]
    assert all(w.ran and w.box is None for w in result.windows)  # 64x96 is below the crop's minimum side
    assert [c for c in calls if c[0] == "window"] == [("window", i, 6) for i in range(7)]
    if backend == "tiny":
        assert result.ran_model and all(w.run_hw == (64, 96) for w in result.windows)
        assert sum(c[0] == "denoise" for c in calls) == 6 * 2
        assert result.latents is None  # no one latent tensor describes the whole clip
    seams = seams_of(result)
    print(f"{backend} seams: {seams}")
    assert seams["seam_ratio"] <= 1.5, seams


def test_classic_without_conditioning_shows_seams(long_clip, monkeypatch):
    """The check can fail: windows that share no frame (so nothing to continue from) leave a visible jump. Shown with
    the first classic remover (nearest visible pixel): the flow-guided one fills this clip so consistently that
    independent windows hardly differ (seam ratio about 1.5)."""
    from fastremover import classic

    monkeypatch.setattr(classic, "classic_remove", classic.classic_remove_v1)  # the pipeline imports it at the call
    frames, mask = long_clip
    result = RemovalPipeline(None, EngineConfig(device="cpu")).remove(frames, mask, RunOptions(overlap=0))
    assert seams_of(result)["seam_ratio"] > 3


def test_windows_continue_from_the_previous_output(tiny_pipe, monkeypatch):
    """A window's shared frames enter as known content (the previous output, mask cleared); the outputs are then
    cross-faded linearly over the shared frames."""
    video, mask = media.synthetic_clip(17, 32, 48, seed=2)
    calls = []  # (frames in, mask in, frames out) of every window
    fill = tiny_pipe._fill_window

    def spy(frames, window_mask, box, size, options, timer, progress, sink, **kwargs):
        # the frames and mask the model sees (copied first: the window's output is written into `frames` as the
        # filled chunks reach `sink`), and every filled chunk
        frames_in, mask_in, parts = frames.copy(), window_mask.copy(), []

        def recording_sink(start, part):
            parts.append(part.copy())
            sink(start, part)

        filled = fill(frames, window_mask, box, size, options, timer, progress, recording_sink, **kwargs)
        calls.append((frames_in, mask_in, np.concatenate(parts)))
        return filled

    monkeypatch.setattr(tiny_pipe, "_fill_window", spy)
    result = tiny_pipe.remove(video.frames, mask, RunOptions(steps=1, window=9, overlap=4, dilate=2))
    assert [(w.start, w.stop, w.overlap) for w in result.windows] == [(0, 9, 0), (5, 14, 4), (8, 17, 6)]
    dilated = result.mask
    first = composite(video.frames[:9], calls[0][2], dilated[:9])  # window 1's output
    frames_in, mask_in, filled = calls[1]
    assert np.array_equal(frames_in[:4], first[5:9]) and not mask_in[:4].any(), "conditioned on window 1's output"
    assert np.array_equal(frames_in[4:], video.frames[9:14]) and np.array_equal(mask_in[4:], dilated[9:14])
    second = composite(video.frames[5:14], filled, dilated[5:14])
    weights = np.array([0.2, 0.4, 0.6, 0.8], np.float32)[:, None, None, None]
    old = first[5:9].astype(np.float32)
    blended = np.rint(old + weights * (second[:4].astype(np.float32) - old)).astype(np.uint8)
    assert np.array_equal(result.frames[5:8], blended[:3])  # frame 8 is blended again by window 3
    assert np.array_equal(result.frames[~dilated], video.frames[~dilated])


def test_single_window_is_the_single_pass_path(tiny_pipe):
    """One window without a crop is exactly prepare -> encode -> denoise -> decode -> finish -> composite."""
    video, mask = media.synthetic_clip(9, 40, 56, seed=5)
    dilated = dilate_masks(mask, 3)
    prep = tiny_pipe.prepare(video.frames, dilated, None)
    latents = tiny_pipe.denoise(*tiny_pipe.encode(prep), steps=2, seed=9)
    expected = composite(video.frames, tiny_pipe.finish(tiny_pipe.decode(latents), prep), dilated)
    result = tiny_pipe.remove(video.frames, mask, RunOptions(steps=2, seed=9, dilate=3, crop="off"))
    assert np.array_equal(result.frames, expected) and torch.equal(result.latents, latents)


# ----------------------------------------------------------------------------------------------------------------------
# Crop mode end to end


def moving_dot_clip(num_frames: int = 21, height: int = 160, width: int = 640, jump_at: int = 13):
    """Textured frames with a small square that sits at the left, then jumps to the right at `jump_at`."""
    video, _ = media.synthetic_clip(num_frames, height, width, seed=4)
    frames = video.frames.copy()
    mask = np.zeros(frames.shape[:3], bool)
    mask[:jump_at, 70:86, 40:60] = True
    mask[jump_at:, 60:76, 560:580] = True
    frames[mask] = (255, 0, 255)  # the "object": pixels outside the mask never carry its colour
    return frames, mask


def transformer_input_shapes(pipe, fn):
    shapes = []
    handle = pipe.models.transformer.register_forward_pre_hook(lambda _m, args: shapes.append(tuple(args[0].shape)))
    try:
        return fn(), shapes
    finally:
        handle.remove()


def test_crop_runs_the_model_on_the_box_and_keeps_outside_pixels(tiny_pipe):
    frames, mask = moving_dot_clip()
    options = RunOptions(steps=1, window=13, overlap=4, dilate=3)
    result, shapes = transformer_input_shapes(tiny_pipe, lambda: tiny_pipe.remove(frames, mask, options))
    # the object jumps at frame 13, where window 2's new frames begin
    assert [(w.start, w.stop, w.overlap) for w in result.windows] == [(0, 13, 0), (8, 21, 5)]
    boxes = [w.box for w in result.windows]
    # The height (160) is below the minimum side: whole; the width is cut to 256 around each window's mask.
    assert boxes[0] == (0, 160, 0, 256) and boxes[1] == (0, 160, 384, 640)
    assert boxes[0] != boxes[1], "each window chooses its own box"
    assert all(w.run_hw == (160, 256) for w in result.windows)
    assert {s[-2:] for s in shapes} == {(160 // 8, 256 // 8)}, "the transformer saw the crop's latents"
    outside = ~result.mask
    assert np.array_equal(result.frames[outside], frames[outside])
    assert not (result.frames[result.mask] == (255, 0, 255)).all(axis=-1).all()
    # Crop off: the same request on the whole frame.
    off = tiny_pipe.remove(frames, mask, RunOptions(steps=1, window=13, overlap=4, dilate=3, crop="off"))
    assert all(w.box is None and w.run_hw == (160, 640) for w in off.windows)
    assert np.array_equal(off.frames[outside], frames[outside])


def test_crop_auto_small_vs_big_object_and_classic():
    frames, mask = moving_dot_clip()
    classic = RemovalPipeline(None, EngineConfig(device="cpu"))
    small = classic.remove(frames, mask, RunOptions(window=13, overlap=4, crop="auto"))
    assert all(w.box is not None for w in small.windows)
    assert np.array_equal(small.frames[~small.mask], frames[~small.mask])
    assert not (small.frames[small.mask] == (255, 0, 255)).all(axis=-1).any()
    big_mask = np.zeros_like(mask)
    big_mask[:, 20:140, 150:450] = True  # crop 464 of 640 columns: 72 % of the frame
    big = classic.remove(frames, big_mask, RunOptions(window=13, overlap=4, crop="auto"))
    assert all(w.box is None for w in big.windows), "a big object runs on the whole frame"
    forced = classic.remove(frames, big_mask, RunOptions(window=13, overlap=4, crop="on"))
    assert all(w.box is not None for w in forced.windows)
    assert np.array_equal(forced.frames[~forced.mask], frames[~forced.mask])


# ----------------------------------------------------------------------------------------------------------------------
# CLI and bench


def test_crop_feather_never_blends_the_object_back_in():
    rng = np.random.default_rng(3)
    assert [crop_feather(d) for d in (0, 1, 2, 4, 6, 8)] == [0, 0, 1, 2, 3, 4]
    for dilate in range(0, 10):
        obj = np.zeros((1, 48, 48), bool)
        for _ in range(3):
            y, x, r = rng.integers(10, 38), rng.integers(10, 38), rng.integers(1, 8)
            obj[0, y - r : y + r, x - r // 2 : x + r] = True
        obj[0, 20, 5:30] = True  # thin line and diagonal-ish corners
        alpha = feather_alpha(dilate_masks(obj, dilate)[0], crop_feather(dilate))
        assert (alpha[obj[0]] == 1).all(), dilate


def test_cli_long_clip_and_window_errors(tmp_path, capsys):
    video, mask = media.synthetic_clip(45, 48, 64, seed=3)
    media.write_video(tmp_path / "in.mp4", video.frames, 24)
    media.write_video(tmp_path / "m.mp4", np.repeat(mask[..., None].astype(np.uint8) * 255, 3, -1), 24)
    out = tmp_path / "out.mp4"
    args = ["remove", str(tmp_path / "in.mp4"), "--mask", str(tmp_path / "m.mp4"), "-o", str(out)]
    # progress bars on (not --quiet): the denoise bar restarts in every window
    code = main([*args, "--model", "random", "--preset", "tiny", "--steps", "1", "--window", "17", "--overlap", "5"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "windows: 4 windows" in captured.out
    assert media.read_video(out).num_frames == 45
    for flags, needle in [(["--window", "3"], "--window 3"), (["--overlap", "81"], "--overlap 81"),
                          (["--crop", "on", "--size", "64x48"], "--crop on")]:
        assert main([*args, *flags]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and needle in err


def test_bench_reports_seams_and_crop_speedup(tmp_path):
    video, mask = media.synthetic_clip(17, 32, 48, seed=1)
    inputs = BenchInputs("tiny-long", video.frames, mask, 24.0)
    (r,) = compare(random_models("tiny", seed=3), inputs, CPU32, modes=["eager"], steps=2, repeats=0,
                   count_flops=False, window=9, overlap=4, crop="on")
    # fidelity is still one window, full frame: equal to the reference
    assert r["fidelity_run"] == {"windows": 1, "crop": "off"} and r["psnr_mean_db"] >= 60
    assert r["windows"] == 3 and r["seam_ratio"] is not None and r["seam_boundary"] > 0 and r["seam_inside"] > 0
    assert r["crop_setting"] == "on" and r["crop_off_total_s"] > 0 and r["crop_total_s"] > 0
    assert r["crop_speedup"] == pytest.approx(r["crop_off_total_s"] / r["crop_total_s"], rel=1e-3)
    assert "not measured" in r["crop_fidelity"]
    json.dumps(r)  # serializable as it is saved


def test_bench_and_verify_flags(tmp_path, capsys):
    video, mask = media.synthetic_clip(13, 40, 56, seed=2)
    media.write_video(tmp_path / "v.mp4", video.frames, 24)
    media.write_video(tmp_path / "m.mp4", np.repeat(mask[..., None].astype(np.uint8) * 255, 3, -1), 24)
    code = main(["verify", str(tmp_path / "v.mp4"), "--mask", str(tmp_path / "m.mp4"), "--model", "random",
                 "--preset", "tiny", "--steps", "1", "--json", str(tmp_path / "v.json"), "--no-flops", "--window", "9"])
    assert code == 0
    assert "seam ratio" in capsys.readouterr().out
    (r,) = json.loads((tmp_path / "v.json").read_text())
    assert r["windows"] == 2 and {"seam_ratio", "seam_boundary", "seam_inside"} <= set(r)
    for argv, needle in [(["bench", "--object-fraction", "0.9"], "--object-fraction"),
                         (["bench", "--video", "v.mp4", "--mask", "m.mp4", "--object-fraction", "0.1"], "--video"),
                         (["bench", "--window", "4"], "--window 4")]:
        assert main(argv) == 2
        assert needle in capsys.readouterr().err
